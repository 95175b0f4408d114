"""The KV cache on the host as a lever with a price (#58): the planner weighs fewer GPU layers, the
cache on the host and a smaller KV type by the decode speed a price table predicts, on what-if
GPUs with injected tables (``EDGEVLM_KV_PRICES``); the committed table's entries; the fit."""

from __future__ import annotations

import json

import pytest

from edgevlm.model.gguf_info import read_gguf
from edgevlm.plan.devices import Device, Probe
from edgevlm.plan.planner import Planner, Wishes
from edgevlm.plan.prices import PARAMS, PRICES_ENV, Traffic, fit, load_prices, prices_for

from .conftest import run_cli

GiB, MiB = 2**30, 2**20
# the LLaVA-1.5-7B-shaped pair (3 layers with the output) at ctx 8192, f16: on this GPU every layer
# fits only with the cache on the host; with it on the GPU, two layers do
FREE = 900 * MiB


def host():
    return Device("CPU", "test host", "cpu", 16 * GiB, 32 * GiB, True, "what-if")


def gpu(free=FREE, description="test GPU"):
    return Device("CUDA0", description, "gpu", free, max(free, 8 * GiB), True, "what-if", 256 * MiB)


def plan_for(pair, devices, **wishes):
    return Planner(read_gguf(pair.model), read_gguf(pair.mmproj), Probe(tuple(devices)), Wishes(**wishes)).plan()


@pytest.fixture(scope="module")
def real(model_pair):
    return model_pair("llava15", "real")


def table(tmp_path, **params) -> str:
    """A price table whose default entry has these prices (the rest 0)."""
    path = tmp_path / "prices.json"
    entry = {"gpu": "default", "params": {k: params.get(k, 0.0) for k in PARAMS}}
    path.write_text(json.dumps({"schema": 1, "entries": {"default": entry}}))
    return str(path)


def test_host_kv_priced_cheap_is_chosen_and_expensive_is_not(real, tmp_path, monkeypatch):
    """Same GPU, same model: where attention on the host is cheap and host weights dear, the
    cache goes to the host and every layer to the GPU; where crossings and host KV are dear, the
    plan keeps the cache on the GPU and moves a layer instead."""
    monkeypatch.setenv(PRICES_ENV, table(tmp_path, base=1e-3, s_host_weights=1e-9, s_host_kv=1e-12, s_hop=1e-6))
    cheap = plan_for(real, [gpu(), host()], n_ctx=8192, kv="f16")
    assert cheap.fits
    assert not cheap.offload_kqv
    assert cheap.n_gpu_layers == 3
    assert "kv on host" in [lv.lever for lv in cheap.levers]
    assert "gpu layers" not in [lv.lever for lv in cheap.levers]
    assert cheap.backend_options()["offload_kqv"] is False  # what the load gets
    host_kv = next(d for d in cheap.devices if d.kind == "cpu").predicted.kv
    assert host_kv == 2 * 8192 * 4096 * 2 * 2  # both layers' f16 cache on the host
    monkeypatch.setenv(PRICES_ENV, table(tmp_path, base=1e-3, s_host_weights=1e-12, s_host_kv=1e-8, s_hop=1e-2))
    dear = plan_for(real, [gpu(), host()], n_ctx=8192, kv="f16")
    assert dear.fits
    assert dear.offload_kqv
    assert dear.n_gpu_layers == 2
    assert dear.devices[0].predicted.kv > 0
    assert "kv on host" not in [lv.lever for lv in dear.levers]
    for p in (cheap, dear):  # both options weighed, the chosen one marked, each with its price
        assert {(o.n_gpu_layers, o.kv_on_gpu) for o in p.options} == {(2, True), (3, False)}
        (chosen,) = [o for o in p.options if o.chosen]
        assert (chosen.n_gpu_layers, chosen.kv_on_gpu) == (p.n_gpu_layers, p.offload_kqv)
        assert chosen.tokens_per_s == max(o.tokens_per_s for o in p.options if o.fits)
        assert all(o.gpu_bytes <= p.devices[0].budget_bytes for o in p.options if o.fits)


