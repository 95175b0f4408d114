"""Tool calls in a model's own words: which format its chat template speaks, what its template
can render (tools, assistant tool calls, tool results), the text that teaches the format to a
template that cannot, a reply's calls parsed out of its text, and the grammar that forces a call.

Formats (the families edgevlm runs):

- ``hermes``: Qwen2.5/3-VL, Hermes, InternVL and the fallback —
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one block per call);
- ``mistral``: Mistral Small 3.x / Pixtral — ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``,
  or the newer ``[TOOL_CALLS]name[ARGS]{...}``;
- ``llama3``: Llama 3.x — ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or alone).

Any format also takes a reply that is nothing but one such JSON object (the JSON fallback).
Pure functions over strings; no llama.cpp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FORMATS",
    "ParsedCall",
    "TemplateCaps",
    "call_grammar",
    "detect_format",
    "fallback_instructions",
    "markers",
    "parse_calls",
    "parse_cut",
    "partial_object",
    "probe_caps",
]

FORMATS = ("hermes", "mistral", "llama3")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text (cut off: the JSON text as far as it was generated)
    id: str = ""  # when the format carries one (Mistral's 9-character ids)
    partial: bool = False  # the reply ended before its arguments did (``parse_cut``)


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders by itself (found by rendering probes, as llama.cpp does)."""

    tools: bool = False  # the ``tools`` list reaches the prompt
    tool_calls: bool = False  # an assistant message's ``tool_calls`` reach the prompt
    tool_role: bool = False  # a ``tool`` message's content reaches the prompt
    thinking: bool = False  # the template knows <think> (reasoning models)
    think_switch: bool = False  # it reads ``enable_thinking``


def detect_format(template: str) -> str:
    """The tool-call format a template's model was trained on (hermes when it names none)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and "<|eot_id|>" in template):
        return "llama3"
    return "hermes"


def markers(fmt: str) -> tuple[str, ...]:
    """Text that starts a tool call in ``fmt`` (a reply holding it is held back while streamed)."""
    return {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",)}[fmt]


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "edgevlm_probe_fn",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"edgevlm_probe_arg": {"type": "string"}}},
    },
}


def probe_caps(render: Callable[..., str], template: str) -> TemplateCaps:
    """Render probe conversations and see what reaches the prompt."""

    def shows(needle: str, messages: list[dict[str, Any]], **kw: Any) -> bool:
        try:
            return needle in render(messages, **kw)
        except Exception:  # a template that refuses the shape does not support it
            return False

    user = {"role": "user", "content": "hi"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "edgevlm_probe_fn", "arguments": {"edgevlm_probe_arg": "x"}},
            }
        ],
    }
    result = {
        "role": "tool",
        "tool_call_id": "call00001",
        "name": "edgevlm_probe_fn",
        "content": "edgevlm_probe_result",
    }
    return TemplateCaps(
        tools=shows("edgevlm_probe_fn", [user], tools=[_PROBE_TOOL]),
        tool_calls=shows("edgevlm_probe_fn", [user, call], tools=[_PROBE_TOOL]),
        tool_role=shows("edgevlm_probe_result", [user, call, result], tools=[_PROBE_TOOL]),
        thinking="<think>" in template,
        think_switch="enable_thinking" in template,
    )


def fallback_instructions(tools: Sequence[dict[str, Any]], required: str | None = None) -> str:
    """A system-prompt section that teaches the hermes format, for templates without tools
    (``required``: "any" or a function name the reply must call)."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
        *(json.dumps(t, ensure_ascii=False) for t in tools),
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    if required == "any":
        lines += ["", "You must call at least one function."]
    elif required:
        lines += ["", f"You must call the function {required}."]
    return "\n".join(lines)


# --- parsing ---------------------------------------------------------------------------------

# calls are read leniently: a control character written raw inside a string (a tab, a newline in
# code, a byte a small model let through its grammar) is kept (and escaped when written back)
_JSON = json.JSONDecoder(strict=False)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_MISTRAL_NEW = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]\s*", re.S)


