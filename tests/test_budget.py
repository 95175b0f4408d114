"""Pre-encoder budgeting: never over budget, exact against mtmd, and tile selection that finds
the detailed region on images whose ground truth we control."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector
from edgevlm.vision.budget import plan_image, render_views
from edgevlm.vision.detail import SCORERS
from edgevlm.vision.images import from_rgb

from .conftest import run_cli

SIZES = [
    (64, 48),
    (336, 336),
    (337, 200),
    (640, 480),
    (1280, 720),
    (1920, 1080),
    (4000, 3000),
    (3840, 2160),
    (7680, 4320),
    (8000, 600),
    (600, 8000),
    (1000, 1000),
]


def flat(w, h, value=180):
    return from_rgb(np.full((h, w, 3), value, np.uint8), f"flat{w}x{h}")


@pytest.fixture(scope="module")
def backends(model_pair):
    out = {}
    for fam in ("llava15", "llava16", "qwen2vl"):
        pair = model_pair(fam)
        out[fam] = Backend(pair.model, pair.mmproj, n_ctx=256, n_threads=2)
    yield out
    for be in out.values():
        be.close()


@pytest.mark.parametrize(
    "family,budgets",
    [
        pytest.param("qwen2vl", [16, 64, 256, 1024, 2304, 4096], marks=pytest.mark.slow),
        ("llava16", [576, 1728, 2304, 2880]),
        ("llava15", [576, 1152, 2304, 2880]),
    ],
)
def test_never_over_budget_and_equal_to_mtmd(backends, family, budgets):
    be = backends[family]
    proj = be.proj_info
    for w, h in SIZES:
        img = flat(w, h)
        for b in budgets:
            ip = plan_image(img, proj, b)
            assert ip.total_tokens <= b, (w, h, b, ip.total_tokens)
            # what mtmd makes of the views we would send
            got = 0
            for _, view in render_views(img, ip):
                got += sum(c.n_tokens for c in be.count_image(view.width, view.height) if c.kind == "image")
            assert got == ip.total_tokens, (w, h, b)


def test_dynamic_budget_keeps_aspect_on_the_grid(backends):
    proj = backends["qwen2vl"].proj_info
    ip = plan_image(flat(4000, 3000), proj, 1024)
    (v,) = ip.selected
    assert abs(v.size[0] / v.size[1] - 4 / 3) < 0.01 and ip.total_tokens <= 1024
    assert ip.total_tokens > 900  # uses the budget, not a fraction of it


def textured(w, h, patch, pos, kind, background, seed):
    """A flat or gradient background with one detailed patch (noise, stripes or text)."""
    rng = np.random.default_rng(seed)
    if background == "flat":
        arr = np.full((h, w, 3), rng.integers(60, 200, 3), np.uint8)
    else:
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([x * 200 // w + 30, y * 200 // h + 30, np.full_like(x, 120)], -1).astype(np.uint8)
    pw, ph = patch
    x0, y0 = pos
    if kind == "noise":
        arr[y0 : y0 + ph, x0 : x0 + pw] = (rng.random((ph, pw, 3)) * 255).astype(np.uint8)
        return arr
    img = Image.fromarray(arr)
    d = ImageDraw.Draw(img)
    if kind == "stripes":
        for i in range(0, pw, 8):
            d.line([(x0 + i, y0), (x0 + i, y0 + ph)], fill=(20, 20, 20), width=3)
    else:  # text
        font = ImageFont.load_default(size=max(10, ph // 8))
        for row in range(6):
            d.text((x0, y0 + row * ph // 6), "The quick brown fox 0123", fill=(10, 10, 10), font=font)
    return np.asarray(img)


def selection_hit_rate(scorer: str, trials: int = 24) -> float:
    """Share of images whose most detailed tile (by ground truth) is among the selected ones."""
    from edgevlm_testkit import cached_model_pair

    proj = load_projector(cached_model_pair("llava15").mmproj)
    rng = np.random.default_rng(42)
    hits = 0
    for t in range(trials):
        w, h = [(4000, 3000), (1920, 1080), (3000, 4000), (2560, 1440)][t % 4]
        pw, ph = w // 6, h // 6
        x0, y0 = int(rng.integers(0, w - pw)), int(rng.integers(0, h - ph))
        kind = ["noise", "stripes", "text"][t % 3]
        bg = ["flat", "gradient"][(t // 3) % 2]
        img = from_rgb(textured(w, h, (pw, ph), (x0, y0), kind, bg, t), "synthetic")
        ip = plan_image(img, proj, 2304, scorer=scorer)
        cx, cy = x0 + pw // 2, y0 + ph // 2  # the tile holding the patch's centre is the truth
        truth = next(v for v in ip.views[1:] if v.box[0] <= cx < v.box[2] and v.box[1] <= cy < v.box[3])
        hits += truth.selected
    return hits / trials


@pytest.mark.slow
def test_selection_finds_the_detailed_region():
    rates = {s: selection_hit_rate(s) for s in SCORERS}
    print("hit rates:", rates)
    assert rates["edges"] >= 0.9, rates  # the default scorer
    assert max(rates.values()) == rates["edges"] or rates["edges"] >= 0.95


def test_flat_tiles_are_skipped_and_global_view_stays(backends):
    proj = backends["llava15"].proj_info
    img = from_rgb(textured(4000, 3000, (600, 500), (3200, 2300), "noise", "flat", 1), "one-patch")
    ip = plan_image(img, proj, 2880)
    assert ip.selected[0].label == "global view"
    tiles = [v for v in ip.selected if v.label.startswith("tile")]
    assert 1 <= len(tiles) < 4 and ip.total_tokens < 2880 and ip.notes  # flat ones skipped


def test_4k_photo_becomes_global_view_plus_three_tiles_in_budget_json(tmp_path, model_pair):
    """Done-when: a 4000×3000 photo with --image-tokens 2304 on LLaVA-1.5."""
    rng = np.random.default_rng(3)
    arr = (rng.random((30, 40, 3)) * 255).astype(np.uint8)  # soft photo-like tones everywhere
    photo = Image.fromarray(arr).resize((4000, 3000), Image.Resampling.BICUBIC)
    d = ImageDraw.Draw(photo)
    font = ImageFont.load_default(size=48)
    for row in range(10):  # a sign with text: the sharpest region
        d.text((3020, 2200 + row * 60), "OPEN 9-17 · NO PARKING", fill=(0, 0, 0), font=font)
    path = tmp_path / "photo.jpg"
    photo.save(path, quality=92)
    pair = model_pair("llava15")
    overlay = tmp_path / "ov.png"
    r = run_cli(
        "budget", str(path), "--mmproj", str(pair.mmproj), "--image-tokens", "2304", "--json", "--overlay", str(overlay)
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    chosen = [v for v in d["views"] if v["selected"]]
    assert d["total_tokens"] == 2304 and len(chosen) == 4
    assert chosen[0]["label"] == "global view"
    assert all(set(v) >= {"box", "tokens", "score", "selected"} for v in d["views"])
    best = max((v for v in d["views"] if v["score"] is not None), key=lambda v: v["score"])
    assert best["selected"] and best["box"][0] <= 3400 <= best["box"][2]
    assert Image.open(overlay).size[0] > 0


def test_budget_cli_human_output(model_pair, images):
    pair = model_pair("qwen2vl")
    r = run_cli("budget", str(images["gradient"]), "--mmproj", str(pair.mmproj), "--image-tokens", "64")
    assert r.returncode == 0 and "dynamic" in r.stdout and "resized" in r.stdout


def test_chat_sends_labelled_views(model_pair, tmp_path):
    import edgevlm

    pair = model_pair("llava15")
    rng = np.random.default_rng(5)
    arr = np.full((1500, 2000, 3), 200, np.uint8)
    for x0, y0 in ((100, 100), (1300, 200), (200, 1000)):
        arr[y0 : y0 + 400, x0 : x0 + 500] = (rng.random((400, 500, 3)) * 255).astype(np.uint8)
    path = tmp_path / "shot.png"
    Image.fromarray(arr).save(path)
    with edgevlm.load(pair.model, pair.mmproj, image_tokens=2304, n_threads=2) as eng:
        assert eng.options.image_tokens == 2304
        conv = eng.conversation()
        r = conv.chat("Read it.", [path], max_tokens=2, temperature=0)
        msg = conv.messages[0]
        assert msg.labels[0] == "global view" and all(lb.startswith("tile row") for lb in msg.labels[1:])
        assert r.stats.image_tokens == 576 * len(msg.labels) == 2304
        text = "".join(p.text for p in eng.formatter.render([("user", "Q", msg.labels)]) if p.kind == "text")
        assert "global view: " in text and "tile row" in text


def test_budget_finds_the_pair_of_a_model_name(tmp_path):
    """``--model demo`` (a name) finds its projector as chat does; without either file, one line."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pic = root / "examples" / "shapes.png"
    by_name = run_cli("budget", str(pic), "--model", "demo", "--json")
    by_path = run_cli(
        "budget", str(pic), "--model", str(root / "models" / "edgevlm-demo.gguf"),
        "--mmproj", str(root / "models" / "mmproj-edgevlm-demo.gguf"), "--json",
    )  # fmt: skip
    assert by_name.returncode == 0 and by_path.returncode == 0, (by_name.stderr, by_path.stderr)
    assert json.loads(by_name.stdout) == json.loads(by_path.stdout)
    alone = run_cli("budget", str(pic))
    assert alone.returncode == 2 and alone.stderr.strip().count("\n") == 0, alone.stderr
    assert "--mmproj" in alone.stderr and "Traceback" not in alone.stderr


