"""Where a benchmark's JSON goes and what it says about its run.

Every benchmark (``scripts/bench_*.py``, ``scripts/soak_serve.py``) writes one file per run into
``docs/results/`` — ``<benchmark>[-<tag>]-<YYYYMMDD>-<commit>.json`` — unless ``--out`` names
another place. The file is the script's own result under ``"result"``, wrapped in what the
numbers depend on: the commit (and whether the code was changed from it), the machine
(``edgevlm_testkit.peers.machine()``), the date, the command line, and how busy the machine was
meanwhile (the load average at the start and the end; the share of the CPUs other processes
used). ``scripts/render_docs.py`` renders docs/*.md and README.md from these files.

    run = Run("bench_merge")          # at the start: the clock and the machine's busy seconds
    ...
    path = run.save(rows, args.out)   # at the end
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "Run", "commit"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


# what a benchmark's numbers depend on besides its own script (the helpers benchmarks import too)
CODE = [
    "edgevlm",
    "testkit",
    "pyproject.toml",
    "scripts/resultfile.py",
    "scripts/peer_servers.py",
    "scripts/caption_sides.py",
]


def _code() -> list[str]:
    me = Path(sys.argv[0]).resolve()
    return [*CODE, str(me.relative_to(ROOT))] if me.is_relative_to(ROOT) else CODE


def _git(*a: str) -> str:
    r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return r.stdout.strip() if r.returncode == 0 else ""


def commit() -> tuple[str, bool]:
    """The checked-out commit, and whether the code a benchmark runs (the package, the test kit,
    this file and the running script) differs from it."""
    head = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", *_code())
    return head or "unknown", bool(changed)


def _busy() -> float | None:
    from edgevlm_testkit.peers import machine_busy_s

    return machine_busy_s()


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Run:
    """One benchmark run: started when made, written by ``save``."""

    def __init__(self, benchmark: str, tag: str = "") -> None:
        self.benchmark, self.tag = benchmark, tag
        self.argv = [Path(sys.argv[0]).name, *sys.argv[1:]]
        self.date = datetime.datetime.now(datetime.timezone.utc)
        self.load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy(), _own()
        self.commit, self.code_changed = commit()  # the code this run runs

    def load(self) -> dict[str, Any]:
        """How busy the machine was during the run: the load average at its start and end, and
        the share of all CPUs that processes other than this one and its children used."""
        wall, busy1, own1 = time.perf_counter() - self.t0, _busy(), _own()
        others = None
        if self.busy0 is not None and busy1 is not None and wall > 0:
            others = round(max(0.0, (busy1 - self.busy0) - (own1 - self.own0)) / (wall * (os.cpu_count() or 1)), 3)
        return {
            "loadavg_start": [round(x, 2) for x in self.load0] if self.load0 else None,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "others_cpu_share": others,
            "wall_s": round(wall, 1),
        }

    def changed_since(self) -> bool:
        """Whether the code differed from the commit at the start or at any point up to now."""
        head, changed = commit()
        moved = head != self.commit and bool(_git("diff", "--name-only", self.commit, head, "--", *_code()))
        return self.code_changed or changed or moved

    def envelope(self, result: Any) -> dict[str, Any]:
        from edgevlm_testkit.peers import machine

        return {
            "benchmark": self.benchmark,
            "tag": self.tag,
            "commit": self.commit,
            "code_changed": self.changed_since(),
            "date": self.date.isoformat(timespec="seconds"),
            "command": self.argv,
            "machine": machine(),
            "load": self.load(),
            "result": result,
        }

    def path(self, head: str) -> Path:
        tag = f"-{self.tag}" if self.tag else ""
        return RESULTS / f"{self.benchmark}{tag}-{self.date:%Y%m%d}-{head[:7]}.json"

    def save(self, result: Any, out: str | Path | None = None) -> Path:
        """Write the result (to ``out``, else a new file in docs/results/); returns the path."""
        env = self.envelope(result)
        path = Path(out) if out else self.path(env["commit"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(env, indent=2, default=str) + "\n")
        return path
