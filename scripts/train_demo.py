#!/usr/bin/env python3
"""Train the demo VLM on the synthetic world (``edgevlm_testkit.world``) and write its GGUF pair.

    pip install -e '.[train]'          # JAX + optax; not needed to run the model
    python scripts/train_demo.py --minutes 60 --out models/

A LLaVA-1.5-style model (CLIP-like ViT, ``mlp`` projector, small ``llama``; see
``scripts/demo_model.py``) trained end to end from scratch on prompts built exactly as edgevlm
builds them: single pictures, AnyRes views of large ones (global view + detailed tiles, as
``--tiles auto`` picks them), and conversations where a picture was replaced by its summary.
Deterministic data from ``--seed``; the step count follows the time budget, so the loss reached
depends on the machine (the run's record — steps, time, loss — goes to ``edgevlm-demo.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_model as dm
from demo_data import AUX_NAMES, DRILLS, N_AUX, N_GROUPS, SampleMaker, Tokens, drill_view

from edgevlm_testkit.world import LETTERS

MODEL_NAME = "edgevlm-demo.gguf"
MMPROJ_NAME = "mmproj-edgevlm-demo.gguf"

# (samples, views, tokens) per batch shape; each step draws one shape from its weight
BUCKETS = {
    "single": (24, 24, 160),
    "conv": (8, 16, 256),
    "tiled": (3, 27, 704),
    "note": (40, 1, 160),  # text only (the one view stays blank and unlabelled)
    "drill": (0, 24, 0),
    "letters": (0, 24, 0),
}
# the end-to-end batch kinds: how each draws a sample (maker, patches a view, token room or None)
SAMPLES = {
    "single": lambda maker, n_patches, room: maker.single(room),
    "conv": lambda maker, n_patches, room: maker.conversation(),
    "tiled": lambda maker, n_patches, room: maker.tiled(n_patches),
    "note": lambda maker, n_patches, room: maker.note(),
}
AUX_WEIGHT = 0.5  # the per-patch auxiliary loss (a training-only head, not exported)
NEG_WEIGHT = 0.5  # its empty patches against those that show a shape or the letter
WEIGHTS = {"single": 0.62, "conv": 0.20, "tiled": 0.18}
VISION_WEIGHTS = {"single": 0.45, "drill": 0.4, "tiled": 0.15}  # the vision phase's pictures


def make_batch(maker: SampleMaker, kind: str, cfg: dm.DemoConfig, pictures_only: bool = False):
    B, NV, T = BUCKETS[kind]
    S, NP = cfg.image_size, cfg.n_patches
    pix = np.zeros((NV, S, S, 3), np.uint8)
    ids = np.zeros((B, T), np.int32)
    slots = np.full((B, T), -1, np.int32)
    loss = np.zeros((B, T), np.float32)
    valid = np.zeros((B, T), bool)
    labels = np.full((NV, NP, len(N_AUX)), -1, np.int32)
    scene_labels = np.full((NV, N_GROUPS + 1), -1, np.int32)
    nv = 0
    b = 0
    if kind in DRILLS:  # pictures only (the vision phase): dense training-only views
        for i in range(NV):
            pix[i], labels[i] = drill_view(maker.rng, S, cfg.grid, kind)
        return pix, ids, slots, loss, valid, labels, scene_labels
    while b < B:
        s = SAMPLES[kind](maker, NP, None if pictures_only else T)
        if len(s.ids) > T or nv + len(s.views) > NV:
            if len(s.ids) > T:
                continue
            break
        n = len(s.ids)
        for i, v in enumerate(s.views):
            pix[nv + i] = v
            if s.labels is not None:
                labels[nv + i] = s.labels[i]
                scene_labels[nv + i] = s.scene_labels[i]
        ids[b, :n] = s.ids
        sl = np.asarray(s.slots)
        slots[b, :n] = np.where(sl >= 0, sl + nv * NP, -1)
        # the loss at position p predicts token p+1; each answer weighs the same however long
        # it is (a description is ~12 tokens, a colour one), and so does each sample
        loss[b, : n - 1] = answer_weights(s.loss)[1:]
        valid[b, :n] = True
        nv += len(s.views)
        b += 1
    return pix, ids, slots, loss, valid, labels, scene_labels


def answer_weights(mask) -> np.ndarray:
    """Per-token loss weights, summing to 1 over a sample: each run of target tokens (one
    answer) weighs 1/sqrt(its length) per token, so a 12-token description counts ~3.5 times a
    one-word answer in all and a one-word answer ~3.5 times each description token. (Weighing
    every answer alike starved the descriptions: the second model listed "a green triangle, a
    green triangle" where it meant two.)"""
    m = np.asarray(mask, bool)
    w = np.zeros(len(m), np.float32)
    starts = np.flatnonzero(m & ~np.concatenate([[False], m[:-1]]))
    for a in starts:
        e = a
        while e < len(m) and m[e]:
            e += 1
        w[a:e] = 1.0 / np.sqrt(e - a)
    return w / max(float(w.sum()), 1e-9)


def aux_ce(logits, lab, none: int):
    """Cross-entropy over labelled patches, patches showing something and empty ones averaged
    apart (most patches are background; otherwise "nothing" wins every patch)."""
    import jax.numpy as jnp
    import optax

    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(lab, 0))
    pos = ((lab >= 0) & (lab != none)).astype(jnp.float32)
    neg = (lab == none).astype(jnp.float32)
    return (ce * pos).sum() / jnp.maximum(pos.sum(), 1.0) + NEG_WEIGHT * (ce * neg).sum() / jnp.maximum(neg.sum(), 1.0)


