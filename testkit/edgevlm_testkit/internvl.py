"""InternVL 2.5 / 3 (``internvl``) pairs: a ``qwen2`` text model (Qwen2.5 with its own
``lm_head``, i.e. an untied ``output.weight``) with a byte-level BPE vocab holding Qwen2.5's added
tokens and InternVL's ``<img>``/``</img>``/``<IMG_CONTEXT>``..., Q4_0 weights; and an InternViT
mmproj in F16: CLS token + learned position embeddings, layer scale (``ls1``/``ls2``), GELU MLP,
pixel shuffle 0.5 (``clip.vision.projector.scale_factor`` = 2: 1024 patches → 256 tokens per
448-px tile) and the ``mlp1`` projector (LayerNorm → Linear → GELU → Linear).

Layout and keys follow ``convert_hf_to_gguf.py`` (``conversion/internvl.py``): the fused ``qkv``
is split into ``attn_q/k/v``, ``v.position_embd.weight`` is F32, the tile limits
(``min/max_dynamic_patch`` = 1/12) are written as ``clip.vision.preproc_{min,max}_tiles``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .shapes import TextShape, VisionShape
from .vocab import CONTROL, USER_DEFINED, bpe_vocab, write_vocab
from .writer import FILE_TYPES, RandomGGUF, decoder_tensors, text_header

# InternVL's preprocessing (build_transform): ImageNet statistics.
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
SCALE_FACTOR = 2  # downsample_ratio 0.5
MIN_TILES, MAX_TILES = 1, 12  # min_dynamic_patch / max_dynamic_patch of InternVL2.5 / 3

# Qwen2.5's added tokens after the 14 specials bpe_vocab already has (not special: USER_DEFINED),
# then InternVL's (special: CONTROL) — ids 151657..151673 in InternVL3-1B's 151674-token vocab.
QWEN25_EXTRA = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
INTERNVL_SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>"]

# InternVL2.5 / 3 ChatML (tokenizer_config.json), default system message included; content is a
# string with mtmd's marker where each image goes (mtmd adds <img> ... </img> around it).
INTERNVL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的"
    "多模态大语言模型。<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Real 448-px tile geometry (448/14 = 32 patches a side, pixel shuffle 2 → 16×16 = 256 tokens)
# in both presets; only widths and depths shrink in "tiny".
INTERNVL_PRESETS = {
    "tiny": (
        TextShape(1024, 128, 2, 4, 2, 256, n_ctx_train=32768, rope_theta=1e6),
        VisionShape(448, 14, 64, 2, 4, 128, merge=SCALE_FACTOR),
    ),
    # InternVL3-1B: Qwen2.5-0.5B text (896 wide, 14 heads / 2 KV heads, ff 4864, vocab 151674,
    # untied lm_head) with 2 of its 24 layers; InternViT-300M-448px-V2_5 (1024 wide, 16 heads,
    # ff 4096) with 2 of its 24 blocks.
    "real": (
        TextShape(151674, 896, 2, 14, 2, 4864, n_ctx_train=32768, rope_theta=1e6),
        VisionShape(448, 14, 1024, 2, 16, 4096, merge=SCALE_FACTOR),
    ),
}


def internvl_vocab(n_vocab: int):
    """Qwen2.5's byte-level BPE vocab (normal pieces, 14 specials, 8 added) + InternVL's 9."""
    extra = QWEN25_EXTRA + INTERNVL_SPECIALS
    base = bpe_vocab(n_vocab - len(extra))
    types = list(base.types) + [USER_DEFINED] * len(QWEN25_EXTRA) + [CONTROL] * len(INTERNVL_SPECIALS)
    return replace(base, tokens=list(base.tokens) + extra, types=types, scores=list(base.scores) + [0.0] * len(extra))


def write_qwen2_text(path: Path, t: TextShape, seed: int, name: str, weight_type: str = "q4_0") -> Path:
    g = RandomGGUF(path, "qwen2", seed, weight_type)
    text_header(g, t, name)
    w = g.writer
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    write_vocab(w, internvl_vocab(t.n_vocab))
    w.add_chat_template(INTERNVL_TEMPLATE)
    decoder_tensors(g, t, qkv_bias=True)  # writes output.weight: InternVL's lm_head is untied
    return g.write()


def write_internvit(path: Path, v: VisionShape, n_text_embd: int, seed: int, name: str) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_type("mmproj")
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "internvl")
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_array("clip.vision.image_mean", IMAGENET_MEAN)
    w.add_array("clip.vision.image_std", IMAGENET_STD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_bool("clip.use_gelu", True)  # hidden_act "gelu"
    w.add_uint32("clip.vision.projector.scale_factor", v.merge)
    w.add_uint32("clip.vision.preproc_min_tiles", MIN_TILES)
    w.add_uint32("clip.vision.preproc_max_tiles", MAX_TILES)

    E, p = v.n_embd, v.patch_size
    n_pos = (v.image_size // p) ** 2 + 1  # + CLS
    g.weight("v.patch_embd.weight", (E, 3, p, p))
    g.bias("v.patch_embd.bias", E)
    g.bias("v.class_embd", E, scale=0.02)
    g.weight("v.position_embd.weight", (n_pos, E), scale=0.02, qtype="f32")
    for i in range(v.n_layer):
        b = f"v.blk.{i}"
        g.norm(f"{b}.ln1", E)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.linear(f"{b}.{proj}", E, E)
        g.bias(f"{b}.ls1.weight", E, scale=0.1)
        g.norm(f"{b}.ln2", E)
        g.linear(f"{b}.ffn_up", v.n_ff, E)
        g.linear(f"{b}.ffn_down", E, v.n_ff)
        g.bias(f"{b}.ls2.weight", E, scale=0.1)
    merged = E * v.merge * v.merge
    g.norm("mm.model.mlp.0", merged)
    g.linear("mm.model.mlp.1", n_text_embd, merged)
    g.linear("mm.model.mlp.3", n_text_embd, n_text_embd)
    return g.write()


def write_internvl(outdir: Path, text: TextShape, vision: VisionShape, seed: int, family: str) -> tuple[Path, Path]:
    model = write_qwen2_text(outdir / "model.gguf", text, seed, f"InternVL3 random ({family})")
    mmproj = write_internvit(outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, "InternViT random")
    return model, mmproj


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = INTERNVL_PRESETS[preset]
    return write_internvl(outdir, text, vision, seed, family)
