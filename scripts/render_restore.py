"""The parts of ``scripts/bench_restore.py``'s runs that the docs show (``scripts/render_docs.py``):
``table`` (the next turn's TTFT three ways per KV type, the targets, the file's size per 1,000
cells and where a restore's time goes) and ``example`` (its ``edgevlm chat --session --json``
run and the refusal, as the terminal showed them). Every number comes from the run's JSON."""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from render_tables import _pct, _table, source

__all__ = ["PARTS", "tables"]

D = dict[str, Any]
MIB = 2**20
WAYS = (
    ("same_process", "(a) same process, KV resident"),
    ("restored", "(b) new process, restored from the file"),
    ("resent", "(c) new process, whole history re-sent"),
)
LOAD_PARTS = (
    ("read_and_checksum", "read + checksum"),
    ("decode_pictures", "pictures decoded (PNG)"),
    ("binding", "binding (model fingerprints)"),
    ("state_seq_set_data", "`llama_state_seq_set_data`"),
)


def _ms(x: float) -> str:
    return f"{x:,.0f}"


def _s(x: float) -> str:
    return f"{x / 1000:.1f}"


def _med(rows: list[D], key: str) -> int:
    return round(statistics.median(r[key] for r in rows))


def _runs(rows: list[D], key: str) -> str:
    return ", ".join(_ms(r[key]) for r in rows)


def _ttft(kv: str, k: D) -> list[list[str]]:
    s, runs = k["summary"], k["runs"]
    out = []
    for way, label in WAYS:
        rows, w = runs[way], s[way]
        restore = f"{_ms(w['load_ms'])} + {_ms(w['turn_ttft_ms'])}" if way == "restored" else "–"
        wall = _s(w["process_to_first_token_ms"]) if "process_to_first_token_ms" in w else "–"
        ev = f"{_med(rows, 'prompt_n')}/{_med(rows, 'cached_n')}"
        out.append(
            [
                kv,
                label,
                f"**{_ms(w['ttft_ms'])}**",
                _runs(rows, "ttft_total_ms"),
                restore,
                wall,
                ev,
                str(_med(rows, "images_encoded")),
                ", ".join(_pct(r["busy_others"]) for r in rows),
            ]
        )
    return out


def _verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def tables(d: D) -> str:
    r = d["result"]
    cfg, by_kv = r["config"], r["by_kv"]
    first = next(iter(by_kv.values()))
    f0 = first["file"]
    head = ["KV", "next turn", "TTFT ms (median)", "per run", "restore: load + turn ms", "process start → 1st token s"]
    head += ["evaluated/cached tokens", "pictures encoded", "others' CPU per run"]
    rows = [row for kv, k in by_kv.items() for row in _ttft(kv, k)]
    out = [
        f"A conversation of {f0['pictures']} pictures and {f0['cells']:,} tokens ({cfg['family']}/{cfg['preset']} "
        f"pair, n_ctx {cfg['n_ctx']:,}, {cfg['threads']} threads), then a text follow-up ({cfg['reply_tokens']} tokens "
        f"answered); medians of {cfg['runs']} runs ((c): the first {cfg['resent_runs']}):",
        "",
        _table(head, rows, {2, 3, 5, 6, 7}),
        "",
    ]
    for kv, k in by_kv.items():
        s = k["summary"]
        met = list(s["targets"].values())
        same = s["same_reply_as_same_process"]
        out.append(
            f"- {kv}: (c) ÷ (b) = **{s['resent_over_restored']:.2f}×** (target ≥ "
            f"{cfg['targets']['resent_over_restored_ge']:g}×: {_verdict(met[0])}); (b) ÷ (a) = "
            f"**{s['restored_over_same_process']:.2f}×** (target ≤ "
            f"{cfg['targets']['restored_over_same_process_le']:g}×: {_verdict(met[1])}; per run "
            f"{', '.join(f'{x:.2f}' for x in s['restored_over_same_process_paired'])}); from the process start, "
            f"(c) ÷ (b) = {s['resent_over_restored_wall']:.2f}×; the follow-up's answer was (a)'s in "
            f"{same['restored']}/{cfg['runs']} runs restored, {same['resent']}/{cfg['resent_runs']} re-sent."
        )
    head2 = ["KV", "KV cells", "file MiB", "of it KV MiB", "pictures MiB", "file MiB per 1,000 cells"]
    head2 += ["KV MiB per 1,000 cells", "save ms"]
    rows2 = []
    for kv, k in by_kv.items():
        f = k["file"]
        rows2.append(
            [
                kv,
                f"{f['cells']:,}",
                f"{f['bytes'] / MIB:.1f}",
                f"{f['kv_bytes'] / MIB:.1f}",
                f"{f['picture_bytes'] / MIB:.2f}",
                f"**{f['bytes_per_1k_cells'] / MIB:.2f}**",
                f"{f['kv_bytes_per_1k_cells'] / MIB:.2f}",
                _ms(f["save_ms"]),
            ]
        )
    out += ["", "The file:", "", _table(head2, rows2), ""]
    head3 = ["KV", *[label for _, label in LOAD_PARTS], "rest of load", "turn: prompt rendered", "turn: the rest"]
    head3 += ["(a)'s turn: prompt rendered", "(a)'s turn: the rest", "(b)'s process, next turn's TTFT"]
    rows3 = []
    for kv, k in by_kv.items():
        b, a = k["summary"]["restored"], k["summary"]["same_process"]
        parts = [b["load_parts_ms"][p] for p, _ in LOAD_PARTS]
        rows3.append(
            [
                kv,
                *[_ms(x) for x in parts],
                _ms(max(0.0, b["load_ms"] - sum(parts))),
                _ms(b["render_ms"]),
                _ms(max(0.0, b["turn_ttft_ms"] - b["render_ms"])),
                _ms(a["render_ms"]),
                _ms(max(0.0, a["ttft_ms"] - a["render_ms"])),
                _ms(b["second_turn_ttft_ms"]),
            ]
        )
    out += [
        "Where (b)'s TTFT goes, medians in ms (a turn's rest: the follow-up evaluated, its first token sampled), "
        "beside (a)'s turn:"
    ]
    out += ["", _table(head3, rows3)]
    return "\n".join(out)


def table(d: D, stem: str) -> str:
    return tables(d) + "\n\n" + source(d, stem)


def _shown(argv: list[str]) -> str:
    """The command as typed: the generated pair's files by their names."""
    args = list(argv)
    for i, a in enumerate(args[:-1]):
        if a in ("-m", "--mmproj"):
            args[i + 1] = Path(args[i + 1]).name
    return "$ " + shlex.join(args)


def _json_line(out: D) -> str:
    """The --json object with the stats that matter here and the session object whole."""
    keep = ("prompt_n", "cached_n", "images_encoded", "image_encode_ms", "ttft_ms", "n_ctx_used")
    stats = ", ".join(f'"{k}": {json.dumps(out["stats"][k])}' for k in keep)
    session = json.dumps(out["session"])
    return f'{{"text": {json.dumps(out["text"])}, "stats": {{{stats}, ...}},\n "session": {session}}}'


def example(d: D, stem: str) -> str:
    r = d["result"]
    kv, k = next(iter(r["by_kv"].items()))
    ex, no = k["cli"], r["refusal"]
    lines = ["```", _shown(ex["argv"]), _json_line(ex["output"])]
    if no:
        lines += [f"{_shown(no['argv'])}  # exit code {no['returncode']}", *no["stderr"].splitlines()]
    lines += ["```"]
    return "\n".join(lines)


PARTS: dict[str, Callable[[D, str], str]] = {"table": table, "example": example}
