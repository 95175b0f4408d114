"""The audio encoder on a real ggml device (``pytest -m gpu``; skipped on a CPU-only build, like
tests/test_gpu.py): with the projector on the first GPU, the buffers the audio clip context
reserves — on the device, and the host buffer that holds the mel frames — equal the planner's
Whisper replay scheduled for that device; mtmd's warm-up is off (as edgevlm loads it), so they
are reserved, and logged, at the first encode and not at load; ``edgevlm chat --audio`` on the
device sends what ``edgevlm budget`` counts, and reserves what ``edgevlm plan`` says.

The "real" presets without flash attention put each block's 1500² score matrix (171.66 MiB) past
lavapipe's 128 MiB tensor limit: ggml's scheduler runs those nodes on the CPU and the rest on the
device, the case where the device variant differs from the CPU replay."""

from __future__ import annotations

import json
import re

import pytest

from edgevlm.backend.system import ggml_devices
from edgevlm_testkit.child import measured_in_child
from edgevlm_testkit.gpu_measure import clip_reserves
from edgevlm_testkit.sounds import write_wav

from .conftest import run_cli

GPUS = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no GPU in this llama.cpp build (scripts/gpu_check.py [--vulkan] --tests)"),
]
MIB = 2**20
ROUND = 0.005 * MIB  # llama.cpp logs MiB with two decimals


def close(predicted: int, logged_mib: float) -> bool:
    return abs(predicted - logged_mib * MIB) <= ROUND


# the real presets with flash attention run wholly on the device, as the tiny ones do (and take a
# minute of lavapipe each): only their split case (no flash attention) is run
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("preset", "fa"), [("tiny", True), ("tiny", False), ("real", False)], ids=["tiny-fa", "tiny-nofa", "real-nofa"]
)
@pytest.mark.parametrize("family", ["ultravox", "qwen25o"])
def test_audio_buffers_on_the_device_are_the_plans_at_the_first_encode(model_pair, family, preset, fa):
    pair = model_pair(family, preset)
    got = measured_in_child(
        "edgevlm_testkit.gpu_measure:audio_on_device", model=str(pair.model), mmproj=str(pair.mmproj), flash_attn=fa
    )
    name = GPUS[0].name
    assert got["gpu"] == name
    assert got["clip_on"], "mtmd logged no clip backend"
    assert set(got["clip_on"]) == {name}, got["clip_on"]  # every clip context on the device
    assert got["at_load"] == [], got["at_load"]  # warm-up off: nothing reserved before the first encode
    logged = dict(got["at_first_encode"])
    assert len(got["at_first_encode"]) == 2, got["at_first_encode"]  # the audio context's two buffers
    assert set(logged) == {name, "CPU"}, got["at_first_encode"]
    assert close(got["predicted_gpu"], logged[name]), (got["predicted_gpu"] / MIB, logged[name])
    assert close(got["predicted_host"], logged["CPU"]), (got["predicted_host"] / MIB, logged["CPU"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["ultravox", "qwen25o"])
def test_chat_hears_on_the_device_what_budget_counts_and_plan_reserves(model_pair, family, tmp_path):
    """A real ``edgevlm chat --audio --ngl -1 -v`` turn: the encoder runs on the device, the turn
    sends ``budget``'s tokens, and the audio buffer reserved at its first encode (the only clip
    reserve: no picture) is ``plan``'s ``audio_encoder_bytes`` for the same flags."""
    pair = model_pair(family)
    wav = write_wav(tmp_path / "speech45.wav", [("speech", 45)])
    args = ["--model", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "-1"]
    budget = run_cli("budget", str(wav), "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--json")
    assert budget.returncode == 0, budget.stderr
    want = json.loads(budget.stdout)["total_tokens"]
    chat = run_cli("chat", *args, "--audio", str(wav), "What is said?", "-n", "4", "--temp", "0", "--json", "-v")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "Traceback" not in chat.stderr
    stats = json.loads(chat.stdout.strip().splitlines()[-1])["stats"]
    assert stats["audio_tokens"] == want > 0
    name = GPUS[0].name
    assert re.search(rf"CLIP using {name} backend", chat.stderr)
    on_device = [mib for buf, mib in clip_reserves(chat.stderr.splitlines()) if buf == name]
    plan = run_cli("plan", *args, "--json")
    assert plan.returncode == 0, plan.stderr
    p = json.loads(plan.stdout)
    assert p["mmproj_on_gpu"]
    assert len(on_device) == 1, on_device
    assert close(p["audio_encoder_bytes"], on_device[0]), (p["audio_encoder_bytes"] / MIB, on_device)
