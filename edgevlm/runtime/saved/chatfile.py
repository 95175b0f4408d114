"""A chat's conversation to and from its file (``edgevlm chat --session``, ``/save``, ``/load``,
and the library's ``conversation().save(path)`` / ``.load(path)``): the messages and pictures,
the summaries made so far, the items its KV cells hold and llama.cpp's copy of those cells,
bound to the model pair and context that made them (``binding``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from ...errors import SavedStateError
from ..conversation import Conversation
from ..items import Item
from ..session import Summaries
from .binding import Binding
from .codec import decode_conversation, decode_items, encode_conversation, encode_items
from .fileformat import SavedFile, load_saved, read_header, write_saved

__all__ = ["KIND", "Restored", "SavedInfo", "check_binding", "read_chat", "session_binding", "write_chat"]

KIND = "conversation"  # a chat's file (the server's disk tier writes "sequence" files)


@dataclass(frozen=True)
class SavedInfo:
    """What a save wrote, or a load read (``--json``: ``session``)."""

    path: str
    bytes: int
    tokens: int  # KV cells in the file
    pictures: int  # pictures of the conversation (summarised ones included)
    messages: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "pictures": self.pictures,
            "messages": self.messages,
        }

    def describe(self) -> str:
        return (
            f"{self.path}: {self.messages} message(s), {self.pictures} picture(s), "
            f"{self.tokens:,} tokens of KV cache, {self.bytes / 2**20:,.1f} MiB"
        )


@dataclass(frozen=True)
class Restored:
    conversation: Conversation
    summaries: Summaries
    system: str | None
    items: tuple[Item, ...]
    kv: bytes | memoryview  # (a view of the file's buffer)
    info: SavedInfo


def check_binding(path: str, header: dict[str, Any], here: Binding) -> Binding:
    try:
        bound = Binding.from_dict(header["binding"])
    except (KeyError, TypeError, ValueError):
        raise SavedStateError(f"{path}: corrupted (what it is bound to is not readable)") from None
    why = bound.differs(here)
    if why:
        raise SavedStateError(f"{path}: {why}")
    return bound


def _kind(path: str, header: dict[str, Any]) -> None:
    if header.get("kind") != KIND:
        raise SavedStateError(f"{path}: a server's cached sequence, not a chat conversation")


def session_binding(path: str) -> Binding:
    """What the file at ``path`` is bound to, from its header alone (``chat --session`` plans
    the same context for it)."""
    header = read_header(path)
    _kind(path, header)
    try:
        return Binding.from_dict(header["binding"])
    except (KeyError, TypeError, ValueError):
        raise SavedStateError(f"{path}: corrupted (what it is bound to is not readable)") from None


def write_chat(
    path: str,
    binding: Binding,
    conversation: Conversation,
    summaries: Summaries,
    system: str | None,
    items: tuple[Item, ...],
    kv: bytes,
    version: str,
) -> SavedInfo:
    data, pictures = encode_conversation(conversation, summaries)
    cells = sum(it.n_tokens for it in items)
    header: dict[str, Any] = {
        "kind": KIND,
        "edgevlm": version,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "binding": binding.to_dict(),
        "system": system,
        "items": encode_items(items),
        "cells": cells,
        "conversation": data,
    }
    size = write_saved(path, header, [*pictures, ("kv", kv)])
    return SavedInfo(path, size, cells, len(conversation.pictures), len(conversation.messages))


def read_chat(path: str, here: Binding) -> Restored:
    f: SavedFile = load_saved(path)
    h = f.header
    _kind(path, h)
    check_binding(path, h, here)
    conv, summaries = decode_conversation(h.get("conversation") or {}, f.sections, path)
    items = decode_items(h.get("items") or [], path)
    kv = f.sections.get("kv", b"")
    if items and not kv:
        raise SavedStateError(f"{path}: corrupted (its KV cells are missing)")
    system = h.get("system")
    info = SavedInfo(path, f.size, sum(it.n_tokens for it in items), len(conv.pictures), len(conv.messages))
    return Restored(conv, summaries, system if isinstance(system, str) else None, items, kv, info)
