"""The parts of ``scripts/bench_caption.py``'s runs that the docs show (``scripts/render_docs.py``):
``table`` and ``readme``. A run has the four sides of issue #48 (``edgevlm caption``, ``edgevlm
batch``, a ``llama-server`` script, the llama-cpp-python loop) with images/s, completion tokens/s,
the CPU seconds each picture cost and the paired ratios against caption; a run made before them
(``edgevlm`` against the loop alone) renders as it did. Every number comes from the run's JSON."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from render_tables import _pct, _table, source

__all__ = ["PARTS"]

D = dict[str, Any]
LABELS = {
    "caption": "`edgevlm caption`",
    "batch": "`edgevlm batch`",
    "llama-server": "`llama-server` script",
    "library": "llama-cpp-python loop",
}
RATIO = {"llama-server": "caption_vs_llama_server", "library": "caption_vs_library"}
TARGETS = (
    ("caption_ge_1.2x_llama_server", "caption ≥ 1.2× the llama-server script"),
    ("caption_ge_1.3x_library", "caption ≥ 1.3× the library loop"),
    ("batch_within_5pct_of_caption", "batch within 5 % of caption"),
    ("caption_engine_share_ge_0.95", "≥ 95 % of caption's time inside llama.cpp"),
)


def _new(d: D) -> bool:
    return all("sides" in v for v in d["result"]["by_max_tokens"].values())


def _x(q: D | None, key: str = "median", invert: bool = False) -> str:
    v = q and q.get(key)
    return "–" if not v else f"{(1 / v if invert else v):.2f}×"


def _vs(name: str, ratios: D) -> tuple[str, str]:
    """caption ÷ the side (images/s, per run) and caption's CPU seconds ÷ the side's."""
    if name in RATIO and RATIO[name] in ratios:
        q = ratios[RATIO[name]]
        return f"**{q['median']:.2f}×** ({', '.join(f'{x:.2f}' for x in q['paired'])})", _x(q, "cpu")
    if name == "batch" and "batch_vs_caption" in ratios:
        q = ratios["batch_vs_caption"]  # batch ÷ caption: shown the other way round, as every row
        return f"**{1 / q['median']:.2f}×** (batch {q['median'] - 1:+.1%})".replace("%", " %"), _x(q, "cpu", True)
    return "–", "–"


def table(d: D, stem: str) -> str:
    if not _new(d):
        return legacy_table(d, stem)
    r = d["result"]
    cfg = r["config"]
    n = cfg["images"]
    head = ["caption tokens", "side", "images/s", "completion tok/s", "completion tokens", "CPU-s / picture"]
    head += ["wall s", "caption ÷ side (per run)", "CPU-s caption ÷ side", "others' CPU per run"]
    rows = []
    for length, v in r["by_max_tokens"].items():
        for name, runs in v["sides"].items():
            sm = v["summary"][name]
            vs, cpu = _vs(name, v["ratios"])
            errors = f" ({sm['errors']} failed)" if sm.get("errors") else ""
            rows.append(
                [
                    length,
                    LABELS.get(name, name) + errors,
                    f"{sm['images_per_s']:.3f}",
                    f"{sm['tok_per_s']:.1f}",
                    f"{sm['generated']:,.0f}",
                    f"{sm['cpu_s_per_image']:.2f}",
                    f"{sm['wall_s']:.1f}",
                    vs,
                    cpu,
                    ", ".join(_pct(x["busy_others"]) for x in runs),
                ]
            )
    w, h = cfg["size"]
    profile = f", scheduler profile `{cfg['scheduler_profile']}`" if cfg.get("scheduler_profile") else ""
    notes = [targets(r), *(f"{LABELS.get(k, k)} skipped: {why}." for k, why in cfg.get("skipped", {}).items())]
    return (
        f"{cfg['family']}/{cfg['preset']}, {n} pictures of {w}×{h}, {cfg['runs']} run(s) side by side, "
        f"{cfg['parallel']} in flight on every side but the loop, {cfg['threads']} threads, n_ctx {cfg['n_ctx']}"
        f"{profile}:\n\n"
        + _table(head, rows, {0, 2, 3, 4, 5, 6, 7, 8})
        + "\n\n"
        + (" ".join(x for x in notes if x) + "\n\n" if any(notes) else "")
        + source(d, stem)
    )


def targets(r: D) -> str:
    out = []
    for length, met in r["targets"].items():
        said = [f"{what}: {'met' if met[key] else '**missed**'}" for key, what in TARGETS if met.get(key) is not None]
        if said:
            out.append(f"{length} tokens — " + "; ".join(said))
    return ("Targets: " + ". ".join(out) + ".") if out else ""


def readme(d: D, stem: str) -> str:
    if not _new(d):
        return legacy_readme(d, stem)
    r = d["result"]
    spans = []
    for key, what in (
        ("caption_vs_llama_server", "the `llama-server` script's"),
        ("caption_vs_library", "the llama-cpp-python loop's"),
    ):
        xs = sorted(v["ratios"][key]["median"] for v in r["by_max_tokens"].values() if key in v["ratios"])
        if xs:
            spans.append(f"{xs[0]:.2f}" + (f"–{xs[-1]:.2f}" if len(xs) > 1 else "") + f"× {what} images/s")
    batch = [
        v["ratios"]["batch_vs_caption"]["median"]
        for v in r["by_max_tokens"].values()
        if "batch_vs_caption" in v["ratios"]
    ]
    if batch:
        pct = ", ".join(f"{b - 1:+.0%}".replace("%", " %") for b in batch)
        spans.append(f"`edgevlm batch` {pct} against caption")
    return (
        f"| `edgevlm caption` vs `llama-server` (same llama.cpp) and a llama-cpp-python loop, "
        f"{r['config']['family']}/{r['config']['preset']} shapes | {'; '.join(spans) or '–'} | "
        f"[caption.md](docs/caption.md) ([run](docs/results/{stem}.json)) |"
    )


# --- runs made before issue #48: edgevlm (``--parallel auto``) against the loop alone ---------------
def legacy_rows(d: D) -> list[list[str]]:
    r = d["result"]
    n = r["config"]["images"]
    system = "the default" if "--long-system" not in d["command"] else "a long guide (`--long-system`)"
    rows = []
    for length, v in r["by_max_tokens"].items():
        ev = {k: statistics.median([x["prompt_evaluated"] for x in v[k]]) / n for k in ("edgevlm", "library")}
        rows.append(
            [
                system,
                length,
                f"{v['edgevlm_images_per_s']:.3f}",
                f"{v['library_images_per_s']:.3f}",
                f"**{v['ratio_median_of_pairs']:.2f}×** ({', '.join(f'{x:.2f}' for x in v['paired_ratios'])})",
                f"{ev['edgevlm']:.0f} vs {ev['library']:.0f}",
                f"{v['edgevlm_engine_share']:.1%}".replace("%", " %"),
                ", ".join(_pct(x["busy_others"]) for x in v["edgevlm"] + v["library"]),
            ]
        )
    return rows


def legacy_table(d: D, stem: str) -> str:
    cfg = d["result"]["config"]
    head = ["system prompt", "caption tokens", "edgevlm images/s", "library loop images/s", "ratio (per run)"]
    head += ["prompt tokens evaluated / image", "inside llama.cpp", "others' CPU per run"]
    return (
        f"{cfg['family']}/{cfg['preset']}, {cfg['images']} pictures, {cfg['runs']} runs side by side, "
        f"edgevlm {cfg['edgevlm_slots']} in flight, {cfg['threads']} threads:\n\n"
        + _table(head, legacy_rows(d), {1, 2, 3, 4, 6})
        + "\n\n"
        + source(d, stem)
    )


def legacy_readme(d: D, stem: str) -> str:
    r = d["result"]
    ratios = sorted(v["ratio_median_of_pairs"] for v in r["by_max_tokens"].values())
    span = f"{ratios[0]:.2f}" + (f"–{ratios[-1]:.2f}" if len(ratios) > 1 else "")
    return (
        f"| `edgevlm caption` vs a llama-cpp-python loop, {r['config']['family']}/{r['config']['preset']} shapes | "
        f"{span}× the images/s | [caption.md](docs/caption.md) ([run](docs/results/{stem}.json)) |"
    )


PARTS: dict[str, Callable[[D, str], str]] = {"table": table, "readme": readme}
