"""Audio on ``edgevlm serve`` (#56): a real server (an ``edgevlm serve`` subprocess on a generated
Ultravox pair: audio only, llama text) driven by the official ``openai`` and ``ollama`` clients —
chat ``input_audio`` parts, the Responses API's, ``/v1/audio/transcriptions`` in its three
formats, Ollama's ``images`` holding a WAV, the budget route's view of a recording, a
per-request audio budget (``--audio-tokens``, ``--max-audio-seconds``); bad recordings are each a
4xx in the API's own shape beside innocent clients that keep getting 200s; a vision-only model
(LLaVA) refuses audio with a 400 naming the model."""

from __future__ import annotations

import base64
import hashlib
import io
import math
import struct
import wave

import httpx
import numpy as np
import ollama
import pytest
from openai import BadRequestError

from edgevlm.serve.ollama_models import ModelFacts, show_body
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.transcribe import Piece, segments

from .beside import Innocents
from .test_serve import Served

RATE = 16000
TOKENS_PER_WINDOW = 375  # the testkit's Ultravox (stack factor 4): mtmd's count for one 30 s window


def tone(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """Speech-loud noise shaped by a few tones (no silence for the intake to drop), int16."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * math.pi * 220 * t) + 0.2 * np.sin(2 * math.pi * 530 * t) + 0.1 * rng.standard_normal(t.size)
    return (np.clip(x, -1, 1) * 32767 * 0.8).astype(np.int16)


def wav_bytes(seconds: float, rate: int = RATE, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(tone(seconds, rate, seed).tobytes())
    return buf.getvalue()


def encoded(seconds: float, fmt: str, codec: str, block: int) -> bytes:
    """``tone(seconds)`` in a ``fmt`` container through ``codec``, fed ``block`` samples at a time."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        s = out.add_stream(codec, rate=RATE, layout="mono")
        pcm = tone(seconds)
        for k in range(0, pcm.size, block):
            frame = av.AudioFrame.from_ndarray(pcm[None, k : k + block], format="s16", layout="mono")
            frame.rate = RATE
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode(None):
            out.mux(p)
    return buf.getvalue()


def mp3_bytes(seconds: float) -> bytes:
    return encoded(seconds, "mp3", "libmp3lame", 1152)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def said(text: str, data: bytes, fmt: str = "wav") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, audio_part(data, fmt)]}


def windows(seconds: float) -> int:
    """mtmd's 30 s windows for a recording (the research notes' formula, 16 kHz, n_fft 400)."""
    n = max(int(seconds * RATE), 201)
    return 1 + (n // 160 + 1) // 3000


class AudioInnocents(Innocents):
    """Innocent clients that each send a short recording (the server hears, it does not see)."""

    CLIP = b64(wav_bytes(2, seed=9))

    def body(self, i: int) -> dict:
        return {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"innocent {i}: what is said?"},
                        {"type": "input_audio", "input_audio": {"data": self.CLIP, "format": "wav"}},
                    ],
                }
            ],
            "max_tokens": 4,
            "temperature": 0,
        }


