"""What ``scripts/bench_kv_price.py`` measured, as docs/gpu.md shows it (``scripts/render_docs.py``
calls ``PARTS``): decode tokens/s per placement and the prices fitted to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from render_tables import _table, source

__all__ = ["PARTS"]

D = dict[str, Any]
UNITS = {  # each fitted price as the docs show it: a factor and a unit
    "base": (1e3, "ms per token"),
    "s_dev_weights": (1e12, "ps per byte of weights on the GPU"),
    "s_host_weights": (1e12, "ps per byte of weights on the host"),
    "s_dev_kv": (1e12, "ps per byte of KV read on the GPU"),
    "s_host_kv": (1e12, "ps per byte of KV read on the host"),
    "s_hop": (1e6, "µs per device↔host crossing"),
}


def price_table(d: D, stem: str) -> str:
    r = d["result"]
    fills = sorted({x["fill"] for x in r["rows"]})
    rows = []
    for key in dict.fromkeys((x["ngl"], x["offload_kqv"], x["kv"]) for x in r["rows"]):
        xs = {x["fill"]: x for x in r["rows"] if (x["ngl"], x["offload_kqv"], x["kv"]) == key}
        ngl, kqv, kv = key
        speeds = [
            f"{xs[f]['tokens_per_s']:.1f} ({xs[f]['predicted_tokens_per_s']:.1f})" if f in xs else "–" for f in fills
        ]
        rows.append([f"{ngl}/{r['shape']['n_layer'] + 1}", "on" if kqv else "off (KV on the host)", kv, *speeds])
    s = r["shape"]
    head = ["GPU layers", "offload_kqv", "KV type", *(f"tok/s at {f} cells (fitted)" for f in fills)]
    prices = "; ".join(f"{r['params'][k] * f:.3g} {unit}" for k, (f, unit) in UNITS.items())
    return (
        f"{r['device']} ({r['gpu']}); a generated LLaVA-shaped pair of {s['n_layer']} layers "
        f"({s['n_embd']} wide, {s['n_head_kv']} KV heads, {s['weights']} weights), context {r['n_ctx']}; "
        f"median of {r['repeats']} runs of {r['tokens']} tokens after a warm-up run:\n\n"
        + _table(head, rows, set(range(3, len(head))))
        + f"\n\nFitted prices (`edgevlm/data/kv_prices.json`): {prices}.\n\n"
        + source(d, stem)
    )


PARTS: dict[str, dict[str, Callable[[D, str], str]]] = {"bench_kv_price": {"table": price_table}}
