"""The GPU path on a real ggml device: the first GPU ggml registered, whatever its backend —
CUDA0 on an NVIDIA build, Vulkan0 on a Vulkan one (Mesa's software device, lavapipe, on a
CPU-only machine). These run where such a device is visible — ``python scripts/gpu_check.py
--vulkan --tests`` builds the Vulkan variant of llama.cpp once and runs them (``pytest -m gpu``)
with ``GGML_VK_VISIBLE_DEVICES=0``; ``python scripts/gpu_check.py --tests`` does the same with a
CUDA build — and are skipped on a CPU-only build.

Checked on the device: every buffer llama.cpp logs (device and host, text model and encoder)
against the plan, with all layers, with part of them (the CPU's extra buffer types on and off,
so a CPU whose default is either takes both paths), with none offloaded, and with the KV cache
on the host (``offload_kqv`` off, a lever the planner weighs); the guard's choices
under a what-if free memory keep the logged device buffers inside it; ``chat``, ``caption`` and
``serve`` end to end with ``--ngl -1``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from edgevlm.backend.system import ggml_devices
from edgevlm.plan.devices import probe
from edgevlm.plan.planner import Wishes, make_plan
from edgevlm_testkit.child import measured_in_child

from .conftest import run_cli

GPUS = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no GPU in this llama.cpp build (scripts/gpu_check.py [--vulkan] --tests)"),
]
MIB = 2**20


PARTIAL = [  # part of the layers on the device: the laptop case, with the CPU's extra buffer types on and off
    pytest.param(*cfg, extra, id="-".join(map(str, cfg)) + f"-extra-{'on' if extra else 'off'}")
    for cfg in (
        ("llava15", 1024, "f16", 512, None, 1),  # only the output layer on the device
        ("llava15", 1024, "q8_0", 128, None, 2),
        ("qwen2vl", 2048, "q8_0", 128, 256, 2),
    )
    for extra in (True, False)
]


@pytest.mark.parametrize(
    "family,n_ctx,kv,ub,img,ngl,extra",
    [
        ("llava15", 1024, "f16", 512, None, None, None),
        ("llava15", 2048, "q8_0", 64, None, None, None),
        ("qwen2vl", 1024, "f16", 512, 64, None, None),
        ("llava15", 1024, "f16", 512, None, 0, None),  # no layer on the device, the encoder there
        *PARTIAL,
    ],
)
def test_plan_matches_llama_cpp_buffers_on_the_device(model_pair, family, n_ctx, kv, ub, img, ngl, extra):
    from edgevlm_testkit.gpu_measure import DeviceRow

    pair = model_pair(family)
    rows = [
        DeviceRow(**r)
        for r in measured_in_child(
            "edgevlm_testkit.gpu_measure:measure_on_device",
            model=str(pair.model),
            mmproj=str(pair.mmproj),
            label=family,
            n_ctx=n_ctx,
            type_kv=kv,
            n_ubatch=ub,
            image_max_tokens=img,
            n_threads=2,
            n_gpu_layers=ngl,
            extra_buffers=extra,
        )  # fmt: skip
    ]
    on_device = [r for r in rows if r.component.endswith(GPUS[0].name)]
    which = "encoder compute" if ngl == 0 else "compute"
    assert on_device and any(r.logged for r in on_device if r.component.startswith(which))
    off = [(r.component, r.predicted, r.logged) for r in rows if not r.within()]
    assert not off, off


@pytest.mark.parametrize("ngl", [2, None], ids=["part-of-the-layers", "every-layer"])
def test_kv_on_the_host_matches_llama_cpp_buffers_and_its_dry_run(model_pair, ngl):
    """llama.cpp's ``offload_kqv`` off, as the planner may choose it: the tiny LLaVA pair loaded
    with part (and all) of its layers on the device and the cache on the host; every logged
    buffer against the plan (the KV cache on the host, none on the device), then a plan made with
    ``--no-kv-offload`` set against llama.cpp's own dry run of it."""
    from edgevlm.plan.check import check_plan
    from edgevlm_testkit.gpu_measure import DeviceRow

    pair = model_pair("llava15")
    rows = [
        DeviceRow(**r)
        for r in measured_in_child(
            "edgevlm_testkit.gpu_measure:measure_on_device",
            model=str(pair.model),
            mmproj=str(pair.mmproj),
            label="kv-host",
            n_ctx=1024,
            type_kv="f16",
            n_ubatch=512,
            image_max_tokens=None,
            n_threads=2,
            n_gpu_layers=ngl,
            offload_kqv=False,
        )  # fmt: skip
    ]
    name = GPUS[0].name
    kv = {r.component: r for r in rows if r.component.startswith("KV on")}
    assert kv[f"KV on {name}"].logged == 0 and kv["KV on the host"].logged > 0
    assert any(r.logged for r in rows if r.component == f"weights on {name}")
    off = [(r.component, r.predicted, r.logged) for r in rows if not r.within()]
    assert not off, off
    wishes = Wishes(n_ctx=1024, kv="f16", n_gpu_layers=-1 if ngl is None else ngl, kv_offload=False)
    plan = make_plan(str(pair.model), str(pair.mmproj), probe(), wishes)
    assert plan.fits and not plan.offload_kqv and plan.n_gpu_layers > 0
    assert next(d for d in plan.devices if d.name == name).predicted.kv == 0
    checked = check_plan(plan)
    assert checked and not [r for r in checked if r.under], [r.to_dict() for r in checked]


