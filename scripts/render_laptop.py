"""The parts of ``scripts/laptop_check.py``'s results (docs/results/laptop_check-*.json) that
docs/gpu.md shows between ``<!-- results:STEM:PART -->`` markers: ``table`` (one row per size
left free) and ``summary`` (the device, the pair, what could not be measured there)."""

from __future__ import annotations

from typing import Any

MIB = 2**20
D = dict[str, Any]


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MIB:,.0f}" if n >= 10 * MIB else f"{n / MIB:,.1f}"


def _run(r: D) -> str:
    ok = "ok" if r["rc"] == 0 and not r["oom"] else "OOM" if r["oom"] else f"failed ({r['rc']})"
    if r.get("answers") is not None:
        ok += f", {r['answers']} answers"
    peak = "peak not measurable" if r["peak"] is None else f"peak {_mib(r['peak'])} of {_mib(r['bound'])}"
    return f"{ok}, {r['seconds']:.0f} s, {peak}" + (" !" if r["within"] is False else "")


def _more(row: D) -> str:
    om, n = row["one_more"], row["plan"]["n_gpu_layers"]
    if "error" in om:
        return "not checked (error)"
    if str(n + 1) not in om:
        return f"none: all {om['layers']} on the device"
    m = om[str(n + 1)]
    return "fits (!)" if m["fits"] else f"short by {_mib(m['shortfall'])} MiB"


def _kv_place(p: dict) -> str:
    """Where the plan put the KV cache (older runs did not record it)."""
    if "offload_kqv" not in p:
        return ""
    return " (device)" if p["offload_kqv"] and p["n_gpu_layers"] > 0 else " (host)"


def table(d: D) -> str:
    res = d["result"]
    gpu = res["device"]["name"]
    lines = [
        f"| free on {gpu} | ballast holds | plan: layers, ctx, KV (where), ubatch | {gpu} planned (MiB) "
        "| one layer more "
        f"| chat, 4000×3000 | serve, 4 clients | caption, {res['setup']['captions']} pictures | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["sizes"]:
        b, p = row["ballast"], row["plan"]
        read = " (what-if: the device cannot say)" if row["what_if"] else f", read {_mib(b['free'])} MiB"
        free = row["size"] + read
        lines.append(
            f"| {free} | {_mib(b['held'])} MiB "
            f"| {p['n_gpu_layers']}, {p['n_ctx']}, {p['type_k']}{_kv_place(p)}, {p['n_ubatch']} "
            f"| {_mib(p['device_total'])} + {_mib(row['overhead'])} overhead | {_more(row)} "
            f"| {_run(row['runs']['chat'])} | {_run(row['runs']['serve'])} | {_run(row['runs']['caption'])} "
            f"| {'yes' if row['ok'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def summary(d: D) -> str:
    res, m = d["result"], d["machine"]
    dev, pair, setup = res["device"], res["pair"], res["setup"]
    ok = sum(r["ok"] for r in res["sizes"])
    unknown = not dev["free_known"]
    return (
        f"{dev['name']} ({dev['description']}, {_mib(dev['total'])} MiB); host {m['cpu']}, {m['cores']} cores; "
        f"llama-cpp-python {m['llama_cpp_python']}; `python scripts/{' '.join(d['command'])}`, {d['date'][:10]}, "
        f"commit `{d['commit'][:7]}`{' plus uncommitted changes' if d.get('code_changed') else ''}.\n\n"
        f"Pair: {setup['why']} ({_mib(pair['bytes'])} MiB"
        + (f", written in {pair['write_seconds']:.1f} s" if pair["write_seconds"] else "")
        + f"){', GPU overhead ' + setup['overhead'] if setup['overhead'] else ''}"
        + (f", plan flags `{' '.join(setup['levers'])}`" if setup["levers"] else "")
        + f". {ok} of {len(res['sizes'])} sizes passed in {res['seconds']:.0f} s."
        + (
            f"\n\n{dev['name']} reports free == total: the ballast held the memory, but free memory could not be read, "
            "so each plan was told the size (`--free-memory`) and no peak could be sampled."
            if unknown
            else ""
        )
        + "\n"
    )


PARTS = {
    "table": lambda d, stem: table(d),
    "summary": lambda d, stem: summary(d),
}
