"""The scheduler replay behind the GPU plan, checked on the CPU-only machine against numbers
llama.cpp's Vulkan backend logged on Mesa's software device (``~llama_context: ... compute
buffer size is X MiB``, four decimals): the device's facts are injected through the same
``Device`` the real probe fills. ``tests/test_vulkan.py`` checks the same on the device itself.
"""

from __future__ import annotations

import pytest

from edgevlm.model.gguf_info import read_gguf
from edgevlm.plan.devices import Device, Probe
from edgevlm.plan.footprint import Config, Footprint, Wishes

MIB = 2**20
GIB = 2**30
# Vulkan0 as the probe reads lavapipe (Mesa 22.3.6): 16-byte alignment, 1 GiB buffers, ops on
# tensors up to maxStorageBufferRange (128 MiB), pinned host buffers (Vulkan_Host, 64-byte aligned)
LAVAPIPE = Device(
    "Vulkan0", "llvmpipe", "gpu", 2 * GIB, 2 * GIB, False, "ggml",
    align=16, max_alloc=GIB, max_tensor=128 * MIB, host_buffer="Vulkan_Host", host_align=64,
)  # fmt: skip
HOST = Device("CPU", "host", "cpu", 64 * GIB, 64 * GIB, True, "what-if")


def predict(pair, ngl: int | None, n_ctx: int, kv: str, ub: int, repack: bool = False):
    fp = Footprint(read_gguf(pair.model), read_gguf(pair.mmproj), Probe((LAVAPIPE, HOST)), Wishes(), repack=repack)
    n = fp.text.n_layer + 1 if ngl is None else ngl
    cfg = Config(n, n_ctx, kv, kv, True, False, 0, max(512, ub), ub)
    gpu, host = fp.predict(cfg)
    return gpu, host


# (family, preset, GPU layers (None: all), n_ctx, KV, n_ubatch) → logged MiB: Vulkan0 compute, Vulkan_Host compute
LOGGED = [
    ("llava15", "tiny", None, 1024, "f16", 512, 3.0117, 1.5137),
    ("llava15", "tiny", 1, 1024, "f16", 512, 3.2500, 1.5137),  # only the output layer on the device
    ("llava15", "tiny", 2, 1024, "f16", 512, 3.0107, 1.5137),
    ("llava15", "tiny", 2, 1024, "q8_0", 64, 0.4543, 0.1892),
    ("llava15", "tiny", None, 4096, "q8_0", 128, 1.5029, 1.1284),
    ("qwen2vl", "tiny", None, 1024, "f16", 512, 3.0176, 1.5196),
    ("qwen2vl", "tiny", None, 2560, "f16", 256, 2.2588, 1.5098),
    ("llava15", "real", None, 4096, "f16", 512, 84.5117, 20.0137),  # 100.5 in the graph's own node order
    ("llava15", "real", None, 4096, "q8_0", 128, 23.2061, 5.0816),
    ("llava15", "real", None, 16384, "q8_0", 512, 96.5898, 32.0918),
    ("qwen2vl", "real", None, 4096, "f16", 512, 62.5176, 302.7520),  # the logits stay on the host
    ("qwen2vl", "real", None, 8192, "q8_0", 128, 200.1289, 3.5830),  # ... unless offloaded with a copy
]


@pytest.mark.parametrize("family,preset,ngl,n_ctx,kv,ub,device_mib,host_mib", LOGGED)
def test_compute_buffers_match_what_vulkan_logged(model_pair, family, preset, ngl, n_ctx, kv, ub, device_mib, host_mib):
    gpu, host = predict(model_pair(family, preset), ngl, n_ctx, kv, ub)
    assert abs(gpu.compute / MIB - device_mib) < 1e-4 and abs(host.compute / MIB - host_mib) < 1e-4


def test_a_tied_output_the_device_refuses_stays_on_the_host(model_pair):
    """Qwen2-VL's tied 151,936-row output: llama.cpp logs "offloading output layer to GPU", the
    device refuses its 297 MiB of logits, and the copy of token_embd stays in host memory."""
    gpu, host = predict(model_pair("qwen2vl", "real"), None, 4096, "f16", 512)
    assert abs(gpu.weights / MIB - 50.25) < 0.006 and abs(host.weights / MIB - 125.19) < 0.006
    roomy = Device(*[getattr(LAVAPIPE, f) for f in ("name", "description", "kind", "free_bytes", "total_bytes")])
    fp = Footprint(read_gguf(model_pair("qwen2vl", "real").model), None, Probe((roomy, HOST)), Wishes(), repack=False)
    g2, h2 = fp.predict(Config(fp.text.n_layer + 1, 4096, "f16", "f16", True, False, 0, 512, 512))
    assert g2.weights > gpu.weights + 100 * MIB and h2.compute < host.compute / 10  # no limit: all on the device


# CUDA0 as the probe reads it (an H200, CUDA 13.0): 128-byte buffers without a size limit, no
# tensor limit, pinned host buffers (CUDA_Host)
H200 = Device("CUDA0", "NVIDIA H200", "gpu", 139 * GIB, 140 * GIB, True, "ggml", host_buffer="CUDA_Host")
# (preset, GPU layers, n_ctx, KV, n_ubatch) → bytes llama.cpp logged (two decimals of MiB): device
# compute, host weights, host compute — docs/results/gpu-check-*.json, with the CPU's extra buffer
# types on and off alike
PART_LOGGED = [
    (LAVAPIPE, "llava15", 1, 1024, "f16", 512, 105056829, 301465600, 26224886),
    (H200, "llava15", 1, 1024, "f16", 512, 130222653, 301465600, 26224886),
    (H200, "llava15", 2, 4096, "f16", 512, 105056829, 187600732, 29370614),
]


