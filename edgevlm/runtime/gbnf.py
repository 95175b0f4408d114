"""GBNF that llama.cpp's grammar parser takes within bounds: expressions, the rules they become,
and the limits every grammar edgevlm writes is held to (``GrammarLimits``, the one place).

llama.cpp's parser (``llama-grammar.cpp``) recurses into every parenthesised group, refuses a
repetition whose item is a group of more than one rule with ``{m,n}`` past 2000 (and silently
drops a maximum above 2000), and prints the whole grammar to stderr whenever it refuses one. So
what is written here is flat:

- a repetition is only ever on one symbol (a rule name, a character class or a literal) with
  counts up to ``LLAMA_REPEAT``; a larger count is written as blocks (``blk ::= x{2000}``
  repeated, and a tail), so the bound stays exact: ``x{0,5000}`` still stops at 5000;
- groups nest at most ``GROUP_DEPTH`` deep in one rule; deeper ones become rules of their own;
- a repetition's item never matches the empty string (``repeat`` rewrites it to an item that
  does not, which matches the same), so neither llama.cpp's stacks nor its left-recursion check
  can run away;
- every rule's cost in llama.cpp's elements (its repetitions expanded) is added up as it is
  written, and a grammar over ``GrammarLimits.elements`` or ``text_bytes`` is refused before
  anything is built (``SchemaError``, naming the schema that made it).

``jsongrammar`` (JSON Schema) and ``regexgrammar`` (a string's ``pattern``) write through this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from ..errors import SchemaError

__all__ = [
    "Alt",
    "Chars",
    "EMPTY",
    "Expr",
    "GROUP_DEPTH",
    "Grammar",
    "GrammarLimits",
    "LIMITS",
    "LLAMA_REPEAT",
    "Lit",
    "Ref",
    "Rep",
    "Seq",
    "alt",
    "nonempty",
    "nullable",
    "repeat",
    "seq",
]


@dataclass(frozen=True)
class GrammarLimits:
    """What a grammar edgevlm writes may hold; more is a ``SchemaError`` (a 400, exit 2)."""

    repeat: int = 1_000_000  # the largest count one repetition may say (maxLength, maxItems, a pattern's {m,n})
    elements: int = 400_000  # llama.cpp grammar elements (8 bytes each; repetitions expanded, rules counted)
    text_bytes: int = 4 * 2**20  # bytes of grammar text
    schema_depth: int = 64  # schemas nested in schemas (properties, items, anyOf ...)
    pattern_depth: int = 32  # groups nested in a pattern
    pattern_length: int = 8192  # characters of one pattern
    enum_trie_depth: int = 12  # enum values share prefixes this many branchings deep (fewer llama.cpp stacks)


LIMITS = GrammarLimits()
LLAMA_REPEAT = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD: {m,n} counts above it are refused or widened
GROUP_DEPTH = 4  # parenthesised groups nested in one rule's text before a rule of its own is made
RULE_COST = 8  # what a rule costs llama.cpp besides its elements (its vector, its name), in elements

_MAX_CHAR = 0x10FFFF
_BEYOND = 0xFFFFFFFF  # (llama.cpp's code points are 32 bits)


# --- expressions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    """A literal string of code points (``"abc"``)."""

    text: str


@dataclass(frozen=True)
class Chars:
    """One character out of ``ranges`` (inclusive code-point ranges, sorted, disjoint)."""

    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Ref:
    """A rule by its name."""

    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Alt:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Rep:
    """``item`` ``lo`` to ``hi`` times (``hi`` None: no maximum); ``item`` never matches ""."""

    item: Expr
    lo: int
    hi: int | None


Expr: TypeAlias = Lit | Chars | Ref | Seq | Alt | Rep
EMPTY = Seq(())


def seq(*items: Expr) -> Expr:
    """``items`` one after another (nested sequences flattened, literals joined)."""
    out: list[Expr] = []
    for it in items:
        for x in it.items if isinstance(it, Seq) else (it,):
            if isinstance(x, Lit) and not x.text:
                continue
            if isinstance(x, Lit) and out and isinstance(out[-1], Lit):
                out[-1] = Lit(out[-1].text + x.text)
            else:
                out.append(x)
    return out[0] if len(out) == 1 else Seq(tuple(out))


def alt(*items: Expr) -> Expr:
    """One of ``items``: nested alternatives flattened, duplicates and single characters merged
    into one class, and an empty alternative written as the rest being optional."""
    flat: list[Expr] = []
    for it in items:
        flat.extend(it.items if isinstance(it, Alt) else (it,))
    chars: list[tuple[int, int]] = []
    rest: list[Expr] = []
    seen: set[Expr] = set()
    empty = False
    for x in flat:
        if isinstance(x, Lit) and len(x.text) == 1:
            chars.append((ord(x.text), ord(x.text)))
        elif isinstance(x, Chars):
            chars.extend(x.ranges)
        elif x == EMPTY or isinstance(x, Lit) and not x.text:
            empty = True
        elif not isinstance(x, (Lit, Ref)):
            rest.append(x)  # (hashing a deep expression each time costs more than a duplicate)
        elif x not in seen:
            seen.add(x)
            rest.append(x)
    if chars:
        rest.insert(0, Chars(merge_ranges(chars)))
    one = rest[0] if len(rest) == 1 else Alt(tuple(rest)) if rest else EMPTY
    return repeat(one, 0, 1) if empty and rest else one


def repeat(item: Expr, lo: int, hi: int | None) -> Expr:
    """``item`` ``lo`` to ``hi`` times. An item that can be empty is first made one that cannot
    (``X{m,n}`` = ``X'{0,n}`` for X' = X without "", as X can stand in for nothing)."""
    if hi is not None and hi < lo:
        raise ValueError(f"repeat: {lo} > {hi}")
    if hi == 0:
        return EMPTY
    if nullable(item):
        part = nonempty(item)
        if part is None:
            return EMPTY
        item, lo = part, 0
    if lo == 1 and hi == 1:
        return item
    return Rep(item, lo, hi)


def merge_ranges(ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The code points (0 to U+10FFFF) not in ``ranges`` (merged)."""
    out, nxt = [], 0
    for a, b in ranges:
        if a > nxt:
            out.append((nxt, a - 1))
        nxt = b + 1
    if nxt <= _MAX_CHAR:
        out.append((nxt, _MAX_CHAR))
    return tuple(out)


