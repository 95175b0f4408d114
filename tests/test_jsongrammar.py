"""edgevlm's JSON Schema → GBNF converter (``runtime.jsongrammar``, issue #59 cases 1 and 7),
checked against two independent references: llama.cpp's own grammar engine (``GrammarOracle``:
which texts a grammar lets a reply be, byte by byte, on a generated pair's vocabulary) and the
``jsonschema`` package (which values a schema allows).

- counts are held exactly on both sides of llama.cpp's 2000 (which it refuses or widens), and
  past it in blocks, up to ``GrammarLimits.repeat``;
- a string's characters never include a raw control character (llama-cpp-python's port allowed
  them: json.loads then refuses the reply);
- what cannot be held is a ``SchemaError`` naming the field and the limit, never a crash, a
  RecursionError or a grammar llama.cpp refuses (and prints whole to stderr);
- every grammar written parses in llama.cpp."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import random

import jsonschema
import llama_cpp as lc
import pytest

import edgevlm
from edgevlm.backend.utf8guard import Utf8Guard
from edgevlm.errors import SchemaError
from edgevlm.runtime.gbnf import LIMITS, LLAMA_REPEAT
from edgevlm.runtime.jsongrammar import json_grammar
from edgevlm.runtime.toolformat import call_grammar

from .grammar_oracle import GrammarOracle

WHERE = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def oracle(model_pair):
    o = GrammarOracle(model_pair("llava15").model)
    yield o
    o.close()


def string_of(lo: int | None = None, hi: int | None = None) -> dict:
    s: dict = {"type": "string"}
    if lo is not None:
        s["minLength"] = lo
    if hi is not None:
        s["maxLength"] = hi
    return s


@pytest.mark.parametrize(
    "lo,hi",
    [(0, LLAMA_REPEAT), (0, LLAMA_REPEAT + 1), (2500, 2500), (LLAMA_REPEAT - 1, 3 * LLAMA_REPEAT + 1), (4001, None)],
)
def test_string_lengths_are_held_exactly_across_llamas_2000(oracle, lo, hi):
    """llama.cpp refuses {m,n} past 2000 (and widens n to no maximum): lengths just inside and
    just outside each bound, and around every block edge, against llama.cpp's own engine."""
    g = json_grammar(string_of(lo, hi))
    edges = {0, 1, lo, LLAMA_REPEAT - 1, LLAMA_REPEAT, LLAMA_REPEAT + 1, 2 * LLAMA_REPEAT, 2 * LLAMA_REPEAT + 1}
    edges |= {max(lo - 1, 0), lo + 1} | ({hi - 1, hi, hi + 1} if hi is not None else {lo + 5000})
    for n in sorted(edges):
        want = lo <= n and (hi is None or n <= hi)
        assert oracle.accepts(g, json.dumps("x" * n)) == want, (lo, hi, n)


@pytest.mark.slow
def test_the_issues_maxlength_20000_is_held_by_llama_cpp(oracle):
    """The repro's schema (which segfaulted the server) as grammar: 20000 characters are
    allowed, 20001 are not, and arrays too are counted exactly past the block size."""
    g = json_grammar({"type": "object", "properties": {"a": string_of(None, 20000)}, "required": ["a"]})
    assert oracle.accepts(g, json.dumps({"a": "é" * 20000}))
    assert not oracle.accepts(g, json.dumps({"a": "x" * 20001}))
    arr = json_grammar({"type": "array", "items": {"const": 1}, "minItems": 2001, "maxItems": 4002})
    for n, want in ((2000, False), (2001, True), (4002, True), (4003, False)):
        assert oracle.accepts(arr, json.dumps([1] * n)) == want, n


def test_a_pattern_with_a_count_past_2000_is_held(oracle):
    g = json_grammar({"type": "string", "pattern": "^a{0,100000}$"})
    assert oracle.accepts(g, json.dumps("a" * 4500))
    assert oracle.accepts(g, '""')
    assert not oracle.accepts(g, json.dumps("a" * 40 + "b"))
    g = json_grammar({"type": "string", "pattern": "^(ab){2001}$"})
    assert oracle.accepts(g, json.dumps("ab" * 2001))
    assert not oracle.accepts(g, json.dumps("ab" * 2000))


