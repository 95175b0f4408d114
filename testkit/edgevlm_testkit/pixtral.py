"""Mistral Small 3.1 (``pixtral`` projector) pairs: a ``llama`` text model with Mistral's
Tekken vocabulary (byte-level BPE, 1000 control tokens first) and Q4_0 weights, and a Pixtral
ViT (2-D RoPE, RMS norms, SwiGLU) with Mistral Small 3.1's 2×2 patch merger in F16.

The real file layout (``conversion/llava.py``, ``conversion/pixtral.py``, ``tools/mtmd/clip.cpp``):

- text: ``llama`` with ``attention.key_length`` 128 while ``n_embd / n_head`` is 160 (5120 / 32),
  so Q is 4096 wide; rope base 1e9; separate ``output.weight``.
- mmproj: ``v.patch_embd.weight`` (no bias), ``v.pre_ln.weight``, blocks with ``attn_{q,k,v,out}``
  (no biases), ``ln1``/``ln2`` (RMS, weight only), ``ffn_{gate,up,down}``; then
  ``mm.input_norm.weight`` + ``mm.patch_merger.weight`` (E·4 → E), ``mm.1``/``mm.2``
  (no biases in Mistral Small 3.1) and ``v.token_embd.img_break`` (the text model's
  ``[IMG_BREAK]`` embedding row). Keys: ``clip.use_silu``, ``clip.vision.spatial_merge_size`` 2.

Pixtral-12B differs: 16-px patches, no merger (no ``spatial_merge_size``, ``mm.input_norm``,
``mm.patch_merger``), ``mm.1``/``mm.2`` with biases, image_size 1024, text n_embd 5120 with 40
layers and head_dim 128, vocab 131072. The token arithmetic and the encoder graph cover both.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .vocab import CONTROL, NORMAL, Vocab, byte_to_unicode, word_pieces, write_vocab
from .writer import FILE_TYPES, RandomGGUF

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # mistral_common's dataset mean/std (= CLIP's)
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Tekken's first control tokens (ids 0..19); the rest of the 1000 are <SPECIAL_n>.
TEKKEN_SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]
N_SPECIAL = 1000
IMG_BREAK_ID = TEKKEN_SPECIALS.index("[IMG_BREAK]")

# Mistral-Small-3.1-24B-Instruct-2503's template (tokenizer_config.json), simplified: no default
# system prompt and no date; image blocks of list content become mtmd's media marker.
MISTRAL_SMALL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}"
    "[SYSTEM_PROMPT]{{ messages[0]['content'] }}[/SYSTEM_PROMPT]"
    "{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if message['content'] is string %}[INST]{{ message['content'] }}[/INST]"
    "{% else %}[INST]{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% elif block['type'] in ['image', 'image_url'] %}<__media__>{% endif %}"
    "{% endfor %}[/INST]{% endif %}"
    "{% elif message['role'] == 'system' %}[SYSTEM_PROMPT]{{ message['content'] }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class MistralText:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length: not n_embd / n_head in Mistral Small
    n_ff: int
    n_ctx_train: int = 131072
    rope_theta: float = 1e9


@dataclass(frozen=True)
class PixtralVision:
    image_size: int
    patch_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    merge: int = 2  # spatial_merge_size (Pixtral-12B: none)


PRESETS = {
    # real geometry (1540 px, 14-px patches, 2×2 merge, 8..1024 tokens), tiny widths; the tiny
    # text model keeps the head_dim != n_embd / n_head quirk (160 / 4 heads, head_dim 32).
    "tiny": (
        MistralText(2048, 160, 2, 4, 2, 32, 256, n_ctx_train=32768),
        PixtralVision(1540, 14, 64, 2, 4, 128, merge=2),
    ),
    # Mistral-Small-3.1-24B-Instruct-2503 (40 text layers, 24 ViT blocks) cut to 2 and 2.
    "real": (MistralText(131072, 5120, 2, 32, 8, 128, 32768), PixtralVision(1540, 14, 1024, 2, 16, 4096, merge=2)),
}


def tekken_vocab(n_vocab: int) -> Vocab:
    """A Tekken-shaped vocabulary: 1000 control tokens, the 256 bytes (GPT-2 byte symbols, in
    byte order), then BPE pieces with the merges that build them."""
    if n_vocab < N_SPECIAL + 256 + 64:
        raise ValueError(f"a Tekken vocab needs at least {N_SPECIAL + 320} tokens")
    tokens = TEKKEN_SPECIALS + [f"<SPECIAL_{i}>" for i in range(len(TEKKEN_SPECIALS), N_SPECIAL)]
    types = [CONTROL] * N_SPECIAL
    b2u = byte_to_unicode()
    tokens += [b2u[b] for b in range(256)]
    types += [NORMAL] * 256
    have = set(tokens[N_SPECIAL:])
    merges: list[str] = []
    space = b2u[ord(" ")]
    for c in string.ascii_letters:  # " a" .. " Z": the left parts of longer pieces
        merges.append(f"{space} {c}")
        tokens.append(space + c)
        types.append(NORMAL)
        have.add(space + c)
    for w in word_pieces(string.ascii_lowercase, n_vocab * 2):
        for word in (space + w, w, space + w.capitalize(), w.capitalize()):
            if len(tokens) >= n_vocab:
                break
            if word in have:
                continue
            left, right = word[:-1], word[-1]
            if left not in have:
                continue
            merges.append(f"{left} {right}")
            tokens.append(word)
            types.append(NORMAL)
            have.add(word)
        if len(tokens) >= n_vocab:
            break
    scores = [0.0] * len(tokens)
    return Vocab(
        "gpt2", tokens, scores, types, merges, bos_id=1, eos_id=2, unk_id=0, pad_id=11, pre="tekken", add_bos=True
    )


def _q4_0(g: RandomGGUF, name: str, shape: tuple[int, int], scale: float | None = None) -> None:
    """A random Q4_0 matrix written block by block (uniform 4-bit codes, one scale), instead of
    quantizing float noise: the real preset's 131072 × 5120 matrices would take minutes.
    Dequantized values have mean ~0 and standard deviation ~ scale (default 1/sqrt(fan_in))."""
    rows, cols = shape
    if cols % 32:
        raise ValueError(f"{name}: row length {cols} is not a multiple of 32")
    s = scale if scale is not None else 1.0 / np.sqrt(cols)
    nblk = cols // 32
    data = g.rng.integers(0, 256, size=(rows, nblk, 18), dtype=np.uint8)
    # codes q in 0..15 → (q - 8) · d; uniform codes have std ≈ 4.6 · d
    d = np.frombuffer(np.float16(s / 4.6).tobytes(), dtype=np.uint8)
    data[:, :, 0:2] = d
    q = gguf.GGMLQuantizationType.Q4_0
    g.writer.add_tensor(name, data.reshape(rows, nblk * 18), raw_dtype=q)


def write_mistral_text(path: Path, t: MistralText, seed: int, name: str) -> Path:
    g = RandomGGUF(path, "llama", seed, "q4_0")
    w = g.writer
    w.add_name(name)
    w.add_file_type(FILE_TYPES["q4_0"])
    w.add_context_length(t.n_ctx_train)
    w.add_embedding_length(t.n_embd)
    w.add_block_count(t.n_layer)
    w.add_feed_forward_length(t.n_ff)
    w.add_head_count(t.n_head)
    w.add_head_count_kv(t.n_head_kv)
    w.add_key_length(t.head_dim)
    w.add_value_length(t.head_dim)
    w.add_rope_dimension_count(t.head_dim)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(t.n_vocab)
    write_vocab(w, tekken_vocab(t.n_vocab))
    w.add_chat_template(MISTRAL_SMALL_TEMPLATE)

    E, q_out, kv_out = t.n_embd, t.n_head * t.head_dim, t.n_head_kv * t.head_dim
    _q4_0(g, "token_embd.weight", (t.n_vocab, E), scale=1.0)
    for i in range(t.n_layer):
        p = f"blk.{i}"
        g.ones(f"{p}.attn_norm.weight", E)
        _q4_0(g, f"{p}.attn_q.weight", (q_out, E))
        _q4_0(g, f"{p}.attn_k.weight", (kv_out, E))
        _q4_0(g, f"{p}.attn_v.weight", (kv_out, E))
        _q4_0(g, f"{p}.attn_output.weight", (E, q_out))
        g.ones(f"{p}.ffn_norm.weight", E)
        _q4_0(g, f"{p}.ffn_gate.weight", (t.n_ff, E))
        _q4_0(g, f"{p}.ffn_up.weight", (t.n_ff, E))
        _q4_0(g, f"{p}.ffn_down.weight", (E, t.n_ff))
    g.ones("output_norm.weight", E)
    _q4_0(g, "output.weight", (t.n_vocab, E))
    return g.write()


def write_pixtral_vision(path: Path, v: PixtralVision, n_text_embd: int, seed: int, name: str) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "pixtral")
    w.add_bool("clip.use_silu", True)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_array("clip.vision.image_mean", CLIP_MEAN)
    w.add_array("clip.vision.image_std", CLIP_STD)
    if v.merge > 1:
        w.add_uint32("clip.vision.spatial_merge_size", v.merge)

    E = v.n_embd
    g.weight("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size))
    g.ones("v.pre_ln.weight", E)
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        g.ones(f"{p}.ln1.weight", E)
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.linear(f"{p}.{proj}", E, E, bias=False)
        g.ones(f"{p}.ln2.weight", E)
        g.linear(f"{p}.ffn_gate", v.n_ff, E, bias=False)
        g.linear(f"{p}.ffn_up", v.n_ff, E, bias=False)
        g.linear(f"{p}.ffn_down", E, v.n_ff, bias=False)
    if v.merge > 1:
        g.ones("mm.input_norm.weight", E)
        g.linear("mm.patch_merger", E, E * v.merge * v.merge, bias=False)
    g.linear("mm.1", n_text_embd, E, bias=v.merge == 1)
    g.linear("mm.2", n_text_embd, n_text_embd, bias=v.merge == 1)
    g.bias("v.token_embd.img_break", n_text_embd, scale=1.0)
    return g.write()


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = PRESETS[preset]
    model = write_mistral_text(outdir / "model.gguf", text, seed, f"Mistral Small 3.1 random ({family})")
    mmproj = write_pixtral_vision(
        outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, "Mistral Small 3.1 Pixtral ViT random"
    )
    return model, mmproj
