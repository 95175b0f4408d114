"""The laptop check's pieces (#58): the ballast that makes a big GPU look like a laptop's, the
full-size pairs written from random quantized blocks, and the "one layer more does not fit"
verdict. The convergence logic runs against an injected device; the ballast process holds real
device memory on the first ggml GPU in the tests marked ``gpu`` (``python scripts/gpu_check.py
--vulkan --tests`` runs them on Mesa's software device, ``--tests`` on a CUDA build)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest

from edgevlm.backend.system import ggml_devices
from edgevlm_testkit.ballast import Ballast, fill
from edgevlm_testkit.bigpair import random_blocks, write_big_llava

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
GPUS = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
NO_GPU = "no GPU in this llama.cpp build (scripts/gpu_check.py [--vulkan] --tests)"


class FakeDevice:
    """A device that reports free = total − what it holds − others, each allocation rounded up
    to ``grain`` and costing ``cost`` × what was asked; ``refuse_over``: the largest it grants;
    ``knows``: False reports free == total whatever is held (lavapipe)."""

    def __init__(self, total=8192 * MIB, others=512 * MIB, grain=2 * MIB, cost=1.0, refuse_over=None, knows=True):
        self.name, self.max_chunk = "Fake0", 0
        self.total, self.others, self.grain, self.cost = total, others, grain, cost
        self.refuse_over, self.knows = refuse_over, knows
        self.held: dict[int, int] = {}
        self.allocs = 0

    def read(self):
        if not self.knows:
            return self.total, self.total
        return self.total - self.others - sum(self.held.values()), self.total

    def alloc(self, n):
        if self.refuse_over is not None and n > self.refuse_over:
            return None
        self.allocs += 1
        self.held[self.allocs] = -(-int(n * self.cost) // self.grain) * self.grain
        return self.allocs

    def release(self, h):
        del self.held[h]


@pytest.mark.parametrize(
    "target,kw",
    [
        (4096 * MIB, {}),
        (6144 * MIB, {"grain": 64 * MIB}),  # a coarse allocator
        (4096 * MIB, {"cost": 1.3}),  # each chunk costs more than asked: overshoots, gives back, refines
        (4096 * MIB, {"refuse_over": 300 * MIB}),  # large chunks refused: halves them
    ],
    ids=["plain", "coarse", "overshoot", "refusals"],
)
def test_fill_leaves_the_target_free_within_the_tolerance(target, kw):
    dev = FakeDevice(**kw)
    report, held = fill(dev, target, tolerance=16 * MIB)
    assert report.free_known
    assert report.converged
    assert abs(dev.read()[0] - target) <= 16 * MIB  # what the device itself now says
    assert report.free == dev.read()[0]
    assert report.held == sum(n for _, n in held)
    assert len(held) == len(dev.held)  # everything it allocated and did not give back, it holds


def test_fill_says_when_the_device_cannot_report_and_still_holds_the_memory():
    dev = FakeDevice(total=2048 * MIB, knows=False)
    report, held = fill(dev, 96 * MIB, tolerance=16 * MIB, chunk=1024 * MIB)
    assert not report.free_known
    assert sum(dev.held.values()) >= 2048 * MIB - 96 * MIB  # real memory held: total − target
    assert "free memory is unknown" in report.note
    assert "--free-memory" in report.note


def test_fill_finds_out_a_device_that_does_not_move_and_says_so():
    """free < total at first (a driver's own reservation) but allocations never show: after two
    that moved nothing it is a device that cannot report, not an endless loop."""
    dev = FakeDevice(total=2048 * MIB)
    dev.read = lambda: (1900 * MIB, 2048 * MIB)  # type: ignore[method-assign]
    report, _ = fill(dev, 512 * MIB, tolerance=16 * MIB, chunk=256 * MIB)
    assert not report.free_known
    assert "--free-memory" in report.note


def test_fill_stops_at_its_deadline():
    dev = FakeDevice(refuse_over=0)  # refuses everything
    ticks = iter(range(0, 10_000, 1))
    report, held = fill(dev, 1024 * MIB, tolerance=MIB, deadline_s=50, chunk=2**40, clock=lambda: next(ticks))
    assert not report.converged
    assert not held
    assert report.note


def test_fill_refuses_a_target_above_what_is_free():
    dev = FakeDevice(total=4096 * MIB)
    report, held = fill(dev, 6144 * MIB)
    assert not held
    assert not report.converged
    assert "less than" in report.note


@pytest.mark.parametrize(
    "qtype,gtype",
    [("q4_k", gguf.GGMLQuantizationType.Q4_K), ("q4_0", gguf.GGMLQuantizationType.Q4_0)],
)
def test_random_blocks_dequantize_to_finite_weights_of_the_asked_spread(qtype, gtype):
    """Checked with gguf-py's own dequantizer: valid blocks, finite, about N(0, std²) in size."""
    raw = random_blocks(np.random.default_rng(0), 64, 4096, qtype, std=4096**-0.5)
    w = gguf.quants.dequantize(raw, gtype)
    assert w.shape == (64, 4096)
    assert np.isfinite(w).all()
    assert 0.3 * 4096**-0.5 < w.std() < 3 * 4096**-0.5
    assert abs(w.mean()) < w.std()


def test_full_llava_pair_reads_as_the_published_shape(tmp_path):
    """The miniature is written in well under a second; the plan reads its header as a model of
    its layers (the full LLaVA-7B shape is the same code with bigger numbers)."""
    from edgevlm.plan.devices import probe
    from edgevlm.plan.planner import make_plan

    pair = write_big_llava(tmp_path, "llava-mini")
    assert pair.seconds < 5
    r = gguf.GGUFReader(pair.model)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.3.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_K
    assert "blk.4.attn_q.weight" not in types
    p = make_plan(str(pair.model), str(pair.mmproj), probe(device="cpu"))
    assert p.fits


def test_one_layer_more_than_the_plan_chose_does_not_fit(tmp_path):
    """``laptop_check --one-more`` on a what-if GPU (this works on a CPU-only build too): the
    auto plan's layer count fits with every lever pinned, one more does not."""
    pair = write_big_llava(tmp_path, "llava-mini")
    env_py = [sys.executable, str(ROOT / "scripts" / "laptop_check.py")]
    common = ["-m", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "auto", "--free-memory", "GPU0=90MiB",
              "--gpu-overhead", "8MiB", "--ubatch", "512"]  # fmt: skip
    plan = json.loads(subprocess.run([sys.executable, "-m", "edgevlm", "plan", *common, "--json"],
                                     capture_output=True, text=True, check=True, timeout=120).stdout)  # fmt: skip
    n = plan["n_gpu_layers"]
    assert 0 < n < 5  # a laptop's share: part of the 4 layers + output
    spec = {"plan": plan, "model": str(pair.model), "mmproj": str(pair.mmproj), "free_memory": ["GPU0=90MiB"],
            "overhead": "8MiB"}  # fmt: skip
    out = subprocess.run([*env_py, "--one-more", json.dumps(spec)], capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[str(n)]["fits"]
    assert got[str(n)]["n_gpu_layers"] == n
    assert not got[str(n + 1)]["fits"]
    assert got[str(n + 1)]["shortfall"] > 0


# ------------------------------------------------------------------------------------------------ on the device
@pytest.mark.timeout(240)
@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=NO_GPU)
def test_ballast_process_holds_real_device_memory_until_stopped():
    """A ballast on the first GPU: where the device reports free memory, it now reads the target
    (to the tolerance); where it cannot (lavapipe), the report says so and the memory is really
    held — lavapipe's device memory is the process's own, so its RSS shows it."""
    from edgevlm.plan.devices import probe

    target = 96 * MIB
    with Ballast(target, python=sys.executable, timeout=180) as b:
        rep = b.report
        assert rep is not None
        if rep.free_known:
            assert rep.converged
            free = probe().gpus[0].free_bytes
            assert abs(free - target) <= 16 * MIB
        else:
            assert "--free-memory" in rep.note
            assert rep.held >= rep.total - target - 16 * MIB
            assert psutil.Process(b.pid).memory_info().rss >= 0.9 * rep.held
        pid = b.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert b.proc is not None
    assert b.proc.returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason=NO_GPU)
def test_ballast_ends_when_its_parent_dies():
    """A parent killed with SIGKILL cannot stop its ballast: the ballast sees its standard input
    close and gives the memory back by itself."""
    code = (
        "import sys, time\n"
        "from edgevlm_testkit.ballast import Ballast\n"
        "b = Ballast('96MiB', python=sys.executable, timeout=180).__enter__()\n"
        "print(b.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        ballast = psutil.Process(pid)
    finally:
        parent.kill()
        parent.communicate(timeout=30)
    gone, alive = psutil.wait_procs([ballast], timeout=60)
    assert gone
    assert not alive