@pytest.mark.parametrize("family", ["llava15", "qwen2vl"])
@pytest.mark.parametrize("free_mib", [96, 8, 4])
def test_guard_keeps_the_device_inside_a_what_if_budget(model_pair, images, family, free_mib):
    """``--free-memory GPU=SIZE --ngl auto``: the plan chooses layers, context, KV and
    micro-batch, and what llama.cpp then allocates on the device (after a picture, or after the
    guard refused one it had no room for: on these tiny sizes its 64 MiB slack) fits in SIZE."""
    pair = model_pair(family)
    name = GPUS[0].name
    free = f"{name}={free_mib}MiB"
    plan = make_plan(str(pair.model), str(pair.mmproj), probe(free_memory=[free], gpu_overhead=0))
    assert plan.fits
    dev = next(d for d in plan.devices if d.name == name)
    assert dev.predicted.total <= dev.budget_bytes <= free_mib * MIB
    row = measured_in_child(
        "edgevlm_testkit.gpu_measure:guard_on_device", model=str(pair.model), mmproj=str(pair.mmproj),
        label=family, free=free, picture=str(images["gradient"]), n_threads=2, gpu_overhead=0,
    )  # fmt: skip
    assert row["logged"] <= free_mib * MIB, (plan.n_gpu_layers, plan.n_ctx, plan.n_ubatch, row["logged"] / MIB)
    if free_mib >= 96:  # everything fits: every layer and the encoder on the device, and it answers
        assert row["answered"] and plan.n_gpu_layers > 0 and plan.mmproj_on_gpu and row["logged"] > 0
    else:
        assert plan.levers, "a small device should pull levers"


def test_unknown_free_memory_is_said_and_assumed():
    p = probe()
    g = next(d for d in p.gpus if d.name == GPUS[0].name)
    if g.free_known:
        pytest.skip(f"{g.name} reports its free memory")
    note = next(n for n in p.notes if n.startswith(g.name))
    assert "free memory unknown" in note and "assumes all of it is free" in note and "--free-memory" in note
    assert g.max_tensor > 0 and g.align > 0  # what the probe read from the backend (Vulkan: a tensor limit)


def test_plan_cli_on_the_device_names_the_host_buffers(model_pair):
    pair = model_pair("qwen2vl")
    r = run_cli("plan", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "-1", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    gpu = next(d for d in plan["devices"] if d["name"] == GPUS[0].name)
    host = next(d for d in plan["devices"] if d["kind"] == "cpu")
    assert gpu["predicted"]["compute"] > 0 and host["predicted"]["compute"] > 0
    assert gpu["predicted"]["mmproj_weights"] > 0 and host["predicted"]["mmproj_compute"] > 0
    if GPUS[0].host_buffer:
        assert any(GPUS[0].host_buffer in reason for reason in plan["reasons"])


def test_chat_caption_and_serve_with_every_layer_on_the_device(model_pair, images, tmp_path):
    from .test_serve import Served, data_uri, user

    pair = model_pair("llava15")
    chat = run_cli("chat", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "-1", "-n", "4",
                   "--image", str(images["square"]), "Describe it.")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert "Traceback" not in chat.stderr and chat.stdout.strip()
    out = tmp_path / "captions.jsonl"
    Image.fromarray((np.random.default_rng(1).random((48, 64, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    cap = run_cli("caption", "--model", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "-1", "-n", "4",
                  str(tmp_path / "a.png"), "--out", str(out))  # fmt: skip
    assert cap.returncode == 0, cap.stderr
    rec = json.loads(out.read_text().splitlines()[0])
    assert rec["error"] is None and rec["caption"]
    s = Served(pair, "--ngl", "-1", "--ctx", "2048")
    try:
        st = s.status()
        gpu = next(d for d in st["plan"]["devices"] if d["name"] == GPUS[0].name)
        assert st["plan"]["n_gpu_layers"] > 0 and gpu["predicted"]["weights"] > 0
        reply = s.client().chat.completions.create(
            model="m", max_tokens=4, messages=[user("What is it?", data_uri(images["noise"].read_bytes()))]
        )
        assert reply.choices[0].message.content is not None and reply.usage.prompt_tokens > 576
    finally:
        err = s.stop()
    assert "Traceback" not in err, err


def test_doctor_reports_the_device():
    r = run_cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["gpu_offload"] and GPUS[0].name in [d["name"] for d in f["devices"]]
    assert f["build"].startswith("CUDA" if GPUS[0].name.startswith("CUDA") else GPUS[0].name.rstrip("0123456789"))
