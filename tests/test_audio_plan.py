"""The audio encoder in the plan, against real llama.cpp on the generated audio pairs (an
audio-only Ultravox file; a Qwen2.5-Omni file with a vision and an audio encoder): the Whisper
graph replay equals the compute buffer the audio clip context reserves (its own, beside the
vision context's), with flash attention on and off; a plan counts the projector's weights once
(both contexts log the whole file) and both contexts' compute buffers; an audio-only projector
plans from the real CLI with no vision compute; the runtime guard admits a recording against
the context left and, until the audio buffer is allocated, the memory free now."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import llama_cpp
import pytest
from llama_cpp import mtmd_cpp

from edgevlm.backend import logs, system
from edgevlm.errors import ContextExceeded, MemoryBusy
from edgevlm.model.audio import window_tokens
from edgevlm.model.gguf_info import projector_info, read_gguf
from edgevlm.plan.devices import Device, Probe
from edgevlm.plan.encoders.whisper import WhisperTensors, whisper_graph
from edgevlm.plan.estimate import audio_compute_bytes
from edgevlm.plan.footprint import Wishes
from edgevlm.plan.guard import SAFETY, Guard
from edgevlm.plan.planner import Planner

from .conftest import run_cli

MIB = 2**20
GIB = 2**30
ROUND = 0.005 * MIB  # llama.cpp logs MiB with two decimals
# mtmd's warm-up picture for the Qwen2.5-VL half of a qwen2.5o file: 1288² → 46² tokens
QWEN25_WARMUP_TOKENS = 46 * 46
_SIZE = re.compile(r"reserve_compute_meta:\s+CPU compute buffer size =\s+([0-9.]+) MiB")
_NODES = re.compile(r"reserve_compute_meta: graph splits = \d+, nodes = (\d+)")
_MODEL = re.compile(r"load_hparams: model size:\s+([0-9.]+) MiB")


@dataclass(frozen=True)
class ClipLog:
    """What mtmd logged at load (warm-up on), per clip context: compute MiB, graph nodes."""

    vision: tuple[float, int] | None
    audio: tuple[float, int] | None
    model_sizes: tuple[float, ...]  # one "model size" line per context


@functools.cache
def clip_log(model: str, mmproj: str, flash_attn: bool) -> ClipLog:
    """Load the pair's projector in mtmd (the text model vocabulary only) with the warm-up on,
    which reserves each context's buffer for its warm-up input (audio: a 3000-frame window)."""
    system.install_log_sink()
    with logs.capture() as lines:
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        lm = llama_cpp.llama_model_load_from_file(model.encode(), mp)
        assert lm
        cp = mtmd_cpp.mtmd_context_params_default()
        cp.use_gpu = False
        cp.n_threads = 2
        cp.warmup = True
        cp.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx = mtmd_cpp.mtmd_init_from_file(mmproj.encode(), lm, cp)
        assert ctx, "mtmd could not load the projector"
        assert mtmd_cpp.mtmd_support_audio(ctx)
        mtmd_cpp.mtmd_free(ctx)
        llama_cpp.llama_model_free(lm)
    # the vision context loads first (clip_init); the audio context's lines follow its hparams
    per: dict[str, list[float | int]] = {"vision": [], "audio": []}
    modality, sizes = "vision", []
    for line in lines:
        if "--- audio hparams ---" in line:
            modality = "audio"
        if m := _SIZE.search(line):
            per[modality] = [float(m.group(1))]
        elif (m := _NODES.search(line)) and per[modality]:
            per[modality].append(int(m.group(1)))
        elif m := _MODEL.search(line):
            sizes.append(float(m.group(1)))
    v, a = per["vision"], per["audio"]
    return ClipLog((float(v[0]), int(v[1])) if v else None, (float(a[0]), int(a[1])) if a else None, tuple(sizes))


def host(free: int = 20 * GIB) -> Device:
    return Device("CPU", "test host", "cpu", free, 32 * GIB, True, "what-if")


