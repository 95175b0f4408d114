"""The GPU numbers a reader sees come from the committed results of ``scripts/gpu_check.py``
(docs/results/gpu-check-*.json), rendered by ``scripts/render_gpu_docs.py``; the guard's CUDA
overhead is the one those results measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgevlm.plan.devices import GPU_OVERHEAD, gpu_overhead_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "render_gpu_docs.py"
RESULTS = sorted((ROOT / "docs" / "results").glob("gpu-check-*.json"))


def _render():
    spec = importlib.util.spec_from_file_location("render_gpu_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_and_readme_show_what_the_committed_results_hold():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_changed_result_changes_the_rendered_tables(tmp_path, monkeypatch):
    render = _render()
    for f in RESULTS:
        (tmp_path / f.name).write_text(f.read_text())
    first = RESULTS[0]
    d = json.loads(first.read_text())
    d["buffers"][0]["logged"] += 2**20
    (tmp_path / first.name).write_text(json.dumps(d))
    before = render.blocks()
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    after = render.blocks()
    stem = first.stem.removeprefix("gpu-check-")
    assert after[f"{stem}:buffers"] != before[f"{stem}:buffers"]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_results_name_the_machine_and_the_build(path):
    d = json.loads(path.read_text())
    m = d["machine"]
    assert m["cpu"] and m["cores"] and {"avx2", "avx512", "amx"} <= set(m) and m["llama_cpp_build"]
    assert d["device"]["name"] and d["buffers"] and d["guard"]


def test_the_guard_keeps_the_overhead_cuda_measured():
    render = _render()
    cuda = json.loads((ROOT / "docs" / "results" / "gpu-check-h200-cuda.json").read_text())
    assert GPU_OVERHEAD["CUDA"] == render.overhead(cuda) == gpu_overhead_for("CUDA0")
    outside = [r["logged"] for r in cuda["buffers"] if r["component"] == "outside the logs after 1st image"]
    assert outside and max(outside) <= GPU_OVERHEAD["CUDA"]  # every measured run stayed inside it
