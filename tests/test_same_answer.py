"""The same request, the same tokens (#57): a request that runs alone is computed in the same
batches, on the same threads, whatever the clock says — so its greedy answer is the same run
after run, on a quiet machine or one whose cores are taken by other work. Each test runs the
real CLI or server in fresh processes, once quiet and again while three CPU burners (busy
loops in processes of their own, more than the machine's 2 cores) run, and compares.

Before, the step loop cut a lone request's rows by measured times (steps of about 1.5 s, a
picture's rows in parts of about 0.3 s beside a server's arrivals) and a picture could be
encoded on part of the cores beside the decoder: a slower run computed other batches, and
its greedy tokens could differ."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator

import httpx

from .conftest import make_image, run_cli
from .test_serve import Served, data_uri, png, user

BURNERS = 3
ROUNDS = 3  # runs under load, after the quiet one


@contextlib.contextmanager
def burning(n: int = BURNERS) -> Iterator[None]:
    """``n`` processes spinning on the CPU meanwhile (stopped by their process ids)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_a_one_shot_answers_the_same_quiet_and_under_load(model_pair, images):
    """``edgevlm chat`` one-shot, greedy, two pictures (Qwen2-VL: M-RoPE, pictures fed in a
    batch of their own), a fresh process each run."""
    pair = model_pair("qwen2vl")
    args = ["chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--temp", "0", "-n", "8", "--json"]
    args += ["-i", str(images["gradient"]), "-i", str(images["noise"]), "Compare"]

    def once() -> str:
        r = run_cli(*args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["text"]

    quiet = once()
    with burning():
        busy = [once() for _ in range(ROUNDS)]
    assert busy == [quiet] * ROUNDS


def test_a_caption_run_one_at_a_time_writes_the_same_captions_under_load(model_pair, tmp_path):
    """``edgevlm caption --parallel 1`` over three pictures (Gemma 3: its pictures' rows in one
    non-causal batch), into a fresh record file each run: the same captions."""
    pair = model_pair("gemma3")
    folder = tmp_path / "pics"
    folder.mkdir()
    for i in range(3):
        make_image(folder / f"{i}.png", 200 + 40 * i, 160, seed=10 + i)

    def once(k: int) -> dict[str, str]:
        out = tmp_path / f"captions-{k}.jsonl"
        r = run_cli(
            *("caption", "-m", str(pair.model), "--mmproj", str(pair.mmproj), str(folder)),
            *("--parallel", "1", "-n", "8", "--out", str(out)),
        )
        assert r.returncode == 0, r.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        return {rec["path"]: rec["caption"] for rec in records}

    quiet = once(0)
    assert len(quiet) == 3
    with burning():
        busy = [once(k) for k in range(1, ROUNDS + 1)]
    assert busy == [quiet] * ROUNDS


def test_a_server_with_one_client_answers_the_same_conversation_the_same(model_pair):
    """A fresh ``edgevlm serve`` per run, one client: a picture whose 576 rows are more than a
    micro-batch (fed in parts, the server looking for arrivals between them), then a follow-up
    in the same conversation. Both replies are the same every run."""
    pair = model_pair("llava15")
    picture = data_uri(png(400, 300, seed=21))

    def once() -> list[str]:
        s = Served(pair, "--ctx", "4096", "--max-tokens", "8")
        try:
            messages = [user("What is in this picture?", picture)]
            replies = []
            for follow_up in ("And its colours?", None):
                body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8}
                r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300)
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["message"]["content"]
                replies.append(text)
                if follow_up is not None:
                    messages = [*messages, {"role": "assistant", "content": text}, user(follow_up)]
            return replies
        finally:
            s.stop()

    quiet = once()
    with burning():
        busy = [once() for _ in range(ROUNDS)]
    assert busy == [quiet] * ROUNDS