def test_the_tile_note_counts_what_the_table_shows():
    """``budget`` on the poster: the note's counts are the table's — tiles the budget holds, those
    sent, those skipped as flat among them, and the rest that scored lower (it once said only
    "1 tile(s) skipped as flat" beside six unselected tiles)."""
    import re
    from pathlib import Path

    from edgevlm.hub.demo import trained_demo_pair
    from edgevlm.vision.images import load_image

    pair = trained_demo_pair()
    if pair is None:
        pytest.skip("the trained demo pair is not here")
    proj = load_projector(str(pair[1]))
    ip = plan_image(load_image(str(Path(__file__).parent.parent / "examples" / "poster.png")), proj, 256)
    tiles = [v for v in ip.views if v.label.startswith("tile")]
    note = next(n for n in ip.notes if "beside the global view" in n)
    held, total, sent = map(int, re.search(r"holds (\d+) of (\d+) tiles .*: (\d+) sent", note).groups())
    flat = int(m.group(1)) if (m := re.search(r"(\d+) skipped as flat", note)) else 0
    rest = int(m.group(1)) if (m := re.search(r"the other (\d+) scored lower", note)) else 0
    assert total == len(tiles) and sent == sum(v.selected for v in tiles)
    assert held == sent + flat and rest == total - held and total - sent == flat + rest