def nullable(e: Expr, rules: Callable[[str], bool] | None = None) -> bool:
    """Whether ``e`` matches the empty string (``rules``: whether a named rule does; none do
    unless it says so)."""
    if isinstance(e, Lit):
        return not e.text
    if isinstance(e, Chars):
        return False
    if isinstance(e, Ref):
        return rules(e.name) if rules is not None else False
    if isinstance(e, Seq):
        return all(nullable(x, rules) for x in e.items)
    if isinstance(e, Alt):
        return any(nullable(x, rules) for x in e.items)
    return e.lo == 0 or nullable(e.item, rules)


MAX_OPTIONAL_PARTS = 32  # parts that may each be empty in one sequence repeated (the rewrite is quadratic)


def nonempty(e: Expr) -> Expr | None:
    """What ``e`` matches except the empty string; None when that is nothing. Raises
    ``ValueError`` for a sequence of more than ``MAX_OPTIONAL_PARTS`` parts that may be empty."""
    if not nullable(e):
        return e
    if isinstance(e, Rep):  # (its item never matches "")
        return Rep(e.item, max(e.lo, 1), e.hi) if e.hi != 1 or e.lo > 1 else e.item
    if isinstance(e, Alt):
        parts = [p for p in (nonempty(x) for x in e.items) if p is not None]
        return alt(*parts) if parts else None
    if isinstance(e, Seq):  # every part may be empty: the first that is not starts it
        if len(e.items) > MAX_OPTIONAL_PARTS:
            raise ValueError(f"more than {MAX_OPTIONAL_PARTS} parts that may be empty in one repeated group")
        out = []
        for i, x in enumerate(e.items):
            first = nonempty(x)
            if first is not None:
                out.append(seq(first, *e.items[i + 1 :]))
        return alt(*out) if out else None
    return None  # an empty literal


# --- the rule set ----------------------------------------------------------------------------------


def gbnf_literal(text: str) -> str:
    out = []
    for ch in text:
        c = ord(ch)
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif 0x20 <= c < 0x7F or c > 0x9F and not 0xD800 <= c <= 0xDFFF:
            out.append(ch)
        else:
            out.append(_escape(c))
    return '"' + "".join(out) + '"'


def _escape(c: int) -> str:
    return f"\\x{c:02X}" if c < 0x100 else f"\\u{c:04X}" if c < 0x10000 else f"\\U{c:08X}"


def _class_char(c: int) -> str:
    ch = chr(c)
    return ch if ch.isascii() and ch.isalnum() or ch == " " else _escape(c)


def gbnf_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """``[...]``, or ``[^...]`` of the complement when that is shorter. A negated class also
    names the values past U+10FFFF: llama.cpp decodes some invalid UTF-8 (a lead byte F4-F7)
    to them, and ``[^...]`` would take them."""
    other = complement(ranges) + ((_MAX_CHAR + 1, _BEYOND),)
    neg = len(other) < len(ranges)
    body = "".join(
        _class_char(a) if a == b else _class_char(a) + "-" + _class_char(b) for a, b in (other if neg else ranges)
    )
    return ("[^" if neg else "[") + body + "]"


