"""The parts of each benchmark's results that the docs show: ``PARTS[benchmark][part](d, stem)``
is the Markdown between ``<!-- results:STEM:PART -->`` markers (``scripts/render_docs.py``).
Every number comes from the file; the words around them are fixed. Parts named ``readme`` are
README's "Measured" rows (its links are relative to the repository root), ``source`` says which
run a table is."""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Callable
from typing import Any

__all__ = ["PARTS", "source"]

MIB = 2**20
D = dict[str, Any]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}".replace("%", " %")


def _flags(m: D) -> str:
    return "/".join(f for f, on in (("AVX2", m.get("avx2")), ("AVX-512", m.get("avx512")), ("AMX", m.get("amx"))) if on)


def source(d: D, stem: str, rel: str = "results/") -> str:
    """Which run: the command, the commit, the machine, the date, how busy the machine was."""
    m, load = d["machine"], d["load"]
    changed = " plus uncommitted changes" if d.get("code_changed") else ""
    la = load.get("loadavg_start"), load.get("loadavg_end")
    busy = (f"; load average {la[0][0]:.1f} at the start, {la[1][0]:.1f} at the end" if la[0] and la[1] else "") + (
        f"; other processes used {_pct(load['others_cpu_share'])} of the CPUs"
        if load.get("others_cpu_share") is not None
        else ""
    )
    return (
        f"`python scripts/{' '.join(d['command'])}`, {d['date'][:10]}, commit `{d['commit'][:7]}`{changed}; "
        f"{m['cpu']}, {m['cores']} cores ({_flags(m)}), llama-cpp-python {m['llama_cpp_python']}{busy}; "
        f"{load['wall_s']:.0f} s ([{stem}.json]({rel}{stem}.json))."
    )