def _detailed_shot(path):
    """A flat page with three noisy patches: LLaVA-1.5's AnyRes sends the tiles that hold them."""
    rng = np.random.default_rng(5)
    arr = np.full((900, 1200, 3), 200, np.uint8)
    for x0, y0 in ((60, 60), (780, 120), (120, 600)):
        arr[y0 : y0 + 240, x0 : x0 + 300] = (rng.random((240, 300, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(path)
    return str(path)


def _budget_and_chat(pair, path: str, flags: list[str]):
    """``edgevlm budget PATH --json`` and ``edgevlm chat -i PATH --json`` (one shot), both with
    ``flags`` and a 4-token reply (the room a first turn's pictures have depends on it)."""
    model = ["-m", str(pair.model), "--mmproj", str(pair.mmproj), *flags, "-n", "4"]
    planned = run_cli("budget", path, *model, "--json")
    sent = run_cli("chat", *model, "-i", path, "--temp", "0", "--json", "Describe the image.")
    return planned, sent


def _labels(d: dict) -> list:
    """What ``edgevlm budget --json`` says goes into the prompt before each view, in order: a
    picture's labels (None for a lone view, as chat sends it), a clip's timestamps."""
    if "views" in d:
        chosen = [v["label"] for v in d["views"] if v["selected"]]
        return chosen if len(chosen) > 1 else [None]
    return [f["label"] for f in d["frames"] if f["kept"]]


@pytest.mark.slow
def test_budget_with_the_model_shows_what_chat_sends(model_pair, tmp_path):
    """``edgevlm budget FILE --model M`` is what ``edgevlm chat -i FILE`` sends on a first turn
    with the same flags: the image tokens llama.cpp evaluated (chat's stats) and the views or
    frames the conversation holds, in order with their labels (the library with those flags) —
    for LLaVA-1.5 tiles (--image-tokens, --tiles off) and a clip (the room beside the reply,
    --max-frames); where chat refuses (a per-picture budget below a frame, --max-pixels, a plan
    that does not fit) budget refuses with the same line."""
    import edgevlm
    from edgevlm.runtime.engine import EngineOptions
    from edgevlm.vision.video import VideoBudget

    from .test_video import make_clip

    pair = model_pair("llava15")
    shot = _detailed_shot(tmp_path / "shot.png")
    clip = make_clip(tmp_path / "moving.mp4", 4)
    # (path, flags, the library's wishes for them, its options for them)
    cases = [
        (shot, ["--image-tokens", "2304"], {"image_tokens": 2304}, {}),
        (shot, ["--image-tokens", "2304", "--tiles", "off"], {"image_tokens": 2304}, {"tiles": "off"}),
        (clip, [], {}, {}),
        (clip, ["--max-frames", "3"], {}, {"video": VideoBudget(max_frames=3)}),
    ]
    for path, flags, wishes, opts in cases:
        planned, sent = _budget_and_chat(pair, path, flags)
        assert planned.returncode == 0 and sent.returncode == 0, (flags, planned.stderr, sent.stderr)
        d = json.loads(planned.stdout)
        assert json.loads(sent.stdout)["stats"]["image_tokens"] == d["total_tokens"] > 0, (path, flags)
        with edgevlm.load(pair.model, pair.mmproj, options=EngineOptions(**opts), n_threads=2, **wishes) as vlm:
            eng = vlm.conversation()
            eng.chat("Describe the image.", [path], max_tokens=4, temperature=0)
            (msg,), (pic,) = eng.messages[:1], eng.pictures
            assert msg.labels == _labels(d) and pic.tokens == d["total_tokens"], (path, flags)
        if path == shot and "off" not in flags:
            assert len(msg.labels) == 4 and msg.labels[0] == "global view"  # (AnyRes: 3 tiles beside it)
        if path == clip and not flags:
            assert d["kept_frames"] > 5  # (the room beside a 4-token reply: more than beside chat's default)
    refused = [  # (path, flags, exit code, what the one line names)
        (clip, ["--image-tokens", "64"], 2, "--image-tokens"),
        (clip, ["--max-pixels", "10000"], 2, "--max-pixels"),
        (shot, ["--free-memory", "cpu=1MiB"], 1, "does not fit"),
    ]
    for path, flags, code, named in refused:
        planned, sent = _budget_and_chat(pair, path, flags)
        errors = [[ln for ln in r.stderr.splitlines() if ln.startswith("Error")] for r in (planned, sent)]
        assert planned.returncode == sent.returncode == code and errors[0] == errors[1], (flags, errors)
        assert len(errors[0]) == 1 and named in errors[0][0], errors
