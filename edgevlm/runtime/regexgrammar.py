"""A JSON Schema string's ``pattern`` as grammar: what may stand between the quotes of the JSON
text of a string the pattern matches.

The pattern language is ECMA-262's (JSON Schema's), this much of it: literal characters and
escapes (``\\d \\w \\s`` and their negations, ``\\t \\n \\r \\f \\v \\0``, ``\\xHH``,
``\\uHHHH``, ``\\u{H...}``, ``\\cX``, escaped punctuation), ``.``, classes ``[...]`` and
``[^...]`` with ranges, groups ``(...)``, ``(?:...)`` and ``(?<name>...)``, alternation ``|``,
and the quantifiers ``* + ? {n} {n,} {n,m}`` (lazy or not: the strings are the same). ``^`` and
``$`` anchor the start and end of the pattern or of one of its top-level alternatives; a side
left unanchored matches anything there, as a JSON Schema pattern is searched, not matched whole.
Lookarounds, backreferences, word boundaries and Unicode property escapes are refused
(``PatternError``), as are patterns longer, deeper or with larger counts than ``GrammarLimits``
allows.

The pattern describes the string's characters; the grammar writes their JSON: a ``"`` or ``\\``
it allows is written escaped, a control character as its escape (``\\n``, ``\\u001f``), never raw.
"""

from __future__ import annotations

import re

from ..errors import shown
from .gbnf import EMPTY, Chars, Expr, GrammarLimits, Lit, alt, complement, merge_ranges, repeat, seq

__all__ = ["PatternError", "encoded", "pattern_expr"]

Ranges = tuple[tuple[int, int], ...]

ALL: Ranges = ((0, 0x10FFFF),)
DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Ranges = merge_ranges(
    [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029)]
    + [(0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
)
DOT: Ranges = complement(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)))  # (no line terminators)
CLASSES = {
    "d": DIGIT,
    "D": complement(DIGIT),
    "w": WORD,
    "W": complement(WORD),
    "s": SPACE,
    "S": complement(SPACE),
}
CONTROL = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B}
# what a JSON string holds as itself: not ", not \, no control character, no lone surrogate
PLAIN: Ranges = complement(((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF)))
SHORT = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
_QUANT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _count(digits: str) -> int:
    """A quantifier's count (past 18 digits: one more than any limit, not Python's refusal)."""
    return int(digits) if len(digits) <= 18 else 10**18


class PatternError(ValueError):
    """A pattern edgevlm cannot write as grammar; the message says why."""


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _has(ranges: Ranges, c: int) -> bool:
    return any(a <= c <= b for a, b in ranges)


def _hex_chars(nibbles: list[int]) -> Expr:
    """One hex digit of ``nibbles``, either case."""
    out = []
    for n in nibbles:
        out.append(Lit("0123456789abcdef"[n]))
        if n >= 10:
            out.append(Lit("ABCDEF"[n - 10]))
    return alt(*out)


def encoded(ranges: Ranges, any_char: Expr) -> Expr:
    """One character of ``ranges`` as JSON writes it inside a string (``any_char``: the rule
    for any character at all)."""
    ranges = merge_ranges(ranges)
    if ranges == ALL:
        return any_char
    parts: list[Expr] = []
    plain = _intersect(ranges, PLAIN)
    if len(plain) == 1 and plain[0][0] == plain[0][1]:
        parts.append(Lit(chr(plain[0][0])))
    elif plain:
        parts.append(Chars(plain))
    if _has(ranges, 0x22):
        parts.append(Lit('\\"'))
    if _has(ranges, 0x5C):
        parts.append(Lit("\\\\"))
    by_high: dict[str, list[int]] = {}
    for c in [*range(0x20), 0x7F]:
        if not _has(ranges, c):
            continue
        if c in SHORT:
            parts.append(Lit(SHORT[c]))
        else:
            by_high.setdefault(f"\\u00{c >> 4:x}", []).append(c & 15)
    for head, low in by_high.items():
        parts.append(seq(Lit(head), _hex_chars(low)))
    if not parts:
        raise PatternError("a character class that matches no character a JSON string can hold")
    return alt(*parts)


def pattern_expr(pattern: str, any_char: Expr, limits: GrammarLimits) -> Expr:
    """What stands between the quotes of the JSON text of a string ``pattern`` matches."""
    if len(pattern) > limits.pattern_length:
        raise PatternError(f"longer than {limits.pattern_length:,} characters")
    return _Parser(pattern, any_char, limits).parse()