def _table(head: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = set(range(1, len(head))) if right is None else right
    align = ["---:" if i in right else "---" for i in range(len(head))]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _src(d: D, stem: str) -> str:
    return source(d, stem)


# --- bench_session ------------------------------------------------------------------------------
def session_table(d: D, stem: str) -> str:
    runs = d["result"]["runs"]
    a_, b_, c_ = runs["edgevlm"], runs["re-prefill"], runs["llama-cpp-python"]

    def ms(r: D) -> str:
        return f"{r['ms']:.0f}" if r["ok"] else "FAIL"

    def ratio(r: D, a: D) -> str:
        return f"{r['ms'] / a['ms']:.1f}×" if r["ok"] and a["ok"] else "–"

    rows = []
    for i, (a, b, c) in enumerate(zip(a_, b_, c_, strict=True)):
        note = f"{a['summarized']} summarised, ctx {a['n_ctx_used']}" if a["ok"] else a["error"][:40]
        rows.append([str(i + 1), ms(a), ms(b), ratio(b, a), ms(c), ratio(c, a), note])
    head = ["turn", "edgevlm ms", "re-prefill ms", "÷ edgevlm", "llama-cpp-python ms", "÷ edgevlm", "edgevlm"]
    return _table(head, rows, set(range(0, 6)))


def session_summary(d: D, stem: str) -> str:
    s, n = d["result"]["summary"], len(d["result"]["runs"]["edgevlm"])
    lines = []
    for k, v in s.items():
        err = v["first_error"]
        lines.append(
            f"- {k}: {v['turns_ok']}/{n} turns, median {v['median_ms'] or 0:.0f} ms a turn, max RSS "
            f"{v['max_rss_mib']:.0f} MiB" + (f"; first error at turn {err['turn']}: {err['error']}" if err else "")
        )
    cfg = d["result"]["config"]
    return (
        f"{n} turns, 10 pictures, n_ctx {cfg['ctx']} ({cfg['preset']} pair, {cfg['threads']} threads):\n\n"
        + "\n".join(lines)
        + "\n\n"
        + _src(d, stem)
    )


# --- bench_merge --------------------------------------------------------------------------------
def merge_table(d: D, stem: str) -> str:
    r = d["result"]
    rows = [
        [
            x["family"],
            x["method"],
            str(x["tokens"]),
            f"{x['prefill_ms']:.0f}",
            f"{x['ttft_ms']:.0f}",
            f"{x['ttft_speedup']:.2f}×",
            f"{x['kv_bytes'] / MIB:.1f}",
            f"{x['fidelity']:.3f}",
        ]
        for x in r["rows"]
    ]
    head = ["family", "method", "tokens", "prefill ms", "TTFT ms", "TTFT speed-up", "KV MiB", "fidelity"]
    return (
        f"1024×768 picture, {r['preset']} pairs, median of {r['runs']} runs:\n\n"
        + _table(head, rows, set(range(2, 8)))
        + "\n\n"
        + _src(d, stem)
    )


# --- bench_budget -------------------------------------------------------------------------------
def budget_table(d: D, stem: str) -> str:
    r = d["result"]
    rows = [
        [
            x["family"],
            str(x["budget"] or "none"),
            str(x["tokens"]),
            f"{x['encode_ms']:.0f}",
            f"{x['prefill_ms']:.0f}",
            f"{x['ttft_ms']:.0f}",
            f"{x['ttft_speedup_vs_unbudgeted']:.1f}×",
            f"{x['peak_rss_bytes'] / MIB:.0f}",
        ]
        for x in r["rows"]
    ]
    head = ["family", "budget", "tokens", "encode ms", "prefill ms", "TTFT ms", "TTFT speed-up", "peak RSS MiB"]
    q = next(x for x in r["rows"] if x["family"] == "qwen2vl" and x["budget"] == 1024)
    met = "met" if r["target_ttft_1024_ge_4x"] else "not met"
    return (
        f"4000×3000 picture, {r['preset']} pairs, median of {r['runs']} run(s), each budget in a fresh process:\n\n"
        + _table(head, rows, set(range(1, 8)))
        + f"\n\nQwen2-VL-shaped at a budget of 1,024 tokens: TTFT {q['ttft_speedup_vs_unbudgeted']:.1f}× sooner than "
        f"unbudgeted (target ≥ 4×: {met}).\n\n" + _src(d, stem)
    )


# --- bench_chat ---------------------------------------------------------------------------------
def chat_tables(d: D, stem: str) -> str:
    r = d["result"]
    o, cfg = r["one_shot"], r["config"]
    one = _table(
        ["side", "TTFT per run (ms)", "median ms", "prompt tokens", "others' CPU share per run"],
        [
            [
                name,
                ", ".join(f"{x:.0f}" for x in o[f"{name}_ttft_ms"]),
                f"{o[f'{name}_median_ms']:.0f}",
                str(o[f"{name}_prompt_tokens"]),
                ", ".join(_pct(b or 0) for b in o[f"{name}_busy_others"]),
            ]
            for name in ("edgevlm", "library")
        ],
        {2, 3},
    )
    ok = r["targets"]["one_shot_ratio_le_1.02"]
    out = [
        f"One-shot TTFT, 1 picture ({cfg['family']}/{cfg['preset']}, {cfg['runs']} runs, {cfg['n_threads']} threads):",
        "",
        one,
        "",
        f"edgevlm ÷ library = {o['median_ratio']:.3f} (paired runs: "
        f"{', '.join(f'{x:.3f}' for x in o['paired_ratios'])}; target ≤ 1.02: {'met' if ok else 'not met'}).",
    ]
    turns = r["conversation"]["turns"]
    if turns:
        rows = [
            [
                str(t["turn"]),
                t["image"] or "–",
                f"{t['edgevlm_ttft_ms']:.0f}",
                f"{t['library_ttft_ms']:.0f}",
                f"{t['ttft_ratio']:.2f}×",
                f"{t['edgevlm_ms']:.0f}",
                f"{t['library_ms']:.0f}",
                f"{t['ratio']:.2f}×",
                f"{t['edgevlm_evaluated_tokens']}/{t['edgevlm_cached_tokens']}",
            ]
            for t in turns
        ]
        head = [
            "turn",
            "picture",
            "TTFT edgevlm",
            "TTFT library",
            "library ÷ edgevlm",
            "turn edgevlm",
            "turn library",
            "library ÷ edgevlm",
            "edgevlm tokens evaluated/cached",
        ]
        busy = r["conversation"]["busy_others"]
        ok5 = r["targets"]["turn5_ratio_ge_3"]
        out += [
            "",
            f"{len(turns)}-turn conversation, medians of {cfg['runs']} runs (ms):",
            "",
            _table(head, rows, set(range(0, 9)) - {1}),
            "",
            f"Turn {turns[-1]['turn']}: library ÷ edgevlm = {turns[-1]['ratio']:.2f}× (target ≥ 3×: "
            f"{'met' if ok5 else 'not met'}); others' CPU share per run: edgevlm "
            f"{', '.join(_pct(b) for b in busy['edgevlm'])}, library {', '.join(_pct(b) for b in busy['library'])}.",
        ]
    return "\n".join(out) + "\n\n" + _src(d, stem)


# --- bench_quality ------------------------------------------------------------------------------
TYPES = ("colour", "shape", "count", "letter", "describe")


def _acc(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def quality_table(d: D, stem: str) -> str:
    r = d["result"]
    rows = [[x["condition"], *[_acc(x.get(t)) for t in TYPES], str(sum(x["n"].values()))] for x in r["rows"]]
    return (
        f"Answer accuracy (%), {r['scenes']} plain + {r['detail']} detail held-out scenes (seeds from {r['seed']}), "
        f"{r['seconds']:.0f} s:\n\n" + _table(["condition", *TYPES, "answers"], rows) + "\n\n" + _src(d, stem)
    )


def _row(d: D, name: str) -> D:
    return next(x for x in d["result"]["rows"] if x["condition"] == name)


def _right(x: D, t: str) -> str:
    n = x["n"].get(t, 0)
    return f"{round((x[t] or 0) * n / 100)} of {n}"


def quality_targets(d: D, stem: str) -> str:
    full = _row(d, "full resolution")
    lines = ["| target | measured | |", "|---|---|---|"]
    ok = [t for t in ("colour", "shape", "count") if (full[t] or 0) >= 90]
    miss = [t for t in ("colour", "shape", "count") if t not in ok]
    lines.append(
        "| ≥ 90 % colour, shape, count at full resolution | "
        + " / ".join(_acc(full[t]) for t in ("colour", "shape", "count"))
        + " | "
        + (f"{' and '.join(ok)} met" if ok else "none met")
        + (f"; {', '.join(f'{t} not ({_right(full, t)})' for t in miss)}" if miss else "")
        + " |"
    )
    let = full["letter"] or 0
    lines.append(
        f"| ≥ 80 % letters | {_acc(full['letter'])} | {'met' if let >= 80 else 'not met'}: {_right(full, 'letter')} |"
    )
    gains = []
    for b in sorted(
        {int(x["condition"].split()[3].rstrip(",")) for x in d["result"]["rows"] if x["condition"].startswith("detail")}
    ):
        on, off = _row(d, f"detail scenes, budget {b}, tiles auto"), _row(d, f"detail scenes, budget {b}, tiles off")
        gains.append((on["letter"] - off["letter"], b, on["letter"], off["letter"]))
    best = max(gains)
    lines.append(
        "| detail scenes: tiles auto ≥ 30 points over off at one budget | "
        + ", ".join(f"{on:.1f} vs {off:.1f} ({b})" for _, b, on, off in sorted(gains, key=lambda g: -g[1]))
        + f" | {'met' if best[0] >= 30 else 'not met'} at {best[1]} tokens ({best[0]:+.0f}) |"
    )
    m_off, m_half = _row(d, "merge off"), _row(d, "merge ratio:0.5")
    diffs = {t: m_half[t] - m_off[t] for t in ("colour", "shape")}
    lines.append(
        "| merge ratio 0.5 within 5 points of off on colour/shape | "
        + ", ".join(f"{t} {'±0' if abs(v) < 0.05 else f'{v:+.1f}'.replace('-', '−')}" for t, v in diffs.items())
        + " | "
        + "; ".join(f"{t} {'met' if abs(v) <= 5 else 'not met'}" for t, v in diffs.items())
        + " |"
    )
    summ = next((x for x in d["result"]["rows"] if x["condition"].startswith("summarised picture")), None)
    note = next((x for x in d["result"]["rows"] if x["condition"].startswith("same questions, a right note")), None)
    if summ and note:
        c = summ["colour"] or 0
        lines.append(
            f"| ≥ 70 % colour about a summarised picture | {_acc(summ['colour'])} ({_acc(note['colour'])} with a right "
            f"note) | {'met' if c >= 70 else 'not met'}: {_right(summ, 'colour')} |"
        )
    return "\n".join(lines)


def quality_readme(d: D, stem: str) -> str:
    full = _row(d, "full resolution")
    return (
        f"| the demo model's answers, {d['result']['scenes']} held-out scenes | shapes {full['shape']:.0f} %, counts "
        f"{full['count']:.0f} %, colours {full['colour']:.0f} %, letters {full['letter']:.0f} % | "
        f"[demo-model.md](docs/demo-model.md) ([run](docs/results/{stem}.json)) |"
    )


# --- bench_ubatch -------------------------------------------------------------------------------
NAMES = {"llava15": "LLaVA-1.5-7B", "qwen2vl": "Qwen2-VL-2B", "llava16": "LLaVA-1.6-7B"}


def ubatch_table(d: D, stem: str) -> str:
    r = d["result"]
    rows = []
    for fam in dict.fromkeys(x["family"] for x in r["rows"]):
        xs = [x for x in r["rows"] if x["family"] == fam]
        rows.append(
            [
                NAMES.get(fam, fam) if r["preset"] == "real" else f"{fam} ({r['preset']})",
                " / ".join(str(x["n_ubatch"]) for x in xs),
                " / ".join(f"{x['text_tok_s']:.0f}" for x in xs),
                " / ".join(f"{x['image_tok_s']:.0f}" for x in xs),
                " / ".join(f"{x['text_compute_mib']:.1f}" for x in xs) + " MiB",
            ]
        )
    head = ["model (layer shapes)", "n_ubatch", "text prefill tok/s", "image prefill tok/s", "text compute buffer"]
    return (
        f"Median of {r['runs']} runs, {r['threads']} threads:\n\n" + _table(head, rows, set()) + "\n\n" + _src(d, stem)
    )


# --- bench_planner ------------------------------------------------------------------------------
def planner_table(d: D, stem: str) -> str:
    r = d["result"]
    rows = [
        [
            name,
            _pct2(s["max_abs_error"]),
            _pct2(min(0.0, s["min_error"]), sign=True),
            f"{s['max_abs_error_mib']:.3f}",
            str(s["n"]),
        ]
        for name, s in r["per_component"].items()
    ]
    rows.append(["**total**", f"**{_pct3(r['total_max_abs_error'])}**", "", "", str(len(r["rows"]))])
    rows.append(["a file size + f16 KV estimate", _pct2(r["naive_max_abs_error"]), "", "", str(len(r["rows"]))])
    head = ["component", "max error (buffers ≥ 1 MiB)", "largest under-estimate", "max error in MiB", "buffers"]
    return (
        f"{len(r['rows'])} configurations ({', '.join(r['presets'])} pairs):\n\n"
        + _table(head, rows)
        + "\n\n"
        + _src(d, stem)
    )


def _pct3(x: float) -> str:
    return f"{x:.3%}".replace("%", " %")


def _pct2(x: float, sign: bool = False) -> str:
    return (f"{x:+.2%}" if sign else f"{x:.2%}").replace("%", " %").replace("-", "−")


def planner_readme(d: D, stem: str) -> str:
    r = d["result"]
    fams = {x["config"].split()[0] for x in r["rows"]}
    return (
        f"| memory predicted vs llama.cpp's own buffer logs, {len(r['rows'])} configurations, {len(fams)} families "
        f"| max error {_pct3(r['total_max_abs_error'])} in total (a file-size estimate: up to "
        f"{_pct2(r['naive_max_abs_error'])} off) | [plan.md](docs/plan.md), "
        f"[models.md](docs/models.md#what-edgevlm-knows-about-each-projector-type) ([run](docs/results/{stem}.json)) |"
    )


# --- soak_serve ---------------------------------------------------------------------------------
def soak_table(d: D, stem: str) -> str:
    r = d["result"]
    statuses = sorted(r["total"], key=lambda x: (not x.isdigit(), x))
    rows = []
    for kind, counts in r["counts"].items():
        sec = r.get("seconds", {}).get(kind, {})
        p50, p95 = sec.get("p50"), sec.get("p95")
        rows.append(
            [kind, *[str(counts.get(st, 0)) for st in statuses]]
            + [f"{p50:.2f}" if p50 is not None else "", f"{p95:.2f}" if p95 is not None else ""]
        )
    rows.append(["all", *[str(r["total"].get(st, 0)) for st in statuses], "", ""])
    a, host = r["args"], r["host_plan"]
    lines = [
        f"{a['clients']} clients × {a['requests']} requests, {a['family']} tiny pair, --ctx {a['ctx']}:",
        "",
        _table(["kind", *statuses, "p50 s", "p95 s"], rows),
        "",
        f"- peak RSS {r['peak_rss_bytes'] / MIB:,.1f} MiB ({r['rss_ready_bytes'] / MIB:,.1f} MiB when ready)",
    ]
    if host.get("limit"):
        lines.append(
            f"- planned for the host: buffers {host['buffers'] / MIB:,.1f} MiB + image cache "
            f"{host['image_cache'] / MIB:,.1f} MiB + process {host['process'] / MIB:,.1f} MiB + allowance for requests "
            f"{host['allowance'] / MIB:,.1f} MiB + host KV cache {host['kv_cache'] / MIB:,.1f} MiB = "
            f"{host['limit'] / MIB:,.1f} MiB; peak / planned = {r['peak_rss_bytes'] / host['limit']:.2f}"
        )
    held = r.get("host_held") or {}
    if held:
        lines.append(
            f"- requests held at most {held['peak_in_use_bytes'] / MIB:,.1f} MiB of the allowance ({held['waits']} "
            f"waited for it, {held['refused']} refused with 503); RSS after the run {held['rss_bytes'] / MIB:,.1f} MiB"
        )
    lines.append(
        f"- {sum(r['total'].values())} requests in {r['wall_s']:.0f} s; 5xx other than 503: {r['bad_5xx']}; hangs: "
        f"{r['hangs']}; connection errors: {r['connection_errors']}; malformed not 4xx/503: "
        f"{r['malformed_not_4xx']}; server alive: {r['alive']}; slots/queue left taken: {r['leaked']}: "
        f"**{'FAIL' if r['failed'] else 'PASS'}**"
    )
    return "\n".join(lines) + "\n\n" + _src(d, stem)


def soak_readme(d: D, stem: str) -> str:
    r = d["result"]
    a, limit = r["args"], r["host_plan"].get("limit")
    n503 = r["total"].get("503", 0)
    plan = f" of {limit / MIB:,.0f} MiB planned" if limit else ""
    load = d["load"].get("others_cpu_share")
    busy = f" (other processes used {_pct(load)} of the CPUs)" if load is not None else ""
    return (
        f"| `edgevlm serve` under faults: {sum(r['total'].values())} random requests, {a['clients']} clients | "
        f"**{'FAIL' if r['failed'] else 'PASS'}**{busy}: {r['bad_5xx']} 5xx besides {n503} 503s, {r['hangs']} hangs, "
        f"peak RSS {r['peak_rss_bytes'] / MIB:,.0f} MiB{plan} | "
        f"[serve.md](docs/serve.md#under-faults) ([run](docs/results/{stem}.json)) |"
    )


# --- bench_video --------------------------------------------------------------------------------
def _video_row(x: D) -> list[str]:
    if x["budget"] is None:
        fits = "refused" if x.get("refused") else ("yes" if x["fits_ctx"] else x.get("stopped") or "error")
        if x.get("refused") and x.get("request_s"):
            ttft = f"{x['request_s'] * 1000:.0f} to refusal"
        else:
            ttft = f"{x['ttft_ms']:.0f}" if x.get("ttft_ms") is not None else "–"
        event, ratio = "–", "1.00×"
        rss = f"{x['peak_rss_bytes'] / MIB:.0f}" + ("+" if x.get("stopped") else "")
    else:
        fits = "yes" if x["fits_ctx"] else f"error: {x.get('error', '')}"[:40]
        ttft = f"{x['ttft_ms']:.0f}" if x.get("ttft_ms") is not None else "–"
        ks = x.get("event_frames") or []
        if x["event_kept"] is None:
            event = "–"
        elif not ks:
            event = "no"
        else:
            event = f"yes, {len(ks)} ({ks[0]:.1f}" + (f"–{ks[-1]:.1f} s)" if len(ks) > 1 else " s)")
        rss = f"{x['peak_rss_bytes'] / MIB:.0f}"
        ratio = f"{x['rss_vs_llamacpp']:.2f}×" if x.get("rss_vs_llamacpp") else "–"
    return [
        x["model"],
        x["approach"],
        str(x.get("frames", "–")),
        f"{x['tokens']:,}" if x.get("tokens") is not None else "–",
        fits,
        ttft,
        rss,
        ratio,
        f"{x['wall_s']:.1f}",
        event,
        _pct(x.get("others_cpu")),
    ]


def video_table(d: D, stem: str) -> str:
    r = d["result"]
    c = r["clip"]
    head = ["model", "approach", "frames", "tokens", "fits ctx?", "TTFT ms", "peak RSS MiB", "RSS ÷ llama.cpp"]
    head += ["wall s", "event frame kept?", "others' CPU"]
    notes = []
    for x in r["rows"]:
        if x["budget"] is not None and x.get("tokens_vs_llamacpp") and x.get("rss_vs_llamacpp"):
            notes.append(
                f"- {x['model']} {x['approach']}: {1 / x['tokens_vs_llamacpp']:.0f}× fewer tokens, "
                f"{1 / x['rss_vs_llamacpp']:.1f}× less peak RSS than llama.cpp's 4 fps"
            )
        elif x["budget"] is None:
            why = x.get("refused") or x.get("stopped") or (str(x["error"]) if x.get("error") else "fits, evaluated")
            notes.append(f"- {x['model']} llama.cpp ({x.get('source', r['peer'])}): {why}")
    return (
        f"A {c['seconds']:g} s {c['size'][0]}×{c['size'][1]} clip ({c['fps']} fps; the red square "
        f"{c['event_s'][0]:.0f}–{c['event_s'][1]:.0f} s), qwen2vl/{r['preset']} pair, n_ctx {r['n_ctx']}, "
        f"{r['threads']} threads, each row in a fresh process:\n\n"
        + _table(head, [_video_row(x) for x in r["rows"]], {2, 3, 5, 6, 7, 8})
        + "\n\n"
        + "\n".join(notes)
        + "\n\n"
        + _src(d, stem)
    )


def video_readme(d: D, stem: str) -> str:
    r = d["result"]
    c = r["clip"]
    q = [x for x in r["rows"] if x["model"].startswith("qwen2vl") and x["budget"] is not None]
    base = next(x for x in r["rows"] if x["model"].startswith("qwen2vl") and x["budget"] is None)
    fewer = sorted(1 / x["tokens_vs_llamacpp"] for x in q if x.get("tokens_vs_llamacpp"))
    rss = [x["rss_vs_llamacpp"] for x in q if x.get("rss_vs_llamacpp")]
    kept = all(x.get("event_kept") for x in q)
    how = "" if r["peer"] == "helper" else ", laid out with PyAV"
    return (
        f"| a {c['seconds']:g} s {c['size'][1]}p clip, Qwen2-VL-2B shapes: edgevlm under a budget vs all frames "
        f"at 4 fps (llama.cpp's video helper{how}) | {fewer[0]:.0f}–{fewer[-1]:.0f}× fewer tokens, {max(rss):.2f}× the "
        f"peak RSS ({min(x['peak_rss_bytes'] for x in q) / MIB:,.0f} MiB vs {base['peak_rss_bytes'] / 2**30:.0f} GiB "
        f"before llama.cpp refuses it); the 5 s event {'kept at every budget' if kept else 'missed at some budget'} | "
        f"[benchmarks.md](docs/benchmarks.md#video-under-a-budget) ([run](docs/results/{stem}.json)) |"
    )


def _video_rows(r: D) -> tuple[D, list[D]]:
    """The Qwen2-VL-shaped rows: llama.cpp's (no budget), then edgevlm's by budget."""
    q = [x for x in r["rows"] if x["model"].startswith("qwen2vl")]
    ours = sorted((x for x in q if x["budget"] is not None), key=lambda x: x["budget"])
    return next(x for x in q if x["budget"] is None), ours


def _peer(r: D) -> str:
    return "llama.cpp's video helper" + ("" if r["peer"] == "helper" else " (frames laid out with PyAV)")


def video_readme_table(d: D, stem: str) -> str:
    """README's "Video under a budget": the clip, then llama.cpp's 4 fps against each budget."""
    r = d["result"]
    c = r["clip"]
    base, ours = _video_rows(r)

    def row(x: D, name: str) -> list[str]:
        fits = "refused" if x.get("refused") else ("yes" if x["fits_ctx"] else "no")
        kept = "–" if x.get("event_kept") is None else ("yes" if x["event_kept"] else "no")
        tokens = f"{x['tokens']:,}" + (" (+ labels)" if x["budget"] is not None else "")
        return [name, str(x["frames"]), tokens, fits, f"{x['peak_rss_bytes'] / MIB:,.0f} MiB", kept]

    rows = [row(base, f"{_peer(r)}, 4 fps")]
    rows += [row(x, f"edgevlm, `--video-tokens {x['budget']}`") for x in ours]
    head = ["approach", "frames", "tokens", f"fits {base['n_ctx']:,} ctx?", "peak RSS", "event frame kept?"]
    return (
        f"A {c['seconds']:g} s {c['size'][1]}p clip ({c['fps']} fps; an event from {c['event_s'][0]:.0f} s to "
        f"{c['event_s'][1]:.0f} s) on the Qwen2-VL-2B shape, each row in a fresh process "
        f"(`scripts/bench_video.py`, [run](docs/results/{stem}.json)):\n\n" + _table(head, rows, {1, 2, 4})
    )


def video_summary(d: D, stem: str) -> str:
    """docs/video.md's paragraph on the same run."""
    r = d["result"]
    c = r["clip"]
    base, ours = _video_rows(r)
    rss = [x["peak_rss_bytes"] / MIB for x in ours]
    toks = " / ".join(f"{x['tokens']:,}" for x in ours)
    kept = (
        "a frame of the event is kept at every budget"
        if all(x.get("event_kept") for x in ours)
        else "the event is missed at some budget"
    )
    refused = (
        f"before the prompt is refused for exceeding the {base['n_ctx']:,}-token context"
        if base.get("refused")
        else "(the prompt fits)"
    )
    return (
        f"`python scripts/bench_video.py` uses a {c['seconds']:g}-second {c['size'][0]}×{c['size'][1]} clip with a red "
        f"square that shows for {c['event_s'][1] - c['event_s'][0]:.0f} seconds, and the Qwen2-VL-2B-shaped pair. "
        f"{_peer(r)} samples {base['frames']:,} frames, {base['tokens']:,} tokens, and peaks at "
        f"{base['peak_rss_bytes'] / 2**30:.1f} GiB of RSS {refused}. edgevlm at `--video-tokens` "
        f"{' / '.join(str(x['budget']) for x in ours)} sends {' / '.join(str(x['frames']) for x in ours)} frames "
        f"({toks} image tokens, their labels within the budget "
        f"too) in {min(rss):,.0f}–{max(rss):,.0f} MiB, and {kept} ([run](results/{stem}.json))."
    )


# --- bench_suite --------------------------------------------------------------------------------
def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def suite_readme(d: D, stem: str) -> str:
    """README's "Test": how long README's test command and the quick loop took, on what machine."""
    m, load = d["machine"], d["load"]

    def one(x: D) -> str:
        c = x["counts"]
        what = ", ".join(f"{c[k]:,} {k}" for k in ("passed", "failed", "error", "skipped", "deselected") if c.get(k))
        bad = "" if x["returncode"] == 0 else f", exit code {x['returncode']}"
        return f"`{shlex.join(x['command'])}` **{_duration(x['wall_s'])}** ({what or 'no tests'}{bad})"

    busy = load.get("others_cpu_share")
    runs = d["result"]["runs"]
    return (
        f"Measured: {'; '.join(one(x) for x in runs)}, one after the other on {m['cpu']}, {m['cores']} cores, "
        + (f"other processes using {_pct(busy)} of the CPUs meanwhile " if busy is not None else "")
        + f"({d['date'][:10]}, commit `{d['commit'][:7]}`, [run](docs/results/{stem}.json); "
        f"`python scripts/bench_suite.py` measures it again)."
    )


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


PARTS: dict[str, dict[str, Callable[[D, str], str]]] = {
    "bench_session": {"table": session_table, "summary": session_summary},
    "bench_merge": {"table": merge_table},
    "bench_budget": {"table": budget_table},
    "bench_chat": {"tables": chat_tables},
    "bench_quality": {"table": quality_table, "targets": quality_targets, "readme": quality_readme},
    "bench_ubatch": {"table": ubatch_table},
    "bench_planner": {"table": planner_table, "readme": planner_readme},
    "soak_serve": {"table": soak_table, "readme": soak_readme},
    "bench_video": {
        "table": video_table,
        "readme": video_readme,
        "readme-table": video_readme_table,
        "summary": video_summary,
    },
    "bench_suite": {"readme": suite_readme},
}
