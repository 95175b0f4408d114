#!/usr/bin/env python3
"""Render every measured table in docs/*.md and README.md from the committed benchmark results
(docs/results/*.json, written by the benchmarks themselves: scripts/resultfile.py).

    python scripts/render_docs.py           # rewrite the marked blocks in place
    python scripts/render_docs.py --check   # exit 1 when a block differs (tests/test_rendered_docs.py)

A block sits between ``<!-- results:STEM:PART -->`` and ``<!-- /results:STEM:PART -->``: STEM
names the results file (``docs/results/STEM.json``, which must exist), PART what is shown of it.
Which PARTs a file has depends on its benchmark (its ``"benchmark"`` field, or ``gpu_check``
for ``gpu-check-*.json``): ``scripts/render_gpu.py``, ``render_serve.py``, ``render_caption.py``,
``render_restart.py``, ``render_restore.py``, ``render_prices.py``, ``render_laptop.py``, ``render_speed.py``,
``render_audio.py`` and ``render_tables.py`` hold them.
Everything between the markers is replaced; what is outside them is the docs' own text.

A STEM ending in ``-pending`` (``bench_suite-pending``) names a run nobody has made yet: its
block holds ``PENDING``, the line that says which script makes the run; that script points the
block at its file when it writes one (``scripts/bench_suite.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import render_audio
import render_caption
import render_gpu
import render_laptop
import render_prices
import render_restart
import render_restore
import render_serve
import render_speed
import render_tables

__all__ = ["BLOCK", "PENDING", "RESULTS", "blocks_in", "check", "docs", "is_pending", "load", "part", "render"]

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"<!-- results:([\w.-]+):([\w-]+) -->\n(.*?)<!-- /results:\1:\2 -->\n?", re.S)
Part = Callable[[dict[str, Any], str], str]
PARTS: dict[str, dict[str, Part]] = {
    "gpu_check": render_gpu.PARTS,
    "bench_serve": render_serve.PARTS,
    "bench_caption": render_caption.PARTS,
    "bench_restore": render_restore.PARTS,
    "laptop_check": render_laptop.PARTS,
    **render_restart.PARTS,
    **render_speed.PARTS,
    **render_tables.PARTS,
    **render_prices.PARTS,
    **render_audio.PARTS,
}


PENDING = "*Not measured yet*: `python {script}` makes the run this line is rendered from."


def is_pending(stem: str) -> bool:
    return stem.endswith("-pending")


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load(stem: str, results: Path | None = None) -> dict[str, Any]:
    path = (results or RESULTS) / f"{stem}.json"
    if not path.is_file():
        raise LookupError(f"docs/results/{stem}.json does not exist")
    d: dict[str, Any] = json.loads(path.read_text())
    return d


def kind(stem: str, d: dict[str, Any]) -> str:
    return "gpu_check" if stem.startswith("gpu-check-") else str(d.get("benchmark", ""))


def part(stem: str, name: str, results: Path | None = None) -> str:
    """What the block ``STEM:NAME`` shows, rendered from its file."""
    if is_pending(stem):
        script = f"scripts/{stem.removesuffix('-pending')}.py"
        if not (SCRIPTS / Path(script).name).is_file():
            raise LookupError(f"{stem}: no {script} makes that run")
        return PENDING.format(script=script)
    d = load(stem, results)
    k = kind(stem, d)
    if name not in PARTS.get(k, {}):
        raise LookupError(f"{stem}.json ({k or 'no benchmark named'}) has no part {name!r}")
    return PARTS[k][name](d, stem).rstrip("\n")


def blocks_in(text: str) -> list[tuple[str, str, str]]:
    """(stem, part, what is there now) for every marked block of a page."""
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


def render(text: str, results: Path | None = None) -> str:
    def sub(m: re.Match[str]) -> str:
        stem, name = m.group(1), m.group(2)
        return f"<!-- results:{stem}:{name} -->\n{part(stem, name, results)}\n<!-- /results:{stem}:{name} -->\n"

    return BLOCK.sub(sub, text)


def check(results: Path | None = None) -> list[str]:
    """What is wrong: a block that differs from what its file renders, one that names a file or
    part that does not exist, a start marker without its end."""
    problems = []
    for doc in docs():
        text = doc.read_text(encoding="utf-8")
        rel = doc.relative_to(ROOT)
        opened = re.findall(r"<!-- results:([\w.-]+:[\w-]+) -->", text)
        closed = set(re.findall(r"<!-- /results:([\w.-]+:[\w-]+) -->", text))
        problems += [f"{rel}: {n}: no end marker" for n in opened if n not in closed]
        for stem, name, now in blocks_in(text):
            try:
                want = part(stem, name, results)
            except LookupError as e:
                problems.append(f"{rel}: {stem}:{name}: {e}")
                continue
            if now.rstrip("\n") != want:
                problems.append(f"{rel}: {stem}:{name}: differs from what its JSON renders")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a block differs or names no file")
    args = ap.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        if problems:
            print("(python scripts/render_docs.py rewrites the blocks)")
            return 1
        print(f"checked {len(docs())} pages")
        return 0
    for doc in docs():
        text = doc.read_text(encoding="utf-8")
        try:
            new = render(text)
        except LookupError as e:
            print(f"{doc.relative_to(ROOT)}: {e}")
            return 1
        if new != text:
            doc.write_text(new, encoding="utf-8")
            print(f"rendered {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