def close(predicted: int, logged_mib: float) -> bool:
    return abs(predicted - logged_mib * MIB) <= ROUND


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
@pytest.mark.parametrize("preset", ["tiny", "real"])
@pytest.mark.parametrize("family", ["ultravox", "qwen25o"])
def test_whisper_replay_equals_the_audio_contexts_reserve(model_pair, family, preset, fa):
    """The replay of the Whisper graph (3000 frames, 1500 positions, the projector's tail) gives
    the audio context's ``reserve_compute_meta`` buffer, node for node."""
    pair = model_pair(family, preset)
    gf = read_gguf(pair.mmproj)
    audio = projector_info(gf).audio
    assert audio is not None
    t = WhisperTensors.from_gguf(gf)
    got = clip_log(str(pair.model), str(pair.mmproj), fa)
    assert got.audio is not None, "the audio context logged no compute buffer"
    logged_mib, nodes = got.audio
    predicted = audio_compute_bytes(audio, fa, t)
    assert close(predicted, logged_mib), (predicted / MIB, logged_mib)
    assert len(whisper_graph(audio, fa, t).nodes) == nodes


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
@pytest.mark.parametrize("family", ["ultravox", "qwen25o"])
def test_plan_counts_the_file_once_and_both_contexts_buffers(model_pair, family, fa):
    """The plan's encoder line on the host: the projector's weights as the whole file that each
    context logs (the same number twice for a mixed file, counted once), and its compute as the
    sum of every clip context's reserve (a mixed file's vision buffer at mtmd's warm-up picture);
    the plan names the audio encoder and its buffer."""
    pair = model_pair(family)
    proj = projector_info(read_gguf(pair.mmproj))
    got = clip_log(str(pair.model), str(pair.mmproj), fa)
    tokens = QWEN25_WARMUP_TOKENS if proj.has_vision_encoder else None
    planner = Planner(
        read_gguf(pair.model),
        read_gguf(pair.mmproj),
        Probe((host(),)),
        Wishes(flash_attn=fa, image_tokens=tokens, n_ctx=4096),
    )
    plan = planner.plan()
    assert plan.fits
    b = plan.devices[-1].predicted
    assert len(got.model_sizes) == (2 if proj.has_vision_encoder else 1)
    assert len(set(got.model_sizes)) == 1  # both contexts log the whole file
    assert close(b.mmproj_weights, got.model_sizes[0]), (b.mmproj_weights / MIB, got.model_sizes)
    assert got.audio is not None
    logged = got.audio[0] + (got.vision[0] if got.vision is not None else 0.0)
    assert (got.vision is not None) == proj.has_vision_encoder
    assert abs(b.mmproj_compute - logged * MIB) <= 2 * ROUND, (b.mmproj_compute / MIB, logged)
    assert proj.audio is not None
    assert plan.audio_encoder == proj.audio.projector_type
    assert close(plan.audio_encoder_bytes, got.audio[0])


def test_an_audio_only_projector_plans_from_the_cli(model_pair):
    """``edgevlm plan`` on the Ultravox pair (no vision encoder: image size 0): no image budget,
    no vision compute, the audio encoder's buffer as its own line; ``--explain`` names it."""
    pair = model_pair("ultravox")
    args = ("plan", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--free-memory", "cpu=16GiB")
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    audio = projector_info(read_gguf(pair.mmproj)).audio
    assert audio is not None
    want = audio_compute_bytes(audio, d["flash_attn"], WhisperTensors.from_gguf(read_gguf(pair.mmproj)))
    assert (d["audio_encoder"], d["audio_encoder_bytes"]) == ("ultravox", want)
    assert d["image_max_tokens"] == 0
    assert d["max_images_in_context"] == 0
    cpu = d["devices"][-1]["predicted"]
    assert cpu["mmproj_compute"] == want  # the audio encoder's buffer, and no vision encoder's
    r = run_cli(*args, "--explain")
    assert r.returncode == 0, r.stderr
    assert "audio encoder" in r.stdout
    assert "no vision encoder" in r.stdout


def test_guard_admits_a_recording_against_context_and_memory(model_pair):
    """``admit_audio``: too many tokens for the cells left → ContextExceeded; the audio buffer
    not allocated yet and not fitting the memory free now → MemoryBusy; once admitted its buffer
    counts as reserved and a later recording needs no memory check."""
    pair = model_pair("ultravox")
    gf = read_gguf(pair.mmproj)
    proj = projector_info(gf)
    assert proj.audio is not None
    plan = Planner(read_gguf(pair.model), gf, Probe((host(),)), Wishes(n_ctx=4096)).plan()
    need = plan.audio_encoder_bytes
    assert need > 0
    free = [need + SAFETY - 1]  # one byte short
    calls = []

    def measure() -> Probe:
        calls.append(1)
        return Probe((host(free[0]),))

    g = Guard(plan, proj, measure)
    tokens = window_tokens(proj.audio)
    with pytest.raises(ContextExceeded, match="audio: needs"):
        g.admit_audio(tokens, tokens - 1)
    with pytest.raises(MemoryBusy, match="audio: encoding needs"):
        g.admit_audio(tokens, tokens)
    assert g.reserved_audio == 0
    free[0] = need + SAFETY
    assert g.admit_audio(tokens, tokens) == tokens
    assert g.reserved_audio == need
    assert g.reserved_bytes == need
    free[0] = 0
    n = len(calls)
    assert g.admit_audio(2 * tokens, 2 * tokens) == 2 * tokens  # allocated already: no check
    assert len(calls) == n
