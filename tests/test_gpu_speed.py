"""edgevlm against llama-server of the same llama.cpp build (issue #58, ``scripts/bench_gpu_speed.py``).

- llama-server comes out of the CMake build that makes the llama-cpp-python wheel
  (``testkit/edgevlm_testkit/llama_server.cmake``): configured here on the pinned sdist, its
  targets link the very libraries the wheel installs, and its install rule stays out of the wheel;
- the flags llama-server gets are what edgevlm's plan chose, and the ratios and targets follow;
- on a device (``pytest -m gpu``: ``scripts/gpu_check.py --vulkan --tests``), the script end to
  end on a tiny pair against the same build's llama-server, when that build is there: the one
  ``python -m edgevlm_testkit.vulkan_build --server`` caches, or ``EDGEVLM_LLAMA_SERVER`` (a CUDA
  build's ``DIR/bin/llama-server``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from edgevlm_testkit.child import DriverCrash

from .conftest import skip_unless_required
from .test_serve import Served, data_uri, png, user

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gpu_speed as bench  # noqa: E402
import render_speed  # noqa: E402

PLAN = {  # what /status says of a plan (the keys the flags are made from)
    "n_gpu_layers": 2,
    "n_ctx": 4096,
    "n_batch": 512,
    "n_ubatch": 256,
    "type_k": "q8_0",
    "type_v": "q8_0",
    "flash_attn": True,
    "offload_kqv": True,
    "mmproj_on_gpu": False,
    "image_max_tokens": 1024,
    "repack": False,
}


def test_llama_server_gets_what_edgevlms_plan_chose():
    flags = bench.llama_server_args(PLAN, parallel=4, threads=2)
    pairs = dict(zip(flags[::1], flags[1:], strict=False))
    want = {"-ngl": "2", "-c": "4096", "-b": "512", "-ub": "256", "-ctk": "q8_0", "-ctv": "q8_0", "-fa": "on"}
    want |= {"-np": "4", "-t": "2", "-tb": "2", "--image-max-tokens": "1024"}
    assert {k: pairs[k] for k in want} == want
    # one KV for the 4 sequences, as edgevlm's; the encoder on the host, weights not repacked, as planned
    assert {"-kvu", "--no-mmproj-offload", "--no-repack"} <= set(flags)
    on_device = bench.llama_server_args({**PLAN, "mmproj_on_gpu": True, "repack": True}, 4, 2)
    assert "--no-mmproj-offload" not in on_device
    assert "--no-repack" not in on_device


def _side(ttft, d1, d4, cap):
    return {
        "ttft": {"s": ttft},
        "decode_1": {"tok_per_s": d1},
        "decode_4": {"tok_per_s": d4},
        "caption": {"images_per_s": cap},
    }


def test_ratios_are_edgevlm_over_llama_server_and_targets_follow():
    r = bench.ratios(_side(0.9, 50.0, 90.0, 1.0), _side(1.0, 40.0, 100.0, 1.0))
    assert r["ratios"] == {"ttft": 0.9, "decode_1": 1.25, "decode_4": 0.9, "caption": 1.0}
    assert r["targets_met"] == {"ttft": True, "decode_1": True, "decode_4": False, "caption": True}
    assert r["missed"] == ["decode_4"]
    slow = bench.ratios(_side(1.2, None, 90.0, 0.5), _side(1.0, 40.0, 90.0, 1.0))
    assert slow["targets_met"] == {"ttft": False, "decode_1": None, "decode_4": True, "caption": False}


def test_status_counts_the_encoders_time_beside_llama_ms(model_pair):
    """The profile's split (bench_gpu_speed.profile_between): ``/status`` kv.encode_ms is the
    encoder's time, summed — 0 before a picture, then more than 0 and no more than the request took."""
    s = Served(model_pair("llava15"), "--max-tokens", "4")
    try:
        kv = s.status()["kv"]
        assert kv["encode_ms"] == 0.0
        t0 = time.monotonic()
        s.client().chat.completions.create(
            model="m", messages=[user("What is it?", data_uri(png(200, 150, seed=5)))], max_tokens=4, temperature=0
        )
        wall_ms = (time.monotonic() - t0) * 1000
        after = s.status()
        assert after["threads"]["encodes"] == 1
        assert 0 < after["kv"]["encode_ms"] <= wall_ms
        assert after["kv"]["llama_ms"] > kv["llama_ms"]
    finally:
        s.stop()


