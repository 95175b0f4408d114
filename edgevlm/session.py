"""The conversation under a token budget: when the next turn would not fit, old pictures become
text summaries instead of the chat failing.

Policy (``SessionPolicy``), applied before a turn is evaluated, until the turn fits in
``n_ctx − reply reserve``:

1. the oldest picture that the current turn does not carry is summarised by the model itself —
   asked right after the conversation so far, while the picture is still in the KV cache
   (bounded length, greedy, cached by picture hash: a picture is summarised at most once) — and
   replaced in its message by ``[image N (file): summary]``;
2. with no picture left to replace, the oldest text turns are dropped (``text_policy="drop"``);
3. a single message larger than the whole budget is refused with a clear message.

Only the KV suffix after the replaced part is rebuilt: the engine's prefix matching keeps every
item before it (``llama_memory_seq_rm`` drops the rest) and re-evaluates the remainder from
cached embeddings (no picture is encoded again). ``/recall N`` brings a picture back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InputError
from .images import LoadedImage

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

DEFAULT_SUMMARY_PROMPT = (
    "In one or two short sentences, describe image {n} ({name}) from earlier in this "
    "conversation, with any text or numbers it shows."
)


@dataclass
class Picture:
    number: int
    image: LoadedImage
    tokens: int  # what it costs in context (all its views)
    summary: str | None = None  # set once it has been replaced

    @property
    def name(self) -> str:
        return os.path.basename(self.image.source) or self.image.source

    @property
    def in_context(self) -> bool:
        return self.summary is None


@dataclass
class SessionPolicy:
    enabled: bool = True
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    summary_tokens: int = 48
    text_policy: str = "drop"  # what to do when only text is left to make room
    summaries: dict[str, str] = field(default_factory=dict)  # by picture hash + prompt
    generated: int = 0  # summaries the model was actually asked for


@dataclass
class RoomReport:
    summarized: list[Picture] = field(default_factory=list)
    evicted_tokens: int = 0
    dropped_turns: int = 0
    prev_cells: int = 0  # cells of the earlier turns (after replacement), for rebuild counting
    rendered: Any = None  # the engine's last render of the conversation (items, units), reused

    def counters(self, engine: "Engine", c: dict[str, Any]) -> dict[str, int]:
        rebuild = max(0, self.prev_cells - c["cached_n"]) if (self.summarized or self.dropped_turns) else 0
        return {"summarized_images": len(self.summarized), "evicted_tokens": self.evicted_tokens,
                "rebuild_tokens": rebuild, "dropped_turns": self.dropped_turns}


def _cells(engine: "Engine", rep: "RoomReport | None" = None) -> int:
    rendered = engine._render()
    if rep is not None:
        rep.rendered = rendered  # the turn evaluates this render when nothing changes after it
    return sum(it.n_tokens for it in rendered[0])


def summarize(engine: "Engine", pic: Picture) -> str:
    """The model's own short description of ``pic`` (cached by content hash)."""
    pol = engine.session
    key = pic.image.sha256 + "\0" + pol.summary_prompt
    if key in pol.summaries:
        return pol.summaries[key]
    question = pol.summary_prompt.format(n=pic.number, name=pic.name)
    current = engine.messages.pop()  # the turn being prepared is not part of the question
    try:
        try:
            text = engine.complete(question, pol.summary_tokens)
        except InputError:
            # No room to ask after the whole conversation: ask about the picture alone.
            saved = list(engine.messages)
            holder = next(m for m in saved if pic.number in m.pictures)
            idx = [i for i, n in enumerate(holder.pictures) if n == pic.number]
            from .engine import Message

            engine.messages[:] = [Message("user", "", [holder.images[i] for i in idx],
                                          labels=[holder.labels[i] for i in idx] if holder.labels else [])]
            try:
                text = engine.complete(question, pol.summary_tokens)
            finally:
                engine.messages[:] = saved
    finally:
        engine.messages.append(current)
    text = " ".join("".join(ch for ch in text if ch.isprintable() or ch.isspace()).split())
    text = text or "(no description)"
    pol.summaries[key] = text
    pol.generated += 1
    return text


def replace_picture(engine: "Engine", pic: Picture, summary: str) -> None:
    """Swap the picture's views for one line of text in the message that carried it."""
    for m in engine.messages:
        if pic.number in m.pictures:
            keep = [i for i, n in enumerate(m.pictures) if n != pic.number]
            m.images = [m.images[i] for i in keep]
            m.labels = [m.labels[i] for i in keep] if m.labels else []
            m.pictures = [m.pictures[i] for i in keep]
            m.notes.append(f"[image {pic.number} ({pic.name}): {summary}]")
    pic.summary = summary


def make_room(engine: "Engine", reserve: int) -> RoomReport:
    """Summarise old pictures / drop old turns until the pending turn fits. Returns what it did."""
    rep = RoomReport()
    budget = engine.backend.n_ctx - reserve
    current = engine.messages[-1]
    while _cells(engine, rep) > budget:
        old = [p for p in engine.pictures if p.in_context and p.number not in current.pictures
               and any(p.number in m.pictures for m in engine.messages[:-1])]
        if old:
            pic = old[0]  # oldest first
            summary = summarize(engine, pic)
            replace_picture(engine, pic, summary)
            rep.summarized.append(pic)
            rep.evicted_tokens += pic.tokens
            engine.notices.append(
                f"context full: image {pic.number} ({pic.name}) replaced by its summary "
                f"({pic.tokens} tokens freed): {summary[:80]}")
            continue
        older = engine.messages[:-1]
        if older and engine.session.text_policy == "drop":
            n = 2 if len(older) >= 2 and older[1].role == "assistant" else 1
            del engine.messages[:n]
            rep.dropped_turns += 1
            engine.notices.append("context full: the oldest turn was dropped")
            continue
        need = _cells(engine, rep)
        raise InputError(
            f"this message needs {need:,} tokens but the context holds {engine.backend.n_ctx:,} "
            f"with {reserve} kept for the reply (shorten it, fewer images, or a larger --ctx)")
    if rep.summarized or rep.dropped_turns:
        msgs = engine.messages
        engine.messages = msgs[:-1]
        try:
            rep.prev_cells = _cells(engine) if engine.messages else 0
        finally:
            engine.messages = msgs
    return rep


def recall(engine: "Engine", number: int) -> LoadedImage:
    """The original pixels of picture ``number``, to send again (``/recall N``)."""
    pic = next((p for p in engine.pictures if p.number == number), None)
    if pic is None:
        raise InputError(f"no image {number} in this conversation (1..{len(engine.pictures)})")
    return pic.image