@pytest.mark.parametrize(
    "schema",
    [
        None,  # json_object
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "additionalProperties": {"type": "string"}, "properties": {"a": {"const": 1}}},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[\\s\\S]*$"}}, "required": ["a"]},
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[^x]+$"}}, "required": ["a"]},
    ],
)
def test_strings_never_hold_a_raw_control_character(oracle, schema):
    """Case 7: JSON forbids U+0000-U+001F raw in a string (json.loads refuses them); the
    grammar allows only their escapes. U+007F is written escaped too, as llama.cpp's converter."""
    g = json_grammar(schema)
    assert oracle.accepts(g, '{"a": "ok"}')
    for c in [*range(0x20), 0x7F]:
        assert not oracle.accepts(g, '{"a": "ok' + chr(c) + '"}'), hex(c)
    for esc in ("\\u0005", "\\n", "\\t", "\\u001f", "\\u007F", "\\\\", '\\"'):
        assert oracle.accepts(g, '{"a": "ok' + esc + '"}'), esc
    assert not oracle.accepts(g, '{"a": "ok\\ud800"}')  # (a lone surrogate: no character)
    if schema is None:  # json_object: any object, with the whitespace llama.cpp's json.gbnf allows
        for text in ('{"a": [1, 2.5e3, "x", null, true, {"b": {}}]}', '{\n  "a": 1\n}', "{}"):
            assert oracle.accepts(g, text), text
        for text in ("[1]", '"x"', '{"a": 01}'):
            assert not oracle.accepts(g, text), text


# (schema, values): the grammar must allow exactly the values jsonschema allows, each written as
# json.dumps writes it (which is the one optional space the grammar allows after , and :)
AGREES = [
    (
        {
            "type": "object",
            "properties": {"a": string_of(1, 3), "b": {"type": "integer", "minimum": -12, "maximum": 250}},
            "required": ["a"],
        },
        [
            {"a": "x"},
            {"a": "xyz"},
            {"a": ""},
            {"a": "wxyz"},
            {"a": "x", "b": -12},
            {"a": "x", "b": -13},
            {"a": "x", "b": 250},
            {"a": "x", "b": 251},
            {"b": 3},
            {"a": 'é"\\\n'},
        ],
    ),
    (
        {
            "type": "array",
            "items": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99},
            "minItems": 2,
            "maxItems": 4,
        },
        [[1, 2], [1], [1, 2, 3, 4], [1, 2, 3, 4, 5], [0, 1], [99, 98], [100, 1], []],
    ),
    (
        {"enum": ["red", "green", "greenish", "blue", 3, None, True, {"k": [1, 2]}]},
        ["red", "green", "greenish", "gree", "greenishes", "blue", 3, None, True, False, {"k": [1, 2]}, "purple"],
    ),
    ({"type": "string", "enum": ["a", 1, "b"]}, ["a", "b", 1]),
    ({"type": "string", "pattern": "^[a-c]{2,3}-\\d+$"}, ["ab-1", "abc-123", "a-1", "abcd-1", "ab-", "ab-x"]),
    ({"type": "string", "pattern": "cat"}, ["cat", "a cat!", "dog", "ca t", 'say "cat"']),
    ({"type": "string", "pattern": "^(a|bc)*$"}, ["", "a", "bcbc", "abca", "b", "cb"]),
    ({"type": "string", "pattern": '^[^"]*$'}, ["abc", 'a"b', "a\\b", "\t"]),
    ({"type": "string", "pattern": "^.+$"}, ["x", "\n", "a\tb", '"q"', ""]),
    ({"type": "string", "pattern": "^(\\s*x?){2,3}$"}, ["", "x", "xx", "xxx", "xxxx", " x x "]),
    ({"type": "string", "pattern": "^(?:[0-9a-f]{2}:){2}[0-9a-f]{2}$|^none$"}, ["0a:1b:2c", "none", "0a:1b", "xnone"]),
    ({"anyOf": [string_of(None, 1), {"type": "number"}]}, ["a", "ab", 1.5, -3, "", None]),
    ({"type": ["string", "null"], "maxLength": 2}, ["ab", "abc", None, 1]),
    (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
            ]
        },
        [{"a": 1, "b": True}, {"a": 1}, {"b": False}, {"a": "1", "b": True}],
    ),
    (
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "required": ["v", "next"],
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                }
            },
            "$ref": "#/$defs/node",
        },
        [{"v": 1, "next": None}, {"v": 1, "next": {"v": 2, "next": None}}, {"v": 1}, {"v": 1, "next": {"v": 2}}],
    ),
    (  # pydantic v1's recursive model: a lone allOf member stays a reference
        {
            "definitions": {
                "Node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"allOf": [{"$ref": "#/definitions/Node"}], "title": "K"}},
                    },
                    "required": ["v"],
                }
            },
            "allOf": [{"$ref": "#/definitions/Node"}],
            "description": "a tree",
        },
        [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}, {"v": 1, "kids": [{"w": 2}]}],
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
        [{"a": 1, "x": "y"}, {"x": 1}, {}, {"a": 1}],
    ),
    ({"type": "object", "additionalProperties": False}, [{}, {"a": 1}]),
    ({"type": "integer", "minimum": 1000000}, [999999, 1000000, 123456789012, -1000000]),
    ({"type": "integer", "maximum": -7}, [-7, -6, -100, 0]),
    ({"type": "number"}, [1, -2.5, 1e-7, "1"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000", "123e4567"]),
    (
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "string"}],
            "items": {"type": "boolean"},
            "maxItems": 3,
        },
        [[1, "a"], [1, "a", True], [1, "a", True, False], [1, "a", 2]],
    ),
]


