"""Conversations that outlive the process (``edgevlm chat --session``, ``/save``, ``/load``): a
conversation saved after each turn and continued by a new process gives the same tokens as one
process that never stopped — with no picture encoded again and no prefix evaluated again — and
every file that cannot be used is refused in one line, leaving it as it was."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import make_image, run_cli

# Replies held to a few lowercase letters: left to themselves the tiny random models repeat one
# token (Gemma 3's is a newline) whatever the cache holds; under a grammar the best allowed token
# moves with every logit, so a wrong cell shows. Short enough to close within -n 12 (--json).
WORDS = {"type": "string", "pattern": "^[a-z ]{1,6}$"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    schema = d / "words.json"
    schema.write_text(json.dumps(WORDS))
    return {
        "schema": schema,
        "a": make_image(d / "a.png", 64, 48, seed=1),
        "b": make_image(d / "b.png", 56, 72, seed=2, mode="gradient"),
    }


def chat_args(pair, *args, kv="f16", ctx="1024"):
    return [
        "chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--temp", "0", "-n", "12",
        "--ctx", ctx, "--kv", kv, *args,
    ]  # fmt: skip


def one_error_line(r) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
@pytest.mark.parametrize("family", ["llava15", "qwen2vl", "gemma3"])
def test_a_conversation_continued_in_a_new_process_gives_the_same_tokens(model_pair, files, tmp_path, family, kv):
    pair = model_pair(family)
    words = ("--json-schema", str(files["schema"]))
    turns = [(files["a"], "Describe it."), (files["b"], "And this one?"), (None, "Which is brighter?")]
    # one process that never stops
    script = "".join((f"/image {img}\n" if img else "") + text + "\n" for img, text in turns)
    whole = run_cli(*chat_args(pair, *words, kv=kv, ctx="2048"), input=script)
    assert whole.returncode == 0, whole.stderr
    expected = [x.strip() for x in whole.stdout.splitlines() if x.strip()]
    assert len(expected) == 3
    # the same conversation, one process per turn, through the session file
    s = tmp_path / "talk.evlm"
    saved_before = 0
    for n, (img, text) in enumerate(turns):
        pics = ["-i", str(img)] if img else []
        r = run_cli(*chat_args(pair, *words, "--session", str(s), "--json", *pics, text, kv=kv, ctx="2048"))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == expected[n], (n, out["text"], expected[n])
        st, sess = out["stats"], out["session"]
        assert sess["restored_tokens"] == saved_before  # what the last process saved came back ...
        assert st["cached_n"] == saved_before  # ... and none of it was evaluated again
        assert st["images_encoded"] == (1 if img else 0)  # only this turn's picture was encoded
        assert sess["restored_pictures"] == n
        assert sess["saved_pictures"] == n + 1 - (img is None)
        assert sess["saved_bytes"] == s.stat().st_size
        saved_before = sess["saved_tokens"]
        assert saved_before > st["cached_n"] + st["prompt_n"] - 1


@pytest.fixture(scope="module")
def saved_llava(model_pair, files, tmp_path_factory):
    """A one-turn conversation about a picture, saved by the tiny LLaVA pair (f16, 1024)."""
    pair = model_pair("llava15")
    s = tmp_path_factory.mktemp("refuse") / "talk.evlm"
    r = run_cli(*chat_args(pair, "--session", str(s), "-i", str(files["a"]), "Describe it."))
    assert r.returncode == 0, r.stderr
    return pair, s


def test_a_file_that_cannot_be_used_is_refused_in_one_line_and_left_as_it_was(model_pair, saved_llava, tmp_path):
    pair, good = saved_llava
    other_weights = model_pair("llava15", seed=1)  # the same shapes and sizes, other weights
    data = good.read_bytes()

    def variant(name: str, content: bytes):
        p = tmp_path / name
        p.write_bytes(content)
        return p

    head_len = struct.unpack_from("<Q", data, 16)[0]
    flipped = bytearray(data)
    flipped[len(data) - 1000] ^= 0xFF  # a byte of the KV cells
    cases = [
        (other_weights.model, pair.mmproj, [], good, "made with another model"),
        (pair.model, other_weights.mmproj, [], good, "made with another projector"),
        (pair.model, pair.mmproj, ["--ctx", "2048"], good, "made with a context of 1,024 tokens, this one has 2,048"),
        (pair.model, pair.mmproj, ["--kv", "q8_0"], good, "made with KV cache f16, this one has q8_0 (--kv f16)"),
        (pair.model, pair.mmproj, [], variant("cut.evlm", data[:-4096]), "truncated"),
        (pair.model, pair.mmproj, [], variant("flip.evlm", bytes(flipped)), "corrupted (its checksum"),
        (pair.model, pair.mmproj, [], variant("new.evlm", data[:12] + struct.pack("<I", 2) + data[16:]),
         "saved by a newer edgevlm (format 2; this one reads format 1)"),
        (pair.model, pair.mmproj, [], variant("hdr.evlm", data[:24] + b"!" + data[25:]), "corrupted"),
        (pair.model, pair.mmproj, [], variant("png.evlm", b"\x89PNG\r\n\x1a\n" + data[8:]), "not an edgevlm saved"),
    ]  # fmt: skip
    assert head_len > 1
    for model, mmproj, extra, path, reason in cases:
        before = path.read_bytes()
        r = run_cli(
            "chat", "-m", str(model), "--mmproj", str(mmproj), "-n", "4", *extra, "--session", str(path), "Go on."
        )
        line = one_error_line(r)
        assert f"{path}: {reason}" in line, (reason, line)
        assert "Traceback" not in r.stderr
        assert path.read_bytes() == before  # a refused file is never overwritten
    # /load in the REPL: the same line, and the session goes on
    r = run_cli(*chat_args(pair, "-n", "4"), input=f"/load {tmp_path / 'cut.evlm'}\nHello\n")
    assert r.returncode == 0, r.stderr
    assert f"Error: {tmp_path / 'cut.evlm'}: truncated" in r.stderr, r.stderr
    assert r.stdout.strip()


def test_save_and_load_in_the_repl_continue_where_it_was(saved_llava, files, tmp_path):
    pair, _ = saved_llava
    s = tmp_path / "repl.evlm"
    ref = run_cli(*chat_args(pair), input=f"/image {files['a']}\nDescribe it.\nAnd then?\n")
    assert ref.returncode == 0, ref.stderr
    expected = [x for x in ref.stdout.splitlines() if x.strip()]
    script = f"/image {files['a']}\nDescribe it.\n/save {s}\n/reset\n/load {s}\nAnd then?\n"
    r = run_cli(*chat_args(pair), input=script)
    assert r.returncode == 0, r.stderr
    assert [x for x in r.stdout.splitlines() if x.strip()] == expected
    assert f"saved {s}: 2 message(s), 1 picture(s)" in r.stderr
    assert f"loaded {s}: 2 message(s)" in r.stderr


def test_a_restored_conversation_that_no_longer_fits_summarises_its_old_picture(saved_llava, files, tmp_path):
    """Two 576-token pictures never fit a 1024 context: the restored one becomes its summary,
    asked of the model while its cells are the ones the file brought back."""
    pair, good = saved_llava
    s = tmp_path / "full.evlm"
    shutil.copy(good, s)
    r = run_cli(*chat_args(pair, "--session", str(s), "--json", "-i", str(files["b"]), "And this one?"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["summarized_images"] == 1
    assert out["session"]["restored_pictures"] == 1
    assert out["session"]["saved_pictures"] == 2
    r = run_cli(*chat_args(pair, "--session", str(s)), input="/history\n")
    assert "image 1 (a.png, 576 tokens): summary:" in r.stderr, r.stderr
    assert "image 2 (b.png" in r.stderr, r.stderr


KILL_MID_SAVE = textwrap.dedent(
    """
    import os, sys
    from edgevlm.runtime.saved import fileformat
    real = os.fsync
    def stop_here(fd):  # the new file is written, not yet renamed: say so, and wait to be killed
        open(sys.argv[2], "w").close()
        import time
        while True:
            time.sleep(1)
    fileformat.os.fsync = stop_here
    fileformat.write_saved(sys.argv[1], {"kind": "conversation"}, [("kv", b"new" * 100000)])
    """
)


def test_a_process_killed_while_saving_leaves_the_previous_file_intact(saved_llava, tmp_path):
    _, good = saved_llava
    s = tmp_path / "talk.evlm"
    shutil.copy(good, s)
    before = s.read_bytes()
    marker = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", KILL_MID_SAVE, str(s), str(marker)])
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, "the save ended before its fsync"
        assert time.monotonic() < deadline, "the save never got to its fsync"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert s.read_bytes() == before
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".talk.evlm.")]
    assert len(left) == 1  # the dead writer's temporary file ...
    from edgevlm.runtime.saved import load_saved, write_saved

    assert load_saved(str(s)).header["kind"] == "conversation"
    write_saved(str(s), {"kind": "conversation"}, [("kv", b"x")])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".talk.evlm.")]  # ... gone at the next save


def test_the_librarys_conversation_saves_and_loads(model_pair, files, tmp_path):
    import edgevlm

    pair = model_pair("qwen2vl")
    with edgevlm.load(str(pair.model), str(pair.mmproj), n_ctx=1024) as vlm:
        a = vlm.conversation()
        a.chat("Describe it.", [str(files["a"])], max_tokens=6, temperature=0)
        info = a.save(str(tmp_path / "lib.evlm"))
        expected = a.chat("And then?", max_tokens=6, temperature=0)
        b = vlm.conversation()
        assert b.load(str(tmp_path / "lib.evlm")) == info
        got = b.chat("And then?", max_tokens=6, temperature=0)
    assert got.text == expected.text
    assert got.stats.cached_n == info.tokens
    assert got.stats.images_encoded == 0
