"""Issue #59, cases 1 and 7, through real servers and real subprocesses (a generated LLaVA pair,
real llama.cpp, the official clients):

1. a ~200-byte JSON Schema (``maxLength`` 20000, ``pattern ^a{0,100000}$``) segfaulted
   ``edgevlm serve`` on every route that builds a grammar, ``edgevlm chat --json-schema`` and,
   as a poison line, every resume of ``edgevlm batch``. Now each is held (a 200 whose JSON keeps
   the bound) or refused (a 400 in the API's own shape naming the field and the limit), while
   two innocent clients keep being answered, and the server's stderr holds no grammar dump.
7. ``json_schema`` at temperature 1 gave strings with raw control characters that
   ``json.loads`` refuses: 30 replies on each of the OpenAI, Ollama and Responses routes must
   parse, and validate with ``jsonschema``."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anthropic
import jsonschema
import ollama
import openai
import pytest

from edgevlm.runtime.gbnf import LIMITS

from .beside import Innocents
from .conftest import run_cli
from .test_batch import cli_batch, line, read_out, write_lines
from .test_serve import Served

pytestmark = pytest.mark.slow  # (each starts a server or subprocesses: over 2 s)

REPRO = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20000}}, "required": ["a"]}
PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{0,100000}$"}}, "required": ["a"]}
OVER = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2 * LIMITS.repeat}}, "required": ["a"]}
SHORT = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24}}, "required": ["a"]}
LIMIT = f"{LIMITS.repeat:,}"
HI = [{"role": "user", "content": "hi"}]
# (24 tokens reach into a reply's JSON; a forced call's markup takes about 40 before its arguments)


@dataclass
class Outcome:
    """What a route answered: a reply's JSON text (and whether it ended, or was cut at its
    length), or a refusal's status, message and the field it names (None where the API's
    error shape has no field)."""

    status: int
    text: str = ""
    whole: bool = False
    message: str = ""
    param: str | None = None


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_schema(url: str, schema: dict, **kw) -> Outcome:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with openai_client(url) as c:
        try:
            r = c.chat.completions.create(
                model="m", messages=HI, response_format=rf, **{"max_tokens": 24, "temperature": 0, **kw}
            )
        except openai.BadRequestError as e:
            return Outcome(e.status_code, message=e.body["message"], param=e.body["param"])
    return Outcome(200, r.choices[0].message.content, r.choices[0].finish_reason == "stop")


def chat_tool(url: str, schema: dict) -> Outcome:
    tools = [{"type": "function", "function": {"name": "t", "parameters": schema}}]
    with openai_client(url) as c:
        try:
            r = c.chat.completions.create(
                model="m", messages=HI, tools=tools, tool_choice="required", max_tokens=64, temperature=0
            )
        except openai.BadRequestError as e:
            return Outcome(e.status_code, message=e.body["message"], param=e.body["param"])
    (call,) = r.choices[0].message.tool_calls
    return Outcome(200, call.function.arguments, r.choices[0].finish_reason == "tool_calls")


def responses(url: str, schema: dict, **kw) -> Outcome:
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    with openai_client(url) as c:
        try:
            r = c.responses.create(model="m", input="hi", text=fmt, **{"max_output_tokens": 24, "temperature": 0, **kw})
        except openai.BadRequestError as e:
            return Outcome(e.status_code, message=e.body["message"], param=e.body["param"])
    return Outcome(200, r.output_text, r.status == "completed")


def _anthropic(url: str, schema: dict, count: bool) -> Outcome:
    tools = [{"name": "t", "input_schema": schema}]
    kw = dict(model="m", messages=HI, tools=tools, tool_choice={"type": "tool", "name": "t"})
    with anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120) as c:
        try:
            if count:
                return Outcome(200, str(c.messages.count_tokens(**kw).input_tokens), True)
            m = c.messages.create(max_tokens=64, extra_body={"temperature": 0}, **kw)
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error"
            assert e.body["error"]["type"] == "invalid_request_error"
            return Outcome(e.status_code, message=e.body["error"]["message"])
    (use,) = m.content
    return Outcome(200, json.dumps(use.input), m.stop_reason == "tool_use")


def messages(url: str, schema: dict) -> Outcome:
    return _anthropic(url, schema, count=False)


def count_tokens(url: str, schema: dict) -> Outcome:
    return _anthropic(url, schema, count=True)


def ollama_chat(url: str, schema: dict, **options) -> Outcome:
    with ollama.Client(host=url, timeout=120) as c:
        try:
            r = c.chat(model="m", messages=HI, format=schema, options={"temperature": 0, "num_predict": 24, **options})
        except ollama.ResponseError as e:
            return Outcome(e.status_code, message=e.error)
    return Outcome(200, r.message.content, r.done_reason == "stop")


# each route that builds a grammar, and where its body holds the schema
ROUTES = {
    chat_schema: "response_format.json_schema.schema",
    chat_tool: "tools[0].function.parameters",
    responses: "text.format.schema",
    messages: "tools[0].input_schema",
    count_tokens: "tools[0].input_schema",
    ollama_chat: "format",
}


def test_a_schema_past_any_grammars_bounds_is_held_or_refused_on_every_route(model_pair):
    """Case 1: the issue's schema and the pattern are held (a 200; a reply that ended is JSON
    the schema allows, so the bound held); a count over ``GrammarLimits.repeat`` is a 400 naming
    the field and the limit; two innocent clients are answered meanwhile; the server stays up and
    its stderr has no grammar dump and no line over 2 KB."""
    server = Served(model_pair("llava15"), "--parallel", "4", "--queue", "8", "--ctx", "8192", "--max-tokens", "16")
    try:
        with Innocents(server.url) as inn:
            for route, field in ROUTES.items():
                for schema in (REPRO, PATTERN):
                    got = route(server.url, schema)
                    assert got.status == 200, (route.__name__, got)
                    if got.whole and route is not count_tokens:
                        jsonschema.validate(json.loads(got.text), schema)
                    elif route is not count_tokens:
                        assert got.text.lstrip().startswith("{"), (route.__name__, got)
                got = route(server.url, OVER)
                assert got.status == 400, (route.__name__, got)
                named = f"{field}.properties.a.maxLength"
                assert named in got.message, (route.__name__, got)
                assert LIMIT in got.message, (route.__name__, got)
                assert got.param in (None, named), (route.__name__, got)
            inn.served(2)
        assert server.proc.poll() is None, "the server died"
    finally:
        err = server.stop()
    assert "error parsing grammar" not in err
    assert "Traceback" not in err
    longest = max(map(len, err.splitlines()), default=0)
    assert longest < 2048, f"a stderr line of {longest} characters"


def test_chat_with_the_issues_schema_answers_or_says_why_in_one_line(model_pair, tmp_path):
    """``edgevlm chat --json-schema``: the issue's schema gives JSON within the bound (exit 0)
    or one line (exit 2: the answer hit -n); a schema past the limit is one line naming the
    field. Never a signal."""
    pair = model_pair("llava15")
    args = ["chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--threads", "2", "--temp", "0", "-n", "48"]
    for name, schema in (("repro", REPRO), ("over", OVER)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(schema))
        r = run_cli(*args, "--json-schema", str(path), "--json", "hi")
        assert r.returncode in (0, 2), (name, r.returncode, r.stderr[-2000:])
        if r.returncode == 0:
            jsonschema.validate(json.loads(r.stdout)["json"], schema)
        else:
            (err,) = r.stderr.strip().splitlines()
            assert "Traceback" not in r.stderr
            if name == "over":
                assert "--json-schema: properties.a.maxLength" in err, err
                assert LIMIT in err, err
    assert name == "over"
    assert r.returncode == 2


def test_a_batch_line_past_the_limit_is_an_error_record_and_the_run_resumes(model_pair, tmp_path):
    """``edgevlm batch``: the line whose schema is past the limit gets OpenAI's 400 naming the
    field, the others are answered (the issue's schema too), and a rerun finishes (exit 4, as
    documented: a line carries an error)."""
    pair = model_pair("llava15")

    def ask(schema: dict | None) -> dict:
        body = {"model": "m", "messages": HI, "max_tokens": 12, "temperature": 0}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return body

    req, out = tmp_path / "requests.jsonl", tmp_path / "out.jsonl"
    write_lines(
        req, [line("first", ask(None)), line("over", ask(OVER)), line("repro", ask(REPRO)), line("last", ask(SHORT))]
    )
    for run in range(2):
        r = cli_batch(pair, str(req), "--out", str(out), "--parallel", "2")
        assert r.returncode == 4, (run, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
    assert "answered 0 · skipped 4 (1 failed earlier)" in r.stderr, r.stderr
    by_id = {o["custom_id"]: o["response"] for o in read_out(out)}
    assert sorted(by_id) == ["first", "last", "over", "repro"]
    assert {k: v["status_code"] for k, v in by_id.items()} == {"first": 200, "over": 400, "repro": 200, "last": 200}
    error = by_id["over"]["body"]["error"]
    assert error["param"] == "response_format.json_schema.schema.properties.a.maxLength"
    assert LIMIT in error["message"]


@pytest.mark.parametrize("route", [chat_schema, ollama_chat, responses], ids=["openai", "ollama", "responses"])
def test_json_schema_replies_at_temperature_1_are_json(model_pair, route):
    """Case 7: 30 replies under ``{"a": {"maxLength": 24}}`` at temperature 1 (a random model
    samples control characters often): every one is whole, parses, and validates."""
    server = Served(model_pair("llava15"), "--parallel", "4", "--queue", "32", "--ctx", "4096")
    try:
        if route is ollama_chat:
            ask = lambda i: ollama_chat(server.url, SHORT, temperature=1, num_predict=96)
        elif route is responses:
            ask = lambda i: responses(server.url, SHORT, temperature=1, max_output_tokens=96)
        else:
            ask = lambda i: chat_schema(server.url, SHORT, temperature=1, max_tokens=96)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, range(30)))
        for got in replies:
            assert got.status == 200, got
            assert got.whole, got
            jsonschema.validate(json.loads(got.text), SHORT)  # (json.loads: strict, no raw control characters)
    finally:
        server.stop()
