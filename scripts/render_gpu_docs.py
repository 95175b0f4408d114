#!/usr/bin/env python3
"""Render the GPU tables of docs/gpu.md (and the GPU rows of README's "Measured") from the
committed results of ``scripts/gpu_check.py`` — docs/results/gpu-check-*.json.

    python scripts/render_gpu_docs.py           # rewrite the marked blocks in place
    python scripts/render_gpu_docs.py --check   # exit 1 when a block differs (tests/test_gpu_results.py)

A block sits between ``<!-- gpu-check:NAME -->`` and ``<!-- /gpu-check:NAME -->``; NAME is the
results file's stem after ``gpu-check-`` (``h200-cuda``, ``lavapipe-vulkan``) plus a part
(``:buffers``, ``:guard``, ``:summary``), or ``readme`` for README's rows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from edgevlm_testkit.gpu_measure import DeviceRow

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOCS = {ROOT / "docs" / "gpu.md", ROOT / "docs" / "install.md", ROOT / "README.md"}
MIB = 2**20
COLUMNS = [  # (heading, component suffix)
    ("weights", "weights on {gpu}"),
    ("KV", "KV on {gpu}"),
    ("compute", "compute on {gpu}"),
    ("encoder weights", "encoder weights on {gpu}"),
    ("encoder compute", "encoder compute on {gpu}"),
    ("host: weights", "weights on the host"),
    ("host: KV", "KV on the host"),
    ("host: compute", "compute on the host"),
    ("host: logits", "output buffer (host)"),
    ("host: encoder inputs", "encoder on the host"),
]


def load(stem: str) -> dict:
    return json.loads((RESULTS / f"gpu-check-{stem}.json").read_text())


def row(r: dict) -> DeviceRow:
    """A results row as the measuring harness made it (its ``within`` and ``under`` rules)."""
    return DeviceRow(**{k: v for k, v in r.items() if k != "error"})


def within(r: dict) -> bool:
    return row(r).within()


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if not r["logged"] and not r["predicted"]:
        return "0"
    err = (r["predicted"] - r["logged"]) / r["logged"] if r["logged"] else 0.0
    cell = f"{r['logged'] / MIB:,.2f} ({err:+.2%})".replace("%", " %")
    if r.get("replayed", -1) >= 0 and r["logged"]:
        cell += f" [replay {(r['replayed'] - r['logged']) / r['logged']:+.0%}]".replace("%", " %")
    return cell + ("" if within(r) else " !")


def overhead(d: dict) -> int:
    """What the guard keeps free on this backend: the largest 'outside the logs after the 1st
    image', rounded up to 32 MiB (edgevlm.plan.devices.GPU_OVERHEAD)."""
    rows = [r["logged"] for r in d["buffers"] if r["component"] == "outside the logs after 1st image"]
    return math.ceil(max(rows) / (32 * MIB)) * 32 * MIB if rows else 0


