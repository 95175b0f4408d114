"""The planner's decisions on injected (what-if) devices, the CLI, and the runtime guard."""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgevlm
from edgevlm.errors import DoesNotFit, InputError
from edgevlm.model.gguf_info import read_gguf
from edgevlm.plan.devices import Device, Probe, parse_size, probe
from edgevlm.plan.footprint import GUARD_SLACK
from edgevlm.plan.guard import SAFETY
from edgevlm.plan.planner import Planner, Wishes, make_plan
from edgevlm.vision.images import from_rgb

from .conftest import run_cli

GiB, MiB = 2**30, 2**20


def host(free=16 * GiB):
    return Device("CPU", "test host", "cpu", free, 32 * GiB, True, "what-if")


def gpu(free, name="CUDA0", known=True):
    return Device(name, "test GPU", "gpu", free, max(free, 8 * GiB), known, "what-if", 256 * MiB)


def plan_for(pair, devices, **wishes):
    return Planner(read_gguf(pair.model), read_gguf(pair.mmproj), Probe(tuple(devices)), Wishes(**wishes)).plan()


@pytest.fixture(scope="module")
def real(model_pair):
    return model_pair("llava15", "real")


def test_parse_size():
    assert parse_size("8GiB") == 8 * GiB and parse_size("8G") == 8 * GiB
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512 MiB") == 512 * MiB
    with pytest.raises(InputError):
        parse_size("eight gigs")


def test_cpu_only_plans_against_ram(model_pair):
    p = plan_for(model_pair("llava15"), [host()])
    assert p.fits and p.n_gpu_layers == 0 and not p.mmproj_on_gpu
    assert [d.kind for d in p.devices] == ["cpu"]
    assert p.devices[0].predicted.total > 0 and p.devices[0].headroom_bytes > 0


def test_roomy_gpu_takes_everything(real):
    p = plan_for(real, [gpu(8 * GiB), host()])
    assert p.fits and p.n_gpu_layers == 3 and p.mmproj_on_gpu
    assert (p.type_k, p.type_v) == ("f16", "f16") and p.flash_attn
    g = p.devices[0].predicted
    assert g.weights > 0 and g.kv > 0 and g.compute > 0 and g.mmproj_weights > 0 and g.mmproj_compute > 0
    assert p.max_images_in_context >= 1 and p.image_max_tokens == 576


ORDER = ["context", "kv q8_0", "micro-batch", "image budget", "kv on host", "gpu layers", "encoder", "kv q4_0"]


def test_degradation_order(real):
    """Less and less GPU memory walks the documented order: ctx → q8_0 → micro-batch → layers →
    encoder → q4_0, and every plan says which levers it pulled, in that order."""
    seen = []
    for free in range(1200, 275, -25):
        p = plan_for(real, [gpu(free * MiB), host()])
        seen.append((free, p.n_ctx, p.type_k, p.n_gpu_layers, p.mmproj_on_gpu, p.fits, p.n_ubatch, p))
        pulled = [lv.lever for lv in p.levers]
        assert pulled == sorted(pulled, key=ORDER.index), pulled
        assert all(lv.saved_bytes >= 0 for lv in p.levers)
    ctxs = [s[1] for s in seen]
    first_drop = next(i for i, s in enumerate(seen) if s[1] < ctxs[0] or s[2] != "f16" or s[3] < 3)
    assert seen[first_drop][1] < ctxs[0] and seen[first_drop][3] == 3  # the context shrinks first
    with_encoder = [s[3] for s in seen if s[4]]  # while the encoder stays on the GPU
    assert with_encoder == sorted(with_encoder, reverse=True) and min(s[3] for s in seen) < 3
    assert any(s[2] == "q8_0" for s in seen)
    # the micro-batch is lowered while every layer still fits on the GPU
    assert any(s[6] < 512 and s[3] == 3 for s in seen)
    assert any(not s[4] for s in seen)  # encoder moved to the CPU at some point
    assert all(s[5] for s in seen)  # the host takes what the GPU cannot


def test_refuses_with_shortfall(real):
    p = plan_for(real, [host(300 * MiB)])
    assert not p.fits and p.shortfall_bytes > 0
    msg = next(r for r in p.reasons if r.startswith("does not fit"))
    assert "MiB short on CPU" in msg and "q4_0" in msg


