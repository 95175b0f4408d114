"""The parts of ``scripts/bench_gpu_speed.py``'s results (docs/results/bench_gpu_speed-*.json) that
docs/gpu.md shows between ``<!-- results:STEM:PART -->`` markers: ``summary`` (the machine, the
device, the build, the load both servers had), ``table`` (each measure per split: edgevlm,
llama-server, the ratio and its target) and ``profile`` (where edgevlm's time went, beside
llama-server's own timings)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PARTS"]

D = dict[str, Any]
MEASURES = [  # (key in the ratios, label, the value of a side, unit)
    ("ttft", "time to first token, 4000×3000 picture", lambda s: s["ttft"]["s"], "s"),
    ("decode_1", "decode, 1 stream", lambda s: s["decode_1"]["tok_per_s"], "tokens/s"),
    ("decode_4", "decode, 4 streams", lambda s: s["decode_4"]["tok_per_s"], "tokens/s"),
    ("caption", "captioning, 4 in flight", lambda s: s["caption"]["images_per_s"], "images/s"),
]


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "–"
    return f"{x:.3f} s" if unit == "s" else f"{x:,.1f} {unit}" if x >= 10 else f"{x:.2f} {unit}"


def _split(row: D) -> str:
    ngl = f"-ngl {row['settings']['n_gpu_layers']}"
    what = {"all": "every layer", "laptop": "laptop split", "0": "no layer"}.get(row["split"])
    return f"{what} ({ngl})" if what else ngl


def summary(d: D, stem: str) -> str:
    r, m = d["result"], d["machine"]
    flags = "/".join(
        f for f, on in (("AVX2", m.get("avx2")), ("AVX-512", m.get("avx512")), ("AMX", m.get("amx"))) if on
    )
    dev, b, st = r["device"], r["build"], r["splits"][0]["settings"]
    same = "the same CMake build as edgevlm's llama-cpp-python" if b.get("same_build") else "another build"
    kv = st["type_k"] if st["type_k"] == st["type_v"] else f"K {st['type_k']}, V {st['type_v']}"
    where = "on the device" if st["mmproj_on_gpu"] else "on the host"
    return "\n".join(
        [
            f"{dev['name']} ({dev['description']}); host {m['cpu']}, {m['cores']} cores, {flags}; "
            f"llama-cpp-python {m['llama_cpp_python']}; llama-server {b.get('llama_server_version') or '?'}, "
            f"{same}. Pair: `{r['pair']['dir']}`.",
            "",
            f"Both servers: context {st['n_ctx']} (one KV for {r['settings']['parallel']} sequences), KV {kv}, "
            f"batch {st['n_batch']}, micro-batch {st['n_ubatch']}, flash attention "
            f"{'on' if st['flash_attn'] else 'off'}, encoder {where}, "
            f"image budget {st['image_max_tokens']} tokens, {r['settings']['threads']} threads; "
            f"[{stem}.json](results/{stem}.json).",
        ]
    )


def table(d: D, stem: str) -> str:
    r = d["result"]
    lines = [
        "| split | measure | edgevlm | llama-server | edgevlm / llama-server | target |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["splits"]:
        for key, label, val, unit in MEASURES:
            ratio, met = row["ratios"][key], row["targets_met"][key]
            verdict = "–" if met is None else "met" if met else "**missed**"
            lines.append(
                f"| {_split(row)} | {label} | {_num(val(row['edgevlm']), unit)} | "
                f"{_num(val(row['llama_server']), unit)} | {'–' if ratio is None else f'{ratio:.2f}×'} | "
                f"{r['targets'][key].replace('<=', '≤').replace('>=', '≥')}× {verdict} |"
            )
    for row in r["splits"]:
        for side, name in (("edgevlm", "edgevlm's server"), ("llama_server", "llama-server")):
            died = row[side].get("died")
            if died:
                log = " / ".join(died["log"][-1:])
                lines += ["", f"At {_split(row)} {name} died (exit {died['exit']}; its log ends `{log}`): "
                          f"the measures after it are missing."]  # fmt: skip
    return "\n".join(lines)


def _server_ms(prof: D, key: str) -> str:
    """llama-server's own timings, over the replies: the prompt's evaluation (picture included)
    for TTFT, a generated token's time for decode."""
    t = [x for x in prof.get("timings") or [] if x]
    if not t:
        return "–"
    if key == "ttft":
        return f"prompt {sum(x['prompt_ms'] for x in t) / len(t):,.0f} ms"
    n = sum(x.get("predicted_n", 0) for x in t)
    return f"{sum(x['predicted_ms'] for x in t) / n:.2f} ms a token" if n else "–"