@pytest.mark.slow
def test_llama_server_is_configured_in_the_wheels_own_cmake_build(tmp_path):
    """Configure (no compile) the pinned sdist as ``pip wheel`` does, with the server's CMake
    file: llama-server is a target of that build, linked to the libraries the wheel installs, and
    installed outside the wheel."""
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("no cmake or ninja here")
    from edgevlm_testkit import vulkan_build as vb

    src = vb.fetch_sdist(tmp_path)
    build = tmp_path / "build"
    args = vb.SERVER_ARGS.split()
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-Wno-dev", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ninja = (build / "build.ninja").read_text()
    link = re.search(r"^build bin/llama-server: \S+ (.*)$", ninja, re.M)
    assert link, "no llama-server target in the wheel's build"
    # the server links the same targets the wheel installs (llama, ggml, mtmd), built once in this tree
    for lib in ("bin/libllama.so", "bin/libggml-base.so", "bin/libggml-cpu.so", "tools/mtmd/libmtmd.so"):
        assert lib in link.group(1), lib
    assert len(re.findall(r"^build [^:]*/ggml\.c\.o:", ninja, re.M)) == 1  # ggml compiled once, for both
    # llama-server's install rule points outside the wheel's tree: the wheel does not change
    rule = (build / "tools" / "server" / "cmake_install.cmake").read_text()
    dest = re.findall(r'file\(INSTALL DESTINATION "([^"]+)" TYPE EXECUTABLE', rule)
    assert dest == [str(build / "not-in-wheel")]


# --- on the device ---------------------------------------------------------------------------------
def _same_build_server() -> list[str] | str:
    """The script's arguments that name a llama-server of this interpreter's llama.cpp build, or
    why there is none."""
    given = os.environ.get("EDGEVLM_LLAMA_SERVER")
    if given:
        return ["--llama-server", given, "--same-build"]
    from edgevlm_testkit import vulkan_build as vb

    exe = vb.cached_server()
    if exe is None:
        return "no llama-server of this build (python -m edgevlm_testkit.vulkan_build --server)"
    stamp = json.loads((exe.parent / "build.json").read_text())
    mine = Path(sys.prefix) / "edgevlm-wheel.sha256"
    if not mine.exists() or mine.read_text().strip() != stamp["wheel_sha256"]:
        return f"{sys.prefix}'s llama-cpp-python is not the wheel built with {exe} (vulkan_build --server)"
    return ["--vulkan-server"]


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_bench_gpu_speed_end_to_end_on_the_device(model_pair, tmp_path):
    from edgevlm.backend.system import ggml_devices

    gpus = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
    if not gpus:
        pytest.skip("no GPU in this llama.cpp build (scripts/gpu_check.py [--vulkan] --tests)")
    server = _same_build_server()
    if isinstance(server, str):
        skip_unless_required("llama-server", server)
    # lavapipe's device memory is the process's heap: both servers die there now and then of a corrupted
    # heap (docs/gpu.md, "Speed against llama-server"), always at a 1024-token budget, whose encoder
    # buffer passes its 128 MiB storage range; the script records a death and goes on
    lavapipe = "llvmpipe" in gpus[0].description
    budget = 256 if lavapipe else 1024
    pair = model_pair("qwen2vl")
    out = tmp_path / "speed.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_speed.py"), *server, "-m", str(pair.model)]
    cmd += ["--mmproj", str(pair.mmproj), "--ctx", "4096", "--ttft-reps", "1", "--reps", "1", "--decode-tokens", "8"]
    cmd += ["--caption-images", "4", "--caption-tokens", "4", "--threads", "2", "--out", str(out)]
    cmd += ["--image-tokens", str(budget), "--logs", str(tmp_path), "--timeout", "300"]
    env = dict(os.environ, GGML_VK_VISIBLE_DEVICES=os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=850, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    res = d["result"]
    assert res["device"]["name"] == gpus[0].name
    assert res["build"]["same_build"]
    assert [s["split"] for s in res["splits"]] == ["all", "laptop"]
    assert res["splits"][0]["settings"]["n_gpu_layers"] == 3  # the tiny pair's 2 layers and the output layer
    assert res["splits"][1]["settings"]["n_gpu_layers"] == 2  # the laptop split: one layer and the output
    measured = 0
    for row in res["splits"]:
        flags = row["llama_server_flags"]
        assert flags[flags.index("-ngl") + 1] == str(row["settings"]["n_gpu_layers"])
        for side in ("edgevlm", "llama_server"):
            died = row[side].get("died")
            if died:  # only lavapipe's known crash (a signal) is let through, and shown
                assert lavapipe, died
                assert (died["exit"] or 0) < 0, died
                warnings.warn(DriverCrash(f"{side} at -ngl {row['settings']['n_gpu_layers']}: {died}"), stacklevel=1)
            for key in ("ttft", "decode_1", "decode_4", "caption"):
                errors = row[side][key]["errors"]
                assert errors == [] or died, (side, key, errors)
            # the image budget held on both sides: the 4000x3000 picture is about the budget's tokens
            tokens = row[side]["ttft"].get("prompt_tokens", [])
            assert all(0.8 * budget < n <= budget + 64 for n in tokens), row[side]["ttft"]
        for key, ratio in row["ratios"].items():
            both = all(not row[s][key]["errors"] for s in ("edgevlm", "llama_server"))
            assert (ratio is not None and ratio > 0) == both, (key, ratio)
            measured += both
        prof = row["edgevlm"]["decode_1"]["profile"]
        if prof:
            assert prof["steps"] > 0
            assert prof["llama_ms"] > 0
    assert measured > 0  # at least one measure on both sides
    for part in render_speed.PARTS["bench_gpu_speed"].values():
        assert part(d, "speed")