def test_user_values_are_kept_and_checked(real):
    p = plan_for(real, [gpu(600 * MiB), host()], n_ctx=4096, kv="f16", n_gpu_layers=3)
    assert p.n_ctx == 4096 and p.type_k == "f16" and p.n_gpu_layers == 3
    assert not p.fits  # they cannot all fit, and the plan says so instead of changing them
    p2 = plan_for(real, [gpu(8 * GiB), host()], n_ctx=1000)
    assert p2.fits and p2.n_ctx == 1024  # padded like llama.cpp


def test_unknown_free_memory_gets_a_larger_margin(real):
    known = plan_for(real, [gpu(2 * GiB), host()])
    unknown = plan_for(real, [gpu(2 * GiB, known=False), host()])
    assert unknown.devices[0].budget_bytes < known.devices[0].budget_bytes


def test_quantized_kv_needs_flash_attention(real):
    p = plan_for(real, [host()], kv="q8_0", flash_attn=False)
    assert not p.fits and "needs flash attention" in p.refusal
    assert plan_for(real, [host()], kv="q8_0").fits  # flash attention is on by default


def test_dynamic_budget_counts_encoder_at_largest_image(model_pair):
    pair = model_pair("qwen2vl")
    small = plan_for(pair, [host()], image_tokens=256, flash_attn=False)
    big = plan_for(pair, [host()], image_tokens=4096, flash_attn=False)
    assert big.devices[0].predicted.mmproj_compute > 10 * small.devices[0].predicted.mmproj_compute
    assert big.image_max_tokens == 4096


def test_plan_cli_table_and_json(real):
    r = run_cli("plan", "-m", str(real.model), "--mmproj", str(real.mmproj), "--free-memory", "8GiB")
    assert r.returncode == 0, r.stderr
    for word in ("n_gpu_layers", "memory per device", "GPU0", "headroom", "why:"):
        assert word in r.stdout
    r = run_cli("plan", "-m", str(real.model), "--mmproj", str(real.mmproj), "--free-memory", "8GiB", "--json")
    d = json.loads(r.stdout)
    for key in (
        "n_gpu_layers",
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "type_k",
        "type_v",
        "flash_attn",
        "offload_kqv",
        "mmproj_on_gpu",
        "image_max_tokens",
        "max_images_in_context",
        "reasons",
    ):
        assert key in d, key
    dev = d["devices"][0]
    assert {"name", "kind", "free_bytes", "total_bytes"} <= set(dev)
    assert {"weights", "kv", "compute", "mmproj_weights", "mmproj_compute", "total"} <= set(dev["predicted"])
    assert dev["free_bytes"] == 8 * GiB


def test_plan_cli_refusal_exit_code(real):
    r = run_cli(
        "plan", "-m", str(real.model), "--mmproj", str(real.mmproj), "--device", "cpu", "--free-memory", "cpu=300MiB"
    )
    assert r.returncode == 1 and "does not fit" in r.stderr and "MiB short" in r.stderr


def test_chat_refuses_when_nothing_fits(model_pair):
    pair = model_pair("llava15")
    r = run_cli(
        "chat",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--device",
        "cpu",
        "--free-memory",
        "cpu=1MiB",
        "hi",
    )
    assert r.returncode == 1 and "does not fit" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(DoesNotFit):
        edgevlm.load(pair.model, pair.mmproj, device="cpu", free_memory=["cpu=1MiB"])