def profile(d: D, stem: str) -> str:
    head = "| split | measure | edgevlm's wall | in llama.cpp's decode calls | in the encoder | the rest (Python) |"
    lines = [
        head + " steps | ms a step: all (llama.cpp, rest) | llama-server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in d["result"]["splits"]:
        for key, label, _, _ in MEASURES:
            e = row["edgevlm"][key]["profile"]
            if not e:
                continue
            per = f"{e['step_ms']:.2f} ({e['llama_ms_per_step']:.2f}, {e['python_ms_per_step']:.2f})"
            peer = row["llama_server"][key]["profile"]
            lines.append(
                f"| {_split(row)} | {label} | {e['wall_ms']:,.0f} ms | {e['llama_ms']:,.0f} ms | "
                f"{e['encode_ms']:,.0f} ms | {e['python_ms']:,.0f} ms | {e['steps']} | {per} | "
                f"{_server_ms(peer, key)} |"
            )
    prof = [row for row in d["result"]["splits"] if row.get("step_profile")]
    if prof:
        lines += [
            "",
            "edgevlm's step loop under cProfile, one stream (a process of its own, where a target was missed):",
            "",
        ]
        lines += [
            "| split | tokens | steps | ms a step | in llama.cpp calls | of which | Python |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in prof:
            sp = row["step_profile"]
            if "error" in sp:
                lines.append(f"| {_split(row)} | – | – | – | – | {sp['error']} | – |")
                continue
            calls = ", ".join(f"{k} {v / max(1, sp['steps']):.2f}" for k, v in sp["calls_ms"].items())
            lines.append(
                f"| {_split(row)} | {sp['tokens']} | {sp['steps']} | {sp['step_ms']:.2f} | "
                f"{sp['calls_ms_per_step']:.2f} | {calls} | {sp['python_ms_per_step']:.2f} |"
            )
    missed = sorted({k for row in d["result"]["splits"] for k in row["missed"]})
    names = {k: label for k, label, _, _ in MEASURES}
    lines += ["", "Missed: " + ("; ".join(names[k] for k in missed) if missed else "none") + "."]
    return "\n".join(lines)


def deaths(d: D, stem: str) -> str:
    """One line for a run: its budget and context, and per split which server ran through and which
    died in which measure (with its exit)."""
    r = d["result"]
    st = r["splits"][0]["settings"]
    parts = []
    for row in r["splits"]:
        sides = []
        for side, name in (("edgevlm", "edgevlm"), ("llama_server", "llama-server")):
            died = row[side].get("died")
            if not died:
                sides.append(f"{name} ran through")
                continue
            where = next((label for key, label, _, _ in MEASURES if row[side][key]["errors"]), "between measures")
            sides.append(f"{name} died in {where} (exit {died['exit']})")
        parts.append(f"{_split(row)}: " + ", ".join(sides))
    return (
        f"- [budget {st['image_max_tokens']}, context {st['n_ctx']}](results/{stem}.json) — " + "; ".join(parts) + "."
    )


PARTS: dict[str, dict[str, Callable[[D, str], str]]] = {
    "bench_gpu_speed": {"summary": summary, "table": table, "profile": profile, "deaths": deaths},
}
