"""LLaVA-1.5 (``mlp``) and LLaVA-1.6 (``mlp`` + pinpoints) pairs: a ``llama`` text model with an
SPM vocab and Q4_0 weights, and a CLIP ``clip`` mmproj in F16."""

from __future__ import annotations

from pathlib import Path

from .shapes import LLAVA16_PINPOINTS, LLAVA_PRESETS, TextShape, VisionShape
from .vocab import spm_vocab, write_vocab
from .writer import FILE_TYPES, RandomGGUF, decoder_tensors, text_header

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def write_llama_text(path: Path, t: TextShape, seed: int, name: str, weight_type: str = "q4_0") -> Path:
    g = RandomGGUF(path, "llama", seed, weight_type)
    text_header(g, t, name)
    llama_keys(g.writer, t)
    write_vocab(g.writer, spm_vocab(t.n_vocab))
    decoder_tensors(g, t, qkv_bias=False)
    return g.write()


def llama_keys(w, t: TextShape) -> None:
    """The ``llama`` architecture's keys beyond the shared header (w: gguf.GGUFWriter)."""
    w.add_rope_dimension_count(t.head_dim)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(t.n_vocab)


def clip_mlp_header(
    w, v: VisionShape, name: str, pinpoints: list[int] | None = None, projector_type: str = "mlp"
) -> None:
    """A CLIP vision tower with a LLaVA projector: the mmproj's metadata (w: gguf.GGUFWriter)."""
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", projector_type)
    w.add_bool("clip.use_gelu", False)  # CLIP ViT-L uses quick-GELU
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.projection_dim", v.n_embd)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_array("clip.vision.image_mean", CLIP_MEAN)
    w.add_array("clip.vision.image_std", CLIP_STD)
    if pinpoints:
        w.add_array("clip.vision.image_grid_pinpoints", pinpoints)
        w.add_string("clip.vision.mm_patch_merge_type", "spatial_unpad")


def write_clip_mlp(
    path: Path,
    v: VisionShape,
    n_text_embd: int,
    seed: int,
    name: str,
    pinpoints: list[int] | None = None,
    projector_type: str = "mlp",
) -> Path:
    """A CLIP + ``mlp`` projector; ``projector_type`` only relabels it (a file that claims another
    projector type, for the paths that read the metadata alone)."""
    g = RandomGGUF(path, "clip", seed, "f16")
    clip_mlp_header(g.writer, v, name, pinpoints, projector_type)

    n_patches = (v.image_size // v.patch_size) ** 2
    E = v.n_embd
    g.bias("v.class_embd", E, scale=0.02)
    g.weight("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size))
    g.weight("v.position_embd.weight", (n_patches + 1, E), scale=0.02)
    g.norm("v.pre_ln", E)
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        g.norm(f"{p}.ln1", E)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.linear(f"{p}.{proj}", E, E)
        g.norm(f"{p}.ln2", E)
        g.linear(f"{p}.ffn_up", v.n_ff, E)
        g.linear(f"{p}.ffn_down", E, v.n_ff)
    g.linear("mm.0", n_text_embd, E)
    g.linear("mm.2", n_text_embd, n_text_embd)
    if pinpoints:
        g.bias("v.image_newline", n_text_embd, scale=0.5)
    return g.write()


def write_llava(outdir: Path, text: TextShape, vision: VisionShape, seed: int, family: str) -> tuple[Path, Path]:
    tiled = family == "llava16"
    label = "LLaVA-1.6" if tiled else "LLaVA-1.5"
    model = write_llama_text(outdir / "model.gguf", text, seed, f"{label} random ({family})")
    mmproj = write_clip_mlp(
        outdir / "mmproj.gguf",
        vision,
        text.n_embd,
        seed + 1,
        f"{label} CLIP random",
        pinpoints=LLAVA16_PINPOINTS if tiled else None,
    )
    return model, mmproj


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = LLAVA_PRESETS[preset]
    return write_llava(outdir, text, vision, seed, family)
