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
    """TTFT of the follow-up on each side, and how many times faster it is than three others:
    edgevlm restarted without the disk tier, llama-server restored from its slot file, and
    llama-server restarted without one."""
    sides = r["sides"]
    refs = [
        (n, (sides.get(n) or {}).get("ttft_s"))
        for n in ("edgevlm no disk tier", "llama-server slot restore", "llama-server")
    ]
    rows = [
        "| after a restart (or not) | follow-up TTFT | times faster than: edgevlm, no disk tier "
        "| llama-server, slot restored | llama-server, restarted |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in SIDES:
        s = sides.get(name) or {}
        t = s.get("ttft_s")
        if t is None:
            rows.append(f"| {name} | – ({str(s.get('error', 'not run'))[:90]}) | | | |")
            continue
        ratios = [f"{ref / t:.1f}×" if ref and name != n else "–" for n, ref in refs]
        rows.append(f"| {name} | {t:.2f} s | " + " | ".join(ratios) + " |")
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
