"""The exact token ids of the replies the server handed out, by their text (the worker's).

A client sends a conversation back as text, and a reply's text tokenized again is often not the
ids that were generated: SentencePiece puts a space before the first word, a word may split
another way. The follow-up would then match the KV cache only up to the start of the reply and
evaluate the whole reply again (on bench_serve's pair: 16 more rows in a follow-up of 29). With
the ids it matches through the reply, as a chat in the library does (``Message.tokens``).

Kept by the text the APIs send (its ends' whitespace trimmed); the ids are all that was
generated, that whitespace included: what the KV cache holds. Bounded: the newest replies, up
to ``max_bytes`` of text and ids together, counted in the host memory the server plans.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["RECALL_BYTES", "ReplyRecall"]

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

    def tokens(self, text: str) -> list[int] | None:
        """The ids a reply with exactly ``text`` was generated as (None: no such reply kept)."""
        with self._lock:
            ids = self._replies.get(text)
            if ids is None:
                return None
            self._replies.move_to_end(text)
            return ids.tolist()
