"""The Responses API's store: the responses kept for ``previous_response_id`` and
``GET /v1/responses/{id}`` (``ResponseStore``, bounded in count and bytes), each a ``Stored``
conversation whose last message is the reply as the conversation goes on from it
(``reply_message``). ``responses`` parses the requests that read it; ``app.Server`` owns it.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from .request import ChatMessage, Reply

__all__ = ["Kept", "ResponseStore", "Stored", "reply_message"]

MESSAGE_OVERHEAD = 200  # bytes a stored message takes beside its text and URLs (the objects)


class Kept(Protocol):
    """What the store needs of a parsed request (``responses.ResponsesCall``) to keep its reply."""

    @property
    def id(self) -> str: ...
    @property
    def store(self) -> bool: ...
    @property
    def messages(self) -> tuple[ChatMessage, ...]: ...
    @property
    def system(self) -> tuple[str, ...]: ...
    @property
    def max_tool_calls(self) -> int | None: ...


@dataclass(frozen=True)
class Stored:
    """A response kept: the conversation it ended (its messages, the reply last; pictures as
    their URLs, never pixels), the system and developer messages it was given, and its body."""

    messages: tuple[ChatMessage, ...]
    system: tuple[str, ...]
    body: dict[str, Any]


def _message_bytes(m: ChatMessage) -> int:
    """What a stored message holds: its text, its pictures' URLs (data URIs: the picture's bytes,
    base64), its calls; never pixels."""
    n = MESSAGE_OVERHEAD + sys.getsizeof(m.text)
    n += sum(sys.getsizeof(im.url) + sys.getsizeof(im.name) for im in m.images)
    n += sum(sys.getsizeof(c.arguments) + len(c.name) + len(c.id) for c in m.tool_calls)
    return n


def reply_message(reply: Reply, index: int, max_tool_calls: int | None = None) -> ChatMessage:
    """The reply as the assistant message a conversation goes on from: the generated text itself
    (the worker knows its exact token ids by it, so the next turn reuses the KV cache), or its
    answer and the calls the client was given."""
    if reply.tool_calls:
        calls = reply.tool_calls[:max_tool_calls] if max_tool_calls else reply.tool_calls
        return ChatMessage("assistant", reply.text, (), index, calls)
    if reply.reasoning:  # (templates leave earlier reasoning out: the answer alone goes on)
        return ChatMessage("assistant", reply.text, (), index)
    return ChatMessage("assistant", reply.raw or reply.text, (), index)


class ResponseStore:
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: at most
    ``limit`` of them and ``max_bytes`` of what they hold (their bodies, and their conversations'
    texts and picture URLs — each message counted once, however many conversations of a chain
    share it), the least recently used given up first. Thread-safe (one lock, never held long)."""

    def __init__(self, limit: int = 256, max_bytes: int = 64 * 2**20):
        self.limit, self.max_bytes = limit, max_bytes
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()  # id → (it, its body's bytes)
        self._shared: dict[int, list[Any]] = {}  # id(message) → [conversations holding it, its bytes]
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            got = self._items.get(rid)
            if got is None:
                return None
            self._items.move_to_end(rid)
            return got[0]

    def put(self, rid: str, stored: Stored) -> bool:
        """Keep ``stored`` (giving up the least recently used to make room); False when it alone
        is larger than the store."""
        if self.limit <= 0:
            return False
        body = len(json.dumps(stored.body, ensure_ascii=False)) + sum(sys.getsizeof(s) for s in stored.system)
        fresh = {id(m): m for m in stored.messages}
        if body + sum(_message_bytes(m) for m in fresh.values()) > self.max_bytes:
            return False
        with self._lock:
            self._drop(rid)
            self._items[rid] = (stored, body)
            self.nbytes += body
            for k, m in fresh.items():
                held = self._shared.setdefault(k, [0, _message_bytes(m)])
                held[0] += 1
                if held[0] == 1:
                    self.nbytes += held[1]
            while len(self._items) > self.limit or self.nbytes > self.max_bytes:
                self._drop(next(iter(self._items)))
        return True

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        got = self._items.pop(rid, None)
        if got is None:
            return False
        stored, body = got
        self.nbytes -= body
        for k in {id(m) for m in stored.messages}:
            held = self._shared[k]
            held[0] -= 1
            if held[0] == 0:
                del self._shared[k]
                self.nbytes -= held[1]
        return True

    def keep(self, call: Kept, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        """Store a finished response when its request asked to (``store``, the default); its
        body says whether it was."""
        if call.store:
            stored = Stored(
                call.messages + (reply_message(reply, len(call.messages), call.max_tool_calls),), call.system, body
            )
            body["store"] = self.put(call.id, stored)
        return body