def aux_losses(params, img, labels, scene_labels, target_weights: dict[str, float] | None = None):
    """The training-only targets on the encoder's output (heads ``aux`` and ``aux_cls``, never
    exported): each image token says what its patch shows (colour, shape, letter), and the class
    token (the last image token) what the whole view holds — counts per colour and shape, and the
    letter — so the text model can read a scene from one token."""
    import jax.numpy as jnp
    import optax

    aux = img @ params["aux"].T
    aux_loss = 0.0
    o = 0
    tw = target_weights or {}
    for i, (name, n) in enumerate(zip(AUX_NAMES, N_AUX, strict=True)):
        aux_loss = aux_loss + tw.get(name, 1.0) * aux_ce(aux[..., o : o + n], labels[..., i], n - 1)
        o += n
    cls = img[:, -1] @ params["aux_cls"].T
    counts = cls[:, : N_GROUPS * 5].reshape(-1, N_GROUPS, 5)
    m = (scene_labels[:, :1] >= 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(counts, jnp.maximum(scene_labels[:, :N_GROUPS], 0))
    aux_loss = aux_loss + (ce.mean(-1) * m[:, 0]).sum() / jnp.maximum(m.sum(), 1.0)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        cls[:, N_GROUPS * 5 :], jnp.maximum(scene_labels[:, N_GROUPS], 0)
    )
    aux_loss = aux_loss + (ce * m[:, 0]).sum() / jnp.maximum(m.sum(), 1.0)
    return aux_loss


def make_optimizer(peak_lr: float):
    """AdamW behind global-norm clipping; the learning rate is set each step (:func:`lr_at`)."""
    import optax

    sched = optax.inject_hyperparams(optax.adamw)(learning_rate=peak_lr, b2=0.98, weight_decay=0.01)
    return optax.chain(optax.clip_by_global_norm(1.0), sched)


def lr_at(peak: float, step: int, warmup: int, frac: float) -> float:
    """Linear warm-up, then cosine over the time budget (``frac`` spent) down to 5 % of peak."""
    return peak * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * frac)))


def encode(cfg: dm.DemoConfig, vision: dict, pix):
    """uint8 views → image embeddings, normalised as mtmd does."""
    import jax.numpy as jnp

    mean = jnp.asarray(dm.CLIP_MEAN, jnp.float32)
    std = jnp.asarray(dm.CLIP_STD, jnp.float32)
    return dm.vision_forward(cfg, vision, (pix.astype(jnp.float32) / 255.0 - mean) / std)


LETTER_TEMP = 10.0  # cosine similarity → logit scale of the letter alignment


def letter_alignment(img, embd, letter_ids, labels):
    """Cross-entropy of each letter-labelled image token against the text model's own token
    embeddings of the 26 letters (cosine similarity, fixed temperature; the embeddings are not
    moved by it): a token that shows a K points where the word "K" does. The output embedding is
    tied, so a copy of that token into the answer position already says K — the circuit that
    copies a letter out of a summary note ("... and the letter K") reads it from the picture
    too."""
    import jax
    import jax.numpy as jnp
    import optax

    e = jax.lax.stop_gradient(embd[letter_ids])
    e = e / jnp.linalg.norm(e, axis=-1, keepdims=True)
    x = img / jnp.maximum(jnp.linalg.norm(img, axis=-1, keepdims=True), 1e-6)
    lab = labels[..., 2]
    m = ((lab >= 0) & (lab < len(letter_ids))).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(LETTER_TEMP * x @ e.T, jnp.clip(lab, 0, len(letter_ids) - 1))
    return (ce * m).sum() / jnp.maximum(m.sum(), 1.0)


