"""A plan set against llama.cpp's own dry run of it (``backend.dryrun``): the compute buffers
of every device and the output buffer, predicted and reserved. ``edgevlm plan --check`` shows
it; where the model file is local it costs a tenth of a second and allocates nothing."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ..backend.dryrun import DryRun
from .footprint import Breakdown, Plan

__all__ = ["CheckRow", "ROUNDING", "can_check", "check_plan", "compare", "learn"]

ROUNDING = int(0.006 * 2**20)  # llama.cpp logs sizes in MiB with two decimals


@dataclass(frozen=True)
class CheckRow:
    device: str  # "CUDA0", "Vulkan0", "CPU"
    buffer: str  # "compute", "output"
    predicted: int  # bytes
    reserved: int  # bytes, what llama.cpp's dry run logged

    @property
    def error(self) -> float:
        return (self.predicted - self.reserved) / self.reserved if self.reserved else 0.0

    @property
    def under(self) -> bool:
        """The plan counted less than llama.cpp reserves (beyond the log's rounding)."""
        return self.reserved - self.predicted > ROUNDING

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), error=self.error, under=self.under)


def can_check(model: str, gpu_names: list[str]) -> bool:
    """Whether llama.cpp's dry run can stand for a plan: the text model is a file here,
    llama.cpp is installed, and every GPU in the plan is a device it registered (a what-if GPU
    on a machine without one is not)."""
    if not os.path.isfile(model):
        return False
    from ..backend.system import ggml_devices

    real = {d.name for d in ggml_devices()}
    return bool(real) and all(n in real for n in gpu_names)


def check_plan(p: Plan) -> list[CheckRow]:
    """llama.cpp's dry run of plan ``p`` (its text model must be a local file), per buffer."""
    from ..backend.dryrun import dry_run

    if not os.path.isfile(p.model):
        raise FileNotFoundError(f"{p.model}: --check needs the model file here")
    got = dry_run(p.model, n_seq_max=p.sequences, **p.backend_options())
    host = next(d for d in p.devices if d.kind == "cpu")
    return compare(got, [(d.name, d.predicted) for d in p.devices if d.kind != "cpu"], (host.name, host.predicted))


def compare(got: DryRun, gpus: list[tuple[str, Breakdown]], host: tuple[str, Breakdown]) -> list[CheckRow]:
    """Rows of predicted vs reserved: each GPU's compute, the host's compute (the CPU backend's
    buffer is the first GPU's pinned host type when the model has a GPU) and the output buffer."""
    names = {n for n, _ in gpus}
    rows = [CheckRow(n, "compute", b.compute, got.compute.get(n, 0)) for n, b in gpus]
    host_compute = sum(v for k, v in got.compute.items() if k not in names)
    rows.append(CheckRow(host[0], "compute", host[1].compute, host_compute))
    rows.append(CheckRow(host[0], "output", host[1].other, sum(got.output.values())))
    return rows


def learn(scale: dict[str, float], rows: list[CheckRow]) -> list[CheckRow]:
    """Raise ``scale`` (per device, what the replay's compute is multiplied by) where llama.cpp
    reserved more compute than the plan counted; the rows that were under."""
    under = [r for r in rows if r.buffer == "compute" and r.under]
    for r in under:
        old = scale.get(r.device, 1.0)
        raw = r.predicted / old
        if raw > 0:  # (a buffer the replay put nowhere cannot be scaled: it stays reported as under)
            scale[r.device] = max(old, r.reserved / raw)
    return under
