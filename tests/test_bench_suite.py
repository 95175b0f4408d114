"""``scripts/bench_suite.py``: how long README's test command and the quick loop take, written as
a run's JSON and rendered into README's "Test" (issue #59, case 12). The script runs here on a
tiny selection, in a temporary folder: what is checked is the path from the run to the line,
never the real suite's numbers."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .test_rendered_docs import _module

ROOT = Path(__file__).resolve().parent.parent
STEM = "bench_suite-20000101-abcdef0"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("suite") / f"{STEM}.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_suite.py"), "--out", str(out), "--",
         "tests/test_docs.py", "-k", "slug", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out.parent, json.loads(out.read_text())


def test_the_run_times_readmes_test_command_and_the_quick_loop(run):
    _, d = run
    assert d["benchmark"] == "bench_suite"
    assert d["command"][0] == "bench_suite.py"
    assert d["machine"]["cores"]
    assert d["machine"]["cpu"]
    assert "others_cpu_share" in d["load"]
    suite, quick = d["result"]["runs"]
    assert suite["command"][:2] == ["pytest", "-q"]
    assert quick["command"][:4] == ["pytest", "-q", "-m", "not slow"]
    for x in (suite, quick):
        assert x["command"][-5:] == ["tests/test_docs.py", "-k", "slug", "-p", "no:cacheprovider"]
        assert x["returncode"] == 0
        assert x["counts"]["passed"] == 1  # test_the_slug_is_githubs alone
        assert x["counts"]["deselected"] >= 1
        assert x["wall_s"] > 0
    # the wall time covers the pytest run: at least what pytest says it took
    took = float(suite["last_line"].rsplit(" in ", 1)[1].split("s")[0])
    assert suite["wall_s"] >= took


def test_the_run_renders_into_readmes_line(run):
    results, d = run
    render = _module("render_docs")
    took = _module("render_tables")._duration  # "N s", or "N min" from two minutes on
    line = render.part(STEM, "readme", results)
    suite, quick = d["result"]["runs"]
    assert f"`{shlex.join(suite['command'])}` **{took(suite['wall_s'])}** (1 passed, " in line
    quick_cmd = "pytest -q -m 'not slow' tests/test_docs.py -k slug -p no:cacheprovider"
    assert f"`{quick_cmd}` **{took(quick['wall_s'])}** (1 passed, " in line
    assert f"{d['machine']['cores']} cores" in line
    assert f"docs/results/{STEM}.json" in line


def test_the_script_points_readmes_pending_block_at_its_run(run, tmp_path):
    """Without --out the script writes into docs/results/ and points README's block at the new
    file; the renderer then fills it (here on a copy of README, with the run above)."""
    results, _ = run
    for f in (ROOT / "docs" / "results").glob("*.json"):  # the other blocks' runs, beside this one
        (results / f.name).write_text(f.read_text())
    suite = _module("bench_suite")
    render = _module("render_docs")
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    before = re.findall(r"<!-- results:(bench_suite-[\w.-]+):readme -->", readme.read_text())
    assert len(before) == 1
    assert before[0] != STEM
    assert suite.point_readme(STEM, readme)
    text = render.render(readme.read_text(encoding="utf-8"), results)
    assert before[0] not in text
    assert f"<!-- results:{STEM}:readme -->\n{render.part(STEM, 'readme', results)}\n" in text
    assert suite.point_readme(STEM, readme)  # a later run replaces it again
