"""``edgevlm chat`` as a user runs it: real subprocesses, real llama.cpp, generated models."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import run_cli
from .test_errors import assert_clean_error

G = ["--temp", "0"]


def chat_args(pair, *extra):
    return ["chat", "--model", str(pair.model), "--mmproj", str(pair.mmproj), *G, *extra]


def test_one_shot_streams_text(model_pair, images):
    pair = model_pair("llava15")
    r = run_cli(*chat_args(pair, "--image", str(images["gradient"]), "-n", "8", "--stats", "Describe"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")
    footer = r.stderr.strip().splitlines()[-1]
    assert footer.startswith("8 tok · ") and "tok/s · prompt" in footer and "TTFT" in footer
    assert footer.endswith("image 576 tok")


def test_one_shot_json(model_pair, images):
    pair = model_pair("qwen2vl")
    r = run_cli(
        *chat_args(pair, "-i", str(images["gradient"]), "-i", str(images["noise"]), "-n", "5", "--json", "Compare")
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # one JSON object and nothing else on stdout
    assert set(out) == {"text", "stats"}
    st = out["stats"]
    for key in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "ttft_ms",
        "itl_ms_mean",
        "image_tokens",
        "image_encode_ms",
        "cached_n",
        "n_ctx_used",
        "n_ctx",
        "peak_rss_bytes",
    ):
        assert key in st, key
    assert st["images_encoded"] == 2 and st["image_tokens"] == 23 * 14 + 11 * 9
    # the same run twice gives the same greedy text
    again = json.loads(
        run_cli(
            *chat_args(pair, "-i", str(images["gradient"]), "-i", str(images["noise"]), "-n", "5", "--json", "Compare")
        ).stdout
    )
    assert again["text"] == out["text"]


def test_repl_over_piped_stdin(model_pair, images):
    pair = model_pair("llava15")
    script = (
        "\n".join(
            [
                f"/image {images['gradient']}",
                "What is it?",
                f"compare with {images['noise']} please",
                '"""',
                "a message",
                "on two lines",
                '"""',
                "/image /no/such/file.png",
                "/history",
                "/stats",
                "/reset",
                "fresh start",
                "/quit",
                "never sent",
            ]
        )
        + "\n"
    )
    r = run_cli(*chat_args(pair, "-n", "4"), input=script)
    assert r.returncode == 0, r.stderr
    replies = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(replies) == 4  # three messages, then one after /reset
    err = r.stderr
    assert "queued" in err and "Error: /no/such/file.png: no such file" in err
    assert "[1 image(s)] What is it?" in err and "[1 image(s)] compare with please" in err
    assert "a message on two lines" in err
    assert '"cached_n"' in err and "conversation reset" in err
    assert "Traceback" not in err


def test_repl_reports_errors_and_keeps_going(model_pair, tmp_path):
    pair = model_pair("llava15")
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    script = f"/image {bad}\nhello\n/unknown\nbye\n"
    r = run_cli(*chat_args(pair, "-n", "3"), input=script)
    assert r.returncode == 0
    assert f"Error: {bad}:" in r.stderr and "unknown command" in r.stderr
    assert len([ln for ln in r.stdout.splitlines() if ln.strip()]) == 2


@pytest.fixture()
def bad_images(tmp_path, images):
    data = images["gradient"].read_bytes()
    files = {
        "missing": tmp_path / "missing.png",
        "truncated": tmp_path / "truncated.png",
        "notimage": tmp_path / "notes.jpg",
        "empty": tmp_path / "empty.png",
    }
    files["truncated"].write_bytes(data[: len(data) // 3])
    files["notimage"].write_text("just some text, not a JPEG")
    files["empty"].write_bytes(b"")
    return files


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "no such file"),
        ("truncated", "corrupt or truncated"),
        ("notimage", "not an image"),
        ("empty", "empty file"),
    ],
)
def test_bad_image_one_line_exit_2(model_pair, bad_images, case, needle):
    pair = model_pair("llava15")
    path = str(bad_images[case])
    assert_clean_error(run_cli(*chat_args(pair, "-i", path, "Describe")), path, needle)


def test_mmproj_that_does_not_fit(model_pair, tmp_path):
    from edgevlm_testkit.llava import write_clip_mlp
    from edgevlm_testkit.shapes import LLAVA_PRESETS

    pair = model_pair("llava15")
    wrong = write_clip_mlp(tmp_path / "wide.gguf", LLAVA_PRESETS["tiny"][1], 96, 1, "wide")
    r = run_cli("chat", "--model", str(pair.model), "--mmproj", str(wrong), "hi")
    assert_clean_error(r, str(wrong), "does not match", "not a pair")


def test_prompt_longer_than_context(model_pair, images):
    pair = model_pair("llava15")
    r = run_cli(*chat_args(pair, "--ctx", "256", "-i", str(images["square"]), "Describe"))
    assert_clean_error(r, str(images["square"]), "needs 576 tokens", "left in the context")
    r = run_cli(*chat_args(pair, "--ctx", "256", "word " * 400))  # (too long by its size: never tokenized)
    assert_clean_error(r, "text (1,999 bytes) is at least", "context holds 256")


def test_chat_help_lists_options():
    r = run_cli("chat", "--help")
    for opt in (
        "--image",
        "--max-tokens",
        "--temp",
        "--seed",
        "--system",
        "--ctx",
        "--ngl",
        "--threads",
        "--verbose",
        "--stats",
        "--json",
    ):
        assert opt in r.stdout, opt


TAGS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "people"],
    "properties": {
        "kind": {"enum": ["photo", "drawing", "screenshot"]},
        "people": {"type": "integer", "minimum": 0, "maximum": 20},
    },
}


def test_json_schema_constrains_the_answer(model_pair, images, tmp_path):
    pair = model_pair("llava15")
    schema = tmp_path / "tags.json"
    schema.write_text(json.dumps(TAGS))
    r = run_cli(
        *chat_args(
            pair, "-i", str(images["gradient"]), "-n", "64", "--json-schema", str(schema), "--json", "Tag this picture."
        )
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["json"] == json.loads(out["text"]) and set(out["json"]) == {"kind", "people"}
    assert out["json"]["kind"] in ("photo", "drawing", "screenshot") and 0 <= out["json"]["people"] <= 20
    plain = run_cli(
        *chat_args(pair, "-i", str(images["gradient"]), "-n", "64", "--json-schema", str(schema), "Tag this picture.")
    )
    assert plain.returncode == 0 and json.loads(plain.stdout) == out["json"]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    r = run_cli(*chat_args(pair, "--json-schema", str(bad), "Hi"))
    assert r.returncode == 2 and "bad.json: not JSON" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal")
def test_ctrl_d_leaves_the_session_on_a_line_of_its_own(model_pair):
    """At the session's prompt on a terminal, Ctrl-D ends it with a newline, so the shell's next
    prompt does not land after ">>> "."""
    from .conftest import on_a_terminal

    rc, seen = on_a_terminal(chat_args(model_pair("llava15")), b">>> ", b"\x04")
    assert rc == 0
    assert seen.rstrip(b"\r\n ").endswith(b">>>") and seen.endswith(b"\n"), seen[-40:]
