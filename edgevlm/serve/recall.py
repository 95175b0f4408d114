"""The exact token ids of the replies the server handed out, by their text (the worker's).

A client sends a conversation back as text, and a reply's text tokenized again is often not the
ids that were generated: SentencePiece puts a space before the first word, a word may split
another way. The follow-up would then match the KV cache only up to the start of the reply and
evaluate the whole reply again (on bench_serve's pair: 16 more rows in a follow-up of 29). With
the ids it matches through the reply, as a chat in the library does (``Message.tokens``).

Kept by the text the APIs send (its ends' whitespace trimmed); the ids are all that was
generated, that whitespace included: what the KV cache holds. Bounded: the newest replies, up
to ``max_bytes`` of text and ids together, counted in the host memory the server plans. With a
disk tier (``--cache-dir``) they are written there at a graceful stop and read back at the next
start (``to_bytes``, ``add_bytes``): a conversation returning after a restart matches its files
through its replies, not only up to the first one.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from ..errors import EdgeVLMError, SavedStateError
from ..runtime.saved import Binding, load_saved, write_saved

__all__ = ["RECALL_BYTES", "ReplyRecall", "load_recall", "save_recall"]

RECALL_BYTES = 8 << 20  # text and ids of the newest replies (about 8 MiB of host memory, at most)
ENTRY_BYTES = 120  # what a kept reply costs besides its text and ids (its key and array objects)


class ReplyRecall:
    def __init__(self, max_bytes: int = RECALL_BYTES):
        self.max_bytes = max_bytes
        self.held = 0  # bytes kept now
        self._lock = threading.Lock()
        self._replies: OrderedDict[str, array[int]] = OrderedDict()

    @staticmethod
    def _size(text: str, ids: array[int]) -> int:
        return len(text.encode("utf-8", "surrogatepass")) + ids.itemsize * len(ids) + ENTRY_BYTES

    def remember(self, text: str, tokens: Sequence[int]) -> None:
        """``tokens`` were generated and detokenize to ``text``, which the client was given."""
        if not text or not tokens:
            return
        ids = array("i", tokens)
        size = self._size(text, ids)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._replies.pop(text, None)
            if old is not None:
                self.held -= self._size(text, old)
            self._replies[text] = ids
            self.held += size
            while self.held > self.max_bytes:
                k, v = self._replies.popitem(last=False)
                self.held -= self._size(k, v)

    def to_bytes(self) -> bytes:
        """The replies kept, oldest first, as JSON."""
        with self._lock:
            return json.dumps([[text, ids.tolist()] for text, ids in self._replies.items()]).encode()

    def add_bytes(self, data: bytes) -> int:
        """Remember the replies of ``to_bytes``'s output (what is not readable is skipped)."""
        try:
            rows = json.loads(data)
        except ValueError:
            return 0
        n = 0
        for row in rows if isinstance(rows, list) else []:
            ok = isinstance(row, list) and len(row) == 2 and isinstance(row[0], str) and isinstance(row[1], list)
            if ok and all(isinstance(t, int) for t in row[1]):
                self.remember(row[0], row[1])
                n += 1
        return n

    def tokens(self, text: str) -> list[int] | None:
        """The ids a reply with exactly ``text`` was generated as (None: no such reply kept)."""
        with self._lock:
            ids = self._replies.get(text)
            if ids is None:
                return None
            self._replies.move_to_end(text)
            return ids.tolist()


def _recall_path(folder: str, binding: Binding) -> str:
    """One file per model pair and context in the folder (another model's is left alone)."""
    return os.path.join(folder, f"replies-{binding.model.fingerprint[:16]}.recall")


def save_recall(recall: ReplyRecall, folder: str, binding: Binding) -> None:
    """Write the replies kept to ``folder`` (atomically, bound like the disk tier's files)."""
    from .. import __version__

    header = {"kind": "replies", "edgevlm": __version__, "binding": binding.to_dict()}
    with contextlib.suppress(EdgeVLMError):  # (a full disk: the next start just knows no replies)
        write_saved(_recall_path(folder, binding), header, [("replies", recall.to_bytes())])


def load_recall(recall: ReplyRecall, folder: str, binding: Binding) -> int:
    """Remember the replies a server of the same model pair left in ``folder``; how many."""
    try:
        f = load_saved(_recall_path(folder, binding))
        if f.header.get("kind") != "replies" or Binding.from_dict(f.header["binding"]).differs(binding):
            return 0
    except (SavedStateError, KeyError, TypeError, ValueError):
        return 0
    return recall.add_bytes(bytes(f.sections.get("replies", b"")))
