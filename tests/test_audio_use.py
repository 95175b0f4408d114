"""Audio through the one intake, end to end on generated pairs that hear (an audio-only Ultravox,
a Qwen2.5-Omni file with both encoders): ``edgevlm budget`` predicts what ``chat`` sends (our
arithmetic against mtmd's own chunks), silence costs little, a recording over its budget is cut
and says so, models that cannot hear (or see) refuse in one line, the same recording has the
same key in every caller, and a conversation with a recording is saved and continued."""

from __future__ import annotations

import dataclasses
import json

import pytest

from edgevlm.runtime.engine import EngineOptions
from edgevlm.runtime.intake import Intake, MediaRef
from edgevlm_testkit.sounds import write_wav

from .conftest import run_cli

HEAR = ["ultravox", "qwen25o"]


@pytest.fixture(scope="module")
def sounds(tmp_path_factory):
    d = tmp_path_factory.mktemp("sounds")
    return {
        "speech45": write_wav(d / "speech45.wav", [("speech", 45)]),
        "speech60": write_wav(d / "speech60.wav", [("speech", 60)], seed=3),
        "quiet60": write_wav(d / "quiet60.wav", [("speech", 4), ("silence", 52), ("speech", 4)], seed=5),
    }


def _pair_args(pair) -> list[str]:
    return ["--model", str(pair.model), "--mmproj", str(pair.mmproj)]


