#!/usr/bin/env python3
"""How long the test suite takes: README's test command (``pytest -q``) and the quick loop
(``pytest -m "not slow"``), one after the other, on this machine.

    python scripts/bench_suite.py                       # both, whole suite; then README's block
    python scripts/bench_suite.py --out /tmp/s.json -- tests/test_docs.py -k slug   # a tiny selection

Each run is timed from start to exit (wall seconds, and the CPU seconds pytest and its children
used), with pytest's own counts (passed, failed, skipped, deselected, errors) and its exit code.
The JSON goes through ``resultfile.Run`` like every benchmark's (the commit, the machine, its
cores and how busy it was meanwhile). Without ``--out`` it is written into docs/results/ and
README's ``<!-- results:bench_suite-…:readme -->`` block (``bench_suite-pending`` until the first
run) is pointed at the new file and rendered (``scripts/render_docs.py``): commit both.
Arguments after ``--`` are given to both pytest runs (paths, ``-k``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resultfile import ROOT, Run

# README's test command and the quick loop, as README gives them
RUNS = (("suite", ["pytest", "-q"]), ("quick", ["pytest", "-q", "-m", "not slow"]))
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- results:(bench_suite-[\w.-]+):readme -->\n.*?<!-- /results:\1:readme -->\n", re.S)


def counts(output: str) -> dict[str, int]:
    """pytest's closing line ("12 passed, 3 skipped, 40 deselected in 9.1s") as counts."""
    lines = [ln for ln in output.splitlines() if COUNT.search(ln) and re.search(r"\bin [\d.]+s", ln)]
    if not lines:
        return {}
    return {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in COUNT.findall(lines[-1])}


def _cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def time_run(name: str, cmd: list[str], extra: list[str]) -> dict[str, Any]:
    argv = [*cmd, *extra]
    t0, c0 = time.perf_counter(), _cpu()
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    tail = [ln for ln in r.stdout.splitlines() if ln.strip()][-1:] or [""]
    print(f"{' '.join(argv)}: {wall:.1f} s, exit {r.returncode}: {tail[0]}", file=sys.stderr)
    return {
        "name": name,
        "command": argv,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "returncode": r.returncode,
        "counts": counts(r.stdout),
        "last_line": tail[0],
    }


def point_readme(stem: str, readme: Path = README) -> bool:
    """README's suite block names ``stem`` now (the renderer fills it); False if it has none."""
    text = readme.read_text(encoding="utf-8")
    new, n = BLOCK.subn(f"<!-- results:{stem}:readme -->\n<!-- /results:{stem}:readme -->\n", text, count=1)
    if n:
        readme.write_text(new, encoding="utf-8")
    return bool(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", help="write the JSON here (default: docs/results/, and README's block)")
    ap.add_argument("pytest_args", nargs="*", help="after --: given to both pytest runs")
    args = ap.parse_args(argv)
    run = Run("bench_suite")
    rows = [time_run(name, cmd, args.pytest_args) for name, cmd in RUNS]
    path = run.save({"runs": rows}, args.out)
    print(f"wrote {path}")
    if args.out is None:
        point_readme(path.stem)
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "render_docs.py")], cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