def _atom(e: Expr) -> bool:
    """Whether llama.cpp repeats ``e`` as one symbol (a rule name, a class, a literal)."""
    return isinstance(e, (Ref, Chars, Lit))


class Grammar:
    """Rules written as they are defined, their cost in llama.cpp's elements added up; over
    ``limits`` raises ``SchemaError`` naming ``where`` (the schema the grammar is for)."""

    def __init__(self, where: str = "", limits: GrammarLimits = LIMITS):
        self.where = where
        self.limits = limits
        self.bodies: dict[str, str] = {}  # name → its text, in the order defined
        self.exprs: dict[str, Expr] = {}  # name → what it was written from (the left-recursion check)
        self.origin: dict[str, str] = {}  # name → the schema it came from (for errors)
        self.by_body: dict[str, str] = {}  # text → a rule that has it (rules made here are shared)
        self.taken: set[str] = set()
        self.used: set[str] = set()  # rule names referred to
        self.lifted: dict[int, tuple[Expr, str]] = {}  # id(expr) → (expr, its rule)
        self.cost = 0
        self.size = 0

    # names ---------------------------------------------------------------------------------
    def name(self, base: str) -> str:
        """A new rule name from ``base`` (``base``, else ``base1``, ``base2`` ...)."""
        base = base or "r"
        if base not in self.taken:
            self.taken.add(base)
            return base
        i = 1
        while f"{base}{i}" in self.taken:
            i += 1
        self.taken.add(f"{base}{i}")
        return f"{base}{i}"

    # rules ---------------------------------------------------------------------------------
    def define(self, base: str, e: Expr, origin: str = "") -> str:
        """A rule for ``e`` (an existing one with the same text, or a new one named from
        ``base``); a rule name stays itself."""
        if isinstance(e, Ref):
            return e.name
        text = self.render(e, base, 0)
        name = self.by_body.get(text)
        if name is None:
            name = self.name(base)
            self._add(name, text, e, origin)
            self.by_body[text] = name
        return name

    def define_as(self, name: str, e: Expr, origin: str = "") -> None:
        """The rule ``name`` (taken with ``name()`` or fixed, as ``root``) is ``e``."""
        self.taken.add(name)
        self._add(name, self.render(e, name, 0), e, origin)

    def _add(self, name: str, text: str, e: Expr, origin: str) -> None:
        self.bodies[name] = text
        self.exprs[name] = e
        self.origin[name] = origin
        self.spend(RULE_COST + 1, len(name) + len(text) + 6)

    def spend(self, elements: int, text: int = 0) -> None:
        self.cost += elements
        self.size += text
        lim = self.limits
        if self.cost > lim.elements:
            raise SchemaError(
                self.where,
                f"the grammar for it would be over {lim.elements:,} llama.cpp grammar elements; make it smaller",
            )
        if self.size > lim.text_bytes:
            raise SchemaError(self.where, f"the grammar for it would be over {lim.text_bytes:,} bytes; make it smaller")

    def text(self) -> str:
        """The grammar, ``root`` first, after the check that no rule starts with itself."""
        missing = self.used - self.bodies.keys()
        if missing:  # (a bug of the writer: llama.cpp would refuse the grammar and print all of it)
            raise RuntimeError(f"grammar rules used but never defined: {sorted(missing)}")
        self.check_left_recursion()
        order = ["root", *(n for n in self.bodies if n != "root")] if "root" in self.bodies else list(self.bodies)
        return "".join(f"{n} ::= {self.bodies[n]}\n" for n in order)

    # rendering -------------------------------------------------------------------------------
    def render(self, e: Expr, owner: str, depth: int) -> str:
        """``e`` as GBNF text inside rule ``owner`` at group depth ``depth``."""
        if isinstance(e, Lit):
            self.spend(len(e.text))
            return gbnf_literal(e.text)
        if isinstance(e, Chars):
            self.spend(2 * len(e.ranges))
            return gbnf_class(e.ranges)
        if isinstance(e, Ref):
            self.spend(1)
            self.used.add(e.name)
            return e.name
        if isinstance(e, Seq):
            return " ".join(
                self._group(x, owner, depth) if isinstance(x, Alt) else self.render(x, owner, depth) for x in e.items
            )
        if isinstance(e, Alt):
            self.spend(len(e.items))
            return " | ".join(self.render(x, owner, depth) for x in e.items)
        return self._repeat(e, owner, depth)

    def _group(self, e: Expr, owner: str, depth: int) -> str:
        """``( e )``, or a rule of its own past ``GROUP_DEPTH``."""
        if depth >= GROUP_DEPTH:
            return self.render(Ref(self.lift(e, owner)), owner, depth)
        self.spend(RULE_COST + 2)
        return "( " + self.render(e, owner, depth + 1) + " )"

    def lift(self, e: Expr, owner: str) -> str:
        """A rule for ``e`` (made once per expression object)."""
        hit = self.lifted.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        name = self.define(f"{owner}-{len(self.lifted) + 1}", e)
        self.lifted[id(e)] = (e, name)
        return name

    def _repeat(self, e: Rep, owner: str, depth: int) -> str:
        item, lo, hi = e.item, e.lo, e.hi
        if not _atom(item):
            item = Ref(self.lift(item, owner))
        if (hi if hi is not None else lo) > LLAMA_REPEAT:
            blocks = self._blocks(item, lo, hi, owner)
            return self._group(blocks, owner, depth) if isinstance(blocks, Alt) else self.render(blocks, owner, depth)
        # llama.cpp expands x{m,n} to m copies of x and n-m rules "x next |" (x* and x+: one)
        text = self.render(item, owner, depth)
        c = max(1, len(item.text) if isinstance(item, Lit) else 2 * len(item.ranges) if isinstance(item, Chars) else 1)
        rules = 1 if hi is None else hi - lo
        self.spend(max(lo - 1, 0) * c + rules * (c + 3 + RULE_COST))
        if (lo, hi) == (0, 1):
            return text + "?"
        if hi is None and lo <= 1:
            return text + ("*" if lo == 0 else "+")
        if lo == hi:
            return f"{text}{{{lo}}}"
        return f"{text}{{{lo},{'' if hi is None else hi}}}"

    def _blocks(self, x: Expr, lo: int, hi: int | None, owner: str) -> Expr:
        """``x{lo,hi}`` with counts over ``LLAMA_REPEAT`` as repetitions of blocks of
        ``LLAMA_REPEAT`` items, each count within it; the same strings, exactly."""
        B = LLAMA_REPEAT

        def block(y: Expr) -> Expr:
            return Ref(self.define(f"{owner}-{B}", Rep(y, B, B)))

        def exactly(y: Expr, n: int) -> Expr:
            if n <= B:
                return repeat(y, n, n)
            q, r = divmod(n, B)
            return seq(exactly(block(y), q), repeat(y, r, r))

        def up_to(y: Expr, k: int) -> Expr:
            if k <= B:
                return repeat(y, 0, k)
            q, r = divmod(k, B)  # 0..qB-1 as (at most q-1 blocks, then under a block) | q blocks and up to r
            blk = block(y)
            return alt(seq(up_to(blk, q - 1), repeat(y, 0, B - 1)), seq(exactly(blk, q), repeat(y, 0, r)))

        return seq(exactly(x, lo), repeat(x, 0, None) if hi is None else up_to(x, hi - lo))

    # checks ----------------------------------------------------------------------------------
    def check_left_recursion(self) -> None:
        """A rule that can reach itself before matching any character (a ``$ref`` to itself
        through ``anyOf``) is refused here: llama.cpp would refuse it with a log line."""
        empty: dict[str, bool] = {n: False for n in self.exprs}
        changed = True
        while changed:  # which rules match "" (a fixpoint)
            changed = False
            for n, e in self.exprs.items():
                if not empty[n] and nullable(e, lambda r: empty.get(r, False)):
                    empty[n] = changed = True
        first = {n: _first_refs(e, lambda r: empty.get(r, False)) for n, e in self.exprs.items()}
        state: dict[str, int] = {}
        for start in first:
            if state.get(start):
                continue
            todo = [(start, iter(sorted(first[start])))]
            state[start] = 1
            while todo:
                node, it = todo[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    todo.pop()
                elif nxt in first and state.get(nxt) == 1:
                    raise SchemaError(
                        self.origin.get(nxt) or self.where,
                        "refers to itself before any text (a $ref loop through anyOf or allOf); no grammar can hold it",
                    )
                elif nxt in first and not state.get(nxt):
                    state[nxt] = 1
                    todo.append((nxt, iter(sorted(first[nxt]))))


def _first_refs(e: Expr, empty: Callable[[str], bool]) -> set[str]:
    """The rules ``e`` may start with (before matching any character)."""
    if isinstance(e, Ref):
        return {e.name}
    if isinstance(e, Rep):
        return _first_refs(e.item, empty)
    if isinstance(e, Alt):
        return set().union(*(_first_refs(x, empty) for x in e.items))
    if isinstance(e, Seq):
        out: set[str] = set()
        for x in e.items:
            out |= _first_refs(x, empty)
            if not nullable(x, empty):
                break
        return out
    return set()
