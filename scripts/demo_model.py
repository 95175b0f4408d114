"""The demo VLM's architecture in JAX, exactly as llama.cpp runs it, and its GGUF export.

Vision: CLIP-like ViT as mtmd's ``clip_graph_llava`` evaluates it — conv patch embedding, the
class token concatenated *after* the patches, learned positions, pre-LayerNorm, ``n_layer``
blocks of which the last is skipped (LLaVA takes the second-to-last layer's output), quick-GELU
FFNs, the optional post-LayerNorm, then rows 1..n_patches (mtmd's patch offset for a class token), an ``mlp`` projector
(linear → GELU → linear). Text: ``llama`` (RMSNorm, RoPE in NORM mode — adjacent pairs — SwiGLU,
tied output embedding). Used by ``scripts/train_demo.py``; needs the ``train`` extra (JAX).
"""

from __future__ import annotations

import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgevlm_testkit.llava import CLIP_MEAN, CLIP_STD, clip_mlp_header, llama_keys
from edgevlm_testkit.shapes import TextShape, VisionShape
from edgevlm_testkit.vocab import BYTE, CONTROL, NORMAL, UNKNOWN, Vocab, write_vocab
from edgevlm_testkit.writer import add_tensor, finish, write_text_header

PAD_COLOUR = (122, 116, 104)  # mtmd's pad colour for LLaVA-1.5 projectors


@dataclass(frozen=True)
class DemoConfig:
    image_size: int = 224
    patch_size: int = 28
    v_embd: int = 192
    v_layers: int = 4  # layers used; the file holds one more (skipped by mtmd)
    v_heads: int = 3
    v_ff: int = 768
    t_embd: int = 192
    t_layers: int = 3
    t_heads: int = 3
    t_ff: int = 512
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid**2


# --- vocabulary ----------------------------------------------------------------------------
WORDS = [
    "What",
    "colour",
    "is",
    "the",
    "shape",
    "How",
    "many",
    "are",
    "there",
    "letter",
    "in",
    "image",
    "Describe",
    "describe",
    "red",
    "green",
    "blue",
    "yellow",
    "white",
    "black",
    "circle",
    "circles",
    "square",
    "squares",
    "triangle",
    "triangles",
    "a",
    "two",
    "three",
    "four",
    "and",
    "USER",
    "ASSISTANT",
    "global",
    "view",
    "tile",
    "row",
    "col",
    "In",
    "one",
    "or",
    "two",
    "short",
    "sentences",
    "from",
    "earlier",
    "this",
    "conversation",
    "with",
    "any",
    "text",
    "numbers",
    "it",
    "shows",
    "Write",
    "sentence",
    "caption",
    "for",
    "of",
    "png",
    "jpg",
    "scene",
    "picture",
    "no",
    "description",
]


