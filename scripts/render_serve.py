"""The parts of ``scripts/bench_serve.py``'s runs that docs/serve.md and README show
(``scripts/render_docs.py``): ``chats`` (a picture per conversation), ``chats-shared`` (one
picture for all; runs with ``--shared-picture``), ``decode`` and ``readme``. Every column comes
from the run's JSON: requests/s, turn-3 TTFT p50 and the ITL p95 beside a new picture and
without one, per server and client count; generated tokens/s per stream count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from render_tables import source

__all__ = ["PARTS"]

D = dict[str, Any]
SERVERS = ("edgevlm", "llama-server", "llama-cpp-python")


def _by(d: D, shared: bool) -> dict[tuple[str, int], D]:
    return {(r["server"], r["clients"]): r for r in d["result"]["chats"] if r["shared_picture"] == shared}


def _ratio(a: float | None, b: float | None) -> str:
    return f"**{a / b:.2f}×**" if a and b else "–"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def chats(d: D, shared: bool) -> str:
    by = _by(d, shared)
    head = ["clients", "req/s edgevlm", "llama-server", "llama_cpp.server", "÷ llama-server"]
    head += ["turn-3 TTFT p50 edgevlm", "llama-server", "llama_cpp.server", "÷ llama-server"]
    head += ["ITL p95 edgevlm, beside a new picture / without (ms)", "llama-server"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in sorted({c for _, c in by}):
        row = {s: by.get((s, n)) for s in SERVERS}
        req = [f"{r['req_per_s']:.2f}" if r else "–" for r in row.values()]
        ttft = [
            f"{r['ttft_p50_turn3']:.2f} s" if r and r.get("ttft_p50_turn3") is not None else "–" for r in row.values()
        ]
        e, ls = row["edgevlm"], row["llama-server"]
        itl = [f"{_ms(r['itl_p95_admitting_ms'])} / {_ms(r['itl_p95_ms'])}" if r else "–" for r in (e, ls)]
        cells = [str(n), *req, _ratio(e and e["req_per_s"], ls and ls["req_per_s"])]
        cells += [*ttft, _ratio(e and e.get("ttft_p50_turn3"), ls and ls.get("ttft_p50_turn3")), *itl]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode(d: D, stem: str) -> str:
    by = {(r["server"], r["streams"]): r for r in d["result"]["decode"]}
    lines = ["| streams | edgevlm | llama-server | llama_cpp.server | ÷ llama-server |", "|---:|---:|---:|---:|---:|"]
    for n in sorted({s for _, s in by}):
        row = [by.get((s, n)) for s in SERVERS]
        cells = [f"{r['tok_per_s']:,.0f}" if r else "–" for r in row]
        lines.append(
            f"| {n} | "
            + " | ".join(cells)
            + f" | {_ratio(row[0] and row[0]['tok_per_s'], row[1] and row[1]['tok_per_s'])} |"
        )
    return "\n".join(lines) + "\n\n" + source(d, stem)


def readme(d: D, stem: str) -> str:
    spans = []
    for shared, what in ((True, "with a shared picture"), (False, "with a picture each")):
        by = _by(d, shared)
        rs = [
            by[("edgevlm", n)]["req_per_s"] / by[("llama-server", n)]["req_per_s"]
            for s, n in by
            if s == "edgevlm" and ("llama-server", n) in by
        ]
        if rs:
            spans.append(f"{min(rs):.2f}–{max(rs):.2f}× {what}")
    ns = sorted({r["clients"] for r in d["result"]["chats"]})
    return (
        f"| `edgevlm serve` vs `llama-server` (same llama.cpp), {ns[0]}–{ns[-1]} users in 3-turn chats | requests/s "
        + ", ".join(spans)
        + f" | [serve.md](docs/serve.md#against-llama-server) ([run](docs/results/{stem}.json)) |"
    )


PARTS: dict[str, Callable[[D, str], str]] = {
    "chats": lambda d, stem: chats(d, False),
    "chats-shared": lambda d, stem: chats(d, True),
    "decode": decode,
    "readme": readme,
}
