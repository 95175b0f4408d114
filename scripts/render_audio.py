"""The docs' parts of ``bench_audio_decode`` (``scripts/bench_audio_decode.py``): peak host
memory decoding a one-hour recording under a token budget, without one, and whole into one
array as llama.cpp's helper does. Every number comes from the results file."""

from __future__ import annotations

from typing import Any

from render_tables import source

__all__ = ["PARTS"]

D = dict[str, Any]


def _num(x: float | None, fmt: str = "{:,.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def decode_table(d: D, stem: str) -> str:
    r = d["result"]
    f = r["file"]
    head = "| case | tokens | decoded | peak RSS | above the imports | seconds |\n|---|---:|---:|---:|---:|---:|"
    rows = [
        f"| {row['label']} | {_num(row.get('tokens'), '{:,}')} | {_num(row.get('decoded_s'), '{:,.0f} s')} | "
        f"{row['peak_rss_mib']:.1f} MiB | {row['above_baseline_mib']:.1f} MiB | {row['seconds']:.2f} |"
        for row in r["rows"]
    ]
    lead = (
        f"A {f['minutes']:.0f}-minute MP3 ({f['bit_rate'] // 1000} kbps, {f['bytes'] / 2**20:.1f} MiB) under a "
        f"{r['budget_tokens']:,}-token budget, Whisper windows of {r['tokens_per_window']} tokens; each case in a "
        f"process of its own. The budgeted decode's lease is {r['lease_mib']:.2f} MiB; it used "
        f"{r['budget_above_first_second_mib']:.1f} MiB more than decoding the first second alone."
    )
    return f"{lead}\n\n{head}\n" + "\n".join(rows) + f"\n\n{source(d, stem)}\n"


PARTS: dict[str, dict[str, Any]] = {"bench_audio_decode": {"table": decode_table}}
