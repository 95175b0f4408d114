"""What a placement costs in decode speed: the price table the planner weighs its options by.

When not every layer fits on the GPU the planner can leave layers on the host, leave the KV cache
on the host (llama.cpp's ``offload_kqv`` off: attention then runs on the CPU, the rest of the
layer on the GPU), or make the KV cache smaller. Which is fastest is a property of the machine,
so it is measured, not guessed: ``scripts/bench_kv_price.py`` loads a generated pair at several
placements on a device, measures decode tokens/s, and fits the few parameters of the model
below by least squares (never negative). The fitted parameters, the measured rows and the
machine they came from are committed per GPU class in ``edgevlm/data/kv_prices.json``; a GPU
with no entry of its own is priced by the table's ``default`` entry, and the plan says so.

The model: the time to decode one token is

    base + s_dev_weights × weight bytes on GPUs + s_host_weights × weight bytes on the host
         + s_dev_kv × KV bytes read on GPUs + s_host_kv × KV bytes read on the host
         + s_hop × device↔host crossings in the layer graph

where the KV bytes read are the cells of a representative fill (half the context the user asked
for, at most ``FILL_CAP``) and a crossing is each change of device along the graph (the input on
the host, each layer where it runs — an offloaded layer with its KV on the host crosses twice,
out to the host for attention and back — the output layer, the logits back on the host).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..model.kv_types import KV_TYPES
from .devices import Device
from .estimate import layer_devices
from .offload import device_refuses

__all__ = [
    "FILL_CAP",
    "PARAMS",
    "PRICES_ENV",
    "PriceTable",
    "Traffic",
    "fit",
    "load_prices",
    "prices_for",
    "representative_fill",
    "traffic",
]

PARAMS = ("base", "s_dev_weights", "s_host_weights", "s_dev_kv", "s_host_kv", "s_hop")
FILL_CAP = 4096  # the fill a price is read at never exceeds this many cells
PRICES_ENV = "EDGEVLM_KV_PRICES"  # another price table (a file of the same form)
DEFAULT_KEY = "default"


@dataclass(frozen=True)
class Traffic:
    """What one decoded token moves: bytes read per device class, and crossings."""

    dev_weights: int = 0
    host_weights: int = 0
    dev_kv: int = 0
    host_kv: int = 0
    hops: int = 0

    def features(self) -> list[float]:
        """The regressors of the price model, in ``PARAMS`` order."""
        return [1.0, self.dev_weights, self.host_weights, self.dev_kv, self.host_kv, float(self.hops)]


@dataclass(frozen=True)
class PriceTable:
    """One GPU class's fitted prices (seconds, seconds per byte) and where they came from."""

    key: str  # what a device's description must contain ("llvmpipe", "NVIDIA H200"), or "default"
    gpu: str  # the GPU's name as the probe reported it where measured
    params: dict[str, float]
    machine: dict[str, Any] = field(default_factory=dict)
    rows: tuple[dict[str, Any], ...] = ()  # the measured configurations (bench_kv_price.py)
    source: str = ""  # the result file the rows came from
    about: str = ""
    fallback: str = ""  # set when this entry prices a device it was not measured on: that device

    def seconds(self, t: Traffic) -> float:
        return sum(self.params.get(k, 0.0) * x for k, x in zip(PARAMS, t.features(), strict=True))

    def tokens_per_s(self, t: Traffic) -> float:
        s = self.seconds(t)
        return 1.0 / s if s > 0 else float("inf")

    @property
    def label(self) -> str:
        """How a plan names the table it priced with."""
        if self.fallback:
            return f"default (no measurement for {self.fallback})"
        return f"measured for {self.gpu}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = list(self.rows)
        return d