def demo_vocab() -> Vocab:
    """SPM vocab: specials, bytes, characters, then every prefix of every word (with and without
    the word-start marker) so llama.cpp's greedy merge reaches whole words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    pieces: list[str] = ["\u2581"]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += list(chars) + ["\u2581" + c for c in chars]
    for w in WORDS:
        for n in range(2, len(w) + 1):
            pieces += [w[:n], "\u2581" + w[:n]]
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(NORMAL)
    scores = [0.0] * 259 + [len(t) * 10.0 - i * 1e-4 for i, t in enumerate(tokens[259:])]
    return Vocab("llama", tokens, scores, types, [], bos_id=1, eos_id=2, unk_id=0, pad_id=None)


# --- parameters ----------------------------------------------------------------------------
def init_params(cfg: DemoConfig, seed: int, n_vocab: int) -> dict:
    rng = np.random.default_rng(seed)

    def lin(n_out, n_in, scale=1.0):
        return (rng.standard_normal((n_out, n_in)) * scale / np.sqrt(n_in)).astype(np.float32)

    E, F = cfg.v_embd, cfg.v_ff
    v = {
        "patch": lin(E, 3 * cfg.patch_size**2),
        "cls": (rng.standard_normal(E) * 0.02).astype(np.float32),
        "pos": (rng.standard_normal((cfg.n_patches + 1, E)) * 0.02).astype(np.float32),
        "pre_w": np.ones(E, np.float32),
        "pre_b": np.zeros(E, np.float32),
        "post_w": np.ones(E, np.float32),
        "post_b": np.zeros(E, np.float32),
        "layers": [],
    }
    for _ in range(cfg.v_layers):
        v["layers"].append(
            {
                "ln1_w": np.ones(E, np.float32),
                "ln1_b": np.zeros(E, np.float32),
                "q": lin(E, E),
                "q_b": np.zeros(E, np.float32),
                "k": lin(E, E),
                "k_b": np.zeros(E, np.float32),
                "v": lin(E, E),
                "v_b": np.zeros(E, np.float32),
                "o": lin(E, E, 0.5),
                "o_b": np.zeros(E, np.float32),
                "ln2_w": np.ones(E, np.float32),
                "ln2_b": np.zeros(E, np.float32),
                "up": lin(F, E),
                "up_b": np.zeros(F, np.float32),
                "down": lin(E, F, 0.5),
                "down_b": np.zeros(E, np.float32),
            }
        )
    T, TF = cfg.t_embd, cfg.t_ff
    v["mm0"], v["mm0_b"] = lin(T, E), np.zeros(T, np.float32)
    v["mm2"], v["mm2_b"] = lin(T, T), np.zeros(T, np.float32)
    t = {
        "embd": (rng.standard_normal((n_vocab, T)) / np.sqrt(T)).astype(np.float32),
        "out_norm": np.ones(T, np.float32),
        "layers": [],
    }
    for _ in range(cfg.t_layers):
        t["layers"].append(
            {
                "attn_norm": np.ones(T, np.float32),
                "q": lin(T, T),
                "k": lin(T, T),
                "v": lin(T, T),
                "o": lin(T, T, 0.5),
                "ffn_norm": np.ones(T, np.float32),
                "gate": lin(TF, T),
                "up": lin(TF, T),
                "down": lin(T, TF, 0.5),
            }
        )
    return {"vision": v, "text": t}


# --- forward (JAX) -------------------------------------------------------------------------
def _jnp():
    import jax.numpy as jnp

    return jnp


def layer_norm(x, w, b, eps=1e-5):
    jnp = _jnp()
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def rms_norm(x, w, eps=1e-5):
    jnp = _jnp()
    return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    jnp = _jnp()
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def vision_forward(cfg: DemoConfig, v: dict, pixels):
    """pixels: [B, S, S, 3] normalised → image embeddings [B, n_patches, t_embd]."""
    import jax

    jnp = _jnp()
    B = pixels.shape[0]
    G, P = cfg.grid, cfg.patch_size
    x = pixels.reshape(B, G, P, G, P, 3).transpose(0, 1, 3, 5, 2, 4).reshape(B, G * G, 3 * P * P)
    h = x @ v["patch"].T
    h = jnp.concatenate([h, jnp.broadcast_to(v["cls"], (B, 1, cfg.v_embd))], axis=1) + v["pos"]
    h = layer_norm(h, v["pre_w"], v["pre_b"])
    H, D = cfg.v_heads, cfg.v_embd // cfg.v_heads
    n = h.shape[1]
    for ly in v["layers"]:
        a = layer_norm(h, ly["ln1_w"], ly["ln1_b"])
        q = (a @ ly["q"].T + ly["q_b"]).reshape(B, n, H, D)
        k = (a @ ly["k"].T + ly["k_b"]).reshape(B, n, H, D)
        vv = (a @ ly["v"].T + ly["v_b"]).reshape(B, n, H, D)
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, vv).reshape(B, n, cfg.v_embd)
        h = h + o @ ly["o"].T + ly["o_b"]
        f = layer_norm(h, ly["ln2_w"], ly["ln2_b"])
        f = f @ ly["up"].T + ly["up_b"]
        f = f * jax.nn.sigmoid(1.702 * f)
        h = h + f @ ly["down"].T + ly["down_b"]
    h = layer_norm(h, v["post_w"], v["post_b"])  # mtmd's optional post-LayerNorm: bounded features
    h = h[:, 1:]  # mtmd takes rows 1..n_patches: patches 1.. and the class token
    e = gelu_tanh(h @ v["mm0"].T + v["mm0_b"])
    return e @ v["mm2"].T + v["mm2_b"]


def rope(x, pos, theta):
    """NORM-mode RoPE (adjacent pairs), x: [B, T, H, D], pos: [B, T]."""
    jnp = _jnp()
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float32) / D)
    ang = pos[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    c, s = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)


def text_forward(cfg: DemoConfig, t: dict, emb, pos, valid):
    """emb: [B, T, E] input embeddings, pos: [B, T], valid: [B, T] bool → logits [B, T, V]."""
    import jax

    jnp = _jnp()
    B, T, _ = emb.shape
    H, D = cfg.t_heads, cfg.t_embd // cfg.t_heads
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None] & valid[:, None, None, :]
    h = emb
    for ly in t["layers"]:
        a = rms_norm(h, ly["attn_norm"])
        q = rope((a @ ly["q"].T).reshape(B, T, H, D), pos, cfg.rope_theta)
        k = rope((a @ ly["k"].T).reshape(B, T, H, D), pos, cfg.rope_theta)
        v = (a @ ly["v"].T).reshape(B, T, H, D)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(mask, s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, cfg.t_embd)
        h = h + o @ ly["o"].T
        f = rms_norm(h, ly["ffn_norm"])
        h = h + (jax.nn.silu(f @ ly["gate"].T) * (f @ ly["up"].T)) @ ly["down"].T
    return rms_norm(h, t["out_norm"]) @ t["embd"].T


def normalise_pixels(u8: np.ndarray) -> np.ndarray:
    return (u8.astype(np.float32) / 255.0 - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)


# --- export --------------------------------------------------------------------------------
def _add(w, name, data, qtype):
    add_tensor(w, name, np.asarray(data, np.float32), qtype)


def _write(w, path: Path) -> Path:
    return finish(w, Path(str(path) + ".part"), path)


def export_text(
    cfg: DemoConfig,
    t: dict,
    vocab: Vocab,
    path: Path,
    qtype: str = "q8_0",
    name: str = "edgevlm demo (trained on the synthetic world)",
) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path) + ".part", "llama")
    t_shape = TextShape(
        len(vocab.tokens),
        cfg.t_embd,
        cfg.t_layers,
        cfg.t_heads,
        cfg.t_heads,
        cfg.t_ff,
        cfg.n_ctx_train,
        cfg.rope_theta,
        tied=True,
    )
    write_text_header(w, t_shape, name, qtype)
    llama_keys(w, t_shape)
    write_vocab(w, vocab)
    _add(w, "token_embd.weight", t["embd"], qtype)
    for i, ly in enumerate(t["layers"]):
        p = f"blk.{i}"
        _add(w, f"{p}.attn_norm.weight", ly["attn_norm"], "f32")
        for k, n in (
            ("q", "attn_q"),
            ("k", "attn_k"),
            ("v", "attn_v"),
            ("o", "attn_output"),
            ("gate", "ffn_gate"),
            ("up", "ffn_up"),
            ("down", "ffn_down"),
        ):
            _add(w, f"{p}.{n}.weight", ly[k], qtype)
        _add(w, f"{p}.ffn_norm.weight", ly["ffn_norm"], "f32")
    _add(w, "output_norm.weight", t["out_norm"], "f32")
    return _write(w, path)


def export_mmproj(
    cfg: DemoConfig, v: dict, path: Path, name: str = "edgevlm demo CLIP (trained on the synthetic world)"
) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path) + ".part", "clip")
    # one block more than used: mtmd's LLaVA graph skips the last one
    v_shape = VisionShape(cfg.image_size, cfg.patch_size, cfg.v_embd, cfg.v_layers + 1, cfg.v_heads, cfg.v_ff)
    clip_mlp_header(w, v_shape, name)
    E, P = cfg.v_embd, cfg.patch_size
    _add(w, "v.class_embd", v["cls"], "f32")
    _add(w, "v.patch_embd.weight", np.asarray(v["patch"]).reshape(E, 3, P, P), "f16")
    _add(w, "v.position_embd.weight", v["pos"], "f16")
    _add(w, "v.pre_ln.weight", v["pre_w"], "f32")
    _add(w, "v.pre_ln.bias", v["pre_b"], "f32")
    layers = list(v["layers"])
    # mtmd skips the last block (LLaVA's second-to-last feature layer): write a copy it never runs
    layers.append(layers[-1])
    for i, ly in enumerate(layers):
        p = f"v.blk.{i}"
        _add(w, f"{p}.ln1.weight", ly["ln1_w"], "f32")
        _add(w, f"{p}.ln1.bias", ly["ln1_b"], "f32")
        for k, n in (
            ("q", "attn_q"),
            ("k", "attn_k"),
            ("v", "attn_v"),
            ("o", "attn_out"),
            ("up", "ffn_up"),
            ("down", "ffn_down"),
        ):
            _add(w, f"{p}.{n}.weight", ly[k], "f16")
            _add(w, f"{p}.{n}.bias", ly[k + "_b"], "f32")
        _add(w, f"{p}.ln2.weight", ly["ln2_w"], "f32")
        _add(w, f"{p}.ln2.bias", ly["ln2_b"], "f32")
    _add(w, "v.post_ln.weight", v["post_w"], "f32")
    _add(w, "v.post_ln.bias", v["post_b"], "f32")
    _add(w, "mm.0.weight", v["mm0"], "f16")
    _add(w, "mm.0.bias", v["mm0_b"], "f32")
    _add(w, "mm.2.weight", v["mm2"], "f16")
    _add(w, "mm.2.bias", v["mm2_b"], "f32")
    return _write(w, path)


def config_dict(cfg: DemoConfig) -> dict:
    return asdict(cfg)


# --- import (the inverse of the exports: continue training from a written pair) ------------
def _tensors(path: Path) -> dict[str, np.ndarray]:
    import gguf
    from gguf.quants import dequantize

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = a.reshape([int(d) for d in reversed(t.shape)])
    return out


def load_pair(cfg: DemoConfig, model: Path, mmproj: Path) -> dict:
    """Parameters from a GGUF pair written by :func:`export_text` / :func:`export_mmproj`
    (Q8_0 weights come back dequantised)."""
    t, v = _tensors(model), _tensors(mmproj)
    E, P = cfg.v_embd, cfg.patch_size
    text = {"embd": t["token_embd.weight"], "out_norm": t["output_norm.weight"], "layers": []}
    for i in range(cfg.t_layers):
        p = f"blk.{i}"
        ly = {"attn_norm": t[f"{p}.attn_norm.weight"], "ffn_norm": t[f"{p}.ffn_norm.weight"]}
        for k, n in (
            ("q", "attn_q"),
            ("k", "attn_k"),
            ("v", "attn_v"),
            ("o", "attn_output"),
            ("gate", "ffn_gate"),
            ("up", "ffn_up"),
            ("down", "ffn_down"),
        ):
            ly[k] = t[f"{p}.{n}.weight"]
        text["layers"].append(ly)
    vision = {
        "cls": v["v.class_embd"],
        "patch": v["v.patch_embd.weight"].reshape(E, 3 * P * P),
        "pos": v["v.position_embd.weight"],
        "pre_w": v["v.pre_ln.weight"],
        "pre_b": v["v.pre_ln.bias"],
        "post_w": v["v.post_ln.weight"],
        "post_b": v["v.post_ln.bias"],
        "mm0": v["mm.0.weight"],
        "mm0_b": v["mm.0.bias"],
        "mm2": v["mm.2.weight"],
        "mm2_b": v["mm.2.bias"],
        "layers": [],
    }
    for i in range(cfg.v_layers):  # the written extra block is the one mtmd skips
        p = f"v.blk.{i}"
        ly = {
            "ln1_w": v[f"{p}.ln1.weight"],
            "ln1_b": v[f"{p}.ln1.bias"],
            "ln2_w": v[f"{p}.ln2.weight"],
            "ln2_b": v[f"{p}.ln2.bias"],
        }
        for k, n in (
            ("q", "attn_q"),
            ("k", "attn_k"),
            ("v", "attn_v"),
            ("o", "attn_out"),
            ("up", "ffn_up"),
            ("down", "ffn_down"),
        ):
            ly[k], ly[k + "_b"] = v[f"{p}.{n}.weight"], v[f"{p}.{n}.bias"]
        vision["layers"].append(ly)
    return {"vision": vision, "text": text}


def dct_patch_basis(cfg: DemoConfig) -> np.ndarray:
    """[v_embd, 3·P·P]: the lowest 2-D DCT frequencies of each colour channel of a patch,
    orthonormal rows (JPEG's basis). Drawings of flat shapes keep nearly all their energy there:
    an initial patch embedding that sees edges and where they run, instead of random mixtures."""
    P, E = cfg.patch_size, cfg.v_embd
    n = int(np.ceil(np.sqrt(E / 3)))
    freqs = sorted(((u, v) for u in range(n) for v in range(n)), key=lambda f: (f[0] + f[1], f))
    x = np.arange(P)
    rows = []
    for u, v in freqs:
        b = np.outer(np.cos(np.pi * (2 * x + 1) * u / (2 * P)), np.cos(np.pi * (2 * x + 1) * v / (2 * P)))
        b /= np.linalg.norm(b)
        for c in range(3):
            r = np.zeros((3, P, P), np.float32)
            r[c] = b
            rows.append(r.reshape(-1))
            if len(rows) == E:
                return np.stack(rows)
    return np.stack(rows)[:E]
