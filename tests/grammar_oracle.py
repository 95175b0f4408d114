"""llama.cpp's own grammar engine as a membership test: whether a grammar (GBNF) lets a text
be generated, byte by byte, and then end — the independent reference the converter's tests
check their grammars against. Uses llama.cpp's sampler API directly (not edgevlm): the grammar
sampler is applied to one candidate token at a time, each text byte as the vocabulary's byte
token (``<0xNN>``), and only a token it allowed is accepted (accepting one it refused would
abort the process)."""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import llama_cpp as lc

__all__ = ["GrammarOracle"]


class GrammarOracle:
    """The vocabulary of ``model`` (a GGUF with SPM byte tokens) and llama.cpp's grammar."""

    def __init__(self, model: str | Path):
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(model).encode(), params)
        assert self.model, model
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.eos = lc.llama_vocab_eos(self.vocab)
        self.byte: dict[int, int] = {}
        for t in range(lc.llama_vocab_n_tokens(self.vocab)):
            m = re.fullmatch(rb"<0x([0-9A-F]{2})>", lc.llama_vocab_get_text(self.vocab, t) or b"")
            if m:
                self.byte[int(m.group(1), 16)] = t
        assert len(self.byte) == 256, "the vocabulary needs the 256 byte tokens"

    def close(self) -> None:
        lc.llama_model_free(self.model)

    def sampler(self, grammar: str):
        """llama.cpp's grammar sampler for ``grammar`` (None when llama.cpp refuses it)."""
        s = lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        return s or None

    def parses(self, grammar: str) -> bool:
        s = self.sampler(grammar)
        if s is not None:
            lc.llama_sampler_free(s)
        return s is not None

    def allowed(self, sampler, token: int) -> bool:
        cell = lc.llama_token_data(token, 0.0, 0.0)
        arr = lc.llama_token_data_array(ctypes.pointer(cell), 1, -1, False)
        lc.llama_sampler_apply(sampler, ctypes.byref(arr))
        return not math.isinf(cell.logit)

    def accepts(self, grammar: str, text: str | bytes) -> bool:
        """Whether the grammar lets ``text`` (bytes: as they are) be generated and the reply
        end there."""
        data = text.encode() if isinstance(text, str) else text
        return self.longest(grammar, data) == len(data) and self._ends(grammar, data)

    def longest(self, grammar: str, text: str | bytes) -> int:
        """How many bytes of ``text`` the grammar lets through before it refuses one."""
        data = text.encode() if isinstance(text, str) else text
        s = self.sampler(grammar)
        assert s is not None, "llama.cpp refused the grammar"
        try:
            for i, b in enumerate(data):
                if not self.allowed(s, self.byte[b]):
                    return i
                lc.llama_sampler_accept(s, self.byte[b])
            return len(data)
        finally:
            lc.llama_sampler_free(s)

    def _ends(self, grammar: str, data: bytes) -> bool:
        s = self.sampler(grammar)
        assert s is not None
        try:
            for b in data:
                lc.llama_sampler_accept(s, self.byte[b])
            return self.allowed(s, self.eos)
        finally:
            lc.llama_sampler_free(s)
