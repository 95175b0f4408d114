"""The conversation under a token budget: when the next turn would not fit, old pictures become
text summaries instead of the chat failing.

A policy over a ``Conversation``, applied before a turn is evaluated, until the turn fits —
its cells within ``n_ctx − reply reserve`` and its pictures within the context budget's image
room (``ContextBudget.image_room``, the rule the plan's image count comes from):

1. the oldest picture that the current turn does not carry is summarised by the model itself —
   asked right after the conversation so far, while the picture is still in the KV cache
   (bounded length, greedy, cached by picture hash: a picture is summarised at most once) — and
   replaced in its message by ``[image N (file): summary]``;
2. with no picture left to replace, the oldest text turns are dropped (``text_policy="drop"``);
3. a single message larger than the whole budget is refused with a clear message.

The policy touches nothing but the conversation it is given: it measures through ``measure``
(messages → cells, picture cells, and the render, reused when nothing changes after it) and asks
for a summary through ``ask`` (a question after some messages → the model's answer). Only the
KV suffix after the replaced part is rebuilt: the scheduler's prefix matching keeps every item
before it and re-evaluates the rest from cached embeddings. ``/recall N`` brings a picture back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from ..errors import ContextExceeded, InputError
from ..vision.images import LoadedImage
from .conversation import Conversation, Message, Picture
from .items import Prompt

__all__ = [
    "DEFAULT_SUMMARY_PROMPT",
    "Footprint",
    "RoomCounters",
    "RoomReport",
    "SessionOptions",
    "Summaries",
    "make_room",
    "recall",
]

DEFAULT_SUMMARY_PROMPT = (
    "In one or two short sentences, describe image {n} ({name}) from earlier in this "
    "conversation, with any text or numbers it shows."
)
# a recording's, when the session's prompt is the default one
DEFAULT_AUDIO_SUMMARY_PROMPT = (
    "In one or two short sentences, say what recording {n} ({name}) from earlier in this "
    "conversation holds: who speaks, and what is said."
)


@dataclass(frozen=True)
class SessionOptions:
    enabled: bool = True  # False: a turn that does not fit fails (``--evict off``)
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    summary_tokens: int = 48
    text_policy: str = "drop"  # what to do when only text is left to make room


@dataclass
class Summaries:
    """Summaries made so far, by picture hash + prompt (they outlive ``reset()``)."""

    texts: dict[str, str] = field(default_factory=dict)
    generated: int = 0  # summaries the model was actually asked for


@dataclass(frozen=True)
class Footprint:
    """What a conversation takes in context: all its cells, those of its pictures, and the
    render they were counted from."""

    cells: int
    image_cells: int
    rendered: Prompt | None = None


class RoomCounters(TypedDict):
    """``RoomReport.counters``: the ``TurnStats`` fields making room set."""

    summarized_images: int
    evicted_tokens: int
    rebuild_tokens: int
    dropped_turns: int


@dataclass
class RoomReport:
    summarized: list[Picture] = field(default_factory=list)
    evicted_tokens: int = 0
    dropped_turns: int = 0
    prev_cells: int = 0  # cells of the earlier turns (after replacement), for rebuild counting
    rendered: Prompt | None = None  # the last render of the conversation, reused by the turn

    def counters(self, cached_n: int) -> RoomCounters:
        rebuild = max(0, self.prev_cells - cached_n) if (self.summarized or self.dropped_turns) else 0
        return {
            "summarized_images": len(self.summarized),
            "evicted_tokens": self.evicted_tokens,
            "rebuild_tokens": rebuild,
            "dropped_turns": self.dropped_turns,
        }


Measure = Callable[[list[Message]], Footprint]
Ask = Callable[[str, list[Message]], str]


def summarize(conv: Conversation, pic: Picture, ask: Ask, options: SessionOptions, memory: Summaries) -> str:
    """The model's own short description of ``pic`` (cached by content hash), asked after the
    conversation before the turn being prepared."""
    prompt = options.summary_prompt
    if pic.what == "recording" and prompt == DEFAULT_SUMMARY_PROMPT:
        prompt = DEFAULT_AUDIO_SUMMARY_PROMPT
    key = pic.image.sha256 + "\0" + prompt
    if key in memory.texts:
        return memory.texts[key]
    question = prompt.format(n=pic.number, name=pic.name)
    earlier = conv.messages[:-1]
    try:
        text = ask(question, earlier)
    except InputError:
        # No room to ask after the whole conversation: ask about the picture alone.
        holder = next(m for m in earlier if pic.number in m.pictures)
        idx = [i for i, n in enumerate(holder.pictures) if n == pic.number]
        alone = Message(
            "user", "", [holder.images[i] for i in idx], labels=[holder.labels[i] for i in idx] if holder.labels else []
        )
        text = ask(question, [alone])
    text = " ".join("".join(ch for ch in text if ch.isprintable() or ch.isspace()).split())
    text = text or "(no description)"
    memory.texts[key] = text
    memory.generated += 1
    return text


def replace_picture(conv: Conversation, pic: Picture, summary: str) -> None:
    """Swap the picture's views for one line of text in the message that carried it."""
    for m in conv.messages:
        if pic.number in m.pictures:
            keep = [i for i, n in enumerate(m.pictures) if n != pic.number]
            m.images = [m.images[i] for i in keep]
            m.labels = [m.labels[i] for i in keep] if m.labels else []
            m.pictures = [m.pictures[i] for i in keep]
            what = f"{pic.what} {pic.number}"
            m.notes.append(f"[{what} ({pic.name}): {summary}]" if pic.name else f"[{what}: {summary}]")
    pic.summary = summary


