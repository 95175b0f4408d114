"""README.md stays short and true: every command is in its table, and every link in it and in
docs/ leads somewhere (a file that exists, a heading that exists)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgevlm.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, code = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and (m := re.match(r"#{1,6} (.+)", line)):
            out.add(slug(m.group(1)))
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return LINK.findall(text)


def test_the_slug_is_githubs():
    assert slug("On a Ray cluster (`--ray`)") == "on-a-ray-cluster---ray"
    assert slug("`edgevlm batch`: OpenAI batch files") == "edgevlm-batch-openai-batch-files"


def test_the_readme_is_short_and_lists_every_command():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    table = [ln for ln in text.splitlines() if ln.startswith("| `edgevlm ")]
    listed = {re.match(r"\| `edgevlm ([a-z]+)`", ln).group(1) for ln in table}
    assert listed == set(main.commands), (sorted(listed), sorted(main.commands))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ... (outside the repository)
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, bad