def build_step(
    cfg: dm.DemoConfig,
    optimizer,
    target_weights: dict[str, float] | None = None,
    letter_ids=None,
    letter_weight: float = 0.0,
):
    import jax
    import jax.numpy as jnp
    import optax

    letter_ids = None if letter_ids is None else jnp.asarray(letter_ids, jnp.int32)

    def loss_fn(params, pix, ids, slots, loss_mask, valid, labels, scene_labels):
        img = encode(cfg, params["vision"], pix)
        aux_loss = aux_losses(params, img, labels, scene_labels, target_weights)
        if letter_weight:
            aux_loss = aux_loss + letter_weight * letter_alignment(img, params["text"]["embd"], letter_ids, labels)
        img = img.reshape(-1, cfg.t_embd)
        tok = params["text"]["embd"][ids]
        emb = jnp.where((slots >= 0)[..., None], img[jnp.maximum(slots, 0)], tok)
        T = ids.shape[1]
        pos = jnp.broadcast_to(jnp.arange(T), ids.shape)
        logits = dm.text_forward(cfg, params["text"], emb, pos, valid)
        tgt = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
        main = (ce * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)
        return main + AUX_WEIGHT * aux_loss, (main, aux_loss)

    @jax.jit
    def step(params, opt_state, pix, ids, slots, loss_mask, valid, labels, scene_labels):
        (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, pix, ids, slots, loss_mask, valid, labels, scene_labels
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    return step


def vision_phase(
    cfg: dm.DemoConfig,
    params: dict,
    maker: SampleMaker,
    budget_s: float,
    peak_lr: float,
    seed: int,
    work: Path,
    mix: dict[str, float] = VISION_WEIGHTS,
    target_weights: dict[str, float] | None = None,
):
    """Train the encoder (and the training-only heads) on the auxiliary targets alone: what each
    patch shows and what each view holds. A ViT learns shapes slowly from scratch (no
    convolutions: it must find edges and how they run from patches); without the text model a
    step costs ~40 % of an end-to-end one. Besides whole scenes and AnyRes views, 40 % of the
    pictures are drills (``demo_data.drill_view``: many shapes and letters in one view, many
    more labelled patches per picture). Held-out accuracies are logged every 250 steps. The
    text weights are untouched."""
    import jax
    import jax.numpy as jnp
    import optax

    sub = {k: params[k] for k in ("vision", "aux", "aux_cls")}
    opt = make_optimizer(peak_lr)
    opt_state = opt.init(sub)

    def loss_fn(sub, pix, labels, scene_labels):
        return aux_losses(sub, encode(cfg, sub["vision"], pix), labels, scene_labels, target_weights)

    @jax.jit
    def step(sub, opt_state, pix, labels, scene_labels):
        loss, grads = jax.value_and_grad(loss_fn)(sub, pix, labels, scene_labels)
        updates, opt_state = opt.update(grads, opt_state, sub)
        return optax.apply_updates(sub, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    held = held_out_views(cfg, maker)
    t0 = time.time()
    n, ema, pending = 0, None, None
    with open(work / "train.log", "a") as log:
        while time.time() - t0 < budget_s:
            lr = lr_at(peak_lr, n, 100, (time.time() - t0) / budget_s)
            kind = rng.choice(list(mix), p=list(mix.values()))
            # drawn while the previous step still runs (JAX dispatches asynchronously)
            pix, _, _, _, _, labels, scene_labels = make_batch(maker, kind, cfg, pictures_only=True)
            if pending is not None:
                ema = float(pending) if ema is None else 0.98 * ema + 0.02 * float(pending)
            opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
            sub, opt_state, pending = step(
                sub, opt_state, jnp.asarray(pix), jnp.asarray(labels), jnp.asarray(scene_labels)
            )
            n += 1
            if n % 25 == 0 and ema is not None:
                msg = f"vision step {n} t={(time.time() - t0) / 60:.1f}m lr={lr:.2e} aux={ema:.3f}"
                if n % 250 == 0:
                    msg += " held-out " + json.dumps(encoder_accuracy(cfg, sub, held))
                print(msg, flush=True)
                log.write(msg + "\n")
                log.flush()
    print("vision phase done: held-out " + json.dumps(encoder_accuracy(cfg, sub, held)), flush=True)
    return {**params, **sub}, n, time.time() - t0


def held_out_views(cfg: dm.DemoConfig, maker: SampleMaker, n: int = 96):
    """Pictures (and their targets) from a seed the training stream never draws: the encoder's
    progress, logged as accuracies rather than losses."""
    import random

    saved = maker.rng
    maker.rng = random.Random(-1)
    try:
        pix, _, _, _, _, labels, scene_labels = make_batch(maker, "single", cfg, pictures_only=True)
        while len(pix) < n:
            p, _, _, _, _, lb, sl = make_batch(maker, "single", cfg, pictures_only=True)
            pix, labels, scene_labels = (np.concatenate(a) for a in ((pix, p), (labels, lb), (scene_labels, sl)))
    finally:
        maker.rng = saved
    return pix[:n], labels[:n], scene_labels[:n]


def encoder_accuracy(cfg: dm.DemoConfig, params: dict, views) -> dict:
    """Per-token accuracy of each auxiliary target on tokens that show something, and of the
    class token's per-group counts and letter."""
    import jax.numpy as jnp

    pix, lab, sl = views
    img = np.asarray(encode(cfg, params["vision"], jnp.asarray(pix)))
    aux = img @ np.asarray(params["aux"]).T
    out, o = {}, 0
    for i, (name, n) in enumerate(zip(AUX_NAMES, N_AUX, strict=True)):
        m = (lab[..., i] >= 0) & (lab[..., i] != n - 1)
        out[name] = float((aux[..., o : o + n].argmax(-1) == lab[..., i])[m].mean()) if m.any() else 0.0
        o += n
    cls = img[:, -1] @ np.asarray(params["aux_cls"]).T
    counts = cls[:, : N_GROUPS * 5].reshape(-1, N_GROUPS, 5).argmax(-1)
    out["view_counts"] = float((counts == sl[:, :N_GROUPS]).all(-1).mean())
    m = sl[:, N_GROUPS] != N_AUX[2] - 1
    out["view_letter"] = float((cls[:, N_GROUPS * 5 :].argmax(-1) == sl[:, N_GROUPS])[m].mean()) if m.any() else 0.0
    return {k: round(v, 3) for k, v in out.items()}


def save_checkpoint(ckpt: Path, params, opt_state, step: int, spent: float, vision_steps: int, vision_s: float):
    """Everything --resume needs, written atomically."""
    import pickle

    import jax

    tmp = ckpt.with_suffix(".part")
    with open(tmp, "wb") as f:
        pickle.dump(
            {
                "params": jax.tree.map(np.asarray, params),
                "opt_state": jax.tree.map(np.asarray, opt_state),
                "step": step,
                "spent": spent,
                "vision_steps": vision_steps,
                "vision_s": vision_s,
            },
            f,
        )
    os.replace(tmp, ckpt)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_shares(text: str, normalise: bool = False) -> dict[str, float]:
    """ "single:0.6,conv:0.4" → {"single": 0.6, "conv": 0.4} (scaled to sum 1 with ``normalise``)."""
    out = {k.strip(): float(v) for k, v in (part.split(":") for part in text.split(",") if part.strip())}
    if normalise:
        total = sum(out.values())
        out = {k: v / total for k, v in out.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="training time budget")
    ap.add_argument("--steps", type=int, help="stop after this many end-to-end steps too (CI's smoke run)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument(
        "--mix",
        default=",".join(f"{k}:{v}" for k, v in WEIGHTS.items()),
        help="batch kinds and their shares (single, conv, tiled, and note: text-only "
        "questions answered from summary notes)",
    )
    ap.add_argument("--out", default="models")
    ap.add_argument("--work", default="test-artifacts/train-demo", help="checkpoints and the log")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    ap.add_argument(
        "--vision-minutes",
        type=float,
        default=0.0,
        help="first train the vision encoder alone on what each patch and view shows "
        "(no text model: ~2.5x the pictures per second), then --minutes end to end",
    )
    ap.add_argument("--vision-lr", type=float, default=1e-3)
    ap.add_argument(
        "--vision-mix",
        default=",".join(f"{k}:{v}" for k, v in VISION_WEIGHTS.items()),
        help="the vision phase's picture kinds and their shares (single, tiled, and the "
        "drills: " + ", ".join(DRILLS) + ")",
    )
    ap.add_argument(
        "--letter-embed",
        type=float,
        default=0.0,
        metavar="WEIGHT",
        help="align each letter-labelled image token with the text embedding of its letter "
        "(an extra auxiliary loss of this weight in the end-to-end phase)",
    )
    ap.add_argument(
        "--aux-weights",
        default="",
        help="per-patch targets weighed other than 1, e.g. letter:3 (of " + ", ".join(AUX_NAMES) + ")",
    )
    ap.add_argument(
        "--question-weights",
        default="",
        help="question kinds asked more or less often than by default, e.g. letter:2.5",
    )
    ap.add_argument(
        "--init",
        metavar="DIR",
        help="start from the GGUF pair (and its record) in DIR instead of random weights: a further training stage",
    )
    ap.add_argument(
        "--init-checkpoint",
        metavar="FILE",
        help="with --init: the training-only heads from that stage's checkpoint.npz",
    )
    ap.add_argument(
        "--export-only",
        action="store_true",
        help="write the GGUF pair from the last checkpoint and stop (to score a run in progress)",
    )
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    mix = parse_shares(args.mix, normalise=True)
    if set(mix) - set(SAMPLES):
        ap.error(f"--mix: unknown batch kinds {sorted(set(mix) - set(SAMPLES))} (of {', '.join(SAMPLES)})")
    vision_mix = parse_shares(args.vision_mix, normalise=True)
    aux_weights = parse_shares(args.aux_weights)
    question_weights = parse_shares(args.question_weights)
    cfg = dm.DemoConfig()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = dm.demo_vocab()
    params = dm.init_params(cfg, args.seed, len(vocab.tokens))
    stages: list[dict] = []
    heads = None
    if args.init:
        src = Path(args.init)
        params = dm.load_pair(cfg, src / MODEL_NAME, src / MMPROJ_NAME)
        if args.init_checkpoint:  # the same stage's checkpoint: its training-only heads too
            import pickle

            with open(args.init_checkpoint, "rb") as f:
                prev_params = pickle.load(f)["params"]
            heads = {k: np.asarray(prev_params[k]) for k in ("aux", "aux_cls")}
        rec_file = src / "edgevlm-demo.json"
        if rec_file.exists():
            prev = json.loads(rec_file.read_text())
            stages = prev.get("stages") or [
                {k: prev[k] for k in ("seed", "steps", "minutes", "final_loss", "mix", "lr") if k in prev}
            ]
    vocab_file = dm.export_text(cfg, params["text"], vocab, work / "vocab.gguf")
    maker = SampleMaker(Tokens(str(vocab_file)), cfg.image_size, cfg.n_patches, args.seed, question_weights)
    params["aux"] = np.zeros((sum(N_AUX), cfg.t_embd), np.float32)
    params["aux_cls"] = np.zeros((N_GROUPS * 5 + N_AUX[2], cfg.t_embd), np.float32)
    if heads is not None:  # a stage that adds targets starts their rows at zero
        for k, h in heads.items():
            n = min(len(h), len(params[k]))
            params[k][:n] = h[:n]
    params = jax.tree.map(jnp.asarray, params)

    budget_s = args.minutes * 60.0
    warmup = 200
    optimizer = make_optimizer(args.lr)
    opt_state = optimizer.init(params)
    letter_ids = [maker.tok(c)[-1] for c in LETTERS]
    step_fn = build_step(cfg, optimizer, aux_weights, letter_ids, args.letter_embed)
    start_step, spent = 0, 0.0
    ckpt = work / "checkpoint.npz"
    vision_steps, vision_s = 0, 0.0
    resumed = (args.resume or args.export_only) and ckpt.exists()
    if args.vision_minutes > 0 and not resumed:
        params, vision_steps, vision_s = vision_phase(
            cfg, params, maker, args.vision_minutes * 60.0, args.vision_lr, args.seed, work, vision_mix, aux_weights
        )
        opt_state = optimizer.init(params)
        save_checkpoint(ckpt, params, opt_state, 0, 0.0, vision_steps, vision_s)
    if resumed:
        import pickle

        with open(ckpt, "rb") as f:
            st = pickle.load(f)
        params, opt_state = jax.tree.map(jnp.asarray, st["params"]), st["opt_state"]
        start_step, spent = st["step"], st["spent"]
        maker.rng.seed(args.seed + start_step)
        vision_steps, vision_s = st.get("vision_steps", 0), st.get("vision_s", 0.0)
    if args.export_only:
        budget_s = 0.0
    rng = np.random.default_rng(args.seed + start_step)
    log = open(work / "train.log", "a")
    t0 = time.time() - spent
    step = start_step
    ema = None
    aux_ema = None
    pending = None
    held = held_out_views(cfg, maker)
    losses_by_kind: dict[str, float] = {}
    last_ckpt = time.time()
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget_s or (args.steps is not None and step - start_step >= args.steps):
            break
        lr = lr_at(args.lr, step, warmup, elapsed / budget_s)
        opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        kind = rng.choice(list(mix), p=list(mix.values()))
        batch = make_batch(maker, kind, cfg)  # drawn while the previous step still runs
        if pending is not None:
            pkind, loss, aux = pending[0], float(pending[1]), float(pending[2])
            aux_ema = aux if aux_ema is None else 0.98 * aux_ema + 0.02 * aux
            losses_by_kind[pkind] = loss if pkind not in losses_by_kind else 0.9 * losses_by_kind[pkind] + 0.1 * loss
            ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        params, opt_state, loss, aux = step_fn(params, opt_state, *map(jnp.asarray, batch))
        pending = (kind, loss, aux)
        step += 1
        if step % 500 == 0:
            msg = f"step {step} held-out encoder " + json.dumps(encoder_accuracy(cfg, params, held))
            print(msg, flush=True)
            log.write(msg + "\n")
        if step % 25 == 0 and ema is not None:
            msg = f"step {step} t={elapsed / 60:.1f}m lr={lr:.2e} loss={ema:.3f} aux={aux_ema:.3f} " + " ".join(
                f"{k}={v:.3f}" for k, v in sorted(losses_by_kind.items())
            )
            print(msg, flush=True)
            log.write(msg + "\n")
            log.flush()
        if time.time() - last_ckpt > 300:
            save_checkpoint(ckpt, params, opt_state, step, time.time() - t0, vision_steps, vision_s)
            last_ckpt = time.time()
    log.close()
    save_checkpoint(ckpt, params, opt_state, step, time.time() - t0, vision_steps, vision_s)
    final = jax.tree.map(np.asarray, params)
    model = dm.export_text(cfg, final["text"], vocab, out / MODEL_NAME)
    mmproj = dm.export_mmproj(cfg, final["vision"], out / MMPROJ_NAME)
    record = {
        "model": MODEL_NAME,
        "mmproj": MMPROJ_NAME,
        "sha256": {MODEL_NAME: sha256(model), MMPROJ_NAME: sha256(mmproj)},
        "bytes": {MODEL_NAME: model.stat().st_size, MMPROJ_NAME: mmproj.stat().st_size},
        "seed": args.seed,
        "steps": step,
        "minutes": round((time.time() - t0) / 60, 1),
        "final_loss": round(float(ema), 4) if ema is not None else None,
        "loss_by_kind": {k: round(v, 4) for k, v in losses_by_kind.items()},
        "config": dm.config_dict(cfg),
        "buckets": BUCKETS,
        "mix": mix,
        "lr": args.lr,
        "machine": f"{os.cpu_count()} CPU cores, JAX {jax.__version__}",
    }
    stage = {k: record[k] for k in ("seed", "final_loss", "mix", "lr")}
    stage["steps"] = step + vision_steps
    stage["minutes"] = round(record["minutes"] + vision_s / 60, 1)
    if vision_steps:
        stage["vision_only"] = {
            "steps": vision_steps,
            "minutes": round(vision_s / 60, 1),
            "lr": args.vision_lr,
            "mix": vision_mix,
        }
    stage["aux"] = {"weight": AUX_WEIGHT, "empty_patches": NEG_WEIGHT}
    if aux_weights:
        stage["aux"]["targets"] = aux_weights
    if args.letter_embed:
        stage["aux"]["letter_embed"] = args.letter_embed
    if question_weights:
        stage["questions"] = question_weights
    record["stages"] = stages + [stage]
    # the totals over every stage: what the pair cost to train
    record["steps"] = sum(st["steps"] for st in record["stages"])
    record["minutes"] = round(sum(st["minutes"] for st in record["stages"]), 1)
    (out / "edgevlm-demo.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