def test_a_smaller_kv_type_competes_too(real, tmp_path, monkeypatch):
    """With ``--kv auto`` q8_0 is an option of its own: on a GPU where an f16 cache leaves one
    layer and a q8_0 one two, with host weights dear the smaller cache wins; q4_0 (more layers
    still on some of these sizes) is shown but not taken while another option fits."""
    monkeypatch.setenv(PRICES_ENV, table(tmp_path, base=1e-4, s_dev_kv=1e-11, s_host_kv=1e-7, s_host_weights=1e-9))
    p = plan_for(real, [gpu(750 * MiB), host()], n_ctx=8192)
    kinds = {o.kv_type for o in p.options}
    assert kinds == {"f16", "q8_0", "q4_0"}
    assert p.type_k == "q8_0"
    assert p.offload_kqv
    assert p.n_gpu_layers == 2
    assert any(o.kv_type == "f16" and o.fits and o.n_gpu_layers == 1 for o in p.options)
    q4 = [o for o in p.options if o.kv_type == "q4_0"]
    assert q4
    assert not any(o.chosen for o in q4)
    assert all("only if nothing else fits" in o.note for o in q4)


def test_the_users_choice_is_kept(real, tmp_path, monkeypatch):
    monkeypatch.setenv(PRICES_ENV, table(tmp_path, base=1e-3, s_host_weights=1e-9, s_host_kv=1e-12))
    on = plan_for(real, [gpu(), host()], n_ctx=8192, kv="f16", kv_offload=True)
    assert on.offload_kqv
    assert on.n_gpu_layers == 2
    assert not on.options
    off = plan_for(real, [gpu(8 * GiB), host()], kv_offload=False)  # everything fits, the cache stays on the host
    assert off.fits
    assert not off.offload_kqv
    assert off.devices[0].predicted.kv == 0
    fixed = plan_for(real, [gpu(), host()], n_ctx=8192, kv="f16", n_gpu_layers=2)
    assert fixed.n_gpu_layers == 2


def test_an_unknown_gpu_says_which_default_it_used(real):
    p = plan_for(real, [gpu(description="NVIDIA GeForce RTX 9999"), host()], n_ctx=8192, kv="f16")
    assert p.prices == "default (no measurement for NVIDIA GeForce RTX 9999)"
    assert any("prices: default (no measurement for NVIDIA GeForce RTX 9999)" in r for r in p.reasons)


def test_plan_explain_and_json_show_the_options(real):
    args = ["plan", "-m", str(real.model), "--mmproj", str(real.mmproj), "--free-memory", "GPU0=900MiB",
            "--gpu-overhead", "256MiB", "--ctx", "8192", "--kv", "f16"]  # fmt: skip
    r = run_cli(*args, "--explain")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "placements weighed by predicted decode speed (prices: default (no measurement for GPU0))" in out
    assert "3/3 f16 host" in out
    assert "2/3 f16 GPU" in out
    assert "kv on host" in out
    d = json.loads(run_cli(*args, "--json").stdout)
    assert d["prices"] == "default (no measurement for GPU0)"
    assert len(d["options"]) == 2
    assert sum(o["chosen"] for o in d["options"]) == 1
    chosen = next(o for o in d["options"] if o["chosen"])
    assert (chosen["n_gpu_layers"], chosen["kv_on_gpu"]) == (d["n_gpu_layers"], d["offload_kqv"])
    assert all(o["tokens_per_s"] > 0 and o["gpu_bytes"] > 0 for o in d["options"])


def test_the_committed_table_has_a_default_and_a_measured_lavapipe_entry():
    tables = load_prices()
    lvp = prices_for(Device("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "gpu", GiB, GiB), tables)
    assert not lvp.fallback
    assert lvp.label.startswith("measured for llvmpipe")
    assert len(lvp.rows) >= 20
    assert lvp.machine.get("llama_cpp_python")
    assert lvp.source.startswith("bench_kv_price")
    assert all(v >= 0 for v in lvp.params.values())
    assert any(v > 0 for v in lvp.params.values())  # a fit, not all zeros (which price is 0 is the device's call)
    other = prices_for(Device("CUDA0", "NVIDIA H200", "gpu", GiB, GiB), tables)
    assert other.fallback == "NVIDIA H200"
    assert other.label == "default (no measurement for NVIDIA H200)"


def test_fit_recovers_known_prices():
    """Rows made from known prices (independent of any measurement) fit back to them."""
    true = dict(base=2e-3, s_dev_weights=1e-11, s_host_weights=5e-10, s_dev_kv=2e-11, s_host_kv=4e-10, s_hop=3e-5)
    rows = []
    for dw, hw, dk, hk, hops in [
        (a, b, c, d, e) for a in (0, 80e6) for b in (0, 40e6) for c in (0, 20e6) for d in (1e6, 30e6) for e in (1, 9)
    ]:
        t = Traffic(int(dw), int(hw), int(dk), int(hk), hops)
        s = sum(true[k] * x for k, x in zip(PARAMS, t.features(), strict=True))
        rows.append(dict(vars(t), tokens_per_s=1 / s))
    got = fit(rows)
    for k in PARAMS:
        assert got[k] == pytest.approx(true[k], rel=1e-6), k
