"""What a chat request's reply may be, decided from the request and the server's options before
it runs: the grammar sampling follows (a forced tool call, JSON output), the template's thinking
switch and a cap on the reasoning, its length, the control tokens it shows, and the splitter
that turns its text into answer, reasoning and tool calls."""

from __future__ import annotations

import functools
import re

from ..errors import InputError, SchemaError, shown
from ..runtime.jsongrammar import json_grammar
from ..runtime.model import LoadedModel
from ..runtime.requests import ThinkCap
from ..runtime.toolformat import call_grammar, markers
from .api_errors import APIError
from .options import ServeOptions
from .replies import THINK_CLOSE, THINK_OPEN, ReplySplitter
from .request import ChatRequest

__all__ = ["ReplyRules"]

_ROOT = re.compile(r"^root\s*::=", re.M)


class ReplyRules:
    """The reply rules of one loaded model under the server's options (module doc)."""

    def __init__(self, model: LoadedModel, options: ServeOptions):
        self.model = model
        self.options = options

    @property
    def tool_format(self) -> str:
        return self.model.scheduler.formatter.tool_format

    @staticmethod
    def forced_call(req: ChatRequest) -> str | None:
        """The call a grammar makes the reply: "any" (tool_choice required) or the function's
        name; None when the model decides."""
        return {"required": "any", "function": req.tool_name}.get(req.tool_choice) if req.offered_tools else None

    @classmethod
    def constrained(cls, req: ChatRequest) -> bool:
        """Whether the reply follows a grammar (a forced call, or JSON output)."""
        return cls.forced_call(req) is not None or req.response_format != "text"

    def reply_length(self, req: ChatRequest) -> tuple[int, int | None]:
        """(most tokens, KV cells kept — None: the budget's rule): max_tokens, else the server's; a
        forced call naming none may run to the context's end to close (kept: the server's)."""
        if req.max_tokens:
            return req.max_tokens, None
        if self.forced_call(req) is None:
            return self.options.max_tokens, None
        budget = self.model.scheduler.budget
        return max(budget.n_ctx, self.options.max_tokens), budget.reply_reserve(self.options.max_tokens)

    def grammar(self, req: ChatRequest) -> str | None:
        """The grammar sampling follows: a forced tool call (tool_choice required or a named
        function), else the JSON of response_format, else none. A reply that starts inside
        <think> (a template without a switch) is made to close it first: the grammar has no
        room for reasoning, and tokens put in past a grammar would break it. A schema that
        cannot be held is a 400 naming its field (``SchemaError``'s path) and the limit."""
        try:
            g = self._grammar(req)
        except SchemaError as exc:
            raise APIError(str(exc), exc.path or None, exc.code) from None
        if g is not None and self.model.scheduler.formatter.starts_thinking(self.think_switch(req)):
            g = _ROOT.sub("edgevlm-answer ::=", g, count=1)
            g = 'root ::= "\\n' + THINK_CLOSE + '\\n\\n" edgevlm-answer\n' + g
        return g

    def _grammar(self, req: ChatRequest) -> str | None:
        if req.offered_tools and req.tool_choice in ("required", "function"):
            names = [t.name for t in req.offered_tools]
            if req.tool_choice == "function" and req.tool_name not in names:
                raise APIError(
                    f"tool_choice names the function {shown(req.tool_name)}, which is not in 'tools'", "tool_choice"
                )
            name = req.tool_name if req.tool_choice == "function" else None
            for t in req.offered_tools:  # each schema alone first: an error names its own field
                if name is None or t.name == name:
                    json_grammar(t.parameters, t.schema_at)
            return call_grammar(
                [t.to_template() for t in req.offered_tools],
                self.tool_format,
                lambda schema: json_grammar(schema, "tools"),
                name,
                req.parallel_tool_calls,
            )
        if req.response_format != "text":
            return json_grammar(req.json_schema, req.schema_at if req.json_schema is not None else "")
        return None

    @functools.cached_property
    def preserved(self) -> frozenset[int]:
        """Control tokens whose text a reply must show: tool-call markers and <think> tags that
        are one token each, hidden when detokenized plainly (Mistral's [TOOL_CALLS])."""
        be = self.model.backend
        out = set()
        for text in (*markers(self.tool_format), "[ARGS]", "</tool_call>", THINK_OPEN, THINK_CLOSE):
            try:
                toks = be.tokenize_text(text)
            except InputError:
                continue
            if len(toks) == 1 and not be.token_bytes(toks[0]) and be.token_bytes(toks[0], special=True):
                out.add(toks[0])
        return frozenset(out)

    def budget_for(self, req: ChatRequest) -> int:
        """The request's reasoning budget: its own under the server's (-1: no cap)."""
        server = self.options.reasoning_budget
        own = req.think_budget if req.think_budget is not None else -1
        if server < 0:
            return own
        return server if own < 0 else min(own, server)

    def think_switch(self, req: ChatRequest) -> bool | None:
        """The template's ``enable_thinking``: off under a grammar (which has no room for
        reasoning), else the request's, else off for a budget of 0."""
        if self.constrained(req):
            return False
        if req.think is not None:
            return req.think
        return False if self.budget_for(req) == 0 else None

    def think_cap(self, req: ChatRequest) -> ThinkCap | None:
        """A cap on the reply's <think> block, for templates that have one."""
        fmt = self.model.scheduler.formatter
        budget = self.budget_for(req)
        think = self.think_switch(req)
        if budget < 0 or not fmt.caps.thinking or think is False and fmt.caps.think_switch:
            return None
        if self.constrained(req):  # (the grammar closes <think> itself: nothing may be put in past it)
            return None
        close = tuple(self.model.backend.tokenize_text("\n" + THINK_CLOSE + "\n\n"))
        return ThinkCap(budget, close, inside=fmt.starts_thinking(think))

    def splitter(self, req: ChatRequest) -> ReplySplitter:
        """What turns this request's reply text into answer, reasoning and tool calls."""
        fmt = self.model.scheduler.formatter
        return ReplySplitter(
            self.tool_format,
            [t.name for t in req.offered_tools],
            thinking=fmt.starts_thinking(self.think_switch(req)),
            may_think=fmt.caps.thinking and self.think_switch(req) is not False,
            forced=self.forced_call(req),
        )
