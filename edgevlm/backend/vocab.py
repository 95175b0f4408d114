"""What a vocabulary says about text before it is tokenized: the most bytes one token stands for,
so that a text's size bounds its tokens from below (``plan.context.ContextBudget.check_text``)."""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["longest_piece"]

_PIECE_BUFFER = 256  # bytes; a longer piece reports its length (negative) and is counted by it


def longest_piece(llama_cpp: Any, vocab: Any, n_vocab: int) -> int | None:
    """The longest piece of ``vocab`` in bytes, control tokens too (edgevlm tokenizes text with
    special tokens parsed), read once at load: about 1.5 µs a token (0.4 s for a 262k vocabulary).

    None where a token may stand for more text than its piece: vocabularies other than
    SentencePiece and byte-level BPE (they normalize text, drop whitespace), and tokens that
    swallow the spaces beside them (``LSTRIP``/``RSTRIP``)."""
    lc = llama_cpp
    if lc.llama_vocab_type(vocab) not in (lc.LLAMA_VOCAB_TYPE_SPM, lc.LLAMA_VOCAB_TYPE_BPE):
        return None
    swallows = lc.LLAMA_TOKEN_ATTR_LSTRIP | lc.LLAMA_TOKEN_ATTR_RSTRIP
    buf = ctypes.create_string_buffer(_PIECE_BUFFER)
    longest = 1
    for t in range(n_vocab):
        if lc.llama_vocab_get_attr(vocab, t) & swallows:
            return None
        n = lc.llama_token_to_piece(vocab, t, buf, _PIECE_BUFFER, 0, True)
        longest = max(longest, abs(n))
    return longest
