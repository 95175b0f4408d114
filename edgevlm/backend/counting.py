"""mtmd's tokenizer: a prompt with media markers → text and image chunks, and image token counts
from placeholder bitmaps (no pixels, nothing encoded). ``MtmdTokenizer`` is what ``Backend`` and
``ImageCounter`` share; ``ImageCounter`` loads only the text model's vocabulary and the projector,
so any projector mtmd supports can be counted exactly without loading the language model.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import BackendError, ImageError, ModelFileError, ModelPairError
from ..model.gguf_info import load_projector
from ..model.tokens import ImageTokens, View
from . import logs
from .native import require
from .system import install_log_sink

__all__ = ["CHUNK_AUDIO", "CHUNK_IMAGE", "CHUNK_TEXT", "Chunk", "Chunks", "ImageCounter", "MtmdTokenizer"]

CHUNK_TEXT, CHUNK_IMAGE, CHUNK_AUDIO = 0, 1, 2


@dataclass
class Chunk:
    """One piece of a tokenized prompt, in order. ``handle`` stays valid while its Chunks live."""

    kind: str  # "text" or "image"
    n_tokens: int
    n_pos: int
    tokens: list[int] | None  # text chunks only
    image_id: str | None  # image chunks: mtmd's id (we set it to the content hash)
    nx: int = 0
    ny: int = 0
    handle: Any = None


class Chunks(list[Chunk]):
    """A list of Chunk that frees mtmd's chunk array when closed."""

    def __init__(self, items, ptr, owner: MtmdTokenizer):
        super().__init__(items)
        self._ptr = ptr
        self._backend = owner

    def close(self) -> None:
        if self._ptr is not None:
            self._backend.mtmd.mtmd_input_chunks_free(self._ptr)
            self._ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover - safety net
        try:
            self.close()
        except Exception:
            pass


