"""Sampling options: one frozen dataclass with the defaults every caller shares (the chat and
caption commands, the engine, the scheduler); ``Backend.make_sampler`` turns it into a llama.cpp
sampler chain. ``ReplyDefaults``: how long a reply is and how it is sampled when the caller names
neither — one row per surface, read by the library, the server and the CLI alike."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHAT_REPLY", "LIBRARY_REPLY", "ReplyDefaults", "SERVE_REPLY", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature <= 0 means greedy; otherwise top-k → top-p → min-p → temperature → seeded draw.
    ``grammar`` (GBNF, root rule ``root``) constrains every token first (``runtime.jsongrammar.json_grammar``)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass(frozen=True)
class ReplyDefaults:
    """A reply's length and sampling when the caller names neither."""

    max_tokens: int
    sampling: SamplingParams


# the library (Engine.chat / stream, a scheduler Request): greedy, so the same call gives the same answer
LIBRARY_REPLY = ReplyDefaults(512, SamplingParams())
# `edgevlm chat`: a little variety for a person at a terminal
CHAT_REPLY = ReplyDefaults(512, SamplingParams(temperature=0.2))
# OpenAI requests that name neither (serve, batch files): llama-server's 0.8 with top-k 40, min-p 0.05
SERVE_REPLY = ReplyDefaults(512, SamplingParams(temperature=0.8))