def make_room(
    conv: Conversation,
    *,
    n_ctx: int,
    reserve: int,
    image_room: int,
    measure: Measure,
    ask: Ask,
    options: SessionOptions,
    memory: Summaries,
    notices: list[str],
) -> RoomReport:
    """Summarise old pictures / drop old turns until the pending turn (the last message) fits.
    Returns what it did."""
    rep = RoomReport()
    budget = n_ctx - reserve
    current = conv.messages[-1]

    def fits() -> bool:
        fp = measure(conv.messages)
        rep.rendered = fp.rendered
        return fp.cells <= budget and fp.image_cells <= image_room

    while not fits():
        old = [
            p
            for p in conv.pictures
            if p.in_context
            and p.number not in current.pictures
            and any(p.number in m.pictures for m in conv.messages[:-1])
        ]
        if old:
            pic = old[0]  # oldest first
            summary = summarize(conv, pic, ask, options, memory)
            replace_picture(conv, pic, summary)
            rep.summarized.append(pic)
            rep.evicted_tokens += pic.tokens
            label = f"{pic.what} {pic.number} ({pic.name})" if pic.name else f"{pic.what} {pic.number}"
            notices.append(f"context full: {label} replaced by its summary ({pic.tokens} tokens freed): {summary[:80]}")
            continue
        older = conv.messages[:-1]
        if older and options.text_policy == "drop":
            n = 2 if len(older) >= 2 and older[1].role == "assistant" else 1
            del conv.messages[:n]
            rep.dropped_turns += 1
            notices.append("context full: the oldest turn was dropped")
            continue
        fp = measure(conv.messages)
        if fp.image_cells > image_room:
            raise ContextExceeded(
                f"this message's pictures need {fp.image_cells:,} tokens but the context keeps "
                f"{image_room:,} for pictures (fewer or smaller images, or a larger --ctx)"
            )
        raise ContextExceeded(
            f"this message needs {fp.cells:,} tokens but the context holds {n_ctx:,} "
            f"with {reserve} kept for the reply (shorten it, fewer images, or a larger --ctx)"
        )
    if (rep.summarized or rep.dropped_turns) and len(conv.messages) > 1:
        rep.prev_cells = measure(conv.messages[:-1]).cells
    return rep


def recall(conv: Conversation, number: int) -> LoadedImage:
    """The original pixels of picture ``number``, to send again (``/recall N``)."""
    pic = next((p for p in conv.pictures if p.number == number), None)
    if pic is None:
        raise InputError(f"no image {number} in this conversation (1..{len(conv.pictures)})")
    return pic.image