def _call(obj: Any, names: set[str] | None) -> ParsedCall | None:
    """A JSON value that is a call: {"name", "arguments"|"parameters"} (arguments as an object
    or as JSON text), naming a known tool when ``names`` is given."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:  # {"function": {...}} as OpenAI sends
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if isinstance(args, str):
        try:
            args = _JSON.decode(args or "{}")
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    cid = obj.get("id") if isinstance(obj.get("id"), str) else ""
    return ParsedCall(name, json.dumps(args, ensure_ascii=False), cid)


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in ``text`` (whitespace between); [] when
    anything else is there."""
    dec = _JSON
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return []
        out.append(v)


def _calls_in(values: list[Any], names: set[str] | None) -> list[ParsedCall] | None:
    flat: list[Any] = []
    for v in values:
        flat += v if isinstance(v, list) else [v]
    calls = [_call(v, names) for v in flat]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_calls(text: str, fmt: str, names: Sequence[str] | None = None) -> tuple[str, list[ParsedCall]]:
    """(the reply's text without its calls, the calls). Text that only looks like a call (bad
    JSON, an unknown function) stays text."""
    known = set(names) if names is not None else None
    if fmt == "hermes" and "<tool_call>" in text:
        calls: list[ParsedCall] = []
        for m in _HERMES.finditer(text):
            got = _calls_in(_json_values(m.group(1)), known)
            if got is None:
                if calls and not m.group(0).rstrip().endswith("</tool_call>"):
                    break  # a last call cut off (max_tokens): the whole ones before it stand
                return text, []
            calls += got
        return text[: text.index("<tool_call>")].strip(), calls
    if fmt == "mistral" and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        if _MISTRAL_NEW.match("[TOOL_CALLS]" + rest):
            found: list[ParsedCall] = []
            pos, body = 0, "[TOOL_CALLS]" + rest
            for m in _MISTRAL_NEW.finditer(body):
                try:
                    args, end = _JSON.raw_decode(body, m.end())
                except ValueError:
                    return text, []
                one = _call({"name": m.group(1), "arguments": args}, known)
                if one is None:
                    return text, []
                found.append(one)
                pos = end
            return (head.strip(), found) if body[pos:].strip() in ("", "</s>") else (text, [])
        listed = _calls_in(_json_values(rest.replace("</s>", "")), known)
        return (head.strip(), listed) if listed else (text, [])
    body = text.split("<|python_tag|>", 1)[1] if fmt == "llama3" and "<|python_tag|>" in text else text
    if body.strip().startswith(("{", "[")):  # the JSON fallback: the whole reply is the call(s)
        got = _calls_in(_json_values(body), known)
        if got:
            return "", got
    return text, []


# --- a reply cut off inside its calls --------------------------------------------------------

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?', re.S)
_STARTS_NAMED = re.compile(r'\s*\[?\s*\{\s*"name"\s*:', re.S)
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*', re.S)