class MtmdTokenizer:
    """Tokenizing and counting over an mtmd context (``self.mtmd``, ``self.mctx``,
    ``self.marker``, ``self._counts`` and ``self.mtmd_lock`` set by the owner). Every call that
    touches the mtmd context holds ``mtmd_lock``: counting runs in request threads while the
    model's own thread encodes."""

    mtmd: Any  # llama_cpp.mtmd_cpp (ctypes bindings)
    mctx: Any  # the mtmd context (a ctypes pointer; None once closed)
    marker: str
    _counts: OrderedDict[tuple[int, int], ImageTokens]
    mtmd_lock: Any

    def bitmap_from_audio(self, samples: np.ndarray, audio_id: str | None = None):
        """An mtmd bitmap from mono float32 samples at the encoder's rate (decoding and
        resampling are the audio module's job); mtmd copies them."""
        data = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if not len(data):
            raise BackendError("internal: an audio bitmap needs samples")
        bm = self.mtmd.mtmd_bitmap_init_from_audio(len(data), data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        if not bm:
            raise BackendError(f"mtmd could not take {len(data)} audio samples")
        if audio_id:
            self.mtmd.mtmd_bitmap_set_id(bm, audio_id.encode())
        return bm

    def bitmap_from_rgb(self, rgb: np.ndarray, image_id: str | None = None):
        """An mtmd bitmap from an HxWx3 uint8 array (decoding/EXIF is the images module's job)."""
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ImageError("internal: bitmap needs an HxWx3 uint8 array")
        h, w = rgb.shape[:2]
        data = np.ascontiguousarray(rgb)
        # mtmd copies the pixels into the bitmap: hand it the array's own buffer
        bm = self.mtmd.mtmd_bitmap_init(w, h, data.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        if not bm:
            raise ImageError(f"mtmd could not take a {w}x{h} image")
        if image_id:
            self.mtmd.mtmd_bitmap_set_id(bm, image_id.encode())
        return bm

    def placeholder_bitmap(self, width: int, height: int):
        """A data-less bitmap: mtmd tokenizes it (counts tokens) but cannot encode it."""
        bm = self.mtmd.mtmd_bitmap_init(width, height, None)
        if not bm:
            raise ImageError(f"mtmd could not take a {width}x{height} placeholder")
        return bm

    def count_image(self, width: int, height: int) -> list[Chunk]:
        """mtmd's own chunks (tokens, positions, grid) for a width×height image, text included."""
        bm = self.placeholder_bitmap(width, height)
        try:
            with self.tokenize(self.marker, [bm], add_special=False) as chunks:
                return [Chunk(c.kind, c.n_tokens, c.n_pos, c.tokens, c.image_id, c.nx, c.ny) for c in chunks]
        finally:
            self.free_bitmap(bm)

    def count_tokens(
        self, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
    ) -> ImageTokens:
        """mtmd's count as ``ImageTokens`` (a placeholder bitmap tokenized, nothing encoded),
        with this context's token limits: exact for any projector mtmd supports. Remembered
        per size (budgets search many)."""
        key = (width, height)
        hit = self._counts.get(key)  # (a hit needs no lock: one dict read)
        if hit is not None:
            return hit
        with self.mtmd_lock:
            hit = self._counts.get(key)
            if hit is None:
                chunks = self.count_image(width, height)
                views = [View(0, 0, c.nx, c.ny, c.n_tokens, c.n_pos) for c in chunks if c.kind == "image"]
                hit = ImageTokens(
                    sum(v.n_tokens for v in views),
                    sum(v.n_pos for v in views),
                    views,
                    text_tokens=sum(c.n_tokens for c in chunks if c.kind == "text"),
                )
                self._counts[key] = hit
                if len(self._counts) > 4096:
                    self._counts.popitem(last=False)
        return hit

    def free_bitmap(self, bm) -> None:
        self.mtmd.mtmd_bitmap_free(bm)

    def tokenize(self, text: str, bitmaps: list, add_special: bool = True) -> Chunks:
        """Split ``text`` (with one media marker per bitmap) into text and image chunks."""
        m = self.mtmd
        if text.count(self.marker) != len(bitmaps):
            raise BackendError(f"prompt has {text.count(self.marker)} image markers but {len(bitmaps)} images")
        inp = m.mtmd_input_text()
        raw = text.encode("utf-8")
        inp.text = raw
        inp.text_len = len(raw)
        inp.add_special = add_special
        inp.parse_special = True
        ptr = m.mtmd_input_chunks_init()
        arr = (m.mtmd_bitmap_p_ctypes * max(len(bitmaps), 1))(*bitmaps)
        with self.mtmd_lock:
            rc = m.mtmd_tokenize(self.mctx, ptr, ctypes.byref(inp), arr, len(bitmaps))
        if rc != 0:
            m.mtmd_input_chunks_free(ptr)
            raise BackendError(f"mtmd_tokenize failed (code {rc})")
        items = []
        for i in range(m.mtmd_input_chunks_size(ptr)):
            c = m.mtmd_input_chunks_get(ptr, i)
            kind = m.mtmd_input_chunk_get_type(c)
            n_tok = m.mtmd_input_chunk_get_n_tokens(c)
            n_pos = m.mtmd_input_chunk_get_n_pos(c)
            if kind == CHUNK_TEXT:
                n = ctypes.c_size_t()
                tp = m.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                items.append(Chunk("text", n_tok, n_pos, [tp[j] for j in range(n.value)], None, handle=c))
            else:
                img = m.mtmd_input_chunk_get_tokens_image(c)
                cid = m.mtmd_input_chunk_get_id(c)
                items.append(
                    Chunk(
                        "image" if kind == CHUNK_IMAGE else "audio",
                        n_tok,
                        n_pos,
                        None,
                        cid.decode() if cid else None,
                        nx=m.mtmd_image_tokens_get_nx(img) if img else 0,
                        ny=m.mtmd_image_tokens_get_ny(img) if img else 0,
                        handle=c,
                    )
                )
        return Chunks(items, ptr, self)


class ImageCounter(MtmdTokenizer):
    """mtmd's exact image token counts for a pair without loading the language model's weights
    (its vocabulary only: mtmd tokenizes the text it puts around images). ``proj_info.counter``
    counts; close it when done."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        mmproj_path: str | os.PathLike[str],
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
    ):
        require()
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.mtmd = mtmd_cpp
        self.mtmd_lock = threading.RLock()
        self._llama_cpp = llama_cpp
        self.model = None
        self.mctx = None
        self.proj_info = load_projector(os.fspath(mmproj_path))
        install_log_sink()
        with logs.capture() as lines:
            params = llama_cpp.llama_model_default_params()
            params.vocab_only = True
            self.model = llama_cpp.llama_model_load_from_file(os.fspath(model_path).encode(), params)
            if not self.model:
                raise ModelFileError(f"{model_path}: llama.cpp could not read its vocabulary")
            mp = mtmd_cpp.mtmd_context_params_default()
            mp.use_gpu = False
            mp.n_threads = 1
            mp.print_timings = False
            mp.warmup = False
            if image_min_tokens:
                mp.image_min_tokens = image_min_tokens
            if image_max_tokens:
                mp.image_max_tokens = image_max_tokens
            self.mctx = mtmd_cpp.mtmd_init_from_file(os.fspath(mmproj_path).encode(), self.model, mp)
        if not self.mctx:
            self.close()
            tail = next((ln for ln in reversed(lines) if "error" in ln.lower() or "failed" in ln.lower()), "")
            raise ModelPairError(f"{mmproj_path}: mtmd could not load the projector {tail}".strip())
        self.marker = mtmd_cpp.mtmd_default_marker().decode()
        self._counts: OrderedDict[tuple[int, int], ImageTokens] = OrderedDict()
        self.proj_info = replace(self.proj_info, counter=self.count_tokens)

    def tokenize_text(self, text: str) -> list[int]:
        """``text``'s token ids in the model's vocabulary (special tokens parsed), as
        ``Backend.tokenize_text`` gives them."""
        lc = self._llama_cpp
        vocab = lc.llama_model_get_vocab(self.model)
        raw = text.encode("utf-8")
        buf = (lc.llama_token * (len(raw) + 8))()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, True)
        if n < 0:
            raise BackendError(f"could not tokenize {text!r}")
        return list(buf[:n])

    def close(self) -> None:
        if self.mctx:
            self.mtmd.mtmd_free(self.mctx)
            self.mctx = None
        if self.model:
            self._llama_cpp.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> ImageCounter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