@pytest.mark.parametrize("schema,values", AGREES, ids=[json.dumps(s)[:48] for s, _ in AGREES])
def test_the_grammar_allows_what_jsonschema_allows(oracle, schema, values):
    g = json_grammar(schema)
    check = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for v in values:
        text = json.dumps(v, ensure_ascii=False)
        assert oracle.accepts(g, text) == check.is_valid(v), (schema, text)


def test_integer_ranges_are_exact(oracle):
    """Bounded integers are written digit by digit (no enum of their values): random ranges,
    every integer around them, against the bounds themselves."""
    rng = random.Random(5)
    ranges = [(-5, 1234), (0, 0), (7, 7), (-300, -299), (99, 1000), (None, -10), (1995, None)]
    ranges += [tuple(sorted(rng.sample(range(-2500, 2500), 2))) for _ in range(4)]
    o = oracle
    for lo, hi in ranges:
        schema = (
            {"type": "integer"}
            | ({"minimum": lo} if lo is not None else {})
            | ({"maximum": hi} if hi is not None else {})
        )
        g = json_grammar(schema)
        a, b = (lo if lo is not None else hi - 40), (hi if hi is not None else lo + 40)
        for n in [*range(a - 12, a + 12), *range(b - 12, b + 12), *rng.sample(range(a - 50, b + 50), 20)]:
            assert o.accepts(g, str(n)) == ((lo is None or n >= lo) and (hi is None or n <= hi)), (lo, hi, n)
    g = json_grammar({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 6})
    assert [n for n in range(10) if o.accepts(g, str(n))] == [3, 4, 5]


def refusal(schema, where: str = WHERE) -> SchemaError:
    with pytest.raises(SchemaError) as err:
        json_grammar(schema, where)
    return err.value


def test_counts_past_the_limit_are_refused_naming_the_field_and_the_limit():
    e = refusal({"type": "object", "properties": {"a": string_of(None, LIMITS.repeat + 1)}})
    assert e.path == WHERE + ".properties.a.maxLength"
    assert f"{LIMITS.repeat:,}" in str(e)
    e = refusal({"type": "array", "minItems": 10**12}, "text.format.schema")
    assert e.path == "text.format.schema.minItems"
    assert f"{LIMITS.repeat:,}" in str(e)
    e = refusal({"properties": {"a b": {"pattern": "^x{0,99999999}$"}}}, "format")
    assert e.path == 'format.properties["a b"].pattern'
    assert f"{LIMITS.repeat:,}" in str(e)
    assert "{0,99999999}" in str(e)
    e = refusal({"type": "string", "pattern": "^a{" + "9" * 5000 + "}$"}, "format")  # (past int()'s 4300 digits)
    assert e.path == "format.pattern"
    assert len(str(e)) < 600
    e = refusal(string_of(5, 2))
    assert e.path == WHERE + ".minLength"
    assert "maxLength 2" in str(e)