def buffers(d: dict) -> str:
    gpu = d["device"]["name"]
    by_label: dict[str, dict[str, dict]] = {}
    for r in d["buffers"]:
        by_label.setdefault(r["label"], {})[r["component"]] = r
    head = "| configuration | " + " | ".join(h for h, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for label, comps in by_label.items():
        cells = [_cell(comps.get(c.format(gpu=gpu))) for _, c in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(d: dict) -> str:
    rows = [r for r in d["buffers"] if not r["component"].startswith("outside")]
    ok = sum(within(r) for r in rows)
    under = sum(row(r).under for r in rows)
    m, dev = d["machine"], d["device"]
    flags = "/".join(f for f, on in (("AVX2", m["avx2"]), ("AVX-512", m["avx512"]), ("AMX", m["amx"])) if on)
    out = [
        f"{dev['name']} ({dev['description']}); host {m['cpu']}, {m['cores']} cores, {flags}; "
        f"llama-cpp-python {m['llama_cpp_python']}.",
        "",
        f"{ok} of {len(rows)} buffers within 0.5 % of the log (or its rounding), {under} under.",
    ]
    outside = [r for r in d["buffers"] if r["component"].startswith("outside")]
    if outside:
        after = max(r["logged"] for r in outside if r["component"].endswith("load"))
        img = max(r["logged"] for r in outside if r["component"].endswith("image"))
        out.append(
            f"Outside every logged buffer the device lost at most {after / MIB:,.1f} MiB after loading and "
            f"{img / MIB:,.1f} MiB after the first picture (cuBLAS, the memory pool): the guard keeps "
            f"{overhead(d) // MIB} MiB free on this backend (`--gpu-overhead`)."
        )
    for n in d.get("notes", []):
        out.append(f"Note: {n}.")
    return "\n".join(out)


def guard(d: dict) -> str:
    head = ("model", "free", "the plan chose", "predicted on the device", "logged after the picture")
    lines = ["| " + " | ".join((*head, "free − overhead", "picture")) + " |", "|---|---|---|---|---|---|---|"]
    for r in d["guard"]:
        lines.append(
            f"| {r['label']} | {r['free'] / MIB:,.0f} MiB | {r['plan']} | {r['predicted'] / MIB:,.1f} MiB | "
            f"{r['logged'] / MIB:,.1f} MiB | {(r['free'] - r['overhead']) / MIB:,.0f} MiB | "
            f"{'answered' if r['answered'] else 'refused (guard)'}{'' if r['ok'] else ' !'} |"
        )
    held = sum(r["ok"] for r in d["guard"])
    lines += ["", f"{held} of {len(d['guard'])} sizes held."]
    return "\n".join(lines)


def build(d: dict, stem: str) -> str:
    """How long the CUDA build took (install.md)."""
    b, dev = d["build"], d["device"]
    secs = " and ".join(f"{s} s" for s in b["seconds"])
    return (
        f"the build took {secs} on {b['cores']} cores ({dev['description']}'s host, CUDA {dev['cuda']}, "
        f"`{b['cmake_args']}`; [gpu-check-{stem}.json](results/gpu-check-{stem}.json))."
    )


def import_order(d: dict) -> str:
    """The import-order probe's lines (``[first] -> ... rc=N``) as a table."""
    lines = ["| imported first | then `llama_cpp.Llama(demo, n_gpu_layers=-1)` |", "|---|---|"]
    for ln in d.get("import_order", []):
        m = re.match(r"\[(.*)\] -> .*rc=(-?\d+)", ln)
        if m:
            rc = int(m.group(2))
            what = "loads" if rc == 0 else "segmentation fault" if rc in (139, -11) else f"exit {rc}"
            lines.append(f"| `{m.group(1)}` | {what} |" if m.group(1) else f"| nothing | {what} |")
    return "\n".join(lines)


def readme() -> str:
    rows = []
    for stem, what in (
        ("lavapipe-vulkan", "Vulkan backend, Mesa's software device"),
        ("h200-cuda", "CUDA backend, an NVIDIA H200"),
    ):
        d = load(stem)
        b = [r for r in d["buffers"] if not r["component"].startswith("outside")]
        ok = sum(within(r) for r in b)
        under = sum(row(r).under for r in b)
        held = sum(r["ok"] for r in d["guard"])
        late = f" ({under} under: the replay alone, before the plan's dry-run check)" if under else ""
        rows.append(
            f"| memory predicted vs llama.cpp's logs with all, part or none of the layers on a GPU ({what}), "
            f"LLaVA-7B and Qwen2-VL-2B shapes | {ok}/{len(b)} buffers on the device and the host within 0.5 %"
            f"{late}; {held}/{len(d['guard'])} what-if sizes held | [gpu.md](docs/gpu.md#measured) |"
        )
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    out = {"readme": readme()}
    for f in sorted(RESULTS.glob("gpu-check-*.json")):
        stem = f.stem.removeprefix("gpu-check-")
        d = load(stem)
        out[f"{stem}:buffers"] = buffers(d)
        out[f"{stem}:summary"] = summary(d)
        out[f"{stem}:guard"] = guard(d)
        if d.get("build"):
            out[f"{stem}:build"] = build(d, stem)
        if d.get("import_order"):
            out[f"{stem}:import-order"] = import_order(d)
    return out


def render(text: str, parts: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in parts:
            raise SystemExit(f"no results for block {name!r}")
        return f"<!-- gpu-check:{name} -->\n{parts[name]}\n<!-- /gpu-check:{name} -->"

    return re.sub(r"<!-- gpu-check:([\w:.-]+) -->\n(?:.*?\n)?<!-- /gpu-check:\1 -->", sub, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a rendered block differs")
    args = ap.parse_args(argv)
    parts = blocks()
    stale = []
    for doc in sorted(DOCS):
        text = doc.read_text()
        new = render(text, parts)
        if new != text:
            stale.append(doc.relative_to(ROOT))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print("out of date: " + ", ".join(map(str, stale)) + " (python scripts/render_gpu_docs.py)")
        return 1
    print(("checked" if args.check else "rendered") + " " + ", ".join(str(d.relative_to(ROOT)) for d in sorted(DOCS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
