"""The parts of each benchmark's results that the docs show: ``PARTS[benchmark][part](d, stem)``
is the Markdown between ``<!-- results:STEM:PART -->`` markers (``scripts/render_docs.py``).
Every number comes from the file; the words around them are fixed. Parts named ``readme`` are
README's "Measured" rows (its links are relative to the repository root), ``source`` says which
run a table is."""

from __future__ import annotations

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
        f"One-shot TTFT, 1 picture ({cfg['family']}/{cfg['preset']}, {cfg['runs']} runs, {cfg['threads']} threads):",
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
        + ", ".join(f"{t} {v:+.1f}" for t, v in diffs.items())
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
    rows.append(["**total**", f"**{_pct2(r['total_max_abs_error'])}**", "", "", str(len(r["rows"]))])
    rows.append(["a file size + f16 KV estimate", _pct2(r["naive_max_abs_error"]), "", "", str(len(r["rows"]))])
    head = ["component", "max error (buffers ≥ 1 MiB)", "largest under-estimate", "max error in MiB", "buffers"]
    return (
        f"{len(r['rows'])} configurations ({', '.join(r['presets'])} pairs):\n\n"
        + _table(head, rows)
        + "\n\n"
        + _src(d, stem)
    )


def _pct2(x: float, sign: bool = False) -> str:
    return (f"{x:+.2%}" if sign else f"{x:.2%}").replace("%", " %").replace("-", "−")


def planner_readme(d: D, stem: str) -> str:
    r = d["result"]
    fams = {x["config"].split()[0] for x in r["rows"]}
    return (
        f"| memory predicted vs llama.cpp's own buffer logs, {len(r['rows'])} configurations, {len(fams)} families "
        f"| max error {_pct2(r['total_max_abs_error'])} in total (a file-size estimate: up to "
        f"{_pct2(r['naive_max_abs_error'])} off) | [plan.md](docs/plan.md), "
        f"[models.md](docs/models.md#what-edgevlm-knows-about-each-projector-type) ([run](docs/results/{stem}.json)) |"
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
}
