"""Sampling options: one frozen dataclass with the defaults every caller shares (the chat and
caption commands, the engine, the scheduler); ``Backend.make_sampler`` turns it into a llama.cpp
sampler chain."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature <= 0 means greedy; otherwise top-k → top-p → min-p → temperature → seeded draw.
    ``grammar`` (GBNF, root rule ``root``) constrains every token first (``json_grammar``)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0