def test_chat_verbose_prints_the_plan(model_pair, images):
    pair = model_pair("llava15")
    r = run_cli("chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "-v", "--temp", "0", "-n", "2", "hi")
    assert r.returncode == 0 and "memory per device" in r.stderr and "why:" in r.stderr


class Meter:
    """What-if memory for the guard, changed between requests like another app would."""

    def __init__(self, free):
        self.free = free

    def __call__(self):
        return Probe((host(self.free),))


def test_guard_shrinks_a_dynamic_image_when_memory_drops(model_pair):
    pair = model_pair("qwen2vl")
    p = make_plan(str(pair.model), str(pair.mmproj), probe(device="cpu"), Wishes(image_tokens=1024))
    meter = Meter(16 * GiB)
    vlm = edgevlm.load(pair.model, pair.mmproj, plan=p, n_threads=2, measure=meter)
    eng = vlm.conversation()
    big = from_rgb((np.random.default_rng(0).random((896, 896, 3)) * 255).astype(np.uint8), "big.png")
    r1 = eng.chat("one", [big], max_tokens=2, temperature=0)
    assert r1.stats.image_tokens == 1024 and not eng.notices
    eng.reset()
    vlm.guard.reserved_encoder = 0  # as if the encoder had not grown yet
    need = vlm.guard.encoder_bytes(896, 896)
    meter.free = SAFETY + need // 2  # another program took memory: half the growth is free
    r2 = eng.chat("two", [big], max_tokens=2, temperature=0)  # admitted smaller, and runs
    assert r2.stats.image_tokens < 1024 and eng.notices and "reduced to" in eng.notices[0]
    vlm.close()


def test_guard_refuses_fixed_size_image_without_memory(model_pair, images):
    pair = model_pair("llava15")
    meter = Meter(16 * GiB)
    vlm = edgevlm.load(pair.model, pair.mmproj, n_threads=2, measure=meter)
    eng = vlm.conversation()
    meter.free = 0
    with pytest.raises(InputError, match="more memory but only"):
        eng.chat("hi", [images["square"]], max_tokens=2)
    assert eng.messages == []
    meter.free = 16 * GiB
    assert eng.chat("hi", [images["square"]], max_tokens=2, temperature=0).stats.image_tokens == 576
    vlm.close()


# --- the levers that fit more: micro-batch, image budget, host reserve --------------------------


def whole_model(pair, n_layer, n_vision_layer):
    """The generated real-shape pair's headers with all of the real model's layers (planner only)."""
    from edgevlm_testkit.headers import with_layers

    return with_layers(read_gguf(pair.model), n_layer), with_layers(read_gguf(pair.mmproj), n_vision_layer)


def plan_headers(headers, devices, **wishes):
    return Planner(*headers, Probe(tuple(devices)), Wishes(**wishes)).plan()


def before_levers(headers, devices, dynamic=False, **wishes):
    """The order before micro-batch and image budget were levers (both held where they start)."""
    return plan_headers(headers, devices, n_ubatch=512, **({"image_tokens": 1024} if dynamic else {}), **wishes)


def test_a_7b_model_keeps_more_layers_on_small_gpus(real):
    """LLaVA-1.5-7B (32 layers, Q4_0 3.5 GiB, CLIP-L 620 MiB): on a 4 GiB GPU a smaller
    micro-batch keeps a layer more on the GPU; on 6 GiB every layer stays, before and after."""
    headers = whole_model(real, 32, 24)
    four = 4 * GiB + GUARD_SLACK  # 4 GiB for the plan once the guard's slack is set aside
    # (the KV cache held on the GPU: on the host it is a lever of its own, weighed by speed)
    before = before_levers(headers, [gpu(four), host()], kv_offload=True)
    after = plan_headers(headers, [gpu(four), host()], kv_offload=True)
    assert before.fits and after.fits
    assert after.n_gpu_layers > before.n_gpu_layers  # 24 vs 23 of 33 (this GPU keeps 256 MiB)
    assert after.n_ubatch < 512 and "micro-batch" in [lv.lever for lv in after.levers]
    levers = [lv.lever for lv in after.levers]
    assert levers.index("micro-batch") < levers.index("gpu layers")
    six_before = before_levers(headers, [gpu(6 * GiB), host()])
    six_after = plan_headers(headers, [gpu(6 * GiB), host()])
    assert six_before.n_gpu_layers == six_after.n_gpu_layers == 33


def test_a_dynamic_model_lowers_its_image_budget_before_moving_layers(model_pair):
    """Qwen2-VL-2B shapes (28 layers, 152k vocabulary, a 32-block ViT) on a 2 GiB GPU: before, no
    layer fitted; the micro-batch and the image budget bring five back."""
    headers = whole_model(model_pair("qwen2vl", "real"), 28, 32)
    before = before_levers(headers, [gpu(2 * GiB), host()], dynamic=True)
    after = plan_headers(headers, [gpu(2 * GiB), host()])
    assert before.n_gpu_layers == 0 and after.n_gpu_layers >= 5
    assert after.image_max_tokens == 256 and after.n_ubatch == 64
    levers = [lv.lever for lv in after.levers if lv.lever != "kv on host"]  # (weighed with the layers)
    assert levers[: levers.index("gpu layers")][-2:] == ["micro-batch", "image budget"]
    reason = next(r for r in after.reasons if r.startswith("image budget 1024 → 256"))
    assert "floor 256" in reason
    kept = plan_headers(headers, [gpu(2 * GiB), host()], image_tokens=1024)  # a user's budget is kept
    assert kept.image_max_tokens == 1024


def test_host_reserve_is_stated_and_settable(model_pair):
    pair = model_pair("qwen2vl", "real")
    p = plan_for(pair, [host(1 * GiB)])
    line = next(r for r in p.reasons if r.startswith("CPU budget"))
    assert "1.00 GiB free − 256.00 MiB kept for the process (--host-reserve) − 5% margin" in line
    assert p.devices[0].budget_bytes == int((1 * GiB - 256 * MiB) * 0.95)
    # 768 MiB kept leaves less than the weights alone, with or without CPU repacking
    q = plan_for(pair, [host(1 * GiB)], host_reserve=768 * MiB)
    assert q.devices[0].budget_bytes == int((1 * GiB - 768 * MiB) * 0.95) and not q.fits
    r = run_cli(
        "plan",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--free-memory",
        "cpu=1GiB",
        "--host-reserve",
        "768MiB",
    )
    assert r.returncode == 1 and "768.00 MiB kept for the process" in r.stdout


@pytest.mark.slow
def test_qwen2vl_fits_1gib_by_the_micro_batch_and_llama_cpp_agrees(model_pair):
    """Done-when: the Qwen2-VL-2B-shaped pair with --free-memory cpu=1GiB fits by lowering the
    micro-batch, and llama.cpp then allocates what the plan predicted. (Where the build repacks
    weights, the tied output's repacked copy takes ~130 MiB more and the micro-batch goes to 128;
    on an AMX build, loaded without repacking, 256 is enough.)"""
    from edgevlm.backend.system import cpu_repacks
    from edgevlm_testkit.measure import Config, measure

    pair = model_pair("qwen2vl", "real")
    p = plan_for(pair, [host(1 * GiB)])
    ubatch = 128 if cpu_repacks() else 256
    assert p.fits and p.n_ubatch == ubatch and p.n_gpu_layers == 0
    assert [lv.lever for lv in p.levers] == ["context", "kv q8_0", "micro-batch"]
    r = run_cli("plan", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--free-memory", "cpu=1GiB", "--explain")
    assert r.returncode == 0 and f"micro-batch   512 → {ubatch}" in r.stdout and "not needed" in r.stdout
    cfg = Config(
        "qwen2vl",
        n_ctx=p.n_ctx,
        type_k=p.type_k,
        type_v=p.type_v,
        flash_attn=p.flash_attn,
        n_ubatch=p.n_ubatch,
        n_batch=p.n_batch,
        image_max_tokens=p.image_max_tokens,
    )
    comps = {c.name: c for c in measure(str(pair.model), str(pair.mmproj), cfg)}
    for name in ("weights (mapped)", "weights (repack)", "kv", "mmproj weights"):
        assert comps[name].within(0.005), comps[name]
    # the compute buffer is what the micro-batch lowered: ~76 MiB at 128, twice that at 256
    assert comps["compute"].within(0.05) and comps["compute"].measured < 80 * MiB * ubatch // 128, comps["compute"]
    assert comps["mmproj compute"].predicted >= comps["mmproj compute"].measured - 0.006 * MiB


@pytest.mark.parametrize("family", ["llava15", "qwen2vl", "gemma3"])
def test_plan_check_sets_the_plan_against_llama_cpps_dry_run(model_pair, family):
    """``plan --check``: llama.cpp's own memory-fit dry run of the plan (model params
    ``no_alloc``, nothing allocated) reserves the compute and output buffers the plan counted —
    an independent reference for the replay (on the CPU here; on a GPU the planner runs it too
    and raises what it counts where llama.cpp reserves more)."""
    pair = model_pair(family)
    r = run_cli("plan", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--check", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["check"]
    assert {(x["device"], x["buffer"]) for x in rows} == {("CPU", "compute"), ("CPU", "output")}
    for x in rows:  # (the tiny vocabularies' logits round to 0.00 MiB in the log)
        assert (x["reserved"] > 0 or x["buffer"] == "output") and not x["under"], x
        assert abs(x["predicted"] - x["reserved"]) <= max(0.005 * x["reserved"], 0.006 * 2**20), x
    table = run_cli("plan", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--check").stdout
    assert "the plan against llama.cpp's dry run" in table and "no buffer above the plan" in table


def test_a_what_if_gpu_is_not_dry_run(model_pair):
    """A what-if GPU on a machine without one cannot be reserved on: the plan is the replay's."""
    pair = model_pair("llava15")
    p = make_plan(str(pair.model), str(pair.mmproj), probe(free_memory=["8GiB"]))
    assert p.n_gpu_layers > 0 and not any("dry run" in r for r in p.reasons)


def _cuda_like_dry_run(ratio: float):
    """What llama.cpp's dry run answered on an H200 with a q8_0 cache and every layer on CUDA0:
    about ``ratio`` × the replay's device compute (docs/results/gpu-check-h200-cuda.json) —
    injected through the rows ``plan.check`` gives, since no CUDA device exists here."""
    from edgevlm.plan.check import CheckRow

    def check(p):
        gpu = next(d for d in p.devices if d.kind != "cpu")
        host = next(d for d in p.devices if d.kind == "cpu")
        raw = gpu.predicted.compute / calls["scale"]
        calls["n"] += 1
        return [
            CheckRow(gpu.name, "compute", gpu.predicted.compute, int(raw * ratio)),
            CheckRow(host.name, "compute", host.predicted.compute, host.predicted.compute),
        ]

    calls = {"n": 0, "scale": 1.0}
    return check, calls


def test_a_plan_llama_cpp_reserves_more_for_is_raised_and_searched_again(real, monkeypatch):
    import edgevlm.plan.planner as planner

    model, mmproj = str(real.model), str(real.mmproj)
    free = ["GPU0=1GiB"]
    before = make_plan(model, mmproj, probe(free_memory=free), check=False)
    check, calls = _cuda_like_dry_run(3.149)
    monkeypatch.setattr(planner, "can_check", lambda *a: True)

    def counting(p):
        rows = check(p)
        calls["scale"] = 3.149  # after the first answer the planner counts ×3.149 on GPU0
        return rows

    monkeypatch.setattr(planner, "check_plan", counting)
    after = make_plan(model, mmproj, probe(free_memory=free))
    gpu_before = next(d for d in before.devices if d.name == "GPU0").predicted
    gpu_after = next(d for d in after.devices if d.name == "GPU0").predicted
    assert calls["n"] == 2  # checked, raised and searched again, checked once more
    assert any("the plan counts ×3.15 there" in r for r in after.reasons)
    assert any("dry run of the plan: 2/2 within it" in r for r in after.reasons)
    # the search paid for the larger compute with a lever (here: a smaller micro-batch or context)
    assert (after.n_ubatch, after.n_ctx, after.n_gpu_layers) != (before.n_ubatch, before.n_ctx, before.n_gpu_layers)
    assert gpu_after.total <= next(d for d in after.devices if d.name == "GPU0").budget_bytes
    assert gpu_after.compute < 3.149 * gpu_before.compute  # not the old configuration, scaled


def test_a_dry_run_that_fails_leaves_the_replays_plan(real, monkeypatch):
    import edgevlm.plan.planner as planner

    model, mmproj = str(real.model), str(real.mmproj)

    def broken(p):
        raise RuntimeError("no context")

    monkeypatch.setattr(planner, "can_check", lambda *a: True)
    monkeypatch.setattr(planner, "check_plan", broken)
    p = make_plan(model, mmproj, probe(free_memory=["GPU0=8GiB"]))
    assert p.fits and any("could not check this plan (no context)" in r for r in p.reasons)
