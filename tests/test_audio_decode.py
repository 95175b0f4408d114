"""edgevlm.audio on real files written here with PyAV (and the stdlib ``wave``): every format to
16 kHz mono float32, the limits (too long, audio bomb, corrupt, not audio), the silence rule and
the budgeted plan."""

from __future__ import annotations

import struct
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from edgevlm.audio import (
    SAMPLE_RATE,
    AudioLimits,
    SilenceSplitter,
    iter_samples,
    kept_spans,
    plan_audio,
    probe,
)
from edgevlm.errors import ContextExceeded, InputError

av = pytest.importorskip("av")

RATE = SAMPLE_RATE
WINDOW = 479_680  # the Whisper family's one 30 s mel window (29.98 s)


def whisper_tokens(n: int) -> int:
    return 750 * (1 + (n // 160 + 1) // 3000)  # qwen2a: 750 per window, mtmd's own count


def speechlike(seconds: float, rate: int = RATE, seed: int = 0, f0: float = 150.0) -> np.ndarray:
    """Voiced 'syllables': harmonics of f0 plus a little noise, loudness rising and falling 4
    times a second (never to zero for 1 s), about -18 dBFS."""
    t = np.arange(round(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    voice = sum(np.sin(2 * np.pi * f0 * k * t + k) / k for k in range(1, 6))
    env = 0.25 + 0.75 * np.abs(np.sin(2 * np.pi * 2.0 * t))
    x = 0.12 * env * voice + 0.01 * rng.standard_normal(t.size)
    return x.astype(np.float32)


def with_pauses(parts: list[tuple[str, float]], rate: int = RATE, noise_db: float | None = None) -> np.ndarray:
    """('s', seconds) of speech or ('-', seconds) of silence, in order; ``noise_db``: background
    noise over the whole at that RMS level (None: digital silence in the pauses)."""
    out = [
        speechlike(d, rate, seed=i) if kind == "s" else np.zeros(round(d * rate), np.float32)
        for i, (kind, d) in enumerate(parts)
    ]
    x = np.concatenate(out)
    if noise_db is not None:
        x = x + (10 ** (noise_db / 20)) * np.random.default_rng(99).standard_normal(x.size).astype(np.float32)
    return x.astype(np.float32)


def write_wave(path: Path, x: np.ndarray, rate: int, channels: int = 1) -> Path:
    pcm = np.clip(x * 32767, -32768, 32767).astype("<i2")
    if channels == 2:
        pcm = np.stack([pcm, pcm], axis=1).reshape(-1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def write_av(path: Path, x: np.ndarray, rate: int, fmt: str, codec: str | None, out_rate: int | None = None,
             video: bool = False, bit_rate: int | None = None) -> Path:  # fmt: skip
    """``x`` (mono float32 at ``rate``) encoded with ``codec`` at ``out_rate``; ``video``: a
    small MPEG-4 picture stream too (10 fps over the same length); ``codec`` None: video only."""
    out_rate = out_rate or rate
    seconds = x.size / rate
    with av.open(str(path), "w", format=fmt) as o:
        if video:
            vs = o.add_stream("mpeg4", rate=10)
            vs.width, vs.height, vs.pix_fmt = 64, 48, "yuv420p"
        frames = []
        if codec:
            st = o.add_stream(codec, rate=out_rate)
            st.layout = "mono"
            if bit_rate:
                st.bit_rate = bit_rate
            cc = st.codec_context
            rs = av.AudioResampler(
                format=cc.format.name, layout="mono", rate=out_rate, frame_size=cc.frame_size or None
            )
            pcm = np.clip(x * 32767, -32768, 32767).astype(np.int16)[None, :]
            src = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            src.sample_rate = rate
            frames = rs.resample(src) + rs.resample(None)
        if video:
            for i in range(max(1, int(seconds * 10))):
                img = np.full((48, 64, 3), (i * 7) % 255, np.uint8)
                for p in vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    o.mux(p)
            for p in vs.encode(None):
                o.mux(p)
        if codec:
            for f in frames:
                for p in st.encode(f):
                    o.mux(p)
            for p in st.encode(None):
                o.mux(p)
    return path


def flac_declaring(path: Path, x: np.ndarray, total_samples: int) -> Path:
    """A FLAC of ``x`` whose STREAMINFO says it has ``total_samples`` (a lying header)."""
    write_av(path, x, RATE, "flac", "flac")
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC"
    assert data[4] & 0x7F == 0  # STREAMINFO first, its fields at byte 8
    word = int.from_bytes(data[18:26], "big")  # rate 20 | channels 3 | bits 5 | total samples 36
    data[18:26] = ((word & ~((1 << 36) - 1)) | total_samples).to_bytes(8, "big")
    path.write_bytes(bytes(data))
    return path


def decode_all(source, name="x", **kw) -> tuple[np.ndarray, list[str]]:
    stream = iter_samples(source, name, **kw)
    x = np.concatenate(list(stream))
    return x, stream.notes


def one_line(exc: pytest.ExceptionInfo[InputError], name: str) -> str:
    text = str(exc.value)
    assert "\n" not in text
    assert text.startswith(f"{name}: ")
    return text


def dominant_hz(x: np.ndarray, rate: int = RATE) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return float(np.argmax(spec) * rate / x.size)


# --- decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fname", "fmt", "codec", "out_rate", "extra"),
    [
        ("s.flac", "flac", "flac", 16000, 0),
        ("s.mp3", "mp3", "libmp3lame", 22050, 0),
        ("s.ogg", "ogg", "libopus", 48000, 0),
        ("s.m4a", "ipod", "aac", 44100, 2048),  # AAC priming and padding: up to two frames more
        ("s.mkv", "matroska", "libopus", 48000, 0),
    ],
)
def test_each_format_decodes_to_its_length_at_16_khz(tmp_path, fname, fmt, codec, out_rate, extra):
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(3 * RATE) / RATE)).astype(np.float32)
    path = write_av(tmp_path / fname, tone, RATE, fmt, codec, out_rate)
    x, notes = decode_all(path, fname)
    assert x.dtype == np.float32
    assert x.ndim == 1
    assert 3 * RATE <= x.size <= 3 * RATE + extra
    assert abs(dominant_hz(x[2000:40000]) - 440) < 2
    assert notes == []
    info = probe(path, fname)
    assert info.has_audio
    assert info.rate == out_rate
    assert info.duration_s == pytest.approx(3.0, abs=0.07)


def test_a_stdlib_wave_at_44_khz_stereo_is_mixed_down_and_resampled(tmp_path):
    tone = (0.3 * np.sin(2 * np.pi * 1000 * np.arange(2 * 44100) / 44100)).astype(np.float32)
    path = write_wave(tmp_path / "st.wav", tone, 44100, channels=2)
    info = probe(path, "st.wav")
    assert (info.container, info.codec, info.rate, info.channels) == ("wav", "pcm_s16le", 44100, 2)
    x, _ = decode_all(str(path), "st.wav")
    assert x.size == 2 * RATE
    assert abs(dominant_hz(x[1000:30000]) - 1000) < 2
    assert float(np.sqrt(np.mean(x[1000:-1000] ** 2))) == pytest.approx(0.3 / np.sqrt(2), rel=0.02)


def test_bytes_and_a_path_give_the_same_samples(tmp_path):
    path = write_av(tmp_path / "b.mp3", speechlike(4.0), RATE, "mp3", "libmp3lame")
    a, _ = decode_all(path, "b.mp3")
    b, _ = decode_all(path.read_bytes(), "b.mp3")
    assert np.array_equal(a, b)


def test_the_audio_track_of_a_video_is_used(tmp_path):
    tone = (0.3 * np.sin(2 * np.pi * 660 * np.arange(2 * RATE) / RATE)).astype(np.float32)
    path = write_av(tmp_path / "clip.mp4", tone, RATE, "mp4", "aac", 44100, video=True)
    with av.open(str(path)) as c:
        assert [s.type for s in c.streams] == ["video", "audio"]
    x, _ = decode_all(path, "clip.mp4")
    assert 2 * RATE <= x.size <= 2 * RATE + 2048
    assert abs(dominant_hz(x[2000:28000]) - 660) < 2


def test_a_video_without_sound_has_no_audio_track(tmp_path):
    path = write_av(tmp_path / "clip.mp4", np.zeros(3 * RATE, np.float32), RATE, "mp4", None, video=True)
    assert not probe(path, "clip.mp4").has_audio
    with pytest.raises(InputError) as e:
        iter_samples(path, "clip.mp4")
    assert one_line(e, "clip.mp4") == "clip.mp4: has no audio track"


@pytest.mark.parametrize("as_bytes", [False, True])
def test_text_and_random_bytes_are_not_audio(tmp_path, as_bytes):
    txt = tmp_path / "x.txt"
    txt.write_text("Meeting notes\nThe quick brown fox jumps over the lazy dog.\n" * 50)
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(np.random.default_rng(1).bytes(20_000))
    for p in (txt, junk):
        with pytest.raises(InputError) as e:
            iter_samples(p.read_bytes() if as_bytes else p, p.name)
        assert one_line(e, p.name).startswith(f"{p.name}: not an audio file PyAV can read (")
    with pytest.raises(InputError, match="no such file"):
        iter_samples(tmp_path / "absent.wav", "absent.wav")
    with pytest.raises(InputError, match="empty file"):
        iter_samples(b"", "empty.wav")


def test_a_truncated_mp3_gives_the_audio_up_to_the_cut_with_a_note(tmp_path):
    path = write_av(tmp_path / "voice.mp3", speechlike(10.0), RATE, "mp3", "libmp3lame")
    full, _ = decode_all(path, "voice.mp3")
    data = path.read_bytes()
    try:
        x, notes = decode_all(data[: len(data) // 2], "voice.mp3")
    except InputError as exc:  # FFmpeg may refuse the last half frame instead: one line then
        assert "\n" not in str(exc)
        assert str(exc).startswith("voice.mp3: corrupt or truncated audio at ")
        return
    assert 3 * RATE < x.size < 7 * RATE
    assert np.array_equal(x[: x.size - 2000], full[: x.size - 2000])  # the audio before the cut, unchanged
    assert len(notes) == 1
    assert notes[0].startswith("voice.mp3: ends at 0:00:0")
    assert "before the 0:00:10 its header says (truncated?)" in notes[0]


def test_a_truncated_flac_is_one_line_naming_where(tmp_path):
    path = write_av(tmp_path / "voice.flac", speechlike(10.0), RATE, "flac", "flac")
    data = path.read_bytes()
    with pytest.raises(InputError) as e:
        decode_all(data[: len(data) // 2], "voice.flac")
    assert one_line(e, "voice.flac").startswith("voice.flac: corrupt or truncated audio at 0:00:0")


def test_a_wav_header_is_never_read_past(tmp_path):
    """A WAV whose data chunk says 1 s with 20 s behind it: FFmpeg's reader stops at the header's
    size, so no more than the declared second comes out (the bomb rule is not even needed)."""
    pcm = (np.clip(speechlike(20.0), -1, 1) * 32767).astype("<i2").tobytes()
    head = b"RIFF" + struct.pack("<I", 36 + 2 * RATE) + b"WAVEfmt "
    head += struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16) + b"data" + struct.pack("<I", 2 * RATE)
    x, _ = decode_all(head + pcm, "lie.wav")
    assert x.size == RATE


def test_a_flac_that_decodes_longer_than_its_header_is_an_audio_bomb(tmp_path):
    path = flac_declaring(tmp_path / "x.flac", speechlike(20.0), RATE * 5)
    assert probe(path, "x.flac").duration_s == 5.0
    got = 0
    with pytest.raises(InputError) as e:
        for block in iter_samples(path, "x.flac"):
            got += block.size
    text = one_line(e, "x.flac")
    assert text.startswith("x.flac: decodes to more than its header's 0:00:05 (stopped at 0:00:06.")
    assert 5 * RATE < got <= (5 * 1.05 + 1) * RATE  # stopped right at the slack, not at 20 s


def test_a_file_declaring_ten_hours_is_refused_before_decoding(tmp_path):
    path = flac_declaring(tmp_path / "talk.flac", speechlike(2.0), RATE * 36_000)
    held: list[int] = []
    t0 = time.perf_counter()
    with pytest.raises(InputError) as e:
        iter_samples(path, "talk.flac", hold=held.append)  # raised on opening: not a sample decoded
    assert time.perf_counter() - t0 < 5
    assert held == []
    assert one_line(e, "talk.flac") == (
        "talk.flac: lasts 10:00:00, more than the 3:00:00 this accepts (--max-audio-seconds)"
    )


def test_decoding_stops_at_max_seconds_when_the_header_says_nothing(tmp_path):
    """A WAV streamed with unknown sizes (0xFFFFFFFF): the limit is counted on the samples."""
    pcm = (speechlike(6.0) * 32767).astype("<i2").tobytes()
    head = b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
    head += struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF)
    x, _ = decode_all(head + pcm, "s.wav")
    assert x.size == 6 * RATE
    with pytest.raises(InputError) as e:
        decode_all(head + pcm, "s.wav", limits=AudioLimits(max_seconds=4.0, slack_s=100.0))
    assert "more than the 0:00:04 this accepts" in one_line(e, "s.wav")


@pytest.mark.parametrize("kind", ["flac", "opus", "stereo-wav"])
def test_the_decoder_is_leased_once_before_the_first_block_for_its_largest_frame(tmp_path, kind):
    if kind == "stereo-wav":
        path = write_wave(tmp_path / "h.wav", speechlike(2.0, 44100), 44100, channels=2)
    else:
        codec = {"flac": "flac", "opus": "libopus"}[kind]
        path = write_av(
            tmp_path / f"h.{kind}", speechlike(2.0), RATE, "ogg" if kind == "opus" else "flac", codec, 48000
        )
    events: list[object] = []
    stream = iter_samples(path, path.name, hold=lambda n: events.append(("hold", n)))
    assert events == []  # nothing yet: the lease is taken when decoding starts
    for block in stream:
        events.append(block.size)
    assert events[0] == ("hold", stream.hold_bytes)
    assert sum(1 for e in events if isinstance(e, tuple)) == 1
    with av.open(str(path)) as c:  # the largest decoded frame, measured independently
        largest = max(f.samples * len(f.layout.channels) * f.format.bytes for f in c.decode(audio=0))
    biggest_block = max(e for e in events if isinstance(e, int))
    assert stream.hold_bytes >= largest + biggest_block * 4 * (1 + stream.info.channels)


# --- silence -------------------------------------------------------------------------------------

PAUSED = [("s", 3.0), ("-", 2.0), ("s", 1.0), ("-", 0.5), ("s", 1.5), ("-", 3.0)]
# kept: 0–3 s speech + 0.125 s of the 2 s pause, 0.125 s before 5 s, 5–8 s (its 0.5 s pause kept
# whole), then 0.125 s of the trailing pause
PAUSED_SPANS = [(0, round(3.125 * RATE)), (round(4.875 * RATE), round(8.125 * RATE))]


@pytest.mark.parametrize("noise_db", [None, -42.0])
def test_long_pauses_are_dropped_keeping_a_short_gap(noise_db):
    x = with_pauses(PAUSED, noise_db=noise_db)
    assert kept_spans(x, RATE) == PAUSED_SPANS


def test_leading_silence_keeps_only_the_gap_before_speech():
    x = with_pauses([("-", 2.0), ("s", 1.0)])
    assert kept_spans(x, RATE) == [(round(1.875 * RATE), 3 * RATE)]


def test_the_silence_rule_does_not_depend_on_block_sizes():
    x = with_pauses(PAUSED + [("s", 0.73), ("-", 1.01), ("s", 0.3)], noise_db=-50.0)[:-37]
    whole = kept_spans(x, RATE)
    assert len(whole) == 4  # the trailing 3 s and the 1.01 s pauses dropped too
    rng = np.random.default_rng(5)
    for block in (1, 7, 319, 320, 333, 576, 1024, 1152, 4096, 16000, 479_680):
        assert kept_spans(x, RATE, block=block) == whole, block
    # ragged blocks, as a decoder hands them out
    s, raw, i = SilenceSplitter(RATE), [], 0
    while i < x.size:
        n = int(rng.integers(1, 3000))
        raw += s.feed(x[i : i + n])
        i += n
    raw += s.finish()
    joined: list[tuple[int, int]] = []
    for a, b in raw:
        joined = [*joined[:-1], (joined[-1][0], b)] if joined and joined[-1][1] == a else [*joined, (a, b)]
    assert joined == whole


# --- the plan ------------------------------------------------------------------------------------


def test_a_mostly_silent_recording_costs_far_fewer_tokens_than_speech(tmp_path):
    speech = write_av(tmp_path / "talk.flac", speechlike(120.0), RATE, "flac", "flac")
    quiet_x = with_pauses([("-", 20.0), ("s", 4.0), ("-", 40.0), ("s", 6.0), ("-", 50.0)], noise_db=-60.0)
    quiet = write_av(tmp_path / "quiet.flac", quiet_x, RATE, "flac", "flac")
    p1, pieces1 = plan_audio(speech, "talk.flac", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=None)
    p2, pieces2 = plan_audio(quiet, "quiet.flac", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=None)
    assert (p1.total_tokens, len(pieces1)) == (5 * 750, 5)  # 120 s / 29.98 s: four windows and a bit
    assert (p2.total_tokens, len(pieces2)) == (750, 1)
    assert p2.speech_s == pytest.approx(10.0 + 0.125 + 0.25 + 0.125, abs=0.02)
    assert p2.silence_dropped_s == pytest.approx(120.0 - p2.speech_s, abs=0.01)
    assert p2.notes == ("kept 0:11 of speech from 2:00 (1:50 silence dropped)",)  # 10.5 s
    assert pieces2[0].label == "[0:19.9–0:24.1, 1:03.9–1:10.1]"
    assert p2.to_dict()["pieces"][0]["spans"] == [[19.875, 24.125], [63.875, 70.125]]
    assert not p1.cut
    assert p1.left_out_s == 0.0


def test_a_budget_cuts_the_recording_and_stops_decoding(tmp_path):
    path = write_av(tmp_path / "talk.mp3", speechlike(180.0), RATE, "mp3", "libmp3lame", bit_rate=32000)
    held: list[int] = []
    plan, pieces = plan_audio(
        path, "talk.mp3", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=1600, hold=held.append
    )
    assert [p.tokens for p in pieces] == [750, 750]
    assert [p.samples.size for p in pieces] == [WINDOW, WINDOW]
    assert plan.cut
    assert plan.total_tokens == 1500
    assert plan.left_out_s == pytest.approx(180.0 - 2 * WINDOW / RATE, abs=0.05)
    assert plan.decoded_s < 2 * WINDOW / RATE + 1.0  # decoding went no further than the cut
    assert plan.duration_s == pytest.approx(180.0, abs=0.1)  # the header's: not decoded
    assert plan.notes[-1] == "cut to the 1,600-token budget: 2:00 not sent (0:00–1:00 kept)"
    assert [p.spans for p in pieces] == [((0.0, 29.98),), ((29.98, 59.96),)]
    assert [p.label for p in pieces] == ["[0:00.0–0:30.0]", "[0:30.0–1:00.0]"]
    assert len(held) == 1
    assert held[0] >= 2 * WINDOW * 4  # the lease covers the two pieces the budget lets it keep


def test_a_budget_below_one_piece_is_context_exceeded(tmp_path):
    with pytest.raises(ContextExceeded) as e:
        plan_audio(
            tmp_path / "voice.mp3", "voice.mp3", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=200
        )
    assert str(e.value) == "voice.mp3: one 29.98 s piece costs 750 tokens but only 200 are left"


def test_pieces_are_windows_in_order_and_the_same_audio_hashes_the_same(tmp_path):
    x = speechlike(70.0)
    wav = write_wave(tmp_path / "a.wav", x, RATE)
    flac = write_av(tmp_path / "a.flac", x, RATE, "flac", "flac")
    plans = [
        plan_audio(p, p.name, window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=None)
        for p in (wav, flac, wav)
    ]
    (pw, aw), (pf, af), (pw2, aw2) = plans
    assert [p.samples.size for p in aw] == [WINDOW, WINDOW, 70 * RATE - 2 * WINDOW]
    assert [p.spans for p in aw] == [
        ((0.0, 29.98),),
        ((29.98, 59.96),),
        ((59.96, 70.0),),
    ]
    assert [p.label for p in aw] == ["[0:00.0–0:30.0]", "[0:30.0–1:00.0]", "[1:00.0–1:10.0]"]
    assert np.array_equal(np.concatenate([p.samples for p in aw]), decode_all(wav, "a.wav")[0])
    assert [p.sha256 for p in aw] == [p.sha256 for p in af] == [p.sha256 for p in aw2]
    assert aw == aw2  # same file, same plan: pieces compare by spans, tokens and digest
    assert pw.to_dict() == pw2.to_dict()
    assert len({p.sha256 for p in aw}) == 3


def test_keep_silence_sends_everything(tmp_path):
    x = with_pauses([("s", 2.0), ("-", 5.0), ("s", 2.0)])
    path = write_av(tmp_path / "k.flac", x, RATE, "flac", "flac")
    kept, pieces = plan_audio(
        path, "k.flac", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=None, keep_silence=True
    )
    assert kept.speech_s == 9.0
    assert kept.rule == "none: silence kept"
    assert pieces[0].spans == ((0.0, 9.0),)
    dropped, pieces = plan_audio(path, "k.flac", window_samples=WINDOW, tokens_for=whisper_tokens, budget_tokens=None)
    assert dropped.speech_s == 4.25  # 2 s, a 0.25 s gap for the 5 s pause, 2 s
    assert "1 s or more dropped" in dropped.rule


def test_a_length_proportional_cost_fills_the_budget_with_a_shorter_last_piece(tmp_path):
    """An lfm2a-like encoder (about 12.5 tokens a second, one chunk): the budget takes a shorter
    last piece rather than none."""
    path = write_av(tmp_path / "p.flac", speechlike(24.0), RATE, "flac", "flac")
    per_s = lambda n: -(-n * 25 // (2 * RATE))  # ceil(12.5 tokens per second)
    plan, pieces = plan_audio(path, "p.flac", window_samples=8 * RATE, tokens_for=per_s, budget_tokens=250)
    assert [p.samples.size for p in pieces] == [8 * RATE, 8 * RATE, 4 * RATE]
    assert plan.total_tokens == 250
    assert plan.cut
    assert plan.left_out_s == pytest.approx(4.0, abs=0.01)