@pytest.mark.parametrize("repack", [True, False], ids=["cpu-repacks", "no-repack"])
@pytest.mark.parametrize("dev,family,ngl,n_ctx,kv,ub,dev_compute,host_weights,host_compute", PART_LOGGED)
def test_host_layers_beside_a_gpu_are_placed_as_llama_cpp_places_them(
    model_pair, repack, dev, family, ngl, n_ctx, kv, ub, dev_compute, host_weights, host_compute
):
    """Part of the layers on the device: llama.cpp offers the host's weights the GPU's pinned host
    type before the CPU's repacked one, so they stay mapped and the device multiplies them for
    large batches (their copies in its compute buffer) — whether or not the CPU repacks. A plan
    that counted them repacked was 30 % under on the device and 3.3x over on the host."""
    pair = model_pair(family, "real")
    fp = Footprint(read_gguf(pair.model), read_gguf(pair.mmproj), Probe((dev, HOST)), Wishes(), repack=repack)
    gpu, host = fp.predict(Config(ngl, n_ctx, kv, kv, True, False, 0, 512, ub))
    rounding = 0.006 * MIB
    assert abs(gpu.compute - dev_compute) < rounding and abs(host.compute - host_compute) < rounding
    assert abs(host.weights - host_weights) < 2 * rounding  # the mapped and (none) repacked buffers


def test_no_layer_on_the_gpu_repacks_as_a_cpu_build_does(model_pair):
    """``--ngl 0``: the backend keeps GPUs out of the text model (``main_gpu`` -1), so the host's
    weights are those of a CPU-only plan, repacked where the CPU repacks, and no device compute."""
    pair = model_pair("llava15", "real")
    cfg = Config(0, 4096, "f16", "f16", True, False, 0, 512, 512)
    alone = Footprint(read_gguf(pair.model), None, Probe((HOST,)), Wishes(), repack=True).predict(cfg)[-1]
    gpu, host = Footprint(read_gguf(pair.model), None, Probe((H200, HOST)), Wishes(), repack=True).predict(cfg)
    assert gpu.compute == gpu.weights == 0 and (host.weights, host.compute) == (alone.weights, alone.compute)


def test_an_attention_cuda_cannot_run_goes_to_the_cpu(model_pair):
    """ggml-cuda's flash attention is built for head sizes 40-256 (ggml_cuda_get_best_fattn_kernel);
    the tiny Qwen2-VL pair's 32-wide heads are not among them, so ggml's scheduler runs those
    attentions on the CPU and copies their inputs there. Logged on an H200 (ctx 2048, q8_0 KV,
    micro-batch 128, 2 of 3 layers on CUDA0): CUDA0 650,117 bytes, host 1,006,633; the replay
    without the rule said 1,074,176 and 660,480 (+65 %, -34 %)."""
    pair = model_pair("qwen2vl")
    fp = Footprint(read_gguf(pair.model), read_gguf(pair.mmproj), Probe((H200, HOST)), Wishes(), repack=False)
    gpu, host = fp.predict(Config(2, 2048, "q8_0", "q8_0", True, True, 256, 512, 128))
    # both within the log's two decimals: CUDA0 0.625 MiB predicted, "0.62 MiB" logged
    assert abs(host.compute - 1006633) < 0.006 * MIB and abs(gpu.compute - 650117) < 0.006 * MIB


def test_a_quantized_weight_is_padded_to_cudas_row_padding():
    """ggml-cuda's ``get_alloc_size``: a quantized weight whose rows are not a multiple of 512
    values takes the rest of one such row more, and each tensor starts at the buffer's alignment
    (128) — by ggml's arithmetic for a 64×64 Q8_0 weight (34-byte blocks of 32 values)."""
    from edgevlm.plan.estimate import WeightTensor
    from edgevlm.plan.offload import device_tensor_bytes

    w = WeightTensor("blk.0.attn_q.weight", 64 * 64 // 32 * 34, 0, 0, False, (64, 64), "Q8_0")
    cuda = Device("CUDA0", "what-if", "gpu", 8 << 30, 8 << 30, align=128)
    vulkan = Device("Vulkan0", "what-if", "gpu", 8 << 30, 8 << 30, align=64)
    assert device_tensor_bytes(w, cuda) == 4864  # 4352 + 448 values' 476 bytes = 4828, aligned to 128
    assert device_tensor_bytes(w, vulkan) == 4352  # no row padding; 4352 is a multiple of 64
    f16 = WeightTensor("blk.0.attn_norm.weight", 64 * 2, 0, 0, False, (64,), "F16")
    assert device_tensor_bytes(f16, cuda) == 128  # not quantized: only aligned
    wide = WeightTensor("blk.0.ffn_up.weight", 4096 * 64 // 32 * 34, 0, 0, False, (4096, 64), "Q8_0")
    assert device_tensor_bytes(wide, cuda) == wide.n_bytes  # rows of 4096: nothing to pad


def test_the_weights_on_a_cuda_device_are_what_llama_cpp_logged_on_an_h200(model_pair):
    """Every layer of the tiny Qwen2-VL pair on CUDA0: llama.cpp logged a 0.24 MiB model buffer
    on an H200 (the device tests, 2026-12-04); the plan, padding and alignment included, rounds
    to it — without the row padding it was 0.23."""
    from edgevlm.plan.devices import probe
    from edgevlm.plan.planner import Wishes as PlanWishes
    from edgevlm.plan.planner import make_plan

    pair = model_pair("qwen2vl")
    plan = make_plan(str(pair.model), str(pair.mmproj), probe(free_memory=["CUDA0=8GiB"]), PlanWishes(n_ctx=1024))
    (cuda,) = [d for d in plan.devices if d.name == "CUDA0"]
    assert round(cuda.predicted.weights / 2**20, 2) == 0.24
