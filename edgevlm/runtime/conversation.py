"""A conversation as data: its messages (with the views of each picture sent) and the pictures
given so far. The engine appends to it, the session policy rewrites it (old pictures → text),
the scheduler renders it; none of them reaches into another's internals."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..audio.plan import AudioPiece
from ..vision.images import LoadedImage

__all__ = ["Conversation", "Message", "Picture"]


@dataclass(eq=False)  # one message is one object: equal only to itself (never by pixels)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    text: str
    images: list[LoadedImage] = field(default_factory=list)  # the views sent, in order
    tokens: list[int] | None = None  # assistant: the exact ids generated
    labels: list[str | None] = field(default_factory=list)  # per view ("global view", ...)
    sources: list[str] = field(default_factory=list)  # the pictures the user gave
    pictures: list[int] = field(default_factory=list)  # per view: the picture's number (1-based)
    notes: list[str] = field(default_factory=list)  # text standing in for evicted pictures
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # assistant: [{"id", "name", "arguments": dict}]
    tool_call_id: str = ""  # tool: the call this is the result of
    name: str = ""  # tool: the function's name

    @property
    def extra(self) -> dict[str, Any]:
        """What a chat template reads beside role and content (tool calls and results)."""
        if self.role == "assistant" and self.tool_calls:
            return {"tool_calls": self.tool_calls}
        if self.role == "tool":
            return {"tool_call_id": self.tool_call_id, "name": self.name}
        return {}

    @property
    def content_text(self) -> str:
        return "\n".join(self.notes + [self.text]) if self.notes else self.text

    @property
    def view_labels(self) -> list[str | None]:
        return self.labels or [None] * len(self.images)


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

    @property
    def what(self) -> str:
        """What notices and summaries call it: "image" (a picture or a clip), or "recording"."""
        return "recording" if isinstance(self.image, AudioPiece) else "image"


@dataclass
class Conversation:
    messages: list[Message] = field(default_factory=list)
    pictures: list[Picture] = field(default_factory=list)  # every picture given, numbered from 1

    def clear(self) -> None:
        self.messages.clear()
        self.pictures.clear()

    def image_tokens_in_context(self) -> int:
        """What the pictures still in context cost (summarised ones cost their text only)."""
        return sum(p.tokens for p in self.pictures if p.in_context)
