"""The docs' parts of ``scripts/bench_restart.py``'s results (``render_docs.PARTS``): the table
the script prints, and which run it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from render_tables import source

__all__ = ["PARTS", "SIDES", "table"]

D = dict[str, Any]
SIDES = ("edgevlm resident", "edgevlm --cache-dir", "edgevlm no disk tier", "llama-server slot restore", "llama-server")


def table(r: dict[str, Any]) -> str:
    sides = r["sides"]
    base = (sides.get("edgevlm no disk tier") or {}).get("ttft_s")
    peer = (sides.get("llama-server") or {}).get("ttft_s")
    rows = [
        "| server, after | follow-up TTFT | vs edgevlm without the disk tier | vs llama-server restarted |",
        "|---|---:|---:|---:|",
    ]
    for name in SIDES:
        s = sides.get(name) or {}
        t = s.get("ttft_s")
        if t is None:
            rows.append(f"| {name} | – ({s.get('error', 'not run')[:90]}) | | |")
            continue
        rows.append(f"| {name} | {t:.2f} s | {base / t:.1f}x faster |" if base else f"| {name} | {t:.2f} s | – |")
        rows[-1] += f" {peer / t:.1f}x faster |" if peer else " – |"
    return "\n".join(rows)


def _table(d: D, stem: str) -> str:
    return table(d["result"])


def _summary(d: D, stem: str) -> str:
    r = d["result"]
    return (
        f"{r['pictures']} pictures, {r['history_tokens']:,} tokens of history, replies of {r['reply_tokens']} tokens, "
        f"context {r['ctx']:,}, test kit preset `{r['preset']}`; the stop that wrote the conversation took "
        f"{r['stop_s']:.1f} s, the folder {r['cache_dir_bytes'] / 2**20:,.1f} MiB. " + source(d, stem)
    )


PARTS: dict[str, dict[str, Callable[[D, str], str]]] = {"bench_restart": {"table": _table, "summary": _summary}}