@pytest.fixture(scope="module")
def hears(model_pair):
    """Ultravox: audio only. Two at once, a queue; a context for a 40 s recording (two windows)."""
    s = Served(
        model_pair("ultravox"),
        *("--parallel", "2", "--queue", "8", "--ctx", "4096", "--max-tokens", "8", "--max-body", "8000000"),
        *("--max-audio-seconds", "60", "--model-id", "hears"),
    )
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def sees(model_pair):
    """LLaVA 1.5: vision only."""
    s = Served(model_pair("llava15"), "--parallel", "1", "--ctx", "2048", "--max-tokens", "4", "--model-id", "sees")
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def budget_of(server: Served, data: bytes, fmt: str = "wav") -> dict:
    body = {"input_audio": {"data": b64(data), "format": fmt}}
    r = httpx.post(server.url + "/v1/edgevlm/budget", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# --- 1. chat completions --------------------------------------------------------------------


def test_chat_input_audio_is_heard_and_its_tokens_counted(hears):
    clip = wav_bytes(5)
    r = hears.client().chat.completions.create(
        model="anything", messages=[said("What is said?", clip)], max_tokens=4, temperature=0
    )
    assert r.choices[0].message.content is not None
    details = r.usage.prompt_tokens_details
    assert details.audio_tokens == TOKENS_PER_WINDOW * windows(5)
    assert r.usage.prompt_tokens > details.audio_tokens  # (the text and the labels too)


def test_mp3_and_wav_of_one_recording_cost_the_same(hears):
    wav, mp3 = budget_of(hears, wav_bytes(5)), budget_of(hears, mp3_bytes(5), "mp3")
    assert wav["total_tokens"] == mp3["total_tokens"] == TOKENS_PER_WINDOW * windows(5)


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}}, "input_audio.data"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "aiff2"}}, "input_audio.format"),
        ({"type": "input_audio", "input_audio": {"data": "UklGRg=="}}, "input_audio.format"),
        ({"type": "input_audio"}, "input_audio"),
    ],
)
def test_bad_input_audio_parts_are_400_naming_the_field(hears, part, param):
    with pytest.raises(BadRequestError) as err:
        hears.client().chat.completions.create(model="m", messages=[{"role": "user", "content": [part]}], max_tokens=2)
    body = err.value.body
    assert body["param"] == f"messages[0].content[0].{param}", body


def test_audio_on_an_assistant_message_is_a_400(hears):
    with pytest.raises(BadRequestError) as err:
        hears.client().chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [audio_part(wav_bytes(1))]}],
            max_tokens=2,
        )
    assert err.value.body["param"] == "messages[1].content[0]"
    assert "only user messages may carry audio" in err.value.body["message"]


# --- 2. Responses ---------------------------------------------------------------------------


def test_responses_input_audio(hears):
    clip = wav_bytes(3, seed=2)
    r = hears.client().responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is said?"}, audio_part(clip)]}],
        max_output_tokens=4,
        temperature=0,
    )
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens_details.model_extra["audio_tokens"] == TOKENS_PER_WINDOW
    assert r.usage.input_tokens > TOKENS_PER_WINDOW


# --- 3. Ollama ------------------------------------------------------------------------------


def test_ollama_hears_a_wav_in_images(hears):
    client = ollama.Client(host=hears.url)
    r = client.chat(
        model="m",
        messages=[{"role": "user", "content": "What is said?", "images": [wav_bytes(3, seed=3)]}],
        options={"num_predict": 4, "temperature": 0},
        stream=False,
    )
    assert r.done
    assert r.prompt_eval_count > TOKENS_PER_WINDOW
    assert client.show("hears").capabilities == ["completion", "audio", "tools"]


def test_ollama_capabilities_follow_the_encoders():
    base = dict(name="m:latest", model_id="m", path="/m.gguf", size=1, digest="0", modified_at=0.0, family="llama")
    rest = dict(parameter_count=1, quantization="F16", n_ctx=1, n_ctx_train=1, template="", info={}, thinking=False)
    rest.update(size_loaded=1, size_vram=0)

    def caps(vision: bool, audio: bool) -> list[str]:
        return show_body(ModelFacts(**base, **rest, vision=vision, audio=audio), ServeOptions())["capabilities"]

    assert caps(True, False) == ["completion", "vision", "tools"]
    assert caps(False, True) == ["completion", "audio", "tools"]
    assert caps(True, True) == ["completion", "vision", "audio", "tools"]


# --- 4. transcriptions ----------------------------------------------------------------------


