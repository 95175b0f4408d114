"""Text tokens as embedding rows, exactly as llama.cpp's graph makes them: ``get_rows`` of the
model's ``token_embd`` through ggml's own dequantizer for its type (``to_float``), zero-padded to
the input width.

llama.cpp takes a batch of token ids or a batch of embeddings, never both. A step that feeds a
picture's rows beside running streams would otherwise make two passes over the weights, one
for the streams' tokens and one for the picture: on a CPU the weights' pass is most of what a
small batch costs (a 4096-wide layer: 35 ms for 1 row, 65 ms for 16). With the streams' tokens
as rows of the picture's batch, a step is one pass.

Only for architectures whose graph takes a token as its plain ``token_embd`` row and treats
token and embedding inputs alike afterwards (``MIXABLE_ARCHS``; Gemma scales token rows only,
M-RoPE models store 2-D positions for embedding rows).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from ..model.gguf_info import read_gguf

__all__ = ["MIXABLE_ARCHS", "TokenRows", "open_token_rows"]

# llama.cpp graphs (src/models/*.cpp) that start from build_inp_embd(model.tok_embd) and never
# look at ubatch.token again
MIXABLE_ARCHS = frozenset({"llama", "qwen2"})

GGML_TYPE_F32 = 0


class _TypeTraits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class TokenRows:
    """The rows of one model's ``token_embd`` (memory-mapped from its GGUF file)."""

    def __init__(self, data: np.ndarray, ggml_type: int, n_embd: int, n_embd_inp: int):
        self.data = data  # (n_vocab, bytes of a row) for quantized types, (n_vocab, n_embd) else
        self.n_embd = n_embd
        self.n_embd_inp = n_embd_inp
        self._to_float = None
        if ggml_type != GGML_TYPE_F32:
            from llama_cpp import _ggml

            lib = _ggml.libggml
            lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
            lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
            fn = lib.ggml_get_type_traits(ggml_type).contents.to_float
            if not fn:
                raise ValueError(f"ggml has no dequantizer for type {ggml_type}")
            self._to_float = _TO_FLOAT(fn)

    def rows(self, tokens: list[int], out: np.ndarray) -> None:
        """Write the rows of ``tokens`` into ``out`` (``(len(tokens), n_embd_inp)`` float32)."""
        out[:, self.n_embd :] = 0.0
        if self._to_float is None:
            out[:, : self.n_embd] = self.data[tokens]
            return
        for i, tok in enumerate(tokens):
            dst = out[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            self._to_float(self.data[tok].ctypes.data, dst, self.n_embd)


def open_token_rows(model_path: str | os.PathLike[str], n_embd_inp: int) -> TokenRows | None:
    """The token rows of a GGUF model whose architecture mixes (``MIXABLE_ARCHS``), mapped
    from its file; None for another architecture, or a file where the table is not found (a
    split model's later part)."""
    import gguf

    gf = read_gguf(model_path)
    t = gf.tensor("token_embd.weight")
    if gf.arch not in MIXABLE_ARCHS or t is None or len(t.shape) != 2:
        return None
    if t.ggml_type not in gguf.GGMLQuantizationType.__members__:
        return None
    ggml_type = int(gguf.GGMLQuantizationType[t.ggml_type])
    n_embd, n_vocab = t.shape
    row_bytes = t.n_bytes // n_vocab
    data: np.ndarray = np.memmap(gf.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(n_vocab, row_bytes))
    if ggml_type == GGML_TYPE_F32:
        data = data.view(np.float32)
    return TokenRows(data, ggml_type, n_embd, n_embd_inp)
