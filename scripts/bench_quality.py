#!/usr/bin/env python3
"""Answer quality of the demo VLM under edgevlm's memory levers, side by side in one run.

The demo model (``models/edgevlm-demo.gguf``, trained by ``scripts/train_demo.py`` on the
synthetic world of ``edgevlm_testkit.world``) is asked about a held-out set of scenes drawn with
other seeds than training used, through edgevlm and real llama.cpp (greedy), under:

- full resolution (one view, no budget);
- image-token budgets (AnyRes global view + detailed tiles within the budget);
- detail scenes (a 30–60 px letter on a 2000–4000 px canvas): tiles off vs auto, same budget;
- token merging off / threshold / ratio 0.5 / ratio 0.25;
- a chat whose first picture the session replaced by the model's own summary (the context is
  too small for two pictures), then asked about ("What colour is the square in image 1?");
- captioning (``caption_images``, prompt "Describe the image."): the description, exact.

Accuracy per question type (graded by ``world.grade``: case and punctuation folded), a table and
JSON (``--out``).

    python scripts/bench_quality.py [--scenes 60] [--detail 40] [--seed 900000]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgevlm_testkit import world  # noqa: E402  (after the path above)

TYPES = world.QUESTION_TYPES
MERGES = ["off", "threshold:0.9", "ratio:0.5", "ratio:0.25"]
MAX_TOKENS = {"describe": 40, "colour": 6, "shape": 6, "count": 6, "letter": 6}


def make_set(seed: int, n: int, kind: str, folder: Path) -> list[tuple[str, world.Scene]]:
    """``n`` scenes from seeds ``seed``, ``seed+1``, … saved as PNG files."""
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        scene = world.make_scene(rng, kind, letter_p=0.5)
        path = folder / f"{kind}-{seed + i}.png"
        world.render(scene).save(path)
        out.append((str(path), scene))
    return out


def pick(scene: world.Scene, rng: random.Random, types=TYPES) -> list[tuple[str, str, str]]:
    """One question per type the scene supports."""
    by: dict[str, list] = defaultdict(list)
    for q in world.questions(scene):
        by[q[0]].append(q)
    return [rng.choice(by[t]) for t in types if by[t]]


class Tally:
    def __init__(self):
        self.right: dict[str, int] = defaultdict(int)
        self.total: dict[str, int] = defaultdict(int)
        self.examples: list[dict] = []

    def add(self, kind: str, answer: str, expected: str, **info) -> None:
        ok = world.grade(answer, expected)
        self.right[kind] += ok
        self.total[kind] += 1
        if len(self.examples) < 4 or not ok and len(self.examples) < 12:
            self.examples.append({"type": kind, "answer": answer.strip(), "expected": expected, "ok": ok, **info})

    def acc(self, kind: str) -> float | None:
        return round(100.0 * self.right[kind] / self.total[kind], 1) if self.total[kind] else None

    def row(self, name: str, **extra) -> dict:
        return {
            "condition": name,
            **{t: self.acc(t) for t in TYPES},
            "n": dict(self.total),
            **extra,
            "examples": self.examples,
        }


def ask(conv, text: str, image: str | None, kind: str) -> str:
    """One question in ``conv`` (a conversation), forgotten before the next (cells kept)."""
    conv.reset(keep_cache=True)
    r = conv.chat(text, [image] if image else [], max_tokens=MAX_TOKENS[kind], temperature=0.0)
    return r.text


def run_questions(conv, scenes, seed: int, types=TYPES) -> Tally:
    """The same questions for the same scenes under every condition (one draw per scene, then
    the types a condition asks about), each asked in ``conv`` and forgotten."""
    t = Tally()
    for i, (path, scene) in enumerate(scenes):
        for kind, q, a in pick(scene, random.Random(seed * 1000 + i)):
            if kind in types:
                t.add(kind, ask(conv, q, path, kind), a, image=Path(path).name, question=q)
    return t


def summary_chats(model, mmproj, seed: int, n: int, folder: Path) -> list[dict]:
    """Picture 1, then picture 2, in a context whose image room holds one (256 cells, each
    picture a global view + one tile = 128 tokens): the session replaces picture 1 by the
    model's own summary; then questions about picture 1, each asked after the conversation and
    forgotten (``Engine.complete``). Only conversations where the summary happened are graded.

    A second row asks the same questions with a *right* note in place of the model's summary
    (one text-only turn: ``[image 1 (file): <the true description>]`` and the question, as the
    session writes the note): how well the text model reads a note, apart from how well the
    model describes — what the first row would be with a perfect summariser."""
    import edgevlm

    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        r = random.Random(seed + i)
        # busy pictures (3-4 shapes): the tile AnyRes picks is never skipped as flat
        scenes = [
            world.make_scene(
                r, "plain", size=(r.randint(600, 1600), r.randint(450, 1200)), letter_p=0.5, n_shapes=r.randint(3, 4)
            )
            for _ in range(2)
        ]
        paths = [folder / f"chat-{seed + i}-{j}.png" for j in range(2)]
        for s, p in zip(scenes, paths, strict=True):
            world.render(s).save(p)
        pairs.append((scenes, [str(p) for p in paths]))
    vlm = edgevlm.load(model, mmproj, n_ctx=256, image_tokens=128)
    eng = vlm.conversation()
    t, right_note = Tally(), Tally()
    summarised = 0
    asked = []
    try:
        for (s1, s2), (p1, p2) in pairs:
            eng.reset()
            eng.chat("Describe the image.", [p1], max_tokens=40, temperature=0.0)
            _, q2, _ = pick(s2, rng, ("colour", "shape", "count"))[0]
            r2 = eng.chat(q2, [p2], max_tokens=6, temperature=0.0)
            if r2.stats.summarized_images < 1:
                continue
            summarised += 1
            summary = next((p.summary for p in eng.pictures if p.number == 1), None)
            for kind, q, a in pick(s1, rng, ("colour", "shape", "count", "letter")):
                question = q[:-1] + " in image 1?"
                t.add(
                    kind,
                    eng.complete(question, 6),
                    a,
                    image=Path(p1).name,
                    question=question,
                    summary=summary,
                    summary_right=world.grade(summary or "", world.describe(s1)),
                )
                asked.append((kind, question, a, p1, s1))
        for kind, question, a, p1, s1 in asked:
            note = f"[image 1 ({Path(p1).name}): {world.describe(s1)}]"
            right_note.add(
                kind, ask(eng, note + "\n" + question, None, kind), a, image=Path(p1).name, question=question
            )
    finally:
        vlm.close()
    return [
        t.row("summarised picture (asked after)", conversations=n, summarised=summarised),
        right_note.row("same questions, a right note (text only)"),
    ]


def captions(eng, plain) -> dict:
    from edgevlm.caption import caption_images

    want = {p: world.describe(s) for p, s in plain}
    t = Tally()
    for rec in caption_images(eng, list(want), prompt="Describe the image.", max_tokens=40):
        t.add("describe", rec.caption or "", want[rec.path], image=Path(rec.path).name)
    return t.row("captioning (caption_images)")


def fmt(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "edgevlm-demo.gguf"))
    ap.add_argument("--mmproj", default=str(ROOT / "models" / "mmproj-edgevlm-demo.gguf"))
    ap.add_argument("--scenes", type=int, default=60, help="plain held-out scenes")
    ap.add_argument("--detail", type=int, default=40, help="detail scenes (tiles off vs auto)")
    ap.add_argument("--seed", type=int, default=900_000, help="first held-out seed (training uses others)")
    ap.add_argument("--chats", type=int, default=30, help="conversations whose first picture gets summarised")
    ap.add_argument("--budgets", default="128,320,576")
    ap.add_argument(
        "--detail-budgets",
        default="576,2304",
        help="image-token budgets for the detail scenes (tiles off and auto get the same)",
    )
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_quality")
    import edgevlm

    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plain = make_set(args.seed, args.scenes, "plain", folder)
        detail = make_set(args.seed + 50_000, args.detail, "detail", folder)
        eng = edgevlm.load(args.model, args.mmproj, n_ctx=4096)
        try:
            rows.append(run_questions(eng.conversation(), plain, args.seed).row("full resolution"))
            for b in [int(x) for x in args.budgets.split(",") if x]:
                view = eng.conversation(image_tokens=b, tiles="auto")
                rows.append(run_questions(view, plain, args.seed).row(f"budget {b}, tiles auto"))
            for b in [int(x) for x in args.detail_budgets.split(",") if x]:
                for tiles in ("off", "auto"):
                    view = eng.conversation(image_tokens=b, tiles=tiles)
                    rows.append(
                        run_questions(view, detail, args.seed + 1, ("letter",)).row(
                            f"detail scenes, budget {b}, tiles {tiles}"
                        )
                    )
            from edgevlm.vision.merge import MergeSpec

            for m in MERGES:
                view = eng.conversation(merge=MergeSpec.parse(m))
                rows.append(
                    run_questions(view, plain, args.seed, ("colour", "shape", "count", "letter")).row(f"merge {m}")
                )
            rows.append(captions(eng, plain))
        finally:
            eng.close()
        rows += summary_chats(args.model, args.mmproj, args.seed + 100_000, args.chats, folder)

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"demo model answer accuracy (%), {args.scenes} plain + {args.detail} detail held-out scenes")
    tab.add_column("condition")
    for t in TYPES:
        tab.add_column(t, justify="right")
    tab.add_column("answers", justify="right")
    for r in rows:
        tab.add_row(r["condition"], *[fmt(r[t]) for t in TYPES], str(sum(r["n"].values())))
    Console(width=140).print(tab)
    result = {
        "model": args.model,
        "mmproj": args.mmproj,
        "seed": args.seed,
        "scenes": args.scenes,
        "detail": args.detail,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
    }
    print(f"{time.time() - t0:.0f} s; JSON: {run.save(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