def _budget(pair, path, *extra) -> dict:
    r = run_cli("budget", str(path), *_pair_args(pair), "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _chat(pair, path, *extra) -> dict:
    args = ["--audio", str(path), "What is said?", "-n", "4", "--temp", "0", "--json"]
    r = run_cli("chat", *_pair_args(pair), *args, *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


@pytest.mark.parametrize("family", HEAR)
def test_budget_predicts_what_chat_sends_under_and_over_its_budget(family, model_pair, sounds):
    pair = model_pair(family)
    path = sounds["speech45"]
    whole = _budget(pair, path)
    assert len(whole["pieces"]) == 2
    assert not whole["cut"]
    sent = _chat(pair, path)
    assert sent["stats"]["audio_tokens"] == whole["total_tokens"]  # mtmd's chunks, counted by the scheduler
    one = whole["pieces"][0]["tokens"]
    cut = _budget(pair, path, "--audio-tokens", str(one + 10))
    assert cut["cut"]
    assert cut["total_tokens"] == one
    assert len(cut["pieces"]) == 1
    assert cut["left_out_s"] == pytest.approx(15, abs=0.5)
    sent = _chat(pair, path, "--audio-tokens", str(one + 10))
    assert sent["stats"]["audio_tokens"] == cut["total_tokens"]
    assert "cut to the" in sent["stderr"]
    assert "not sent" in sent["stderr"]


def test_a_mostly_silent_recording_costs_far_fewer_tokens_than_speech(model_pair, sounds):
    pair = model_pair("qwen25o")
    speech = _budget(pair, sounds["speech60"])
    quiet = _budget(pair, sounds["quiet60"])
    assert speech["duration_s"] == pytest.approx(quiet["duration_s"], abs=0.1)
    assert quiet["total_tokens"] * 3 <= speech["total_tokens"]
    assert quiet["silence_dropped_s"] > 45
    kept = _budget(pair, sounds["quiet60"], "--keep-silence")
    assert kept["total_tokens"] == speech["total_tokens"]  # the flag keeps them: the length's cost again
    assert _chat(pair, sounds["quiet60"])["stats"]["audio_tokens"] == quiet["total_tokens"]


def test_pieces_are_labelled_with_the_times_they_cover(model_pair, sounds):
    d = _budget(model_pair("ultravox"), sounds["quiet60"])
    (piece,) = d["pieces"]
    assert len(piece["spans"]) == 2  # the speech before and after the silence, in one window
    (a0, a1), (b0, b1) = piece["spans"]
    assert a0 == 0
    assert 4 <= a1 < 5
    assert 55 < b0 <= 56
    assert b1 == pytest.approx(60, abs=0.05)
    assert piece["label"].startswith("[0:00.0–0:04")
    assert "1:00.0]" in piece["label"]


def test_models_that_cannot_hear_or_see_refuse_in_one_line(model_pair, sounds, tmp_path):
    from PIL import Image

    r = run_cli("chat", *_pair_args(model_pair("llava15")), "--audio", str(sounds["speech45"]), "hi", "-n", "2")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "speech45.wav" in line
    assert "mmproj.gguf (LLaVA-1.5" in line
    assert "has no audio encoder" in line
    png = tmp_path / "red.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(png)
    r = run_cli("chat", *_pair_args(model_pair("ultravox")), "-i", str(png), "hi", "-n", "2")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "red.png" in r.stderr
    assert "has no vision encoder" in r.stderr


def test_bad_audio_is_one_line_not_a_traceback(model_pair, tmp_path, sounds):
    pair = model_pair("ultravox")
    junk = tmp_path / "notes.wav"
    junk.write_text("these are not samples\n" * 50)
    cut = tmp_path / "cut.wav"
    whole = sounds["speech45"].read_bytes()
    cut.write_bytes(whole[:44])  # a header and nothing else
    for bad in (junk, cut):
        r = run_cli("chat", *_pair_args(pair), "--audio", str(bad), "hi", "-n", "2")
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert bad.name in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_the_same_recording_has_the_same_key_and_tokens_in_every_caller(model_pair, sounds, tmp_path):
    """A path (chat, caption's files), its bytes (the server's bodies, batch lines): one key."""
    from edgevlm.model.gguf_info import load_projector

    pair = model_pair("ultravox")
    proj = load_projector(pair.mmproj)
    intake = Intake.for_audio(proj, EngineOptions())
    path = sounds["speech45"]
    by_path = intake.views(MediaRef(str(path)))
    by_bytes = intake.views(MediaRef(path.read_bytes(), name="upload"))
    assert by_path.kind == by_bytes.kind == "audio"
    assert by_path.key == by_bytes.key == _budget(pair, path)["key"]
    assert [p.sha256 for p in by_path.views] == [p.sha256 for p in by_bytes.views]
    assert by_path.tokens == by_bytes.tokens
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "speech45.wav").write_bytes(path.read_bytes())
    out = tmp_path / "caps.jsonl"
    r = run_cli("caption", str(folder), *_pair_args(pair), "--max-tokens", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert rec["sha256"] == by_path.key
    assert rec["image_tokens"] == by_path.tokens
    assert rec["error"] is None
    assert rec["prompt"] == "Write a one-sentence caption for this recording."  # (not "this image")


def test_the_repl_takes_audio_and_a_saved_conversation_keeps_it(model_pair, sounds, tmp_path):
    pair = model_pair("qwen25o")
    saved = tmp_path / "talk.evlm"
    script = f"/audio {sounds['speech45']}\nWhat is said?\n/audio {tmp_path / 'nope.wav'}\n/stats\n"
    r = run_cli("chat", *_pair_args(pair), "-n", "3", "--temp", "0", "--session", str(saved), input=script)
    assert r.returncode == 0, r.stderr
    assert "nope.wav: no such audio file" in r.stdout + r.stderr
    assert saved.is_file()
    r = run_cli("chat", *_pair_args(pair), "-n", "3", "--temp", "0", "--session", str(saved), "--json", "And then?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["session"]["restored_pictures"] == 1  # the recording came back from the file
    assert out["stats"]["cached_n"] > 1000  # its cells too: nothing encoded again
    assert out["stats"]["images_encoded"] == 0


def test_the_same_request_gives_the_same_tokens(model_pair, sounds):
    pair = model_pair("ultravox")
    a = _chat(pair, sounds["speech45"], "-n", "6")
    b = _chat(pair, sounds["speech45"], "-n", "6")
    assert a["text"] == b["text"]
    assert a["stats"]["predicted_n"] == b["stats"]["predicted_n"]


def test_an_encoder_that_would_abort_llama_cpp_is_refused_before_encoding(model_pair, sounds, tmp_path):
    """Ultravox 0.5's stack factor 8: mtmd counts 187 tokens a window, its graph gives 188 and
    clip_encode aborts the process. edgevlm says so in one line and plans no audio buffer."""
    from edgevlm.model.audio import refusal
    from edgevlm.model.gguf_info import load_projector
    from edgevlm_testkit.audio import AUDIO_PRESETS, write_ultravox_mmproj

    shape = dataclasses.replace(AUDIO_PRESETS["tiny"], stack_factor=8)
    mmproj = write_ultravox_mmproj(tmp_path / "mmproj.gguf", shape, 128, 1, "Ultravox 0.5 random")
    assert "aborts this llama.cpp" in (refusal(load_projector(mmproj).audio) or "")
    model = model_pair("ultravox").model
    r = run_cli("chat", "--model", str(model), "--mmproj", str(mmproj), "--audio", str(sounds["speech45"]), "hi")
    assert r.returncode == 2, r.stderr  # (not 134: nothing reached clip_encode)
    (line,) = r.stderr.strip().splitlines()
    assert "stack factor 8" in line
    assert "187" in line
    plan = run_cli("plan", "--model", str(model), "--mmproj", str(mmproj), "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["audio_encoder_bytes"] == 0


def test_a_batch_line_with_input_audio_costs_what_budget_says(model_pair, sounds, tmp_path):
    """An OpenAI batch file's line carries the recording as base64: the same tokens as the file."""
    import base64

    pair = model_pair("ultravox")
    path = sounds["quiet60"]
    data = base64.b64encode(path.read_bytes()).decode()
    part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    r = run_cli("batch", str(src), *_pair_args(pair), "--out", str(out))
    assert r.returncode == 0, r.stderr
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    usage = rec["response"]["body"]["usage"]
    assert usage["prompt_tokens_details"]["audio_tokens"] == _budget(pair, path)["total_tokens"]


def test_inspect_describes_an_audio_projector(model_pair):
    only, both = model_pair("ultravox"), model_pair("qwen25o")
    r = run_cli("inspect", str(only.mmproj), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["mmproj"]
    assert "image_tokens" not in d
    assert d["audio"]["projector_type"] == "ultravox"
    assert d["audio_tokens"] == {"per_30s_window": 375, "refused": None}
    r = run_cli("inspect", str(both.model), "--mmproj", str(both.mmproj))
    assert r.returncode == 0, r.stderr
    assert "image tokens @ 560x560" in r.stdout
    assert "750 per 30 s window" in r.stdout
    assert "qwen2a" in r.stdout


def test_an_old_recording_gives_way_to_its_summary_when_the_context_fills(model_pair, sounds):
    import edgevlm
    from edgevlm import Sound

    pair = model_pair("ultravox")
    vlm = edgevlm.load(str(pair.model), str(pair.mmproj), n_ctx=1024)
    try:
        eng = vlm.conversation()
        first = eng.chat("one", [Sound(str(sounds["speech45"]), "talk.wav")], max_tokens=2, temperature=0)
        assert first.stats.audio_tokens == 750
        second = eng.chat("two", [Sound(str(sounds["speech45"]), "again.wav")], max_tokens=2, temperature=0)
        assert second.stats.summarized_images == 1  # 2 × 750 audio tokens cannot share 1,024 cells
        said = [n for n in eng.notices if "replaced by its summary" in n]
        assert said
        assert said[0].startswith("context full: recording 1 (talk.wav)")
        assert any(n.startswith("[recording 1 (talk.wav): ") for m in eng.messages for n in m.notes)
    finally:
        vlm.close()