def _table_path() -> Path:
    env = os.environ.get(PRICES_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data" / "kv_prices.json"


def load_prices(path: str | os.PathLike[str] | None = None) -> dict[str, PriceTable]:
    """Every entry of a price table file (``$EDGEVLM_KV_PRICES``, else the packaged one)."""
    raw = json.loads(Path(path or _table_path()).read_text())
    out = {}
    for key, e in raw["entries"].items():
        out[key] = PriceTable(
            key=key,
            gpu=e.get("gpu", key),
            params={k: float(e["params"].get(k, 0.0)) for k in PARAMS},
            machine=e.get("machine", {}),
            rows=tuple(e.get("rows", ())),
            source=e.get("source", ""),
            about=e.get("about", ""),
        )
    if DEFAULT_KEY not in out:
        raise ValueError(f"{path or _table_path()}: the price table has no {DEFAULT_KEY!r} entry")
    return out


def prices_for(device: Device, tables: dict[str, PriceTable] | None = None) -> PriceTable:
    """The entry whose key the device's description (or name) contains, longest key first; else the
    default entry, marked with the device it stands in for."""
    tables = load_prices() if tables is None else tables
    text = f"{device.description} {device.name}".lower()
    for key in sorted((k for k in tables if k != DEFAULT_KEY), key=len, reverse=True):
        if key.lower() in text:
            return tables[key]
    d = tables[DEFAULT_KEY]
    who = device.description if device.description and device.description != "what-if GPU" else device.name
    return replace(d, fallback=who)


def representative_fill(n_ctx_wished: int) -> int:
    """The KV cells a price is read at: half the context asked for, at most ``FILL_CAP``."""
    return max(1, min(n_ctx_wished // 2, FILL_CAP))


def traffic(
    tensors: Any, n_layer: int, n_head_kv: int, head_dim: int, gpus: list[Device], ngl: int,
    type_k: str, type_v: str, offload_kqv: bool, fill: int,
) -> Traffic:  # fmt: skip
    """Bytes one token reads per device class at ``fill`` cells, and the graph's crossings.
    ``tensors``: ``estimate.TextTensors`` (the input embedding is a row lookup, not counted)."""
    splits = [float(g.usable_bytes or 1) for g in gpus]
    devs = layer_devices(n_layer, ngl, splits) if gpus else [-1] * (n_layer + 1)
    dev_w = host_w = 0
    for w in tensors.tensors:
        if w.layer < 0:
            continue
        d = devs[w.layer]
        if d >= 0 and not device_refuses(w, gpus[d]):
            dev_w += w.n_bytes
        else:
            host_w += w.n_bytes
    e = n_head_kv * head_dim
    per_layer = int(fill * e * (KV_TYPES[type_k].bytes_per_element + KV_TYPES[type_v].bytes_per_element))
    dev_kv = host_kv = 0
    where = [-1]  # the input embedding is looked up on the host
    for il in range(n_layer):
        d = devs[il]
        if d >= 0 and offload_kqv:
            dev_kv += per_layer
            where.append(d)
        elif d >= 0:  # attention on the host, the rest of the layer on the GPU
            host_kv += per_layer
            where += [d, -1, d]
        else:
            host_kv += per_layer
            where.append(-1)
    where += [devs[n_layer], -1]  # the output layer, then the logits read on the host
    hops = sum(1 for a, b in zip(where, where[1:], strict=False) if a != b)
    return Traffic(dev_w, host_w, dev_kv, host_kv, hops)


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares prices, none negative (Lawson–Hanson), from measured rows: each a
    ``Traffic``'s fields and the tokens/s measured (``tokens_per_s``). Columns are scaled to
    unit size first so bytes and counts weigh alike."""
    import numpy as np

    x = np.array([Traffic(**{k: r[k] for k in Traffic.__dataclass_fields__}).features() for r in rows], dtype=float)
    y = np.array([1.0 / r["tokens_per_s"] for r in rows], dtype=float)
    scale = np.where(np.abs(x).max(axis=0) > 0, np.abs(x).max(axis=0), 1.0)
    a = x / scale
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    coef = np.zeros(n)
    for _ in range(4 * n):
        grad = a.T @ (y - a @ coef)
        if passive.all() or grad[~passive].max(initial=0.0) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                coef = z
                break
            bad = passive & (z <= 0)
            step = np.min(coef[bad] / (coef[bad] - z[bad] + 1e-300))
            coef = coef + step * (z - coef)
            passive &= coef > 1e-15
    return {k: float(c / s) for k, c, s in zip(PARAMS, coef, scale, strict=True)}
