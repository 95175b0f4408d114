"""What the scheduler is asked and what it gives back: a ``Request`` (a rendered prompt, reply
length, sampling, stops), the ``Sequence`` it becomes in flight (its reply so far, stats, how
it ended), the ``GenerationResponse`` steps of a reply, and the ``Client`` that submitted it
(its sequences running, and those finished, handed to it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend.sampling import LIBRARY_REPLY, SamplingParams
from .feed import Feed
from .items import Item, Prompt
from .stats import TurnStats
from .textstream import TextStream

__all__ = ["Client", "GenerationResponse", "Request", "Sequence", "WAIT"]

WAIT = "wait"  # submit(): not now, the cells are taken until a request in flight finishes


@dataclass(frozen=True)
class GenerationResponse:
    """One step of a reply: new text, and on the last step the reason and stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: TurnStats | None = None


@dataclass(frozen=True)
class ThinkCap:
    """A cap on a reply's reasoning: after ``budget`` tokens inside ``<think>`` (the reply starts
    inside one when ``inside``, or opens one first thing), ``close`` — the tokens of
    ``</think>`` — are put in as if sampled, and the answer follows."""

    budget: int
    close: tuple[int, ...]
    inside: bool = False
    open_text: str = "<think>"
    close_text: str = "</think>"


@dataclass(frozen=True)
class Request:
    """A prompt to evaluate and reply to."""

    prompt: Prompt
    max_tokens: int = LIBRARY_REPLY.max_tokens
    sampling: SamplingParams = LIBRARY_REPLY.sampling
    stops: tuple[str, ...] = ()  # besides the model's end-of-generation tokens
    reserve: int | None = None  # KV cells kept for the reply (None: the context budget's rule)
    new_images: frozenset[str] = frozenset()  # image units new in this turn (stats.image_tokens)
    t_start: float | None = None  # when the caller started on it (TTFT counts from there)
    counters: Mapping[str, int] = field(default_factory=dict)  # stats a policy adds
    tag: Any = None  # the caller's
    keep_logits: bool = False  # diagnostics: keep the logits the reply starts from
    preserve: frozenset[int] = frozenset()  # control tokens whose text the reply shows ([TOOL_CALLS])
    think: ThinkCap | None = None  # a reasoning budget


class Client:
    """One caller of a scheduler (a conversation, a caption run, the server's worker): the
    sequences it submitted that still run, and those finished and not taken yet."""

    def __init__(self, name: str = ""):
        self.name = name
        self.running: set[Sequence] = set()
        self.finished: deque[Sequence] = deque()

    def take_finished(self) -> list[Sequence]:
        """The sequences of this client that finished since the last call."""
        out = list(self.finished)
        self.finished.clear()
        return out

    def __repr__(self) -> str:
        return f"Client({self.name!r}, running={len(self.running)})"


class Sequence:
    """A request in flight or finished: its reply so far, its stats, and how it ended."""

    def __init__(
        self,
        request: Request,
        reserve: int,
        t_start: float,
        t_submit: float,
        client: Client | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
        arrival: int = 0,
    ):
        self.request = request
        self.reserve = reserve
        self.t_start = t_start
        self.client = client
        self.arrival = arrival  # prompt work is done in arrival order
        self.text = TextStream(request.stops, tokenize)
        self.sampler: object | None = None  # llama.cpp's sampler chain: an opaque handle (Backend.make_sampler)
        self.pending: list[Item] = []  # what the KV cache does not hold yet: the prompt's rest, then a reply token
        self.pending_prompt = 0  # how many of them belong to the prompt (the rest: a reply token)
        self.pending_cells = 0  # the cells they take
        self.feed: Feed | None = None  # the picture whose embedding rows are being fed
        self.asked: dict[tuple[str, int], bool] = {}  # image chunks asked for: were they encoded already
        self.wait_for: tuple[Sequence, int] | None = None  # (an earlier request, k): it will hold our first k items
        self.times: list[float] = []  # when each token was sampled
        self.prompt_ms = (t_submit - t_start) * 1000  # preparation + llama.cpp time for the prompt
        self.predicted_ms = 0.0
        self.c: dict[str, Any] = dict(
            cached_n=0,
            prompt_n=0,
            image_tokens=0,
            encode_ms=0.0,
            encoded=0,
            reused=0,
            image_tokens_in=0,
            image_tokens_out=0,
            merge_map_size=0,
            cache_source="",  # where its cached prefix was: resident, host (RAM), disk ("" none)
            **request.counters,
        )
        self.out: deque[GenerationResponse] = deque()
        self.finish_reason: str | None = None
        self.stats: TurnStats | None = None
        self.error: BaseException | None = None
        self.first_logits: np.ndarray | None = None
        cap = request.think
        self.thinking = cap is not None and cap.inside  # inside <think> now
        self.thought = 0  # reasoning tokens so far
        self.forced: deque[int] = deque()  # tokens put in next instead of sampled
        if cap is not None and cap.inside and cap.budget <= 0:
            self.forced.extend(cap.close)  # no reasoning at all: closed before the first token

    @property
    def tag(self) -> Any:
        return self.request.tag

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    @property
    def reply(self) -> str:
        return self.text.text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def generating(self) -> bool:
        """Its prompt is in the KV cache: each step gives it one token."""
        return self.pending_prompt == 0

    @property
    def feeding(self) -> Feed:
        """The picture whose rows are being fed; asked only once the scheduler set ``feed``
        (``Scheduler._feed_ready``) and before its last row is in (``Scheduler._fed``)."""
        feed = self.feed
        assert feed is not None, "no picture is being fed"
        return feed

    @property
    def fed(self) -> int:
        """Cells of the current picture already in the KV cache (not in the slot's items yet)."""
        return self.feed.done if self.feed is not None else 0

    def cap_thinking(self, before: int) -> None:
        """Count a reasoning token (the reply's text was ``before`` characters long before it);
        at the budget, close the block (``ThinkCap``)."""
        cap = self.request.think
        assert cap is not None
        text = self.text.text
        if not self.thinking:
            # a reply that opens <think> first thing (only there: later it is just text)
            if self.thought == 0 and text.lstrip().startswith(cap.open_text) and before < len(cap.open_text) + 8:
                self.thinking = True
            return
        if text.find(cap.close_text, max(0, before - len(cap.close_text))) >= 0:
            self.thinking = False  # closed by the model (or by us)
            return
        self.thought += 1
        if self.thought >= cap.budget and not self.forced:
            self.forced.extend(cap.close)
