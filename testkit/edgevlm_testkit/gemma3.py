"""Gemma 3 (``gemma3`` projector) pairs: a ``gemma3`` text model (sliding-window attention on
some layers, Q/K RMS norms, post-attention/post-FFN norms, GELU-tanh FFN, embeddings scaled by
sqrt(n_embd), head_dim independent of n_embd, tied embeddings) with Gemma's SentencePiece vocab
and Q4_0 weights, and a SigLIP ViT (896 px, 14 px patches → 64×64 patches, 4×4 average pool →
256 tokens, ``mm.soft_emb_norm`` + ``mm.input_projection``) in F16.

Tensor and key names follow ``convert_hf_to_gguf.py`` (``conversion/gemma.py``: Gemma3Model,
Gemma3VisionModel) and what ``src/models/gemma3.cpp`` / ``tools/mtmd/clip.cpp`` load. Like the
converter, the patch and position embeddings are F32 and the input projection F16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    Vocab,
    spm_vocab,
    write_vocab,
)
from .writer import FILE_TYPES, QTYPES, RandomGGUF, text_header

# SigLIP preprocessing of Gemma 3 (preprocessor_config.json)
GEMMA3_MEAN = [0.5, 0.5, 0.5]
GEMMA3_STD = [0.5, 0.5, 0.5]

# Gemma 3's chat template (google/gemma-3-4b-it), kept whole except that list content is not
# needed (edgevlm passes strings with mtmd's media marker; mtmd adds <start_of_image> and
# <end_of_image> itself). The system prompt is folded into the first user turn, "assistant" is
# "model", every turn ends with <end_of_turn>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    '{%- set role = "model" -%}'
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    '{{ raise_exception("Invalid content type") }}'
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class GemmaText:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int  # attention.key_length: Gemma 3's head_dim is not n_embd / n_head
    n_swa: int = 1024  # attention.sliding_window
    swa_pattern: int = 2  # every swa_pattern-th layer is global (the real model: 6, the default)
    n_ctx_train: int = 131072
    rope_theta: float = 1_000_000.0  # global layers (SWA layers: llama.cpp's 10000 default)


@dataclass(frozen=True)
class GemmaVision:
    image_size: int
    patch_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int


GEMMA3_PRESETS = {
    # tiny widths/depths with the real geometry: 896 px, 14 px patches (64×64), 4×4 pool → 256
    "tiny": (GemmaText(1024, 128, 2, 4, 2, 256, head_dim=64), GemmaVision(896, 14, 64, 2, 2, 128)),
    # Gemma-3-4B-it: text 2560 wide, 8 heads × 256, 4 KV heads, ff 10240, vocab 262144,
    # sliding window 1024, 34 layers → 2 (layer 0 sliding-window, layer 1 global);
    # SigLIP-So400m: 1152 wide, 16 heads, ff 4304, 27 blocks → 2.
    "real": (GemmaText(262144, 2560, 2, 8, 4, 10240, head_dim=256), GemmaVision(896, 14, 1152, 2, 16, 4304)),
}

# Gemma's first tokens (ids 0..106) and the image tokens (<start_of_image> = 255999,
# <end_of_image> = 256000 in the 262144-token vocabulary).
_HEAD = (
    [
        ("<pad>", CONTROL),
        ("<eos>", CONTROL),
        ("<bos>", CONTROL),
        ("<unk>", UNKNOWN),
        ("<mask>", USER_DEFINED),
        ("[multimodal]", USER_DEFINED),
    ]
    + [(f"<unused{i}>", UNUSED) for i in range(99)]
    + [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
)
START_OF_TURN, END_OF_TURN = 105, 106
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3


def gemma_vocab(n_vocab: int) -> Vocab:
    """A Gemma-3-style SentencePiece vocabulary of exactly ``n_vocab`` tokens: Gemma's control
    tokens at their real ids, the 256 byte tokens, generated pieces, and the image tokens
    (``<start_of_image>``, ``<end_of_image>`` at 255999/256000 when the vocabulary is that big,
    else near its end; ``<image_soft_token>`` last)."""
    if n_vocab < 512:
        raise ValueError("a Gemma vocab needs at least 512 tokens")
    tokens = [t for t, _ in _HEAD] + [f"<0x{i:02X}>" for i in range(256)]
    types = [k for _, k in _HEAD] + [BYTE] * 256
    n_fixed = len(tokens)
    soi = 255999 if n_vocab > 256001 else n_vocab - 3
    tail = {
        soi: ("<start_of_image>", USER_DEFINED),
        soi + 1: ("<end_of_image>", USER_DEFINED),
        n_vocab - 1: ("<image_soft_token>", USER_DEFINED),
    }
    pieces = iter(spm_vocab(n_vocab).tokens[259:])  # "▁", chars, "▁word" ..., all distinct
    for i in range(n_fixed, n_vocab):
        if i in tail:
            tok, kind = tail[i]
        else:
            tok, kind = next(pieces), NORMAL
        tokens.append(tok)
        types.append(kind)
    scores = [
        0.0 if k != NORMAL else -1000.0 + len(t) * 10.0 - i * 1e-4
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
    ]
    return Vocab(
        "llama",
        tokens,
        scores,
        types,
        [],
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        pad_id=PAD_ID,
        pre="default",
        add_bos=True,
        extra_ids={"eot": END_OF_TURN},
    )


def _q4_0_rows(g: RandomGGUF, name: str, shape: tuple[int, int], scale: float, block_rows: int = 8192) -> None:
    """A random Q4_0 matrix quantized in row blocks (a 262144-row embedding in f32 would take
    2.7 GB at once); the same rng draws in the same order, so the bytes are deterministic."""
    rows, cols = shape
    q = QTYPES["q4_0"]
    parts = []
    for r0 in range(0, rows, block_rows):
        n = min(block_rows, rows - r0)
        data = g.rng.standard_normal((n, cols), dtype=np.float32) * np.float32(scale)
        parts.append(gguf.quants.quantize(data, q))
    g.writer.add_tensor(name, np.concatenate(parts, axis=0), raw_dtype=q)


def write_gemma3_text(path: Path, t: GemmaText, seed: int, name: str, weight_type: str = "q4_0") -> Path:
    g = RandomGGUF(path, "gemma3", seed, weight_type)
    text_header(g, t, name)
    w = g.writer
    w.add_key_length(t.head_dim)
    w.add_value_length(t.head_dim)
    w.add_rope_dimension_count(t.head_dim)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(t.n_swa)
    w.add_sliding_window_pattern(t.swa_pattern)
    vocab = gemma_vocab(t.n_vocab)
    write_vocab(w, vocab)
    w.add_add_space_prefix(False)
    w.add_add_eos_token(False)
    w.add_chat_template(GEMMA3_TEMPLATE)

    D = t.head_dim
    kv = t.n_head_kv * D
    if weight_type == "q4_0":
        _q4_0_rows(g, "token_embd.weight", (t.n_vocab, t.n_embd), scale=1.0)
    else:
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
        g.ones(f"{p}.post_attention_norm.weight", t.n_embd)
        g.ones(f"{p}.ffn_norm.weight", t.n_embd)
        g.linear(f"{p}.ffn_gate", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_up", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_down", t.n_embd, t.n_ff, bias=False)
        g.ones(f"{p}.post_ffw_norm.weight", t.n_embd)
    g.ones("output_norm.weight", t.n_embd)
    # tied embeddings: no output.weight (llama.cpp reuses token_embd for the logits)
    return g.write()


def write_gemma3_vision(path: Path, v: GemmaVision, n_text_embd: int, seed: int, name: str) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "gemma3")
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_array("clip.vision.image_mean", GEMMA3_MEAN)
    w.add_array("clip.vision.image_std", GEMMA3_STD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_bool("clip.use_gelu", True)  # SigLIP: gelu_pytorch_tanh
    # no clip.vision.projector.scale_factor: clip.cpp's default 4×4 pool is Gemma 3's

    E = v.n_embd
    n_patches = (v.image_size // v.patch_size) ** 2
    g.weight("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size), qtype="f32")
    g.bias("v.patch_embd.bias", E)
    g.weight("v.position_embd.weight", (n_patches, E), scale=0.02, qtype="f32")
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        g.norm(f"{p}.ln1", E)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.linear(f"{p}.{proj}", E, E)
        g.norm(f"{p}.ln2", E)
        g.linear(f"{p}.ffn_up", v.n_ff, E)
        g.linear(f"{p}.ffn_down", E, v.n_ff)
    g.norm("v.post_ln", E)
    g.ones("mm.soft_emb_norm.weight", E)
    # HF's mm_input_projection_weight is (vision, text): ggml ne = [n_text_embd, n_embd]
    g.weight("mm.input_projection.weight", (E, n_text_embd), scale=1.0 / np.sqrt(E))
    return g.write()


def write_gemma3(outdir: Path, text: GemmaText, vision: GemmaVision, seed: int, family: str) -> tuple[Path, Path]:
    model = write_gemma3_text(outdir / "model.gguf", text, seed, f"Gemma 3 random ({family})")
    mmproj = write_gemma3_vision(outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, "Gemma 3 SigLIP random")
    return model, mmproj


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = GEMMA3_PRESETS[preset]
    return write_gemma3(outdir, text, vision, seed, family)