def parse_cut(
    text: str, fmt: str, names: Sequence[str], forced: str | None = None
) -> tuple[str, list[ParsedCall]] | None:
    """A reply that ended inside its tool calls (cut off by max_tokens): (its text before the
    calls, the calls) — the whole ones, and the last as far as it got (``partial``: its
    ``arguments`` the JSON text as generated; a call whose arguments are whole is whole though
    its closing was cut). The markup itself is never in the text, and a call whose function
    cannot be told (its name cut off, or not one offered) is left out. ``forced``: "any" or the
    function a grammar made the reply call (then the reply is a call, and a name cut off is that
    function's or the one function it begins). None: no call after all — no marker, not forced,
    and no offered function named at its start (a JSON answer cut off)."""
    if fmt == "hermes" and "<tool_call>" in text:
        calls: list[ParsedCall] = []
        for m in _HERMES.finditer(text):
            closed = m.group(0).rstrip().endswith("</tool_call>")
            body = m.group(1) if closed else _unclosed(m.group(1), "</tool_call>")
            got = _calls_in(_json_values(body), set(names))
            if got is not None:
                calls += got
            elif not closed and (one := _cut_call(body, names, forced or "any")) is not None:
                calls.append(one)  # (a closed call that is broken is left out: markup is never text)
        return text[: text.index("<tool_call>")].strip(), calls
    if fmt == "mistral" and "[TOOL_CALLS]" in text:
        head, _, rest = text.partition("[TOOL_CALLS]")
        rest = rest.replace("</s>", "")
        if rest.lstrip().startswith(("[", "{")):
            return head.strip(), _cut_values(rest, names, forced or "any") or []
        calls = []
        for piece in rest.split("[TOOL_CALLS]"):  # the newer form: name[ARGS]{...}, one after another
            name, sep, args = piece.partition("[ARGS]")
            fn = _function(name.strip(), bool(sep), names, forced or "any")
            if fn is not None:
                calls.append(_with_args(fn, args) if sep else ParsedCall(fn, "", partial=True))
        return head.strip(), calls
    head, body = "", text
    if fmt == "llama3" and "<|python_tag|>" in text:
        head, _, body = text.partition("<|python_tag|>")
        forced = forced or "any"
    if not body.lstrip().startswith(("{", "[")) or not (forced or _STARTS_NAMED.match(body)):
        return None if not forced else (head.strip(), [])
    found = _cut_values(body, names, forced)
    return None if found is None else (head.strip(), found)


def _unclosed(body: str, tag: str) -> str:
    """``body`` without the start of ``tag`` that the cut left at its end."""
    body = body.rstrip()
    for n in range(min(len(tag) - 1, len(body)), 0, -1):
        if body.endswith(tag[:n]):
            return body[:-n].rstrip()
    return body


def _function(name: str, whole: bool, names: Sequence[str], forced: str | None) -> str | None:
    """The function a call names: ``name`` when it is offered; a name cut off (``whole``
    false) is the one offered function it begins (or the forced one) — only when the reply is
    surely a call (``forced``)."""
    if whole:
        return name if name in names else None
    if forced is None:
        return None
    if forced != "any" and forced.startswith(name):
        return forced
    begun = [n for n in names if n.startswith(name)]
    return begun[0] if len(begun) == 1 else None


def _with_args(name: str, args: str) -> ParsedCall:
    """A call to ``name`` whose arguments start ``args``: whole when they are a whole JSON
    object, else partial with the text as generated."""
    try:
        value, _ = _JSON.raw_decode(args.lstrip())
    except ValueError:
        return ParsedCall(name, args.strip(), partial=True)
    whole = _call({"name": name, "arguments": value}, None)
    return whole if whole is not None else ParsedCall(name, args.strip(), partial=True)


def _cut_call(obj: str, names: Sequence[str], forced: str | None) -> ParsedCall | None:
    """One call object as far as it was generated (``{"name": "zoom", "arguments": {"box": "le``)."""
    m = _NAME.search(obj)
    fn = _function(m.group(1), bool(m.group(2)), names, forced) if m else _function("", False, names, forced)
    if fn is None:
        return None
    a = _ARGS.search(obj)
    return _with_args(fn, obj[a.end() :]) if a else ParsedCall(fn, "", partial=True)


def _cut_values(body: str, names: Sequence[str], forced: str | None) -> list[ParsedCall] | None:
    """Call objects one after another (in a JSON list or not), the last perhaps cut off; None
    when the first is no call and the reply is not surely one (``forced`` None)."""
    dec, s = _JSON, body.strip()
    calls: list[ParsedCall] = []
    i = 1 if s.startswith("[") else 0
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        if i >= len(s) or s[i] == "]":
            return calls
        try:
            value, i = dec.raw_decode(s, i)
        except ValueError:
            one = _cut_call(s[i:], names, forced)
            if one is None and forced is None and not calls:
                return None
            return calls + ([one] if one is not None else [])
        got = _calls_in([value], set(names))
        if got is None and forced is None and not calls:
            return None
        calls += got or []


