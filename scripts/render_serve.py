"""The parts of ``scripts/bench_serve.py``'s runs that docs/serve.md and README show
(``scripts/render_docs.py``): ``chats`` (a picture per conversation), ``chats-shared`` (one
picture for all; runs with ``--shared-picture``), ``decode`` and ``readme``. Every column comes
from the run's JSON: requests/s, turn-3 TTFT p50 and the ITL p95 beside a new picture and
without one, and the server's CPU seconds per request, per server and client count; generated
tokens/s and CPU seconds per 1,000 tokens per stream count. Runs made before the CPU was read
(no ``cpu_s`` in their rows) show "–" there."""

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


def _cpu(r: D | None, key: str) -> float | None:
    return r.get(key) if r else None


def _cpus(row: dict[str, D | None], key: str) -> list[str]:
    """Each server's CPU seconds (per request, per 1k tokens), and edgevlm's ÷ llama-server's."""
    v = {s: _cpu(r, key) for s, r in row.items()}
    cells = ["–" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}" for x in v.values()]
    return [*cells, _ratio(v["edgevlm"], v["llama-server"])]


def _profile(d: D) -> str:
    p = (d["result"].get("args") or {}).get("profile")
    return f"`edgevlm serve --profile {p}`:\n\n" if p and p != "None" else ""


def chats(d: D, shared: bool) -> str:
    by = _by(d, shared)
    head = ["clients", "req/s edgevlm", "llama-server", "llama_cpp.server", "÷ llama-server"]
    head += ["turn-3 TTFT p50 edgevlm", "llama-server", "llama_cpp.server", "÷ llama-server"]
    head += ["ITL p95 edgevlm, beside a new picture / without (ms)", "llama-server"]
    head += ["CPU-s / request edgevlm", "llama-server", "llama_cpp.server", "CPU ÷ llama-server"]
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
        cells += _cpus(row, "cpu_s_per_request")
        lines.append("| " + " | ".join(cells) + " |")
    return _profile(d) + "\n".join(lines)


def decode(d: D, stem: str) -> str:
    by = {(r["server"], r["streams"]): r for r in d["result"]["decode"]}
    head = ["streams", "edgevlm", "llama-server", "llama_cpp.server", "÷ llama-server"]
    head += ["CPU-s / 1k tokens edgevlm", "llama-server", "llama_cpp.server", "CPU ÷ llama-server"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in sorted({s for _, s in by}):
        row = {s: by.get((s, n)) for s in SERVERS}
        e, ls = row["edgevlm"], row["llama-server"]
        cells = [str(n), *[f"{r['tok_per_s']:,.0f}" if r else "–" for r in row.values()]]
        cells += [_ratio(e and e["tok_per_s"], ls and ls["tok_per_s"]), *_cpus(row, "cpu_s_per_1k_tokens")]
        lines.append("| " + " | ".join(cells) + " |")
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
    cpu = []
    for shared in (True, False):
        by = _by(d, shared)
        cpu += [
            e["cpu_s_per_request"] / ls["cpu_s_per_request"]
            for (s, n), e in by.items()
            if s == "edgevlm"
            and (ls := by.get(("llama-server", n)))
            and e.get("cpu_s_per_request")
            and ls.get("cpu_s_per_request")
        ]
    if cpu:
        spans[-1] += f"; CPU-s per request {min(cpu):.2f}–{max(cpu):.2f}× llama-server's"
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
