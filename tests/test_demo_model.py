"""The trained demo VLM (models/edgevlm-demo.gguf): its record, its resolution, its answers."""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgevlm_testkit import world

from .conftest import skip_unless_required

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def _record() -> dict:
    return json.loads((MODELS / "edgevlm-demo.json").read_text())


# --- the trained pair -----------------------------------------------------------------------


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_the_committed_pair_matches_its_training_record():
    RECORD = _record()
    for name in (RECORD["model"], RECORD["mmproj"]):
        p = MODELS / name
        assert p.stat().st_size == RECORD["bytes"][name]
        assert _sha(p) == RECORD["sha256"][name], f"{name} differs from the trained file"
    assert sum(RECORD["bytes"].values()) <= 20 * 1024 * 1024


def test_demo_resolves_to_the_trained_pair():
    from edgevlm.hub.registry import resolve

    RECORD = _record()
    r = resolve("demo")
    assert Path(r.model.local) == MODELS / RECORD["model"]
    assert Path(r.mmproj.local) == MODELS / RECORD["mmproj"]
    assert any("trained" in n for n in r.notes)


def _needs_train_extra() -> None:
    """JAX and optax (the ``train`` extra, which .ci/run installs): else skip, or fail in CI."""
    try:
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError:
        skip_unless_required("train", "JAX or optax missing (pip install -e '.[train]')")


def _script_module(name: str):
    """A module of scripts/ (the training code is not part of the package)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def demo_engine():
    import edgevlm

    RECORD = _record()
    eng = edgevlm.load(MODELS / RECORD["model"], MODELS / RECORD["mmproj"], n_ctx=1024)
    yield eng
    eng.close()


def test_llama_cpp_loads_it_and_it_reads_colours_and_shapes_from_held_out_pictures(demo_engine, tmp_path):
    """Greedy answers to colour and shape questions on scenes from seeds training never used:
    well above the ~25 % / ~40 % a model that ignores the picture gets. On these 40 scenes the
    committed model answers 35/49 colour and 67/69 shape questions; its accuracy per question
    type and condition is in README (scripts/bench_quality.py)."""
    right = {"colour": 0, "shape": 0}
    total = {"colour": 0, "shape": 0}
    for seed in range(5_000_000, 5_000_040):
        rng = random.Random(seed)
        scene = world.make_scene(rng, "plain", size=(rng.randint(224, 900), rng.randint(224, 900)))
        qs = [q for q in world.questions(scene) if q[0] in right]
        if not qs:
            continue
        path = tmp_path / f"{seed}.png"
        world.render(scene).save(path)
        for kind, q, a in qs:
            r = demo_engine.chat(q, [str(path)], max_tokens=6, temperature=0.0)  # one turn, nothing kept
            right[kind] += world.grade(r.text, a)
            total[kind] += 1
    assert total["colour"] >= 40 and right["colour"] / total["colour"] >= 0.55, f"{right} of {total}"
    assert total["shape"] >= 40 and right["shape"] / total["shape"] >= 0.85, f"{right} of {total}"


def test_chat_cli_with_demo_answers_from_the_picture(tmp_path):
    """`edgevlm chat --model demo` in a subprocess: the trained pair, its note, an answer that
    changes with the picture."""
    answers = []
    for colour in ("red", "blue"):
        scene = world.Scene(640, 480, "white", False, (world.Shape("square", colour, 320, 240, 160),))
        path = tmp_path / f"{colour}.png"
        world.render(scene).save(path)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgevlm",
                "chat",
                "--model",
                "demo",
                "--image",
                str(path),
                "--temp",
                "0",
                "-n",
                "6",
                "What colour is the square?",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "trained" in out.stderr  # the note says what the demo is
        answers.append(world.normalize(out.stdout))
    assert answers == ["red", "blue"], answers


def test_a_further_training_stage_starts_from_exactly_the_committed_weights(tmp_path):
    """``train_demo.py --init models`` reads the pair back (scripts/demo_model.load_pair) and a
    stage that trained nothing writes byte-identical files: the import is the exporters' inverse."""
    dm = _script_module("demo_model")
    RECORD = _record()
    cfg = dm.DemoConfig(**RECORD["config"])
    params = dm.load_pair(cfg, MODELS / RECORD["model"], MODELS / RECORD["mmproj"])
    text = dm.export_text(cfg, params["text"], dm.demo_vocab(), tmp_path / RECORD["model"])
    mmproj = dm.export_mmproj(cfg, params["vision"], tmp_path / RECORD["mmproj"])
    assert _sha(text) == RECORD["sha256"][RECORD["model"]]
    assert _sha(mmproj) == RECORD["sha256"][RECORD["mmproj"]]


