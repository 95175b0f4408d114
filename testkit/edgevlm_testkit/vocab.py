"""Tokenizers built from scratch for the generated models (no hub, deterministic).

Two kinds, matching the real families:

- SPM (LLaMA / LLaVA): ``<unk> <s> </s>``, the 256 byte tokens ``<0x00>``..``<0xFF>`` that
  llama.cpp's SPM vocab needs for byte fallback, then pieces (``▁word``) with descending scores.
- GPT-2 byte-level BPE (Qwen2): the 256 byte symbols, merges that build pieces out of them, and
  the Qwen2-VL special tokens (``<|im_start|>``, ``<|vision_start|>`` ...).

Pieces are generated from letters, so any vocabulary size is reachable without a word list.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass

# llama.cpp / gguf token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "are",
    "this",
    "be",
    "at",
    "by",
    "an",
    "or",
    "from",
    "image",
    "picture",
    "photo",
    "shows",
    "a",
    "red",
    "green",
    "blue",
    "white",
    "black",
    "cat",
    "dog",
    "sky",
    "tree",
    "house",
    "car",
    "person",
    "text",
    "left",
    "right",
    "top",
    "bottom",
    "small",
    "large",
    "there",
    "two",
    "one",
    "describe",
    "what",
    "color",
    "see",
]


@dataclass(frozen=True)
class Vocab:
    model: str  # "llama" (SPM) or "gpt2" (BPE)
    tokens: list[str]
    scores: list[float]
    types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    unk_id: int | None
    pad_id: int | None
    pre: str | None = None
    add_bos: bool = True
    extra_ids: dict[str, int] | None = None  # named special tokens (e.g. "eot")


def word_pieces(alphabet: str, limit: int) -> list[str]:
    """Deterministic list of letter strings: words first, then all bigrams, trigrams, ..."""
    out: list[str] = []
    seen: set[str] = set()

    def push(s: str) -> bool:
        if s not in seen:
            seen.add(s)
            out.append(s)
        return len(out) >= limit

    for w in _WORDS:
        if push(w):
            return out
    for n in itertools.count(2):
        for combo in itertools.product(alphabet, repeat=n):
            if push("".join(combo)):
                return out
    return out  # pragma: no cover


def spm_vocab(n_vocab: int) -> Vocab:
    """A LLaMA-style SentencePiece vocabulary of exactly ``n_vocab`` tokens."""
    if n_vocab < 512:
        raise ValueError("an SPM vocab needs at least 512 tokens (3 specials + 256 bytes + pieces)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    # Single characters, with and without the word-start marker.
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces = ["\u2581"] + [c for c in chars] + ["\u2581" + c for c in chars]
    pieces += ["\u2581" + w for w in word_pieces(string.ascii_lowercase, (n_vocab - len(tokens)) // 2 + 64)]
    pieces += [w for w in word_pieces(string.ascii_lowercase, n_vocab)]
    seen: set[str] = set()
    for p in pieces:
        if len(tokens) >= n_vocab:
            break
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(NORMAL)
    # Longer pieces score higher so the greedy SPM merge prefers whole words.
    scores = [0.0] * 259 + [-1000.0 + len(t) * 10.0 - i * 1e-4 for i, t in enumerate(tokens[259:])]
    return Vocab("llama", tokens, scores, types, [], bos_id=1, eos_id=2, unk_id=0, pad_id=None)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def bpe_vocab(n_vocab: int) -> Vocab:
    """A Qwen2-style byte-level BPE vocabulary of exactly ``n_vocab`` tokens (specials last)."""
    n_special = len(QWEN_SPECIALS)
    if n_vocab < 256 + n_special + 64:
        raise ValueError("a BPE vocab needs at least 334 tokens")
    b2u = byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    have = set(tokens)
    merges: list[str] = []
    space = b2u[ord(" ")]
    n_normal = n_vocab - n_special
    # Every piece is reachable by merging its left part (already a token) with one character.
    for w in word_pieces(string.ascii_lowercase, n_normal * 2):
        for word in (space + w, w):
            if len(tokens) >= n_normal:
                break
            if word in have:
                continue
            left, right = word[:-1], word[-1]
            if left not in have:
                continue
            merges.append(f"{left} {right}")
            tokens.append(word)
            have.add(word)
        if len(tokens) >= n_normal:
            break
    types = [NORMAL] * len(tokens)
    ids = {}
    for s in QWEN_SPECIALS:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(CONTROL)
    scores = [0.0] * len(tokens)
    eot = ids["<|im_end|>"]
    return Vocab(
        "gpt2",
        tokens,
        scores,
        types,
        merges,
        bos_id=ids["<|endoftext|>"],
        eos_id=eot,
        unk_id=None,
        pad_id=ids["<|endoftext|>"],
        pre="qwen2",
        add_bos=False,
        extra_ids={"eot": eot},
    )


def write_vocab(writer, vocab: Vocab) -> None:  # writer: gguf.GGUFWriter
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.model == "llama":
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    if vocab.unk_id is not None:
        writer.add_unk_token_id(vocab.unk_id)
    if vocab.pad_id is not None:
        writer.add_pad_token_id(vocab.pad_id)
    if vocab.extra_ids and "eot" in vocab.extra_ids:
        writer.add_eot_token_id(vocab.extra_ids["eot"])
    writer.add_add_bos_token(vocab.add_bos)
