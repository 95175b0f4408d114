"""JSON Schema → GBNF: edgevlm's own converter, for every grammar a reply follows (OpenAI's
``json_schema`` and ``json_object``, Responses' ``text.format``, Anthropic's
``output_config.format``, Ollama's ``format``, the arguments of a forced tool call, ``edgevlm
chat|caption --json-schema``, batch lines).

What it holds: ``type`` (one or a list), ``enum``, ``const``, ``anyOf``/``oneOf`` (the keywords
beside them hold in each alternative), ``allOf`` (merged), local ``$ref`` (``#``, ``#/$defs/X``,
``#/definitions/X``, any JSON pointer; recursive schemas too), ``properties``/``required``/
``additionalProperties`` (properties in the schema's order, required ones first, as
llama.cpp's converter), ``items``/``prefixItems``/``additionalItems`` with ``minItems``/
``maxItems``, ``minLength``/``maxLength``, ``pattern`` (``regexgrammar``), ``format`` date, time,
date-time and uuid, integer ``minimum``/``maximum`` (exclusive too), ``nullable``. Other keywords
are ignored (the grammar then allows more than the schema). Between tokens one optional space.

Every count is held exactly, however large, up to ``GrammarLimits.repeat`` (``gbnf`` writes it
flat); larger counts, deeper nesting and grammars over the size limits are a ``SchemaError``
naming the field (``response_format.json_schema.schema.properties.a.maxLength``) and the limit.
A string's characters exclude the control characters U+0000-U+001F and U+007F (JSON writes
them escaped) and escapes of lone surrogates, so each character of the grammar is one character
of the decoded string: ``minLength`` and ``maxLength`` hold as ``jsonschema`` counts them.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from typing import Any, cast

from ..errors import SchemaError, shown
from .gbnf import EMPTY, LIMITS, Expr, Grammar, GrammarLimits, Lit, Ref, alt, repeat, seq
from .jsonrules import JSON_OBJECT, PRIMS, QUOTE, RESERVED, SPACE, int_range, json_text, literal_trie, rule_refs
from .regexgrammar import PatternError, pattern_expr

__all__ = ["field_path", "json_grammar"]

META = {"title", "description", "default", "examples", "$comment", "$id", "$schema", "$defs", "definitions"}
META |= {"deprecated", "readOnly", "writeOnly", "$anchor", "discriminator"}
LOWER = {"minLength", "minItems", "minimum", "exclusiveMinimum", "minProperties"}
UPPER = {"maxLength", "maxItems", "maximum", "exclusiveMaximum", "maxProperties"}
STRICT = {"pattern", "format", "const", "anyOf", "oneOf", "prefixItems", "nullable"}  # (two different: refused)
_NAME = re.compile(r"[^A-Za-z0-9-]+")
_IDENT = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")


def field_path(where: str, segs: tuple[Any, ...]) -> str:
    """``where`` (``response_format.json_schema.schema``, or an option: ``--json-schema``) and
    the segments under it as one field path (``...schema.properties.a.maxLength``,
    ``--json-schema: properties.a``), short enough for one log line."""
    out = where + (": " if where.startswith("--") and segs else "")
    for s in segs:
        if isinstance(s, int):
            out += f"[{s}]"
        elif _IDENT.fullmatch(s) and len(s) <= 48:
            out += f".{s}" if out and not out.endswith(" ") else s
        else:
            out += "[" + json.dumps(s[:40] + ("..." if len(s) > 40 else "")) + "]"
    return out if len(out) <= 400 else out[:150] + "..." + out[-240:]


def _base(name: str) -> str:
    """A rule name from ``name``: letters, digits and '-' (llama.cpp's), at most 32 of them."""
    return _NAME.sub("-", name).strip("-")[:32] or "r"


# --- the converter -----------------------------------------------------------------------------


def json_grammar(schema: Any = None, where: str = "", limits: GrammarLimits = LIMITS) -> str:
    """GBNF (start rule ``root``) for JSON values ``schema`` allows; None: any JSON object
    (``json_object``). ``where`` names the schema in errors (``response_format.json_schema.schema``;
    "" for a file's). A schema that cannot be held, or only over ``limits``, is a ``SchemaError``."""
    if schema is None:
        return JSON_OBJECT
    return _Converter(schema, where, limits).convert()


class _Converter:
    def __init__(self, doc: Any, where: str, limits: GrammarLimits):
        self.doc = doc
        self.where = where
        self.limits = limits
        self.g = Grammar(where, limits)
        self.g.taken |= RESERVED
        self.refs: dict[str, str] = {"#": "root"}
        self.todo: list[tuple[str, Any, tuple[Any, ...]]] = []

    def error(self, at: tuple[Any, ...], problem: str) -> SchemaError:
        return SchemaError(field_path(self.where, at), problem)

    def convert(self) -> str:
        self.prim("space")
        self.g.define_as("root", self.visit(self.doc, (), "root", 0), self.where)
        while self.todo:
            name, target, at = self.todo.pop(0)
            self.g.define_as(name, self.visit(target, at, name, 0), field_path(self.where, at))
        return self.g.text()

    def prim(self, name: str) -> Ref:
        if name not in self.g.bodies:
            self.g.define_as(name, PRIMS[name])
            for dep in sorted(rule_refs(PRIMS[name])):
                self.prim(dep)
        return Ref(name)

    def rule(self, base: str, e: Expr) -> Ref:
        return Ref(self.g.define(_base(base), e))

    # schemas -----------------------------------------------------------------------------
    def visit(self, s: Any, at: tuple[Any, ...], name: str, depth: int) -> Expr:
        """What the JSON text of a value ``s`` allows looks like (ending in the optional space)."""
        if depth > self.limits.schema_depth:
            raise self.error(at, f"schemas nest deeper than {self.limits.schema_depth} levels here")
        if s is True or s == {}:
            return self.prim("value")
        if s is False:
            raise self.error(at, "false: no value fits this schema")
        if not isinstance(s, dict):
            raise self.error(at, f"a schema is an object or true/false, not {type(s).__name__}")
        if "$ref" in s:
            return Ref(self.ref(s["$ref"], at + ("$ref",)))
        if "allOf" in s:
            one = s["allOf"]
            if isinstance(one, list) and len(one) == 1 and not set(s) - META - {"allOf"}:
                return self.visit(one[0], at + ("allOf", 0), name, depth + 1)  # (pydantic v1's {"allOf": [{"$ref"}]})
            s = self.all_of(s, at, depth, ())
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.any_of(s, key, at, name, depth)
        if s.get("nullable") is True:  # (OpenAPI 3.0)
            rest = {k: v for k, v in s.items() if k != "nullable"}
            return alt(self.visit(rest, at, name, depth + 1), self.prim("null"))
        kind = s.get("type")
        if "const" in s or "enum" in s:
            return self.literals(s, kind, at)
        if isinstance(kind, list):
            if not kind or not all(isinstance(k, str) for k in kind):
                raise self.error(at + ("type",), "must be a type name or a non-empty list of them")
            return alt(*(self.visit({**s, "type": k}, at, f"{name}-{k}", depth + 1) for k in dict.fromkeys(kind)))
        if kind is None:
            kind = _infer(s)
        if kind is None:
            return self.prim("value")
        if kind == "object":
            return self.object_(s, at, name, depth)
        if kind == "array":
            return self.array(s, at, name, depth)
        if kind == "string":
            return self.string(s, at)
        if kind == "integer":
            return self.integer(s, at)
        if kind in ("number", "boolean", "null"):
            return self.prim(kind)
        raise self.error(at + ("type",), f"unknown type {shown(kind)}")

    def ref(self, ref: Any, at: tuple[Any, ...]) -> str:
        """The rule for the schema ``ref`` points at (made later, once: recursion is fine)."""
        name = self.refs.get(ref) if isinstance(ref, str) else None
        if name is None:
            target, segs = self.resolve(ref, at)
            name = self.g.name(_base(str(segs[-1]) if segs else "root"))
            self.refs[ref] = name
            self.todo.append((name, target, segs))
        return name

    def resolve(self, ref: Any, at: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        """The schema ``ref`` points at, and its place in the document."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.error(at, f"only references inside the schema (#/...) are supported, not {shown(ref)}")
        pointer = urllib.parse.unquote(ref[1:])
        node, segs = self.doc, cast(tuple[Any, ...], ())
        if pointer and not pointer.startswith("/"):
            raise self.error(at, f"{shown(ref)} is not a JSON pointer (#/...)")
        for raw in pointer.split("/")[1:] if pointer else ():
            key = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node, segs = node[key], segs + (key,)
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node, segs = node[int(key)], segs + (int(key),)
            else:
                raise self.error(at, f"{shown(ref)} points at nothing in the schema")
        return node, segs

    def inline(self, m: Any, at: tuple[Any, ...], depth: int, seen: tuple[str, ...]) -> dict[str, Any]:
        """``m`` with its ``$ref`` followed and its ``allOf`` merged (one level), for merging."""
        if depth > self.limits.schema_depth:
            raise self.error(at, f"schemas nest deeper than {self.limits.schema_depth} levels here")
        while isinstance(m, dict) and "$ref" in m:
            ref = m["$ref"]
            if ref in seen:
                raise self.error(at, f"{shown(ref)} refers to itself inside allOf")
            seen += (ref,)
            m = self.resolve(ref, at + ("$ref",))[0]
        if m is True:
            return {}
        if m is False:
            raise self.error(at, "false: no value fits this schema")
        if not isinstance(m, dict):
            raise self.error(at, f"a schema is an object or true/false, not {type(m).__name__}")
        return self.all_of(m, at, depth + 1, seen) if "allOf" in m else m

    def all_of(self, s: dict[str, Any], at: tuple[Any, ...], depth: int, seen: tuple[str, ...]) -> dict[str, Any]:
        members = s["allOf"]
        if not isinstance(members, list) or not members:
            raise self.error(at + ("allOf",), "must be a non-empty list of schemas")
        out = {k: v for k, v in s.items() if k != "allOf"}
        for i, m in enumerate(members):
            out = self.merge(out, self.inline(m, at + ("allOf", i), depth + 1, seen), at + ("allOf", i))
        return out

    def merge(self, a: dict[str, Any], b: dict[str, Any], at: tuple[Any, ...]) -> dict[str, Any]:
        """What holds when both ``a`` and ``b`` hold, as far as the grammar reads them."""
        out = dict(a)
        for k, v in b.items():
            w = out.get(k)
            if k not in out or w == v:
                out[k] = v
            elif k == "properties" and isinstance(w, dict) and isinstance(v, dict):
                out[k] = {**w, **{p: {"allOf": [w[p], x]} if p in w else x for p, x in v.items()}}
            elif k == "required" and isinstance(w, list) and isinstance(v, list):
                out[k] = list(dict.fromkeys([*w, *v]))
            elif k == "type":
                out[k] = self.both_types(w, v, at)
            elif k in LOWER | UPPER and _number(w) and _number(v):
                out[k] = max(w, v) if k in LOWER else min(w, v)
            elif k == "enum" and isinstance(w, list) and isinstance(v, list):
                out[k] = [x for x in w if x in v]
                if not out[k]:
                    raise self.error(at + ("enum",), "allOf: no value is in every enum")
            elif k in ("items", "additionalProperties") and isinstance(w, dict) and isinstance(v, dict):
                out[k] = {"allOf": [w, v]}
            elif k == "additionalProperties" and (w is False or v is False):
                out[k] = False
            elif k in STRICT:
                raise self.error(at + (k,), f"allOf: two different {k!r} cannot both be held by a grammar")
        return out

    def both_types(self, w: Any, v: Any, at: tuple[Any, ...]) -> Any:
        def widened(x: Any) -> set[str]:  # (a number may be an integer)
            kinds = set(x) if isinstance(x, list) else {x}
            return kinds | {"integer"} if "number" in kinds else kinds

        both = widened(w) & widened(v)
        if "number" in both:
            both.discard("integer")
        if not both:
            raise self.error(at + ("type",), "allOf: no type fits every schema")
        return both.pop() if len(both) == 1 else sorted(both)

    def any_of(self, s: dict[str, Any], key: str, at: tuple[Any, ...], name: str, depth: int) -> Expr:
        alts = s[key]
        if not isinstance(alts, list) or not alts:
            raise self.error(at + (key,), "must be a non-empty list of schemas")
        rest = {k: v for k, v in s.items() if k != key and k not in META}
        out = []
        for i, a in enumerate(alts):
            sub = at + (key, i)
            if rest:  # (the keywords beside anyOf hold in every alternative)
                a = self.merge(rest, self.inline(a, sub, depth + 1, ()), sub)
            out.append(self.visit(a, sub, f"{name}-{i}", depth + 1))
        return alt(*out)

    def literals(self, s: dict[str, Any], kind: Any, at: tuple[Any, ...]) -> Expr:
        key = "const" if "const" in s else "enum"
        values = [s["const"]] if key == "const" else s["enum"]
        if not isinstance(values, list) or not values:
            raise self.error(at + (key,), "must be a non-empty list")
        kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else None
        texts = []
        for v in values:
            if kinds is not None and not kinds & _kinds_of(v):
                continue
            try:
                texts.append(json_text(v))
            except (ValueError, RecursionError):
                raise self.error(
                    at + (key,), "holds a value JSON cannot write (NaN, Infinity, too many digits, too deep)"
                ) from None
        if not texts:
            raise self.error(at + (key,), f"no value here has the type {shown(kind)}")
        if sum(map(len, texts)) > self.limits.elements:  # (before the work of sorting them)
            self.g.spend(sum(map(len, texts)))
        return seq(literal_trie(sorted(set(texts)), 0, self.limits.enum_trie_depth), SPACE)

    def count(self, s: dict[str, Any], key: str, at: tuple[Any, ...]) -> int | None:
        v = s.get(key)
        if v is None:
            return None
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or v < 0
            or isinstance(v, float)
            and not v.is_integer()
        ):
            raise self.error(at + (key,), f"must be a whole number of at least 0, not {shown(v)}")
        if v > self.limits.repeat:
            said = f"{int(v):,}" if v < 10**18 else shown(v)
            raise self.error(at + (key,), f"{said} is over the limit of {self.limits.repeat:,} a grammar holds")
        return int(v)

    def counts(self, s: dict[str, Any], what: str, at: tuple[Any, ...]) -> tuple[int, int | None]:
        lo, hi = self.count(s, "min" + what, at), self.count(s, "max" + what, at)
        if lo is not None and hi is not None and lo > hi:
            raise self.error(at + ("min" + what,), f"{lo} is more than max{what} {hi}: nothing fits")
        return lo or 0, hi

    def object_(self, s: dict[str, Any], at: tuple[Any, ...], name: str, depth: int) -> Expr:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise self.error(at + ("properties",), "must be an object of schemas")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.error(at + ("required",), "must be a list of property names")
        more = s.get("additionalProperties")
        if not props and more in (None, True):
            return self.prim("object")
        kvs: dict[str, Ref] = {}
        for p, ps in props.items():
            sub = p if name == "root" else f"{name}-{p}"
            value = self.rule(sub, self.visit(ps, at + ("properties", p), sub, depth + 1))
            kvs[p] = self.rule(sub + "-kv", seq(Lit(json_text(p)), SPACE, Lit(":"), SPACE, value))
        comma = seq(Lit(","), SPACE)
        optional = [p for p in props if p not in required]
        if more is True or isinstance(more, dict):
            anything: Expr = (
                self.prim("value")
                if more is True
                else self.visit(more, at + ("additionalProperties",), f"{name}-more", depth + 1)
            )
            kv = self.rule(f"{name}-more-kv", seq(self.prim("string"), Lit(":"), SPACE, anything))
            kvs["*"] = self.rule(f"{name}-more-kvs", seq(kv, repeat(seq(comma, kv), 0, None)))
            optional.append("*")
        body: list[Expr] = [Lit("{"), SPACE]
        for i, p in enumerate(p for p in props if p in required):
            body += [comma, kvs[p]] if i else [kvs[p]]
        if optional:  # each optional one there or not, in order (alternative i: the first there is i)
            tails: list[Expr] = [EMPTY] * (len(optional) + 1)
            for j in range(len(optional) - 1, 0, -1):
                tails[j] = self.rule(f"{name}-rest", seq(repeat(seq(comma, kvs[optional[j]]), 0, 1), tails[j + 1]))
            choice = alt(*(seq(kvs[p], tails[i + 1]) for i, p in enumerate(optional)))
            body.append(repeat(seq(comma, choice) if len(body) > 2 else choice, 0, 1))
        return seq(*body, Lit("}"), SPACE)

    def array(self, s: dict[str, Any], at: tuple[Any, ...], name: str, depth: int) -> Expr:
        items, prefix = s.get("items"), s.get("prefixItems")
        if isinstance(items, list):  # (draft 4's tuples)
            prefix, pkey, extra, ekey = items, "items", s.get("additionalItems"), "additionalItems"
        else:
            pkey, extra, ekey = "prefixItems", items, "items"
            if prefix is None:
                prefix, extra = [], True if items is None else items
        if not isinstance(prefix, list):
            raise self.error(at + (pkey,), "must be a list of schemas")
        lo, hi = self.counts(s, "Items", at)
        comma = seq(Lit(","), SPACE)
        parts: list[Expr] = []
        for i, p in enumerate(prefix):
            part = self.rule(f"{name}-{i}", self.visit(p, at + (pkey, i), f"{name}-{i}", depth + 1))
            parts += [comma, part] if i else [part]
        if prefix and extra in (None, False):  # a tuple: exactly these (as llama.cpp's converter)
            return seq(Lit("["), SPACE, *parts, Lit("]"), SPACE)
        item = self.rule(f"{name}-item", self.visit(extra, at + (ekey,), f"{name}-item", depth + 1))
        if prefix:
            k = len(prefix)
            body = seq(*parts, repeat(seq(comma, item), max(lo - k, 0), None if hi is None else max(hi - k, 0)))
        elif hi == 0:
            body = EMPTY
        else:
            rest = repeat(seq(comma, item), max(lo - 1, 0), None if hi is None else hi - 1)
            body = seq(item, rest) if lo >= 1 else repeat(seq(item, rest), 0, 1)
        return seq(Lit("["), SPACE, body, Lit("]"), SPACE)

    def string(self, s: dict[str, Any], at: tuple[Any, ...]) -> Expr:
        if "pattern" in s:
            pattern = s["pattern"]
            if not isinstance(pattern, str):
                raise self.error(at + ("pattern",), "must be a string")
            try:
                inner = pattern_expr(pattern, self.prim("char"), self.limits)
            except PatternError as exc:
                raise self.error(at + ("pattern",), f"{exc} (in {shown(pattern)})") from None
            return seq(QUOTE, inner, QUOTE, SPACE)
        fmt = s.get("format")
        if fmt in ("date", "time", "date-time") or isinstance(fmt, str) and re.fullmatch("uuid[1-5]?", fmt):
            return seq(QUOTE, self.prim(fmt if fmt in PRIMS else "uuid"), QUOTE, SPACE)
        lo, hi = self.counts(s, "Length", at)
        if lo == 0 and hi is None:
            return self.prim("string")
        return seq(QUOTE, repeat(self.prim("char"), lo, hi), QUOTE, SPACE)

    def integer(self, s: dict[str, Any], at: tuple[Any, ...]) -> Expr:
        lo, hi = self.bound(s, at, True), self.bound(s, at, False)
        if lo is None and hi is None:
            return self.prim("integer")
        e = int_range(lo, hi)
        if e is None:
            raise self.error(at, f"no integer of at most 16 digits lies between its bounds ({lo}, {hi})")
        return seq(e, SPACE)

    def bound(self, s: dict[str, Any], at: tuple[Any, ...], lower: bool) -> int | None:
        key, ekey = ("minimum", "exclusiveMinimum") if lower else ("maximum", "exclusiveMaximum")
        v, e = s.get(key), s.get(ekey)
        for k, x in ((key, v), (ekey, e)):
            if x is not None and not (_number(x) and math.isfinite(x) or k == ekey and isinstance(x, bool)):
                raise self.error(at + (k,), f"must be a finite number, not {shown(x)}")
        out = None
        if v is not None:
            strict = e is True
            out = (
                (math.floor(v) + 1 if strict else math.ceil(v))
                if lower
                else (math.ceil(v) - 1 if strict else math.floor(v))
            )
        if e is not None and not isinstance(e, bool):
            b = math.floor(e) + 1 if lower else math.ceil(e) - 1
            out = b if out is None else max(out, b) if lower else min(out, b)
        return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _kinds_of(v: Any) -> set[str]:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int) or isinstance(v, float) and v.is_integer():
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    return {"string"} if isinstance(v, str) else {"array"} if isinstance(v, list) else {"object"}


def _infer(s: dict[str, Any]) -> str | None:
    """The type a schema without ``type`` means by its keywords (None: any)."""
    for kind, keys in (
        ("object", ("properties", "additionalProperties", "required", "minProperties", "maxProperties")),
        ("array", ("items", "prefixItems", "additionalItems", "minItems", "maxItems")),
        ("string", ("pattern", "minLength", "maxLength", "format")),
        ("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")),
    ):
        if any(k in s for k in keys):
            return kind
    return None