def test_a_long_answer_weighs_more_in_all_and_less_per_token():
    answer_weights = _script_module("train_demo").answer_weights
    # a one-token answer, a three-token description, a one-token answer: 1, 1/sqrt(3) each, 1
    w = answer_weights([0, 0, 1, 0, 0, 1, 1, 1, 0, 1])
    z = 2 + 3**0.5
    assert w.tolist() == pytest.approx([0, 0, 1 / z, 0, 0] + [3**-0.5 / z] * 3 + [0, 1 / z])
    assert w.sum() == pytest.approx(1.0)
    assert answer_weights([0, 0]).sum() == 0


def test_each_image_token_is_labelled_with_the_patch_mtmd_hands_over():
    """mtmd's LLaVA graph puts the class token after the patches and returns rows
    1..n_patches: token j shows patch j+1, the last token is the class token. The training
    targets follow that order (the first model's labelled token j with patch j)."""
    dd = _script_module("demo_data")
    # 224 px canvas, 28 px patches (8×8): a red square filling patch (row 2, col 3) exactly
    scene = world.Scene(224, 224, "white", False, (world.Shape("square", "red", 3 * 28 + 14, 2 * 28 + 14, 28),))
    patches = dd.patch_labels(scene, (0, 0, 224, 224), 224, 8)
    tokens = dd.token_labels(scene, (0, 0, 224, 224), 224, 8)
    red, square = dd.COLOUR_IDS["red"], dd.SHAPE_IDS["square"]
    p = 2 * 8 + 3
    assert patches[p, 0] == red and patches[p, 1] == square and patches[p, 3] == square  # its centre
    assert tokens[p - 1].tolist() == patches[p].tolist()
    assert (tokens[-1] == -1).all()  # the class token has no patch
    assert [i for i in range(64) if tokens[i, 0] == red] == [p - 1]


