"""The host cache's disk tier (``serve --cache-dir DIR``): a graceful stop writes the conversations
kept to DIR, a restarted server answers a returning conversation from there (OpenAI's
``cached_tokens``, Anthropic's ``cache_read_input_tokens`` say so), files of another model are
left alone, and two servers on one DIR do not share it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest
from anthropic import Anthropic

from edgevlm_testkit.waiting import until
from tests.test_serve import Served, data_uri, free_port, png, user

PICTURE = data_uri(png(96, 80, seed=3))
OTHER = data_uri(png(80, 96, seed=4))  # the Anthropic conversation's: nothing in common with the first


def ask(server: Served, messages: list[dict], held: list[int] | None = None) -> tuple[str, int]:
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    if held is not None:  # what the KV cache holds of the conversation after it: all but the last token
        held.append(r.usage.prompt_tokens + r.usage.completion_tokens - 1)
    return r.choices[0].message.content or "", r.usage.prompt_tokens_details.cached_tokens


def ask_anthropic(server: Served, text: str, reply: str, more: str) -> tuple[int, str]:
    first = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": OTHER.split(",")[1]}}
    with Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120) as client:
        r = client.messages.create(
            model="m",
            max_tokens=6,
            messages=[
                {"role": "user", "content": [first, {"type": "text", "text": text}]},
                *([{"role": "assistant", "content": reply}, {"role": "user", "content": more}] if reply else []),
            ],
        )
    return r.usage.cache_read_input_tokens or 0, r.content[0].text if r.content else ""


def files_in(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".evlm")


@pytest.fixture(scope="module")
def pair(model_pair):
    return model_pair("llava15")


def test_a_restarted_server_answers_a_returning_conversation_from_disk(pair, tmp_path):
    d = tmp_path / "cache"
    args = ("--cache-dir", str(d), "--ctx", "2048", "--parallel", "1")
    first = Served(pair, *args)
    try:
        held: list[int] = []
        reply, cached = ask(first, [user("What is it?", PICTURE)], held)
        assert cached < 576
        a_cached, _ = ask_anthropic(first, "Describe it.", "", "")
        assert a_cached < 576  # (the chat template's first tokens at most)
    finally:
        err = first.stop()
    assert "Error" not in err, err
    assert "Traceback" not in err, err
    assert len(files_in(d)) >= 1  # the graceful stop wrote what the KV cache kept
    again = Served(pair, *args)
    try:
        _, cached = ask(again, [user("What is it?", PICTURE), {"role": "assistant", "content": reply}, user("More?")])
        # the picture's cells and the reply's came from disk (the reply's exact ids were kept too)
        assert cached == held[0]
        st = again.status()["kv"]["host_cache"]["disk"]
        assert st["read"] >= 1
        assert st["ignored"] == 0
        read, _ = ask_anthropic(again, "Describe it.", "x", "More?")
        assert read >= 576
        assert again.status()["kv"]["host_cache"]["disk"]["read"] >= 2
    finally:
        again.stop()
    # the same follow-up on a server without the disk tier evaluates it all again
    plain = Served(pair, "--ctx", "2048", "--parallel", "1")
    try:
        _, cached = ask(plain, [user("What is it?", PICTURE), {"role": "assistant", "content": reply}, user("More?")])
        assert cached < 576
    finally:
        plain.stop()


def test_files_of_another_model_are_left_alone_and_one_dir_takes_one_server(model_pair, pair, tmp_path):
    d = tmp_path / "cache"
    other = Served(model_pair("qwen2vl"), "--cache-dir", str(d), "--ctx", "2048")
    try:
        ask(other, [user("What is it?", PICTURE)])
    finally:
        other.stop()
    theirs = {p.name: p.read_bytes() for p in d.iterdir() if p.suffix == ".evlm"}
    assert theirs
    server = Served(pair, "--cache-dir", str(d), "--ctx", "2048")
    try:
        disk = server.status()["kv"]["host_cache"]["disk"]
        assert disk["ignored"] == len(theirs)
        assert disk["conversations"] == 0
        _, cached = ask(server, [user("What is it?", PICTURE)])
        assert cached == 0  # nothing of the other model's is loaded
        # a second server on the same folder says so in one line and stops
        port = free_port()
        second = subprocess.run(
            [sys.executable, "-m", "edgevlm", "serve", "-m", str(pair.model), "--mmproj", str(pair.mmproj),
             "--port", str(port), "--ctx", "2048", "--cache-dir", str(d)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        errors = [x for x in second.stderr.splitlines() if x.startswith("Error")]
        assert errors == [f"Error: --cache-dir {d}: in use by another edgevlm serve (process {server.proc.pid})"]
        assert server.status()["state"] == "ready"  # the first one goes on
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        server.stop()
    for name, data in theirs.items():  # not deleted, not changed
        assert (d / name).read_bytes() == data
    shutil.rmtree(d)


def test_conversations_pushed_out_of_ram_go_to_disk_and_come_back(pair, tmp_path):
    """No RAM tier (--cache-ram 0): a third 576-token picture in a 1536 context moves the
    least recently used conversation out — to disk — and its return reads it back."""
    args = ("--cache-dir", str(tmp_path / "cache"), "--cache-ram", "0", "--ctx", "1536", "--parallel", "1")
    server = Served(pair, *args)
    try:
        pictures = [data_uri(png(90 + 8 * i, 70, seed=10 + i)) for i in range(3)]
        replies = [ask(server, [user("What is it?", p)])[0] for p in pictures]
        disk = until(lambda: (d := server.status()["kv"]["host_cache"]["disk"])["written"] >= 1 and d, "written")
        assert disk["conversations"] >= 1
        assert server.status()["kv"]["host_cache"]["conversations"] == 0  # (nothing held in RAM)
        _, cached = ask(
            server, [user("What is it?", pictures[0]), {"role": "assistant", "content": replies[0]}, user("More?")]
        )
        assert cached >= 576
        assert server.status()["kv"]["host_cache"]["disk"]["read"] >= 1
    finally:
        server.stop()


WORDS = {
    "type": "json_schema",
    "json_schema": {"name": "words", "schema": {"type": "string", "pattern": "^[a-z ]{1,6}$"}},
}


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("family", ["llava15", "qwen2vl", "gemma3"])
def test_a_conversation_restored_after_a_restart_gives_the_same_tokens(model_pair, tmp_path, family, kv):
    """The follow-up after a restart from --cache-dir is the follow-up of a server that never
    stopped: the same rows evaluated after the same cells, so the same tokens."""
    pair = model_pair(family)
    first = [user("What is it?", PICTURE)]
    answers = []
    for restart in (False, True):
        args = ("--cache-dir", str(tmp_path / f"cache-{restart}"), "--ctx", "2048", "--parallel", "1", "--kv", kv)
        server = Served(pair, *args)
        try:
            reply, _ = ask(server, first)
            history = [*first, {"role": "assistant", "content": reply}]
            if restart:
                server.stop()
                server = Served(pair, *args)
            r = server.client().chat.completions.create(
                model="m", messages=[*history, user("And now?")], max_tokens=12, temperature=0, response_format=WORDS
            )
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        finally:
            server.stop()
    # the same tokens, after the same cells reused: from the KV cache in one, from disk in the other
    # (all the first turn's that a resent history matches: a whitespace-only reply comes back empty)
    assert answers[0] == answers[1]
    assert answers[1][1] > 0