def test_transcriptions_in_three_formats(hears, tmp_path):
    p = tmp_path / "speech.wav"
    p.write_bytes(wav_bytes(40, seed=4))
    c = hears.client()
    with p.open("rb") as f:
        j = c.audio.transcriptions.create(file=f, model="whisper-1", response_format="json")
    assert isinstance(j.text, str)
    assert j.usage.input_token_details.audio_tokens == TOKENS_PER_WINDOW * windows(40)
    assert j.usage.output_tokens >= 1
    with p.open("rb") as f:
        t = c.audio.transcriptions.create(file=f, model="whisper-1", response_format="text", language="en")
    assert isinstance(t, str)
    with p.open("rb") as f:
        v = c.audio.transcriptions.create(
            file=f, model="whisper-1", response_format="verbose_json", timestamp_granularities=["segment"]
        )
    assert v.duration == pytest.approx(40, abs=0.05)
    spans = [(s.start, s.end) for s in v.segments]
    assert len(spans) == windows(40)
    assert spans[0][0] == 0
    assert spans[-1][1] == pytest.approx(40, abs=0.05)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # in order, not overlapping


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": "srt"}, "response_format", "json, text, verbose_json"),
        ({"response_format": "vtt"}, "response_format", "json, text, verbose_json"),
        ({"timestamp_granularities[]": "word"}, "timestamp_granularities[]", "segment"),
        ({"model": ""}, "model", "required"),
        ({"temperature": "3"}, "temperature", "0 to 1"),
    ],
)
def test_transcription_form_errors_are_400_naming_the_field(hears, fields, param, says):
    r = httpx.post(
        hears.url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", wav_bytes(1), "audio/wav")},
        data={"model": "whisper-1", **fields},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert says in err["message"], err


def test_a_transcription_past_max_body_is_413(hears):
    r = httpx.post(
        hears.url + "/v1/audio/transcriptions",
        files={"file": ("big.wav", b"\0" * 8_100_000, "audio/wav")},
        data={"model": "m"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert "--max-body" in r.json()["error"]["message"]


def test_segments_split_by_piece_labels_else_whole_text_first():
    pieces = [Piece(0, 30, "[0:00.0–0:30.0]"), Piece(30, 40, "[0:30.0–0:40.0]")]
    split = segments("[0:00.0–0:30.0] hello there [0:30.0–0:40.0] and bye", pieces, 0.0)
    assert [s["text"] for s in split] == ["hello there", "and bye"]
    whole = segments("hello there and bye", pieces, 0.0)
    assert [s["text"] for s in whole] == ["hello there and bye", ""]
    assert [(s["start"], s["end"]) for s in whole] == [(0, 30), (30, 40)]


# --- the cache key and the budget route -----------------------------------------------------


def test_one_recording_has_one_key_through_chat_and_transcriptions(hears):
    clip = wav_bytes(4, seed=5)
    seen = budget_of(hears, clip)
    assert seen["key"] == hashlib.sha256(clip).hexdigest()
    assert seen["total_tokens"] == TOKENS_PER_WINDOW * windows(4)
    assert [(p["start"], p["end"]) for p in seen["pieces"]] == [(0.0, 4.0)]
    c = hears.client()
    c.chat.completions.create(model="m", messages=[said("What is said?", clip)], max_tokens=2, temperature=0)
    before = hears.status()["kv"]["encode_ms"]
    t = c.audio.transcriptions.create(file=("clip.wav", clip), model="m", response_format="json")
    assert t.usage.input_token_details.audio_tokens == seen["total_tokens"]
    # the transcription's recording is the chat's: its pieces' embeddings come from the cache,
    # the encoder does not run again
    assert hears.status()["kv"]["encode_ms"] == before


# --- 5. the per-request limit ---------------------------------------------------------------


def test_a_recording_longer_than_max_audio_seconds_is_a_400(hears):
    with pytest.raises(BadRequestError) as err:
        hears.client().chat.completions.create(model="m", messages=[said("hi", wav_bytes(61, rate=8000))], max_tokens=2)
    assert "--max-audio-seconds" in err.value.body["message"], err.value.body


def test_audio_tokens_cut_a_long_recording_and_the_reply_says_so(model_pair):
    s = Served(model_pair("ultravox"), "--ctx", "4096", "--max-tokens", "4", "--audio-tokens", str(TOKENS_PER_WINDOW))
    try:
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={"messages": [said("What is said?", wav_bytes(40, seed=6))], "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["audio_tokens"] == TOKENS_PER_WINDOW
        notices = body["edgevlm"]["notices"]
        assert any(f"cut to the {TOKENS_PER_WINDOW}-token budget" in n for n in notices), notices
    finally:
        assert "Traceback" not in s.stop()


# --- 6. bad recordings beside innocent clients, and a model that cannot hear ----------------


def flac_bytes(seconds: float) -> bytes:
    return encoded(seconds, "flac", "flac", 4096)


def flac_bomb() -> bytes:
    """20 s of FLAC whose STREAMINFO says it holds 1 s (the 36-bit sample count ends at byte 26)."""
    data = bytearray(flac_bytes(20))
    v = int.from_bytes(data[18:26], "big")
    data[18:26] = ((v & ~((1 << 36) - 1)) | RATE).to_bytes(8, "big")
    return bytes(data)


def truncated_mp3() -> bytes:
    """An MP3 cut a third of the way, with junk where its next frame was."""
    data = mp3_bytes(4)
    return data[: len(data) // 3] + b"\xff\xfb\x90" + bytes(range(256)) * 4


BAD = {  # what a client sends, and the format it says it is
    "truncated mp3": (truncated_mp3, "mp3"),
    "text called .wav": (lambda: b"this is a text file, not a recording\n" * 20, "wav"),
    "audio bomb (FLAC saying 1 s, holding 20 s)": (flac_bomb, "flac"),
}


def test_bad_recordings_are_4xx_beside_innocents(hears):
    with AudioInnocents(hears.url) as inn:
        for what, (make, fmt) in BAD.items():
            data = make()
            r = httpx.post(
                hears.url + "/v1/chat/completions",
                json={"messages": [said("hi", data, fmt)], "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 400, (what, r.status_code, r.text)
            assert r.json()["error"]["message"].startswith("audio 1: "), (what, r.text)
            t = httpx.post(
                hears.url + "/v1/audio/transcriptions",
                files={"file": (f"x.{fmt}", data)},
                data={"model": "m"},
                timeout=60,
            )
            assert t.status_code == 400, (what, t.status_code, t.text)
            assert t.json()["error"]["message"].startswith(f"x.{fmt}: "), (what, t.text)
            msg = {"role": "user", "content": "hi", "images": [b64(data)]}
            o = httpx.post(hears.url + "/api/chat", json={"model": "m", "stream": False, "messages": [msg]}, timeout=60)
            assert o.status_code == 400, (what, o.status_code, o.text)
            assert isinstance(o.json()["error"], str), (what, o.text)
        bad64 = {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}]}
        with pytest.raises(BadRequestError) as err:
            hears.client().chat.completions.create(model="m", messages=[bad64], max_tokens=2)
        assert err.value.body["param"] == "messages[0].content[0].input_audio.data"
        inn.served(2)


def ten_hour_wav() -> bytes:
    """A WAV whose header declares 10 hours of data, holding a second."""
    head = wav_bytes(1)
    n = 10 * 3600 * RATE * 2
    return head[:4] + struct.pack("<I", 36 + n) + head[8:40] + struct.pack("<I", n) + head[44:]


def test_a_lying_wav_header_and_a_cut_mp3_are_heard_as_what_they_hold(hears):
    """FFmpeg's WAV reader takes the length from what the file holds: a header declaring 10
    hours costs nothing, the second it holds is one piece; an MP3 cut cleanly between frames is
    the audio up to the cut, and the reply says so."""
    c = hears.client()
    r = c.chat.completions.create(model="m", messages=[said("hi", ten_hour_wav())], max_tokens=2)
    assert r.usage.prompt_tokens_details.audio_tokens == TOKENS_PER_WINDOW
    cut = mp3_bytes(4)
    r = httpx.post(
        hears.url + "/v1/chat/completions",
        json={"messages": [said("hi", cut[: len(cut) // 3], "mp3")], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert any("truncated?" in n for n in r.json()["edgevlm"]["notices"]), r.json()


def test_a_model_without_an_audio_encoder_refuses_audio_naming_the_model(sees):
    with pytest.raises(BadRequestError) as err:
        sees.client().chat.completions.create(model="m", messages=[said("hi", wav_bytes(2))], max_tokens=2)
    assert "has no audio encoder" in err.value.body["message"], err.value.body
    r = httpx.post(
        sees.url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", wav_bytes(2))},
        data={"model": "m"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "has no audio encoder" in r.json()["error"]["message"], r.text
    assert ollama.Client(host=sees.url).show("sees").capabilities == ["completion", "vision", "tools"]
