"""Qwen2-VL (``qwen2vl_merger``) and Qwen2.5-VL (``qwen2.5vl_merger``) pairs: a ``qwen2vl``
M-RoPE text model with a byte-level BPE vocab and Q4_0 weights, and a dynamic-resolution ViT
with a 2×2 patch merger in F16."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .shapes import QWEN_PRESETS, TextShape, VisionShape
from .vocab import bpe_vocab, write_vocab
from .writer import FILE_TYPES, RandomGGUF, decoder_tensors, text_header

QWEN_MEAN = [0.48145466, 0.4578275, 0.40821073]
QWEN_STD = [0.26862954, 0.26130258, 0.27577711]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL splits head_dim/2 rotary pairs into (t, h, w) = 1/4, 3/8, 3/8 (16/24/24 of 64)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h, 0]


def write_qwen2vl_text(path: Path, t: TextShape, seed: int, name: str, weight_type: str = "q4_0") -> Path:
    g = RandomGGUF(path, "qwen2vl", seed, weight_type)
    text_header(g, t, name)
    w = g.writer
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_sections(mrope_sections(t.head_dim))
    write_vocab(w, bpe_vocab(t.n_vocab))
    w.add_chat_template(CHATML_TEMPLATE)
    decoder_tensors(g, t, qkv_bias=True)
    return g.write()


def write_qwen_vision(path: Path, v: VisionShape, n_text_embd: int, seed: int, name: str, v25: bool) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    g.writer.add_name(name)
    g.writer.add_file_type(FILE_TYPES["f16"])
    qwen_vision_into(g, v, n_text_embd, v25, "qwen2.5vl_merger" if v25 else "qwen2vl_merger")
    return g.write()


def qwen_vision_into(g: RandomGGUF, v: VisionShape, n_text_embd: int, v25: bool, ptype: str) -> None:
    """Qwen2/2.5-VL's ViT and merger (keys and tensors) into ``g``, under projector type ``ptype``
    (a Qwen2.5-Omni file names the one type of both its encoders)."""
    w = g.writer
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", ptype)
    if v25:
        w.add_bool("clip.use_silu", True)
        # Qwen2.5-VL: full attention every 8th block (fullatt_block_indexes 7, 15, ...);
        # with few blocks, the last one is the full-attention block.
        w.add_uint32("clip.vision.n_wa_pattern", min(8, v.n_layer))
    else:
        w.add_bool("clip.use_gelu", False)  # quick-GELU
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_uint32("clip.vision.spatial_merge_size", v.merge)
    w.add_array("clip.vision.image_mean", QWEN_MEAN)
    w.add_array("clip.vision.image_std", QWEN_STD)

    E = v.n_embd
    # Qwen's 3-D patch conv (temporal 2) is stored as two 2-D kernels.
    g.weight("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size))
    g.weight("v.patch_embd.weight.1", (E, 3, v.patch_size, v.patch_size))
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        g.norm(f"{p}.ln1", E, bias=not v25)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.linear(f"{p}.{proj}", E, E)
        g.norm(f"{p}.ln2", E, bias=not v25)
        if v25:
            g.linear(f"{p}.ffn_gate", v.n_ff, E)
        g.linear(f"{p}.ffn_up", v.n_ff, E)
        g.linear(f"{p}.ffn_down", E, v.n_ff)
    g.norm("v.post_ln", E, bias=not v25)
    merged = E * v.merge * v.merge
    g.linear("mm.0", merged, merged)
    g.linear("mm.2", n_text_embd, merged)


def write_qwen(outdir: Path, text: TextShape, vision: VisionShape, seed: int, family: str) -> tuple[Path, Path]:
    v25 = family == "qwen25vl"
    label = "Qwen2.5-VL" if v25 else "Qwen2-VL"
    model = write_qwen2vl_text(outdir / "model.gguf", text, seed, f"{label} random ({family})")
    mmproj = write_qwen_vision(outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, f"{label} ViT random", v25)
    return model, mmproj


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = QWEN_PRESETS[preset]
    if preset == "real":  # tied embeddings, as Qwen2-VL-2B and Qwen2.5-VL-3B have
        text = replace(text, tied=True)
    return write_qwen(outdir, text, vision, seed, family)
