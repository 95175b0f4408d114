"""``edgevlm batch``: OpenAI batch files answered by real llama.cpp in a subprocess — the bodies
compared with what a real ``edgevlm serve`` answers the same requests, bad lines as error lines,
resume after a kill, server errors asked again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from edgevlm.errors import InputError
from edgevlm.serve.batchfile import read_batch_file
from tests.conftest import run_cli
from tests.test_serve import Served, data_uri, png, user


def line(cid: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def body(*content, max_tokens: int = 8, **kw) -> dict:
    return {"model": "tiny", "messages": [user(*content)], "max_tokens": max_tokens, "temperature": 0, **kw}


def write_lines(path, lines) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for ln in lines:
            fh.write((ln if isinstance(ln, str) else json.dumps(ln)) + "\n")


def read_out(path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(x) for x in fh if x.strip()]


@pytest.fixture(scope="module")
def pair(model_pair):
    return model_pair("llava15")


def cli_batch(pair, *args, timeout=300):
    return run_cli(
        "batch", *args, "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--threads", "2", timeout=timeout
    )


def test_a_batch_file_is_answered_as_the_server_answers(pair, tmp_path):
    pic = tmp_path / "pic.png"
    pic.write_bytes(png(200, 150, seed=3))
    uri = data_uri(png(96, 80, seed=4))
    good = {
        "inline": body("What is this?", uri),
        "by-path": body("Describe it.", str(pic)),
        "text-only": body("Say hello.", max_tokens=6),
        "json": body("Tags?", uri, response_format={"type": "json_object"}, max_tokens=12),
    }
    bad = {
        "bad-image": body("What is this?", data_uri(b"not a picture at all")),
        "bad-field": {"messages": [], "max_tokens": 4},
        "bad-temp": body("Hi", temperature=7),
    }
    lines = [line(k, v) for k, v in {**good, **bad}.items()]
    lines.insert(2, "{this is not json")
    lines.append(line("embed", {"input": "x"}, url="/v1/embeddings"))
    lines.append(line("inline", body("again?")))  # a repeated custom_id: answered once
    req = tmp_path / "requests.jsonl"
    write_lines(req, lines)
    # one at a time, as the server below answers them: the same prompts meet the same KV cache
    r = cli_batch(pair, str(req), "--out", str(tmp_path / "out.jsonl"), "--parallel", "1")
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    assert "custom_id 'inline' came on an earlier line" in r.stderr
    out = read_out(tmp_path / "out.jsonl")
    by_id = {o["custom_id"]: o for o in out if o["custom_id"] is not None}
    assert len(by_id) == len(good) + len(bad) + 1  # + the /v1/embeddings line
    assert [o for o in out if o["custom_id"] is None][0]["error"]["code"] == "invalid_json_line"
    assert by_id["embed"]["response"] is None and by_id["embed"]["error"]["code"] == "invalid_url"
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["id"].startswith("batch_req_")
    for k in good:
        assert by_id[k]["response"]["status_code"] == 200 and by_id[k]["error"] is None
        assert by_id[k]["response"]["request_id"].startswith("req_")
    json.loads(by_id["json"]["response"]["body"]["choices"][0]["message"]["content"])
    assert by_id["bad-image"]["response"]["status_code"] == 400
    assert by_id["bad-image"]["response"]["body"]["error"]["code"] == "invalid_image"
    assert by_id["bad-field"]["response"]["body"]["error"]["param"] == "messages"
    assert by_id["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"

    # The same bodies sent to a real server: the same answers, field for field.
    served = Served(pair, "--allow-path", str(tmp_path), "--parallel", "1")
    try:
        client = served.client()
        for k, b in {**good, **bad}.items():
            raw = client.chat.completions.with_raw_response.create(**b) if k in good else None
            if raw is None:
                import httpx

                resp = httpx.post(served.url + "/v1/chat/completions", json=b, timeout=60)
                assert resp.status_code == by_id[k]["response"]["status_code"]
                assert resp.json() == by_id[k]["response"]["body"], k
                continue
            want = json.loads(raw.http_response.text)
            got = by_id[k]["response"]["body"]
            assert set(got) == set(want), k
            for key in ("object", "model", "choices"):
                assert got[key] == want[key], (k, key)
            # cached_tokens says what the prefix cache held when the line ran: in a batch that
            # depends on which earlier lines had finished, so it is not part of the answer
            strip = lambda u: {**u, "prompt_tokens_details": None}
            assert strip(got["usage"]) == strip(want["usage"]), k
    finally:
        served.stop()

    # A rerun answers nothing again: every custom_id has its line.
    again = cli_batch(pair, str(req), "--out", str(tmp_path / "out.jsonl"))
    assert again.returncode == 4
    assert "answered 0 · skipped 9 (5 failed earlier)" in again.stderr
    assert len(read_out(tmp_path / "out.jsonl")) == len(out)


def test_server_errors_are_asked_again_and_a_torn_line_is_repaired(pair, tmp_path):
    req = tmp_path / "r.jsonl"
    write_lines(req, [line(f"q{i}", body(f"Count to {i}.", max_tokens=4)) for i in range(4)])
    out = tmp_path / "o.jsonl"
    busy = {
        "id": "batch_req_x",
        "custom_id": "q1",
        "error": None,
        "response": {
            "status_code": 503,
            "request_id": "req_x",
            "body": {"error": {"message": "busy", "type": "server_error", "param": None, "code": "memory_busy"}},
        },
    }
    ok = {
        "id": "batch_req_y",
        "custom_id": "q0",
        "error": None,
        "response": {"status_code": 200, "request_id": "req_y", "body": {"choices": [], "usage": {}}},
    }
    out.write_text(json.dumps(ok) + "\n" + json.dumps(busy) + "\n" + '{"id": "batch_req_z", "custom_id": "q2", "resp')
    r = cli_batch(pair, str(req), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "asked again 1 request(s) that got a server error earlier" in r.stderr
    lines = read_out(out)
    assert sorted(o["custom_id"] for o in lines) == ["q0", "q1", "q2", "q3"]
    assert {o["custom_id"]: o["response"]["status_code"] for o in lines} == {"q0": 200, "q1": 200, "q2": 200, "q3": 200}
    assert lines[0] == ok  # what was answered stays as it was


def test_unusable_files_are_one_line_and_exit_2(pair, tmp_path):
    for name, content, why in [
        ("missing.jsonl", None, "cannot read"),
        ("empty.jsonl", "\n\n", "holds no request lines"),
        ("notes.txt", "hello\nworld\n", "not a batch file"),
        ("binary.jsonl", b"\xff\xfe\x00bin", "not UTF-8"),
    ]:
        p = tmp_path / name
        if isinstance(content, str):
            p.write_text(content)
        elif content is not None:
            p.write_bytes(content)
        r = cli_batch(pair, str(p), "--out", str(tmp_path / "o.jsonl"))
        assert r.returncode == 2, (name, r.stderr)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and name in err[0] and why in err[0], (name, r.stderr)
    with pytest.raises(InputError, match="not a batch file"):
        read_batch_file(str(tmp_path / "notes.txt"))
    other = tmp_path / "other.jsonl"
    other.write_text('{"custom_id": "a", "path": "x.png"}\n')  # a caption log is not a batch output
    req = tmp_path / "r.jsonl"
    write_lines(req, [line("a", body("Hi"))])
    r = cli_batch(pair, str(req), "--out", str(other))
    assert r.returncode == 2 and "not a batch output file" in r.stderr


def test_a_killed_run_resumes_without_duplicates(pair, tmp_path):
    req = tmp_path / "r.jsonl"
    write_lines(
        req, [line(f"k{i}", body(f"Story {i}:", data_uri(png(64, 64, seed=i)), max_tokens=48)) for i in range(12)]
    )
    out = tmp_path / "o.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "edgevlm",
        "batch",
        str(req),
        "--out",
        str(out),
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--threads",
        "2",
        "--parallel",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out.exists() and len(read_out(out)) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = len(read_out(out))
    assert before < 12
    r = cli_batch(pair, str(req), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"skipped {before}" in r.stderr
    ids = [o["custom_id"] for o in read_out(out)]
    assert sorted(ids) == sorted(f"k{i}" for i in range(12))


def test_responses_lines_are_answered_with_response_objects_as_the_server_answers(pair, tmp_path):
    """OpenAI's Batch API takes /v1/responses lines too: each is answered with a ``response``
    object, field for field what ``POST /v1/responses`` returns for the same body."""
    uri = data_uri(png(96, 80, seed=4))
    resp_body = {
        "model": "tiny",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                {"type": "input_image", "image_url": uri}]}],
        "max_output_tokens": 8, "temperature": 0,
    }  # fmt: skip
    req = tmp_path / "requests.jsonl"
    write_lines(req, [
        line("resp", resp_body, url="/v1/responses"),
        line("chat", body("Say hello.", max_tokens=4)),
        line("later", {**resp_body, "previous_response_id": "resp_nowhere"}, url="/v1/responses"),
    ])  # fmt: skip
    r = cli_batch(pair, str(req), "--out", str(tmp_path / "out.jsonl"), "--parallel", "1")
    assert r.returncode == 4, r.stderr  # the third line: no stored response to follow in a batch
    by_id = {o["custom_id"]: o for o in read_out(tmp_path / "out.jsonl")}
    got = by_id["resp"]["response"]["body"]
    assert by_id["resp"]["response"]["status_code"] == 200 and got["object"] == "response"
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["later"]["response"]["status_code"] == 404
    served = Served(pair, "--parallel", "1")
    try:
        import httpx

        want = httpx.post(served.url + "/v1/responses", json=resp_body, timeout=60).json()
    finally:
        served.stop()
    assert set(got) == set(want)
    for key in ("object", "status", "model", "output_text"):
        if key in want:
            assert got[key] == want[key], key
    assert [i["type"] for i in got["output"]] == [i["type"] for i in want["output"]]
    text = lambda b: [c["text"] for i in b["output"] if i["type"] == "message" for c in i["content"]]  # noqa: E731
    assert text(got) == text(want)
