"""The GPU numbers a reader sees come from the committed results of ``scripts/gpu_check.py``
(docs/results/gpu-check-*.json), rendered by ``scripts/render_docs.py`` with
``scripts/render_gpu.py`` (tests/test_rendered_docs.py checks every block); the guard's CUDA
overhead is the one those results measured."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from edgevlm.plan.devices import GPU_OVERHEAD, gpu_overhead_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
RESULTS = sorted((ROOT / "docs" / "results").glob("gpu-check-*.json"))


def _render_gpu():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("render_gpu", SCRIPTS / "render_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_changed_buffer_changes_the_rendered_table():
    render = _render_gpu()
    d = json.loads(RESULTS[0].read_text())
    before = render.buffers(d)
    d["buffers"][0]["logged"] += 2**20
    assert render.buffers(d) != before


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_results_name_the_machine_and_the_build(path):
    d = json.loads(path.read_text())
    m = d["machine"]
    assert m["cpu"] and m["cores"] and {"avx2", "avx512", "amx"} <= set(m) and m["llama_cpp_build"]
    assert d["device"]["name"] and d["buffers"] and d["guard"]


def test_the_guard_keeps_the_overhead_cuda_measured():
    render = _render_gpu()
    cuda = json.loads((ROOT / "docs" / "results" / "gpu-check-h200-cuda.json").read_text())
    assert GPU_OVERHEAD["CUDA"] == render.overhead(cuda) == gpu_overhead_for("CUDA0")
    outside = [r["logged"] for r in cuda["buffers"] if r["component"] == "outside the logs after 1st image"]
    assert outside and max(outside) <= GPU_OVERHEAD["CUDA"]  # every measured run stayed inside it