def test_rank_target_is_the_place_describe_lists_the_group():
    """The fifth per-patch target: where the covering shape's group comes in "Describe the
    image." (``world.groups``, left to right by each group's leftmost member)."""
    dd = _script_module("demo_data")
    # two blue circles (one far right, one left of centre) and a red square at the far left
    shapes = (
        world.Shape("circle", "blue", 200, 42, 28),
        world.Shape("square", "red", 14, 42, 28),
        world.Shape("circle", "blue", 98, 154, 28),
    )
    scene = world.Scene(224, 224, "white", False, shapes)
    assert world.describe(scene) == "a red square and two blue circles"
    lab = dd.patch_labels(scene, (0, 0, 224, 224), 224, 8)
    at = lambda x, y: lab[int(y // 28) * 8 + int(x // 28), 4]
    assert at(14, 42) == 0 and at(98, 154) == 1 and at(200, 42) == 1
    assert at(150, 200) == dd.MAX_GROUPS  # background: none


def test_letter_drills_label_every_letter_they_draw():
    """The "letters" drill (a training-only picture for the encoder): 5-9 letters at a scene
    letter's size, each labelled on the tokens of the patches that hold a fair part of it, and
    drawn where it is labelled (letter tokens differ from the background)."""
    dd = _script_module("demo_data")
    none = dd.N_AUX[2] - 1
    rng = random.Random(3)
    for _ in range(5):
        pix, lab = dd.drill_view(rng, 224, 8, "letters")
        assert pix.shape == (224, 224, 3) and lab.shape == (64, len(dd.N_AUX))
        tokens = lab[:, 2]
        assert 5 <= (tokens != none).sum() <= 40
        assert len(set(tokens[tokens != none].tolist())) >= 3  # several letters in one view
        # token j is patch j+1: the patches labelled with a letter are not plain background
        patches = [j + 1 for j in range(63) if tokens[j] != none]
        for p in patches:
            r, c = divmod(p, 8)
            assert pix[r * 28 : (r + 1) * 28, c * 28 : (c + 1) * 28].reshape(-1, 3).std(0).max() > 10


def test_training_shares_parse_and_normalise():
    parse = _script_module("train_demo").parse_shares
    assert parse("letters:0.45,single:0.3,drill:0.15,tiled:0.1", normalise=True) == pytest.approx(
        {"letters": 0.45, "single": 0.3, "drill": 0.15, "tiled": 0.1}
    )
    assert parse("single:3,conv:1", normalise=True) == {"single": 0.75, "conv": 0.25}
    assert parse("letter:2") == {"letter": 2.0} and parse("") == {}


def test_note_samples_ask_what_their_notes_say_and_encode_no_picture():
    """The text-only "note" kind: one to three summary notes as the session writes them, then
    questions about one of the pictures, each answerable from its note alone; no views."""
    dd = _script_module("demo_data")
    tok = dd.Tokens(str(MODELS / _record()["model"]))
    maker = dd.SampleMaker(tok, 224, 64, seed=5)
    kinds = set()
    for _ in range(40):
        s = maker.note()
        assert s.views == [] and all(x == -1 for x in s.slots) and s.labels is None
        text = tok.llm.detokenize(s.ids[1:]).decode()
        notes = dict(re.findall(r"\[image (\d) \([^)]*\): ([^\]]*)\]", text))
        assert 1 <= len(notes) <= 3
        turns = [t.split("\nASSISTANT: ") for t in text.split("USER: ")[1:]]
        asked = [(q.split("\n")[-1], a) for q, a in turns]
        assert asked and all(q.endswith(("?", ".")) for q, _ in asked), text
        for q, a in asked:
            n = re.search(r"image (\d)", q).group(1)
            desc = notes[n]
            if q.startswith("Describe"):
                kinds.add("describe")
                assert a.strip() == desc
            elif q.startswith("What letter"):
                kinds.add("letter")
                assert desc.endswith(f"the letter {a.strip()}")
            elif q.startswith("What colour"):
                kinds.add("colour")
                shape = re.match(r"What colour is the (\w+)", q).group(1)
                assert f"{a.strip()} {shape}" in desc
        # the loss falls on the answers only: every target token is in an assistant reply
        targets = tok.llm.detokenize([t for t, m in zip(s.ids, s.loss, strict=True) if m]).decode()
        assert all(a.strip() in targets for _, a in asked)
    assert {"describe", "letter", "colour"} <= kinds


def test_each_letter_is_one_token_the_note_and_the_answer_share():
    """``--letter-embed`` aligns a letter's image tokens with the text embedding of the token
    ``train_demo`` takes for it: that must be the one token the answer is and the note's
    "... and the letter K" ends with, for every letter."""
    dd = _script_module("demo_data")
    tok = dd.Tokens(str(MODELS / _record()["model"]))
    ids = {c: tok(c) for c in world.LETTERS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == 26
    for c, (i,) in ids.items():
        assert tok(f"[image 1 (scene-1.png): a red square and the letter {c}]")[-2] == i


def test_letter_alignment_pulls_a_letter_token_towards_its_word_and_ignores_the_rest():
    """The alignment loss itself (JAX, the ``train`` extra): near zero for image tokens equal to
    their letter's embedding, large for another letter's, and tokens labelled with no letter (or
    unlabelled) do not count."""
    _needs_train_extra()
    import numpy as np

    align = _script_module("train_demo").letter_alignment
    rng = np.random.default_rng(0)
    embd = rng.standard_normal((40, 16)).astype(np.float32)
    letter_ids = np.arange(10, 36)
    labels = np.full((1, 4, 5), -1, np.int32)
    labels[0, :, 2] = [3, 7, 26, 26]  # two letter tokens (D, H), two with no letter
    img = rng.standard_normal((1, 4, 16)).astype(np.float32)
    img[0, 0], img[0, 1] = embd[13] * 2.0, embd[17] * 0.5  # D's and H's own embeddings (any length)
    right = float(align(img, embd, letter_ids, labels))
    wrong = img.copy()
    wrong[0, 0] = embd[20]
    assert right < 0.5 < float(align(wrong, embd, letter_ids, labels))
    noise = img.copy()
    noise[0, 2:] = rng.standard_normal((2, 16))  # the unlabelled tokens change: the loss does not
    assert float(align(noise, embd, letter_ids, labels)) == pytest.approx(right)


@pytest.mark.slow
def test_three_training_steps_write_a_pair_llama_cpp_runs(tmp_path):
    """``train_demo.py --steps 3`` (the ``train`` extra; one batch kind, so one XLA compile)
    trains from random weights end to end and writes a GGUF pair whose record names its files
    and steps, with a finite loss; llama.cpp loads the pair and encodes a picture through the
    trained projector."""
    _needs_train_extra()
    import math

    import edgevlm

    train = _script_module("train_demo")
    args = ["--steps", "3", "--mix", "single:1", "--out", str(tmp_path), "--work", str(tmp_path / "work")]
    assert train.main(args) == 0
    rec = json.loads((tmp_path / "edgevlm-demo.json").read_text())
    assert rec["steps"] == 3 and math.isfinite(rec["final_loss"]), rec
    for name in (rec["model"], rec["mmproj"]):
        assert _sha(tmp_path / name) == rec["sha256"][name]
    assert _sha(tmp_path / rec["model"]) != _record()["sha256"][rec["model"]]  # not the committed pair
    picture = tmp_path / "scene.png"
    world.render(world.make_scene(random.Random(7), "plain", size=(320, 240))).save(picture)
    eng = edgevlm.load(tmp_path / rec["model"], tmp_path / rec["mmproj"], n_ctx=1024)
    try:
        r = eng.chat("What colour is the square?", [str(picture)], max_tokens=4, temperature=0.0)
    finally:
        eng.close()
    assert r.stats.images_encoded == 1 and r.stats.image_tokens > 0, r.stats
