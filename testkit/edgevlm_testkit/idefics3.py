"""SmolVLM / Idefics3 (``idefics3``) pairs: a ``llama`` text model (SmolLM2) with a byte-level BPE
vocab holding SmolVLM's image tokens, Q4_0 weights, and a SigLIP ``clip`` mmproj in F16 whose
output goes through a pixel shuffle (``clip.vision.projector.scale_factor``) and one linear layer.

Geometry as in SmolVLM-256M/500M (SigLIP base patch16/512): 512-px tiles of 16-px patches, pixel
shuffle 4 → 64 tokens per tile; mtmd resizes the longest edge to ``clip.vision.preproc_image_size``
(2048) and cuts 512-px tiles plus a 512-px global view.

What mirrors ``convert_hf_to_gguf.py`` (``conversion/smolvlm.py``): the keys above,
``clip.use_gelu``, the SigLIP tensors (patch conv with bias, learned position embeddings without a
class token, no pre-norm, a post-norm), ``mm.model.fc.weight`` without bias, and the embeddings
(``v.patch_embd.*``, ``v.position_embd.weight``) kept in F32 (``tensor_force_quant``).
The vocabulary follows SmolVLM's tokenizer: SmolLM2's 17 specials first, the byte-level BPE body,
then SmolVLM's 128 added tokens (``<global-img>``, ``<row_1_col_1>``..``<row_6_col_6>``,
``<fake_token_around_image>``, ``<image>``, reserved, ``<end_of_utterance>`` last) — at ids
49152..49279 in the real preset, as in the real model.
"""

from __future__ import annotations

import string
from pathlib import Path

from .shapes import TextShape, VisionShape
from .vocab import CONTROL, NORMAL, Vocab, byte_to_unicode, word_pieces, write_vocab
from .writer import FILE_TYPES, RandomGGUF, decoder_tensors, text_header

SIGLIP_MEAN = [0.5, 0.5, 0.5]
SIGLIP_STD = [0.5, 0.5, 0.5]
SCALE_FACTOR = 4  # SmolVLM-256M/500M pixel shuffle (2B / Idefics3-8B: 3 / 2)
LONGEST_EDGE = 2048  # preprocessor_config.json size.longest_edge (4 × 512)

# real geometry in both presets; the tiny one shrinks widths and depths only
IDEFICS3_PRESETS = {
    "tiny": (
        TextShape(1024, 128, 2, 4, 2, 256, n_ctx_train=8192, rope_theta=100000.0),
        VisionShape(512, 16, 64, 2, 4, 128),
    ),
    # SmolVLM-500M-Instruct: SmolLM2-360M text (960 wide, 15 heads / 5 kv, ff 2560, vocab 49280,
    # 32 layers → 2) and SigLIP base patch16/512 (768 wide, 12 heads, ff 3072, 12 blocks → 2).
    "real": (
        TextShape(49280, 960, 2, 15, 5, 2560, n_ctx_train=8192, rope_theta=100000.0),
        VisionShape(512, 16, 768, 2, 12, 3072),
    ),
}

# SmolLM2's tokenizer specials (ids 0..16)
SMOLLM2_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]
N_ADDED = 128  # SmolVLM's added tokens: 49152..49279


def smolvlm_added_tokens() -> list[str]:
    rows = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    head = ["<global-img>"] + rows + ["<fake_token_around_image>", "<image>"]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(N_ADDED - len(head) - 1)]
    return head + reserved + ["<end_of_utterance>"]


