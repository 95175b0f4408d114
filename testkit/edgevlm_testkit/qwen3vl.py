"""Qwen3-VL (``qwen3vl_merger``) pairs: a ``qwen3vl`` text model (interleaved M-RoPE, Q/K RMS
norms, deepstack inputs: the embedding fed to it is n_embd × (1 + n_deepstack_layers) wide) with
a byte-level BPE vocab and Q4_0 weights, and a dynamic-resolution ViT (16 px patches, learned
position embeddings interpolated to the image, fused QKV, 2×2 patch merger, deepstack mergers on
some blocks) in F16.

Tensor and key names follow ``convert_hf_to_gguf.py`` (``conversion/qwen3vl.py``) and what
``tools/mtmd/clip.cpp`` / ``src/models/qwen3vl.cpp`` load.
"""

from __future__ import annotations

from pathlib import Path

from .shapes import TextShape, VisionShape
from .vocab import bpe_vocab, write_vocab
from .writer import FILE_TYPES, RandomGGUF, text_header

# Qwen3-VL's preprocessor (preprocessor_config.json: image_mean/std 0.5)
QWEN3VL_MEAN = [0.5, 0.5, 0.5]
QWEN3VL_STD = [0.5, 0.5, 0.5]

# Qwen3-VL-Instruct's template, simplified: no default system prompt (unlike Qwen2-VL); string
# content is emitted as is (edgevlm puts mtmd's media marker in it), list content as the HF
# processor does (<|vision_start|><|image_pad|><|vision_end|> per image).
QWEN3VL_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (text, vision, deepstack block indexes, tied embeddings).
# One deepstack block, not the real three: llama.cpp adds deepstack feature i to the output of
# text layer i, and in the last layer that add meets the out_ids row selection (n_outputs rows
# vs n_tokens rows: GGML_ASSERT(ggml_can_repeat) aborts the process on any multi-token prompt
# decoded with logits for its last token only). So n_deepstack_layers < text n_layer = 2. Block 0
# keeps the real models' layout of a deepstack block before the last (its output stays alive until
# the graph's final concat).
QWEN3VL_PRESETS = {
    # tiny widths/depths, the real image geometry (16 px patches, merge 2, 48×48 position table)
    "tiny": (
        TextShape(1024, 128, 2, 4, 2, 256, n_ctx_train=262144, rope_theta=5e6),
        VisionShape(768, 16, 64, 2, 4, 128, merge=2),
        (0,),
        True,
    ),
    # Qwen3-VL-2B-Instruct: text 2048 wide, 16 heads (head_dim 128), 8 KV heads, ff 6144,
    # vocab 151936, tied embeddings, 28 layers → 2; ViT 1024 wide, 16 heads, ff 4096,
    # 24 blocks → 2, deepstack_visual_indexes [5, 11, 17] of 24 → block 0 (see above).
    "real": (
        TextShape(151936, 2048, 2, 16, 8, 6144, n_ctx_train=262144, rope_theta=5e6),
        VisionShape(768, 16, 1024, 2, 16, 4096, merge=2),
        (0,),
        True,
    ),
}


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen3-VL's mrope_section [24, 20, 20] for 64 rotary pairs, scaled to head_dim / 2."""
    half = head_dim // 2
    t = half * 24 // 64
    h = (half - t) // 2
    return [t, h, half - t - h, 0]


def write_qwen3vl_text(
    path: Path, t: TextShape, seed: int, name: str, n_deepstack: int, tied: bool, weight_type: str = "q4_0"
) -> Path:
    g = RandomGGUF(path, "qwen3vl", seed, weight_type)
    text_header(g, t, name)
    w = g.writer
    w.add_key_length(t.head_dim)
    w.add_value_length(t.head_dim)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_sections(mrope_sections(t.head_dim))
    w.add_num_deepstack_layers(n_deepstack)
    write_vocab(w, bpe_vocab(t.n_vocab))
    w.add_chat_template(QWEN3VL_TEMPLATE)

    D = t.head_dim
    kv = t.n_head_kv * D
    g.weight("token_embd.weight", (t.n_vocab, t.n_embd), scale=1.0)
    for i in range(t.n_layer):
        p = f"blk.{i}"
        g.ones(f"{p}.attn_norm.weight", t.n_embd)
        g.linear(f"{p}.attn_q", t.n_head * D, t.n_embd, bias=False)
        g.linear(f"{p}.attn_k", kv, t.n_embd, bias=False)
        g.linear(f"{p}.attn_v", kv, t.n_embd, bias=False)
        g.linear(f"{p}.attn_output", t.n_embd, t.n_head * D, bias=False)
        g.ones(f"{p}.attn_q_norm.weight", D)
        g.ones(f"{p}.attn_k_norm.weight", D)
        g.ones(f"{p}.ffn_norm.weight", t.n_embd)
        g.linear(f"{p}.ffn_gate", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_up", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_down", t.n_embd, t.n_ff, bias=False)
    g.ones("output_norm.weight", t.n_embd)
    if not tied:
        g.weight("output.weight", (t.n_vocab, t.n_embd))
    return g.write()


def write_qwen3vl_vision(
    path: Path, v: VisionShape, n_text_embd: int, seed: int, name: str, deepstack: tuple[int, ...]
) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    w.add_bool("clip.use_gelu", True)  # gelu_pytorch_tanh
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_uint32("clip.vision.spatial_merge_size", v.merge)
    w.add_array("clip.vision.image_mean", QWEN3VL_MEAN)
    w.add_array("clip.vision.image_std", QWEN3VL_STD)
    w.add_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(v.n_layer)])

    E, p = v.n_embd, v.patch_size
    merged = E * v.merge * v.merge
    n_pos = (v.image_size // p) ** 2
    # the 3-D patch conv (temporal 2) as two 2-D kernels, plus its bias
    g.weight("v.patch_embd.weight", (E, 3, p, p))
    g.weight("v.patch_embd.weight.1", (E, 3, p, p))
    g.bias("v.patch_embd.bias", E)
    # learned position embeddings (F32: ggml_interpolate needs F32 input)
    g.weight("v.position_embd.weight", (n_pos, E), scale=0.02, qtype="f32")
    for i in range(v.n_layer):
        b = f"v.blk.{i}"
        g.norm(f"{b}.ln1", E)
        g.linear(f"{b}.attn_qkv", 3 * E, E)
        g.linear(f"{b}.attn_out", E, E)
        g.norm(f"{b}.ln2", E)
        g.linear(f"{b}.ffn_up", v.n_ff, E)
        g.linear(f"{b}.ffn_down", E, v.n_ff)
    for i in sorted(deepstack):
        d = f"v.deepstack.{i}"
        g.norm(f"{d}.norm", merged)
        g.linear(f"{d}.fc1", merged, merged)
        g.linear(f"{d}.fc2", n_text_embd, merged)
    g.norm("v.post_ln", E)  # merger.norm (before the 2×2 shuffle)
    g.linear("mm.0", merged, merged)
    g.linear("mm.2", n_text_embd, merged)
    return g.write()


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision, deepstack, tied = QWEN3VL_PRESETS[preset]
    model = write_qwen3vl_text(outdir / "model.gguf", text, seed, f"Qwen3-VL random ({family})", len(deepstack), tied)
    mmproj = write_qwen3vl_vision(
        outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, "Qwen3-VL ViT random", tuple(deepstack)
    )
    return model, mmproj
