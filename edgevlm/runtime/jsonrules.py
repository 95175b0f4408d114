"""The rules every JSON grammar shares: a JSON string's character (no raw control character, no
escaped lone surrogate), strings, numbers, integers, the any-value rules, the string formats
(date, time, date-time, uuid), OpenAI's ``json_object`` grammar, integer ranges written digit
by digit, and enum values as a trie of their shared prefixes. ``jsongrammar`` writes schemas
with them."""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any

from .gbnf import EMPTY, Alt, Chars, Expr, Grammar, Lit, Ref, Seq, alt, repeat, seq
from .regexgrammar import PLAIN

__all__ = [
    "JSON_OBJECT",
    "PRIMS",
    "QUOTE",
    "RESERVED",
    "SPACE",
    "int_range",
    "json_text",
    "literal_trie",
    "nests_deeper",
    "rule_refs",
]

QUOTE = Lit('"')
SPACE = Ref("space")
DIGIT = Chars(((0x30, 0x39),))
HEX = Chars(((0x30, 0x39), (0x41, 0x46), (0x61, 0x66)))
TOP = 10**16 - 1  # the largest integer written (16 digits, as llama.cpp's converter)
_SURROGATE = re.compile("[\ud800-\udfff]")


def nests_deeper(data: Any, most: int) -> bool:
    """Whether ``data`` nests more than ``most`` arrays and objects (walked without recursion:
    a schema file checked before anything walks it recursively)."""
    todo: list[tuple[Any, int]] = [(data, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth > most:
            return True
        todo.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def json_text(value: Any) -> str:
    """``value`` as JSON text, its characters as themselves (lone surrogates escaped)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _char() -> Expr:
    """One character of a JSON string: any but ", \\ and the control characters, or an escape
    (no lone surrogate: ``\\uD800``-``\\uDFFF`` are not written)."""
    not_d = Chars(((0x30, 0x39), (0x41, 0x43), (0x45, 0x46), (0x61, 0x63), (0x65, 0x66)))
    unicode = alt(
        seq(not_d, repeat(HEX, 3, 3)),
        seq(Chars(((0x44, 0x44), (0x64, 0x64))), Chars(((0x30, 0x37),)), repeat(HEX, 2, 2)),
    )
    return alt(Chars(PLAIN), seq(Lit("\\"), alt(*map(Lit, '"\\/bfnrt'), seq(Lit("u"), unicode))))


def _two(lo: str, hi: str) -> Expr:
    return Chars(((ord(lo), ord(hi)),))


def _prims(ws: Ref) -> dict[str, Expr]:
    comma = seq(Lit(","), ws)
    pair = seq(Ref("string"), Lit(":"), ws, Ref("value"))
    hours = alt(seq(_two("0", "1"), DIGIT), seq(Lit("2"), _two("0", "3")))
    minutes = seq(_two("0", "5"), DIGIT)
    return {
        "char": _char(),
        "string": seq(QUOTE, repeat(Ref("char"), 0, None), QUOTE, ws),
        "integral-part": alt(DIGIT, seq(_two("1", "9"), repeat(DIGIT, 1, 15))),
        "number": seq(
            repeat(Lit("-"), 0, 1),
            Ref("integral-part"),
            repeat(seq(Lit("."), repeat(DIGIT, 1, 16)), 0, 1),
            repeat(
                seq(
                    Chars(((0x45, 0x45), (0x65, 0x65))),
                    repeat(Chars(((0x2B, 0x2B), (0x2D, 0x2D))), 0, 1),
                    repeat(DIGIT, 1, 16),
                ),
                0,
                1,
            ),
            ws,
        ),
        "integer": seq(repeat(Lit("-"), 0, 1), Ref("integral-part"), ws),
        "boolean": seq(alt(Lit("true"), Lit("false")), ws),
        "null": seq(Lit("null"), ws),
        "value": alt(*(Ref(n) for n in ("object", "array", "string", "number", "boolean", "null"))),
        "object": seq(Lit("{"), ws, repeat(seq(pair, repeat(seq(comma, pair), 0, None)), 0, 1), Lit("}"), ws),
        "array": seq(
            Lit("["), ws, repeat(seq(Ref("value"), repeat(seq(comma, Ref("value")), 0, None)), 0, 1), Lit("]"), ws
        ),
        "date": seq(
            repeat(DIGIT, 4, 4),
            Lit("-"),
            alt(seq(Lit("0"), _two("1", "9")), seq(Lit("1"), _two("0", "2"))),
            Lit("-"),
            alt(seq(Lit("0"), _two("1", "9")), seq(_two("1", "2"), DIGIT), seq(Lit("3"), _two("0", "1"))),
        ),
        "time": seq(
            hours,
            Lit(":"),
            minutes,
            Lit(":"),
            minutes,
            repeat(seq(Lit("."), repeat(DIGIT, 1, 9)), 0, 1),
            alt(Lit("Z"), seq(Chars(((0x2B, 0x2B), (0x2D, 0x2D))), hours, Lit(":"), minutes)),
        ),
        "date-time": seq(Ref("date"), Lit("T"), Ref("time")),
        "uuid": seq(
            repeat(HEX, 8, 8), *itertools.chain.from_iterable((Lit("-"), repeat(HEX, n, n)) for n in (4, 4, 4, 12))
        ),
    }


PRIMS = {"space": repeat(Lit(" "), 0, 1), **_prims(SPACE)}
RESERVED = {"root", "edgevlm-answer", "edgevlm-call", *PRIMS}  # (rules.py and toolformat add the two)


def rule_refs(e: Expr) -> set[str]:
    """The rules ``e`` names."""
    if isinstance(e, Ref):
        return {e.name}
    if isinstance(e, (Lit, Chars)):
        return set()
    items = e.items if isinstance(e, (Seq, Alt)) else (e.item,)
    return set().union(*(rule_refs(x) for x in items))


def _json_object() -> str:
    """OpenAI's ``json_object`` (and Ollama's ``"json"``): any JSON object, whitespace as
    llama.cpp's own ``json.gbnf`` allows it (a newline and indentation too)."""
    g = Grammar("json_object")
    ws = Ref("ws")
    prims = _prims(ws)
    g.define_as("root", Ref("object"))
    for name in ("value", "object", "array", "string", "char", "number", "integral-part", "boolean", "null"):
        g.define_as(name, prims[name])
    g.define_as("ws", repeat(alt(Lit(" "), seq(Lit("\n"), repeat(Chars(((0x09, 0x09), (0x20, 0x20))), 0, 20))), 0, 1))
    return g.text()


JSON_OBJECT = _json_object()


def literal_trie(texts: list[str], depth: int, most: int) -> Expr:
    """One of ``texts``, alternatives sharing their prefixes (``most`` branchings deep): an
    enum of a thousand values is a few grammar stacks at a time, not a thousand. ``texts``:
    sorted, each once."""
    if len(texts) == 1:
        return Lit(texts[0])
    if depth >= most:
        return alt(*map(Lit, texts))
    parts: list[Expr] = []
    for head, group in itertools.groupby(texts, key=lambda t: t[:1]):
        tails = [t[1:] for t in group]
        if not head:
            parts.append(EMPTY)
            continue
        shared = os.path.commonprefix(tails)
        parts.append(seq(Lit(head + shared), literal_trie([t[len(shared) :] for t in tails], depth + 1, most)))
    return alt(*parts)


def int_range(lo: int | None, hi: int | None) -> Expr | None:
    """The JSON text of the integers from ``lo`` to ``hi`` (None: no bound; at most 16 digits),
    no leading zeros; None when there are none."""
    lo = -TOP if lo is None else max(lo, -TOP)
    hi = TOP if hi is None else min(hi, TOP)
    if lo > hi:
        return None
    parts = []
    if lo < 0:
        parts.append(seq(Lit("-"), _between(1 if hi >= 0 else -hi, -lo)))
    if hi >= 0:
        parts.append(_between(max(lo, 0), hi))
    return alt(*parts)


def _between(a: int, b: int) -> Expr:
    """The digits of the integers ``a`` to ``b`` (0 <= a <= b)."""
    parts: list[Expr] = []
    full: list[int] = []  # lengths whose every number is in (2 digits or more)
    for d in range(len(str(a)), len(str(b)) + 1):
        x, y = max(a, 10 ** (d - 1) if d > 1 else 0), min(b, 10**d - 1)
        if d > 1 and x == 10 ** (d - 1) and y == 10**d - 1:
            full.append(d)
        else:
            parts.append(_same_length(str(x), str(y)))
    if full:
        parts.append(seq(_two("1", "9"), repeat(DIGIT, full[0] - 1, full[-1] - 1)))
    return alt(*parts)


def _same_length(s: str, t: str) -> Expr:
    """The digit strings from ``s`` to ``t``, both of one length."""
    if s == t:
        return Lit(s)
    if s[0] == t[0]:
        return seq(Lit(s[0]), _same_length(s[1:], t[1:]))
    n = len(s) - 1
    a, b = int(s[0]), int(t[0])
    parts: list[Expr] = []
    if s[1:] != "0" * n:
        parts.append(seq(Lit(s[0]), _same_length(s[1:], "9" * n)))
        a += 1
    tail = None
    if t[1:] != "9" * n:
        tail = seq(Lit(t[0]), _same_length("0" * n, t[1:]))
        b -= 1
    if a <= b:
        parts.append(seq(_two(str(a), str(b)), repeat(DIGIT, n, n)))
    if tail is not None:
        parts.append(tail)
    return alt(*parts)