def partial_object(text: str) -> dict[str, Any]:
    """What a JSON object cut off part-way holds so far: its whole members, and a last string
    as far as it went ({} when nothing whole is there yet) — the arguments of a call cut off,
    as an object (Anthropic's ``tool_use.input``)."""
    text = text.strip()
    cuts, state = [len(text)], _Scan()
    for i, ch in enumerate(text):  # where the text may be cut back to: before a comma, after a bracket
        if state.feed(ch):
            cuts += [i] if ch == "," else [i + 1] if ch in "{[" else []
    if state.escaped:
        cuts[0] -= 1  # (an escape cut in two)
    for cut in sorted(set(cuts), reverse=True)[:64]:
        head = text[:cut].rstrip().rstrip(",")
        tail = _Scan()
        for ch in head:
            tail.feed(ch)
        try:
            value = _JSON.decode(head + tail.closing())
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


class _Scan:
    """JSON text read a character at a time: whether it is in a string, and what is open."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.in_string = self.escaped = False

    def feed(self, ch: str) -> bool:
        """Take ``ch``; whether it was outside a string (structure)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.open.append("}" if ch == "{" else "]")
        elif ch in "}]" and self.open:
            self.open.pop()
        return True

    def closing(self) -> str:
        """The quote and brackets that close what is open."""
        return ('"' if self.in_string else "") + "".join(reversed(self.open))


# --- grammar ---------------------------------------------------------------------------------


def call_schema(tools: Sequence[dict[str, Any]], fmt: str, name: str | None = None) -> dict[str, Any]:
    """The JSON Schema of one call object in ``fmt`` to one of ``tools`` (or to ``name``)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    options = []
    defs: dict[str, Any] = {}
    for i, fn in enumerate(chosen):
        params = fn.get("parameters") or {"type": "object"}
        if '"$ref"' in json.dumps(params):
            # a schema with local references ("#/$defs/X", pydantic's) moves whole under the
            # top's $defs, its references with it (the converter resolves paths of objects)
            defs[f"edgevlm-args-{i}"] = _rebase_refs(params, f"#/$defs/edgevlm-args-{i}")
            params = {"$ref": f"#/$defs/edgevlm-args-{i}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ValueError(f"no tool named {name!r}")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def _rebase_refs(node: Any, at: str) -> Any:
    """``node`` with every local ``$ref`` ("#/...") put under ``at`` (a schema moved there)."""
    if isinstance(node, list):
        return [_rebase_refs(v, at) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase_refs(v, at) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = at + ref[1:]
    return out


_ROOT = re.compile(r"^root\s*::=", re.M)


def call_grammar(
    tools: Sequence[dict[str, Any]],
    fmt: str,
    to_gbnf: Callable[[dict[str, Any]], str],
    name: str | None = None,
    parallel: bool = True,
) -> str:
    """GBNF for a reply that is nothing but tool calls in ``fmt`` (one, or one or more with
    ``parallel``), each to one of ``tools`` (or to ``name``) with arguments that fit its schema.
    ``to_gbnf``: a JSON Schema → GBNF converter whose start rule is ``root``."""
    body = _ROOT.sub("edgevlm-call ::=", to_gbnf(call_schema(tools, fmt, name)), count=1)
    if fmt == "hermes":
        block = '"<tool_call>\\n" edgevlm-call "\\n</tool_call>"'
        root = f'root ::= {block} ("\\n" {block})*' if parallel else f"root ::= {block}"
    elif fmt == "mistral":
        more = ' ("," edgevlm-call)*' if parallel else ""
        root = f'root ::= "[TOOL_CALLS]" "[" edgevlm-call{more} "]"'
    else:  # llama3 and the JSON fallback: one object
        root = "root ::= edgevlm-call"
    return root + "\n" + body