@pytest.mark.parametrize(
    "pattern,why",
    [
        ("^(?=a)b$", "lookaround"),
        ("^(a)\\1$", "backreference"),
        ("^\\bword$", "word boundary"),
        ("^\\p{L}+$", "Unicode property"),
        ("^a(b", "unterminated group"),
        ("^[ab", "unterminated character class"),
        ("^*a$", "nothing to repeat"),
        ("^a{3,2}$", "out of order"),
        ("^a$b", "anchors"),
        ("^" + "(" * 40 + "a" + ")" * 40 + "$", "nested deeper than 32"),
        ("x" * (LIMITS.pattern_length + 1), "longer than"),
    ],
)
def test_patterns_it_cannot_hold_are_refused_with_the_reason(pattern, why):
    e = refusal({"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})
    assert e.path == WHERE + ".properties.p.pattern"
    assert why in str(e), str(e)
    assert "\n" not in str(e)
    assert len(str(e)) < 600


def test_schemas_it_cannot_hold_are_refused_never_a_crash():
    deep: dict = {"type": "string"}
    for _ in range(5000):  # (a file read by the CLI has no body-depth limit)
        deep = {"type": "array", "items": deep}
    e = refusal(deep)
    assert f"deeper than {LIMITS.schema_depth}" in str(e)
    assert len(str(e)) < 600
    e = refusal({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}, "$ref": "#/$defs/A"})
    assert e.path == WHERE + ".$defs.A"
    assert "refers to itself" in str(e)
    assert "refers to itself" in str(refusal({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A"}))
    assert "only references inside the schema" in str(refusal({"$ref": "https://example.com/s.json"}))
    assert "points at nothing" in str(refusal({"properties": {"a": {"$ref": "#/$defs/missing"}}}))
    assert refusal({"properties": {"a": False}, "required": ["a"]}).path == WHERE + ".properties.a"
    assert refusal({"type": "integer", "minimum": 10**17}).path == WHERE


def test_a_grammar_over_the_size_limit_is_refused_naming_the_schema():
    """What llama.cpp would have to build for it is counted as it is written: a few hundred KB
    of schema can make megabytes of grammar (keywords beside anyOf hold in each alternative)."""
    props = {f"p{i}": {"type": "integer"} for i in range(400)}
    e = refusal({"properties": props, "anyOf": [{"required": [f"p{i}"]} for i in range(400)]})
    assert e.path == WHERE
    assert f"{LIMITS.elements:,} llama.cpp grammar elements" in str(e)
    values = [hashlib.sha1(str(i).encode()).hexdigest() for i in range(20000)]  # (few shared prefixes)
    e = refusal({"enum": values}, "tools[2].input_schema")
    assert e.path == "tools[2].input_schema"
    assert "elements" in str(e)


def test_every_grammar_written_parses_in_llama_cpp(oracle, capfd):
    """llama.cpp prints a grammar it refuses whole to stderr: none of ours may be refused."""
    schemas = [s for s, _ in AGREES] + [
        {"type": "object", "properties": {"a": string_of(None, 20000)}, "required": ["a"]},
        {"type": "string", "pattern": "^((a{0,2000}){0,2000}){0,2000}$"},
        {"type": "array", "items": {"type": "object"}, "minItems": 4500, "maxItems": LIMITS.repeat},
        {"type": "string", "minLength": LIMITS.repeat, "maxLength": LIMITS.repeat},
        {"enum": [f"v{i}" for i in range(5000)]},
        {"type": "string", "format": "date-time"},
        {"type": "object", "properties": {k: {"type": "integer"} for k in ("root", "space", "edgevlm-call", "a-1")}},
        {"description": "anything at all"},
        {"type": "string", "pattern": "^(\\d*-?)*$"},  # (an item that can be empty, repeated)
    ]
    for s in schemas:
        assert oracle.parses(json_grammar(s)), s
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(schemas[:6])]
    for fmt in ("hermes", "mistral", "llama3"):
        assert oracle.parses(call_grammar(tools, fmt, json_grammar)), fmt
    assert "error parsing grammar" not in capfd.readouterr().err


def test_a_reply_under_a_grammar_never_takes_an_overlong_utf8_form(model_pair, oracle):
    """llama.cpp's grammar reads the overlong ``E0 82 A2`` as one "¢" (the text: three broken
    bytes, three U+FFFD past a maxLength of 1); the chain edgevlm samples with refuses such a
    second byte after a lone E0 (``backend.utf8guard``) and lets the valid ones through."""
    g = json_grammar({"type": "string", "maxLength": 1})
    overlong = b'"\xe0\x82\xa2"'
    assert oracle.accepts(g, overlong)  # (the hole, in llama.cpp alone)
    assert len(json.loads(overlong.decode(errors="replace"))) == 3
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=512) as vlm:
        be, before = vlm.backend, Utf8Guard.held()
        chain = be.make_sampler(edgevlm.SamplingParams(0.0, grammar=g))
        assert Utf8Guard.held() == before + 1
        try:
            for b in b'"\xe0':
                be.accept(chain, oracle.byte[b])
            after = {b: oracle.byte[b] for b in (0x80, 0x82, 0x9F, 0xA0, 0xA2, 0xBF)}
            cells = (lc.llama_token_data * len(after))(*(lc.llama_token_data(t, 1.0, 0.0) for t in after.values()))
            arr = lc.llama_token_data_array(cells, len(after), -1, False)
            lc.llama_sampler_apply(chain, ctypes.byref(arr))
            kept = {b for b, cell in zip(after, cells, strict=True) if not math.isinf(cell.logit)}
            assert kept == {0xA0, 0xA2, 0xBF}
        finally:
            be.free_sampler(chain)
        assert Utf8Guard.held() == before  # (freeing the chain let its guard go)
