"""Every generated family end to end through the real CLI: what ``edgevlm budget`` says a picture
costs is what ``edgevlm chat`` sends, captioning works, and token merging runs where the
projector's tokens lie on a grid (and is refused with a note where they do not)."""

from __future__ import annotations

import json
import math

import pytest

from edgevlm.model.gguf_info import load_projector
from edgevlm.model.projectors import facts

from .conftest import ALL_FAMILIES, make_image, run_cli


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("family-pictures")
    return [make_image(d / "wide.png", 900, 500, seed=4, mode="gradient"), make_image(d / "tall.png", 300, 700, seed=5)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_budget_chat_caption_and_merge(model_pair, pictures, tmp_path, family):
    pair = model_pair(family)
    m = ["-m", str(pair.model), "--mmproj", str(pair.mmproj)]
    for pic in pictures:
        b = run_cli("budget", str(pic), "--mmproj", str(pair.mmproj), "--json")
        assert b.returncode == 0, b.stderr
        planned = json.loads(b.stdout)["total_tokens"]
        c = run_cli("chat", *m, "-i", str(pic), "--json", "--temp", "0", "-n", "3", "--tiles", "off", "Describe")
        assert c.returncode == 0, c.stderr
        st = json.loads(c.stdout)["stats"]
        assert st["image_tokens"] == planned, (pic.name, st["image_tokens"], planned)
        assert st["predicted_n"] >= 1
    out = tmp_path / "caps.jsonl"
    r = run_cli("caption", *m, *map(str, pictures), "-n", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 2 and all(x["caption"] is not None and x["image_tokens"] > 0 for x in recs)
    r = run_cli(
        "chat",
        *m,
        "-i",
        str(pictures[0]),
        "--merge",
        "ratio:0.5",
        "--json",
        "--temp",
        "0",
        "-n",
        "2",
        "--tiles",
        "off",
        "Describe",
    )
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    if facts(load_projector(pair.mmproj)).grid:
        assert st["image_tokens_out"] < st["image_tokens_in"]
        assert st["image_tokens_out"] <= math.ceil(st["image_tokens_in"] / 2) + st["image_tokens_in"] // 16
    else:
        assert "--merge ignored" in r.stderr and st.get("image_tokens_out", st["image_tokens"]) == st["image_tokens"]