class _Parser:
    def __init__(self, src: str, any_char: Expr, limits: GrammarLimits):
        self.s = src
        self.i = 0
        self.any = any_char
        self.limits = limits

    def fail(self, what: str, at: int | None = None) -> PatternError:
        return PatternError(f"{what} at index {self.i if at is None else at}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def parse(self) -> Expr:
        branches = []
        while True:
            anchored = self.peek() == "^"
            self.i += anchored
            body = self.sequence(0, top=True)
            ended = self.peek() == "$"
            self.i += ended
            anywhere = repeat(self.any, 0, None)
            branches.append(seq(EMPTY if anchored else anywhere, body, EMPTY if ended else anywhere))
            if self.peek() != "|":
                break
            self.i += 1
        if self.i < len(self.s):
            raise self.fail("unbalanced ')'" if self.peek() == ")" else f"unexpected {self.peek()!r}")
        return alt(*branches)

    def alternation(self, depth: int) -> Expr:
        parts = [self.sequence(depth)]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence(depth))
        return alt(*parts)

    def sequence(self, depth: int, top: bool = False) -> Expr:
        items: list[Expr] = []
        while self.i < len(self.s):
            c = self.peek()
            if c in "|)":
                break
            if c == "$" and top and self.peek(1) in ("", "|"):
                break
            if c in "^$":
                raise self.fail(
                    f"{c!r} (anchors are allowed only at the start or end of the pattern or of its alternatives)"
                )
            items.append(self.quantified(self.atom(depth)))
        return seq(*items)

    def atom(self, depth: int) -> Expr:
        c = self.peek()
        start = self.i
        if c == "(":
            if depth >= self.limits.pattern_depth:
                raise self.fail(f"groups nested deeper than {self.limits.pattern_depth}")
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.s.startswith("?<", self.i) and self.peek(2) not in ("=", "!"):
                end = self.s.find(">", self.i)
                if end < 0:
                    raise self.fail("an unterminated group name")
                self.i = end + 1
            elif self.peek() == "?":
                raise self.fail("lookaround or inline flags (not supported)")
            inner = self.alternation(depth + 1)
            if self.peek() != ")":
                raise self.fail("an unterminated group", start)
            self.i += 1
            return inner
        if c == "[":
            return encoded(self.char_class(), self.any)
        if c == ".":
            self.i += 1
            return encoded(DOT, self.any)
        if c == "\\":
            got = self.escape(in_class=False)
            return encoded(got if isinstance(got, tuple) else ((got, got),), self.any)
        if c in "*+?" or c == "{" and _QUANT.match(self.s, self.i):
            raise self.fail(f"nothing to repeat before {c!r}")
        self.i += 1
        return encoded(((ord(c), ord(c)),), self.any)

    def quantified(self, item: Expr) -> Expr:
        c, at = self.peek(), self.i
        m = _QUANT.match(self.s, self.i) if c == "{" else None
        if c in ("*", "+", "?"):
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.i += 1
        elif m:
            lo = _count(m.group(1))
            hi = lo if m.group(2) is None else _count(m.group(3)) if m.group(3) else None
            self.i = m.end()
        else:
            return item
        most, said = self.limits.repeat, shown(self.s[at : self.i])
        if lo > most or (hi or 0) > most:
            raise self.fail(f"{said}: over the limit of {most:,} repetitions", at)
        if hi is not None and hi < lo:
            raise self.fail(f"{said}: the numbers are out of order", at)
        if self.peek() == "?":
            self.i += 1  # (lazy: the same strings)
        if self.peek() in ("*", "+", "?") or self.peek() == "{" and _QUANT.match(self.s, self.i):
            raise self.fail("a quantifier after a quantifier")
        try:
            return repeat(item, lo, hi)
        except ValueError as exc:
            raise self.fail(str(exc), at) from None

    def char_class(self) -> Ranges:
        start = self.i
        self.i += 1
        neg = self.peek() == "^"
        self.i += neg
        out: list[tuple[int, int]] = []
        while True:
            if self.i >= len(self.s):
                raise self.fail("an unterminated character class", start)
            if self.peek() == "]":
                self.i += 1
                break
            lo = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                self.i += 1
                hi = self.class_atom()
                if isinstance(lo, int) and isinstance(hi, int):
                    if hi < lo:
                        raise self.fail("a character range out of order")
                    out.append((lo, hi))
                    continue
                out.append((0x2D, 0x2D))  # (a class escape beside '-': the '-' is itself)
                for x in (lo, hi):
                    out.extend(x if isinstance(x, tuple) else ((x, x),))
                continue
            out.extend(lo if isinstance(lo, tuple) else ((lo, lo),))
        ranges = merge_ranges(out)
        return complement(ranges) if neg else ranges

    def class_atom(self) -> int | Ranges:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        c = self.peek()
        self.i += 1
        return ord(c)

    def escape(self, in_class: bool) -> int | Ranges:
        """The escape at ``\\``: a code point, or a class (``\\d``)."""
        at = self.i
        self.i += 1
        c = self.peek()
        if not c:
            raise self.fail("a pattern that ends in '\\'", at)
        self.i += 1
        if c in CLASSES:
            return CLASSES[c]
        if c in CONTROL:
            return CONTROL[c]
        if c == "b" and in_class:
            return 0x08
        if c == "0" and not self.peek().isdigit():
            return 0
        if c == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", self.s[self.i : self.i + 2]):
            self.i += 2
            return int(self.s[self.i - 2 : self.i], 16)
        if c == "u":
            m = re.compile(r"[0-9a-fA-F]{4}|\{([0-9a-fA-F]{1,6})\}").match(self.s, self.i)
            if m and int(m.group(1) or m.group(0), 16) <= 0x10FFFF:
                self.i = m.end()
                return int(m.group(1) or m.group(0), 16)
        if c == "c" and self.peek().isascii() and self.peek().isalpha():
            self.i += 1
            return ord(self.s[self.i - 1]) % 32
        if not c.isascii() or not c.isalnum():
            return ord(c)  # an escaped punctuation mark is itself
        what = {
            "b": "a word boundary",
            "B": "a word boundary",
            "k": "a backreference",
            "p": "a Unicode property escape",
            "P": "a Unicode property escape",
        }.get(c, "a backreference" if c.isdigit() else "an unknown escape")
        raise self.fail(f"\\{c}: {what} (not supported)", at)
