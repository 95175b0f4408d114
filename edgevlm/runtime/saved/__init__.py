"""Conversations that outlive the process: one file format (``fileformat``), what a file is
bound to (``binding``: the model pair and the context that made its KV cells), and the codec of
a sequence's items and a chat's conversation (``codec``). The scheduler exports and adopts the
KV cells; the chat engine and the server's host cache write and read the files."""

from .binding import Binding, FileId, binding_of, file_id
from .chatfile import Restored, SavedInfo, read_chat, session_binding, write_chat
from .codec import decode_conversation, decode_items, encode_conversation, encode_items
from .fileformat import FORMAT, SavedFile, load_saved, read_header, saved_size, write_saved

__all__ = [
    "FORMAT",
    "Binding",
    "FileId",
    "Restored",
    "SavedInfo",
    "SavedFile",
    "binding_of",
    "decode_conversation",
    "decode_items",
    "encode_conversation",
    "encode_items",
    "file_id",
    "load_saved",
    "read_chat",
    "read_header",
    "saved_size",
    "session_binding",
    "write_chat",
    "write_saved",
]
