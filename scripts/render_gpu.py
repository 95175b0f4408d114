"""The parts of ``scripts/gpu_check.py``'s results (docs/results/gpu-check-*.json) that docs/gpu.md,
docs/install.md and README's "Measured" show; ``scripts/render_docs.py`` puts them between
``<!-- results:gpu-check-STEM:PART -->`` markers. PART is ``summary``, ``buffers``, ``guard``,
``build``, ``import-order`` or ``readme`` (README's row)."""

from __future__ import annotations

import math
import re

from edgevlm_testkit.gpu_measure import DeviceRow

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


def build(d: dict, stem: str = "") -> str:
    """How long the CUDA build took (install.md)."""
    b, dev = d["build"], d["device"]
    secs = " and ".join(f"{s} s" for s in b["seconds"])
    return (
        f"the build took {secs} on {b['cores']} cores ({dev['description']}'s host, CUDA {dev['cuda']}, "
        f"`{b['cmake_args']}`; [{stem}.json](results/{stem}.json))."
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


WHAT = {"Vulkan": "Vulkan backend, Mesa's software device", "CUDA": "CUDA backend, an NVIDIA H200"}


def readme(d: dict) -> str:
    """README's "Measured" row for one backend's run."""
    b = [r for r in d["buffers"] if not r["component"].startswith("outside")]
    ok = sum(within(r) for r in b)
    under = sum(row(r).under for r in b)
    held = sum(r["ok"] for r in d["guard"])
    late = f" ({under} under: the replay alone, before the plan's dry-run check)" if under else ""
    what = next((w for k, w in WHAT.items() if d["device"]["name"].startswith(k)), d["device"]["name"])
    return (
        f"| memory predicted vs llama.cpp's logs with all, part or none of the layers on a GPU ({what}), "
        f"LLaVA-7B and Qwen2-VL-2B shapes | {ok}/{len(b)} buffers on the device and the host within 0.5 %"
        f"{late}; {held}/{len(d['guard'])} what-if sizes held | [gpu.md](docs/gpu.md#measured) |"
    )


PARTS = {
    "summary": lambda d, stem: summary(d),
    "buffers": lambda d, stem: buffers(d),
    "guard": lambda d, stem: guard(d),
    "build": build,
    "import-order": lambda d, stem: import_order(d),
    "readme": lambda d, stem: readme(d),
}
