"""One fact in one place: what a picture costs is the same whichever command says it, and the
commands' defaults are the options dataclasses' own."""

from __future__ import annotations

import inspect
import json

import click
import pytest

import edgevlm
from edgevlm.backend.sampling import CHAT_REPLY, LIBRARY_REPLY, SERVE_REPLY
from edgevlm.caption.settings import CaptionSettings
from edgevlm.cli import main
from edgevlm.cluster.connect import DEFAULT_BATCH
from edgevlm.plan.context import IN_FLIGHT_MAX
from edgevlm.runtime.requests import Request
from edgevlm.serve.options import ServeOptions, serve_slots

from .conftest import make_image, run_cli


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    return make_image(tmp_path_factory.mktemp("fact") / "photo.png", 1024, 768, seed=5, mode="gradient")


def test_budget_says_what_chat_sends(any_pair, photo):
    """Default options on every generated family: ``budget`` (with the text model, and with the
    projector alone) counts the tokens ``chat`` then sends."""
    m, p = str(any_pair.model), str(any_pair.mmproj)
    chat = run_cli("chat", "-m", m, "--mmproj", p, "-i", str(photo), "-n", "1", "--json", "What is it?")
    assert chat.returncode == 0, chat.stderr
    sent = json.loads(chat.stdout)["stats"]["image_tokens"]
    for extra in (["--model", m], []):
        r = run_cli("budget", str(photo), "--mmproj", p, *extra, "--json")
        assert r.returncode == 0, r.stderr
        plan = json.loads(r.stdout)
        assert plan["total_tokens"] == sent, (extra, plan["total_tokens"], sent)
        assert any("--image-tokens changes it" in n for n in plan["notes"]), plan["notes"]


def _default(command: str, option: str):
    cmd = main.commands[command]
    param = next(p for p in cmd.params if isinstance(p, click.Option) and option in p.opts)
    return param.default


def test_command_defaults_are_the_dataclasses():
    assert _default("chat", "--max-tokens") == CHAT_REPLY.max_tokens
    assert _default("chat", "--temp") == CHAT_REPLY.sampling.temperature
    assert _default("chat", "--top-k") == CHAT_REPLY.sampling.top_k
    assert _default("caption", "--max-tokens") == CaptionSettings.max_tokens
    assert _default("caption", "--temp") == CaptionSettings.temperature
    for command in ("serve", "batch"):
        assert _default(command, "--max-tokens") == SERVE_REPLY.max_tokens
        assert _default(command, "--timeout") == ServeOptions.timeout_s
    assert _default("serve", "--queue") == ServeOptions.queue
    assert _default("serve", "--max-body") == ServeOptions.max_body_bytes
    assert _default("caption", "--ray-batch") == _default("batch", "--ray-batch") == DEFAULT_BATCH
    # the server's automatic parallelism stops where the planner's in-flight count does
    assert serve_slots(1 << 20, None, 16) == IN_FLIGHT_MAX > serve_slots(2048, None, 16)
    # a plan counts its pictures with the reply the library then gives a turn by default
    load_reply = inspect.signature(edgevlm.load).parameters["reply_tokens"].default
    assert load_reply == Request.max_tokens == LIBRARY_REPLY.max_tokens


def test_request_sampling_defaults_are_the_servers_and_can_be_set():
    """``serve --temp`` (and top_k, top_p, min_p) sets how requests that name none sample; the
    defaults are ``ServeOptions.sampling``; a request's own value wins."""
    from edgevlm.backend.sampling import SamplingParams
    from edgevlm.serve.openai import parse_chat_request

    for command in ("serve", "batch"):
        assert _default(command, "--temp") == SERVE_REPLY.sampling.temperature
        assert _default(command, "--top-k") == ServeOptions.sampling.top_k
        assert _default(command, "--top-p") == ServeOptions.sampling.top_p
        assert _default(command, "--min-p") == ServeOptions.sampling.min_p
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(body).sampling == ServeOptions.sampling
    greedy = SamplingParams(temperature=0.0, top_k=5)
    assert parse_chat_request(body, greedy).sampling == greedy
    assert parse_chat_request({**body, "temperature": 0.5}, greedy).sampling.temperature == 0.5