def smolvlm_vocab(n_vocab: int) -> Vocab:
    """SmolVLM-style byte-level BPE vocabulary of exactly ``n_vocab`` tokens (``smollm`` pre-tokenizer)."""
    added = smolvlm_added_tokens()
    n_base = n_vocab - len(added)
    if n_base < len(SMOLLM2_SPECIALS) + 256 + 64:
        raise ValueError("a SmolVLM vocab needs at least 521 tokens")
    b2u = byte_to_unicode()
    tokens = list(SMOLLM2_SPECIALS)
    types = [CONTROL] * len(tokens)
    byte_syms = [b2u[b] for b in range(256)]
    tokens += byte_syms
    types += [NORMAL] * 256
    have = set(byte_syms)
    merges: list[str] = []
    space, nl = b2u[ord(" ")], b2u[ord("\n")]

    def push(word: str) -> bool:
        """Add ``word`` (its left part must already be a token); False once the base is full."""
        if len(tokens) >= n_base:
            return False
        if word in have or word[:-1] not in have:
            return True
        merges.append(f"{word[:-1]} {word[-1]}")
        tokens.append(word)
        types.append(NORMAL)
        have.add(word)
        return True

    # what mtmd looks up ("\n\n") and the pieces of its out-of-vocabulary row/col text
    for w in (
        nl + nl,
        "ro",
        "row",
        "co",
        "col",
        "Us",
        "Use",
        "User",
        "As",
        "Ass",
        "Assi",
        "Assis",
        "Assist",
        "Assista",
        "Assistan",
        "Assistant",
    ):
        push(w)
    for w in word_pieces(string.ascii_lowercase, 2 * n_base):
        if not (push(space + w) and push(w)):
            break
    while len(tokens) < n_base:  # not reached for sane sizes
        tokens.append(f"<|pad_{len(tokens)}|>")
        types.append(CONTROL)
    tokens += added
    types += [CONTROL] * len(added)
    eou = n_vocab - 1
    return Vocab(
        "gpt2",
        tokens,
        [0.0] * len(tokens),
        types,
        merges,
        bos_id=1,
        eos_id=eou,
        unk_id=0,
        pad_id=2,
        pre="smollm",
        add_bos=False,
    )


# SmolVLM's chat template, with a branch for string content (edgevlm renders each user message as
# one string with mtmd's marker where the image goes): "User:<image>text<end_of_utterance>\n".
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}"
    "{% if message['content'].startswith('<__media__>') %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{{ message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<end_of_utterance>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_smollm_text(path: Path, t: TextShape, seed: int, name: str, weight_type: str = "q4_0") -> Path:
    g = RandomGGUF(path, "llama", seed, weight_type)
    text_header(g, t, name)
    w = g.writer
    w.add_rope_dimension_count(t.head_dim)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(t.n_vocab)
    write_vocab(w, smolvlm_vocab(t.n_vocab))
    w.add_chat_template(SMOLVLM_TEMPLATE)
    decoder_tensors(g, t, qkv_bias=False)  # SmolVLM-256M/500M keep a separate lm_head (output.weight)
    return g.write()


def write_siglip_idefics3(
    path: Path,
    v: VisionShape,
    n_text_embd: int,
    seed: int,
    name: str,
    scale_factor: int = SCALE_FACTOR,
    longest_edge: int = LONGEST_EDGE,
) -> Path:
    g = RandomGGUF(path, "clip", seed, "f16")
    w = g.writer
    w.add_type("mmproj")
    w.add_name(name)
    w.add_file_type(FILE_TYPES["f16"])
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", n_text_embd)
    w.add_uint32("clip.vision.image_size", v.image_size)
    w.add_uint32("clip.vision.patch_size", v.patch_size)
    w.add_uint32("clip.vision.embedding_length", v.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", v.n_ff)
    w.add_uint32("clip.vision.block_count", v.n_layer)
    w.add_uint32("clip.vision.attention.head_count", v.n_head)
    w.add_array("clip.vision.image_mean", SIGLIP_MEAN)
    w.add_array("clip.vision.image_std", SIGLIP_STD)
    w.add_string("clip.projector_type", "idefics3")
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    w.add_bool("clip.use_gelu", True)
    if longest_edge:  # older SmolVLM GGUFs lack it (mtmd then tiles by rounding each side)
        w.add_uint32("clip.vision.preproc_image_size", longest_edge)

    E = v.n_embd
    n_patches = (v.image_size // v.patch_size) ** 2
    g.weight("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size), qtype="f32")
    g.bias("v.patch_embd.bias", E)
    g.weight("v.position_embd.weight", (n_patches, E), scale=0.02, qtype="f32")
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        for proj in ("attn_k", "attn_v", "attn_q", "attn_out"):
            g.linear(f"{p}.{proj}", E, E)
        g.norm(f"{p}.ln1", E)
        g.linear(f"{p}.ffn_up", v.n_ff, E)
        g.linear(f"{p}.ffn_down", E, v.n_ff)
        g.norm(f"{p}.ln2", E)
    g.norm("v.post_ln", E)
    g.linear("mm.model.fc", n_text_embd, E * scale_factor * scale_factor, bias=False)
    return g.write()


def write_pair(outdir: Path, preset: str, seed: int, family: str) -> tuple[Path, Path]:
    text, vision = IDEFICS3_PRESETS[preset]
    model = write_smollm_text(outdir / "model.gguf", text, seed, f"SmolVLM random ({family})")
    mmproj = write_siglip_idefics3(outdir / "mmproj.gguf", vision, text.n_embd, seed + 1, "SmolVLM SigLIP random")
    return model, mmproj
