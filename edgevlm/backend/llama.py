"""The loaded model pair: with ``system``, the only code that touches ``llama_cpp`` and ``mtmd``.

``Backend`` owns a ``llama_cpp.Llama`` (model + context) and the mtmd context for a model pair,
and offers the primitives the scheduler builds on: tokenize a prompt with images into chunks,
encode an image chunk, decode text or image embeddings at a position (one sequence, or a batch
from several), share and drop KV cells, sample, read logits and vocabulary facts.
No policy lives here: what to evaluate, when, and what to keep is the scheduler's business.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BackendError, InputError, ModelFileError, ModelPairError
from ..model.gguf_info import check_pair, load_projector, load_text_model
from ..model.kv_types import KV_DEFAULT, KV_TYPES, is_quantized
from ..model.tokens import ImageTokens
from . import logs
from .counting import CHUNK_AUDIO, CHUNK_IMAGE, CHUNK_TEXT, Chunk, Chunks, MtmdTokenizer  # noqa: F401
from .native import require
from .sampling import SamplingParams
from .system import default_threads, install_log_sink, placement
from .tokrows import open_token_rows
from .utf8guard import Utf8Guard
from .vocab import longest_piece

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["Backend", "Chunk", "Chunks", "SamplingParams"]

# llama-cpp-python's default-params factories are module globals: one constructor at a time
# patches them (two models loading in two threads must not see each other's parameters).
_FACTORY_LOCK = threading.Lock()


@contextlib.contextmanager
def _llama_defaults(n_seq_max: int, progress_callback, extra_buffers: bool):
    """``Llama`` exposes neither several sequences, nor a load-progress callback, nor the CPU's
    extra buffer types: patch the default-params factories it calls, for the constructor only
    (under ``_FACTORY_LOCK``). ``n_seq_max`` > 1 gives the context that many sequences over one
    unified KV cache (every sequence may use the whole context, and cells copied with
    ``seq_cp`` are shared). Only what differs from the library's defaults is set.

    Judged in #57 (no write into the library's structs without a reason): each field set here
    is one ``Llama`` has no keyword for, set on the public parameter structs the library's own
    factories return, for this constructor only; ``tests/test_load_params.py`` checks that the
    load differs from a plain ``Llama`` load by these fields alone, and fails the day the binding
    takes one of them as a keyword (then the keyword replaces the patch)."""
    with _FACTORY_LOCK, _patched_defaults(n_seq_max, progress_callback, extra_buffers):
        yield


@contextlib.contextmanager
def _patched_defaults(n_seq_max: int, progress_callback, extra_buffers: bool):
    import llama_cpp.llama as llama_mod

    lc = llama_mod.llama_cpp
    saved = lc.llama_context_default_params, lc.llama_model_default_params
    keep: list[Any] = []

    def context_params():
        params = saved[0]()
        if n_seq_max > 1:
            params.n_seq_max = n_seq_max
            params.kv_unified = True
        return params

    def model_params():
        params = saved[1]()
        if params.use_extra_bufts != extra_buffers:
            params.use_extra_bufts = extra_buffers
        if progress_callback is not None:

            def report(progress: float, _user) -> bool:
                try:
                    progress_callback(float(progress))
                except Exception:  # never raise into C
                    pass
                return True

            keep.append(lc.llama_progress_callback(report))
            params.progress_callback = keep[-1]
        return params

    lc.llama_context_default_params, lc.llama_model_default_params = context_params, model_params
    try:
        yield
    finally:
        lc.llama_context_default_params, lc.llama_model_default_params = saved


class Backend(MtmdTokenizer):
    """llama.cpp text model + mtmd projector, loaded once.

    Thread safety: the llama.cpp context is driven by one caller at a time (the scheduler's
    lock); the mtmd context is also used by threads that count image tokens or tokenize
    pictures, so every mtmd call that touches it holds ``self.mtmd_lock``."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        mmproj_path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        flash_attn: bool = True,
        type_k: str = KV_DEFAULT,
        type_v: str = KV_DEFAULT,
        offload_kqv: bool = True,
        mmproj_use_gpu: bool = True,
        mmproj_flash_attn: bool | None = None,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        warmup: bool = False,
        use_mmap: bool = True,
        op_offload: bool | None = None,
        verbose: bool = False,
        progress_callback: Any = None,
        n_seq_max: int = 1,
        extra_buffers: bool | None = None,
    ) -> None:
        require()
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.llama_cpp = llama_cpp
        self.mtmd = mtmd_cpp
        self.mtmd_lock = threading.RLock()
        self.model_path = os.fspath(model_path)
        self.mmproj_path = os.fspath(mmproj_path)
        # Validate both files up front: clear one-line errors instead of C aborts.
        self.text_info = load_text_model(self.model_path)
        self.proj_info = load_projector(self.mmproj_path)
        check_pair(self.text_info, self.proj_info)
        for what, kv in (("K", type_k), ("V", type_v)):
            if kv not in KV_TYPES:
                raise InputError(f"KV cache type {kv!r} for {what}: use one of {', '.join(KV_TYPES)}")
        if is_quantized(type_v) and not flash_attn:
            raise ModelPairError(f"a quantized V cache ({type_v}) needs flash attention")

        install_log_sink()
        logs.set_echo(verbose)
        self.n_threads = n_threads or default_threads()
        self.type_k, self.type_v, self.flash_attn = type_k, type_v, flash_attn  # (what a saved KV state is bound to)
        self.load_log: list[str] = []
        with logs.capture() as lines:
            try:
                kwargs: dict[str, Any] = dict(
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_ubatch=n_ubatch,
                    n_gpu_layers=n_gpu_layers,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    flash_attn=flash_attn,
                    offload_kqv=offload_kqv,
                    use_mmap=use_mmap,
                    type_k=KV_TYPES[type_k].ggml_id,
                    type_v=KV_TYPES[type_v].ggml_id,
                    verbose=verbose,
                    op_offload=op_offload,
                )
                where = placement(n_gpu_layers, extra_buffers)
                extra = where.pop("use_extra_bufts")  # (Llama takes the rest as keywords)
                kwargs.update(where)
                with _llama_defaults(n_seq_max, progress_callback, extra):
                    self.llama: Llama | None = llama_cpp.Llama(self.model_path, **kwargs)  # None once closed
            except (ValueError, RuntimeError) as exc:
                raise ModelFileError(f"{self.model_path}: llama.cpp could not load it ({exc})") from None
            params = mtmd_cpp.mtmd_context_params_default()
            params.use_gpu = mmproj_use_gpu
            params.n_threads = self.n_threads
            params.print_timings = verbose
            params.warmup = warmup
            fa = flash_attn if mmproj_flash_attn is None else mmproj_flash_attn
            params.flash_attn_type = (
                llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
            if image_min_tokens:
                params.image_min_tokens = image_min_tokens
            if image_max_tokens:
                params.image_max_tokens = image_max_tokens
            self.image_min_tokens = image_min_tokens
            self.image_max_tokens = image_max_tokens
            self.mctx = mtmd_cpp.mtmd_init_from_file(self.mmproj_path.encode(), self.llama.model, params)
        self.load_log = list(lines)
        if not self.mctx:
            self.llama.close()
            tail = next((ln for ln in reversed(lines) if "error" in ln.lower() or "failed" in ln.lower()), "")
            raise ModelPairError(f"{self.mmproj_path}: mtmd could not load the projector {tail}".strip())
        self.supports_audio = bool(mtmd_cpp.mtmd_support_audio(self.mctx))
        if not mtmd_cpp.mtmd_support_vision(self.mctx) and not self.supports_audio:
            self.close()
            raise ModelPairError(f"{self.mmproj_path}: projector has neither vision nor audio support")
        self.marker = mtmd_cpp.mtmd_default_marker().decode()
        self._counts: OrderedDict[tuple[int, int], ImageTokens] = OrderedDict()
        # from here on, projector types without edgevlm arithmetic are counted by mtmd itself
        self.proj_info = replace(self.proj_info, counter=self.count_tokens)
        self.n_ctx: int = llama_cpp.llama_n_ctx(self.llama.ctx)
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch
        self.n_vocab = self.llama.n_vocab()
        # the embedding width mtmd writes: wider than n_embd with Qwen3-VL's deepstack features
        self.n_embd_inp = int(llama_cpp.llama_model_n_embd_inp(self.llama.model))
        self.use_mrope = bool(mtmd_cpp.mtmd_decode_use_mrope(self.mctx))
        self.non_causal = bool(mtmd_cpp.mtmd_decode_use_non_causal(self.mctx, None))
        self._post_decode_cb = mtmd_cpp.mtmd_helper_post_decode_callback()
        self._batch = llama_cpp.llama_batch_init(max(n_batch, 1), 0, 1)
        self.n_seq_max = int(llama_cpp.llama_n_seq_max(self.llama.ctx))
        self._batch_ext = None  # for decode_multi, made on first use
        # text tokens as embedding rows (tokrows), where the architecture allows it
        self._token_rows = None if self.use_mrope else open_token_rows(self.model_path, self.n_embd_inp)
        self._byte_tokens: dict[int, int] | None = None  # byte → a token of that one byte (on first use)
        self._pieces: dict[int, bytes] = {}  # token → its text (token_bytes)
        self._eog: dict[int, bool] = {}  # token → whether it ends generation
        self._vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.bos_id = int(llama_cpp.llama_vocab_bos(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        # the most bytes of text one token stands for: a text's size bounds its tokens from below
        # before it is tokenized (plan.context.ContextBudget.check_text)
        self.max_token_bytes = longest_piece(llama_cpp, self._vocab, self.n_vocab)

    # --- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_batch_ext", None) is not None:
            self.llama_cpp.llama_batch_ext_free(self._batch_ext)
            self._batch_ext = None
        if getattr(self, "_batch", None) is not None:
            self.llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "mctx", None):
            with self.mtmd_lock:  # (an encode in another thread finishes first)
                self.mtmd.mtmd_free(self.mctx)
                self.mctx = None
        llama = getattr(self, "llama", None)  # (absent when the constructor failed first)
        if llama is not None:
            llama.close()
            self.llama = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def image_budget(self) -> str:
        """mtmd's image-token limits, "min-max" (0: the projector's): in picture keys and bindings."""
        return f"{self.image_min_tokens or 0}-{self.image_max_tokens or 0}"

    @property
    def _llm(self) -> Llama:
        """The open model (nothing uses the backend after ``close``)."""
        assert self.llama is not None, "the backend is closed"
        return self.llama

    # --- images and tokenization ------------------------------------------------------
    def tokenize_text(self, text: str, add_special: bool = False) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def tokenize_fragment(self, text: str) -> list[int]:
        """Tokens whose pieces, one after another, are exactly ``text`` (a reply cut by a stop
        string inside a token): the tokenizer's own where they are, else one token per byte
        (a SentencePiece vocabulary puts a space before a fragment's first word)."""
        raw = text.encode("utf-8")
        toks = self._llm.tokenize(raw, add_bos=False, special=False)
        if b"".join(self.token_bytes(t) for t in toks) == raw:
            return toks
        if self._byte_tokens is None:
            table: dict[int, int] = {}
            for t in range(self.n_vocab):
                piece = self.token_bytes(t)
                if len(piece) == 1 and piece[0] not in table:
                    table[piece[0]] = t
            self._byte_tokens = table
        if all(b in self._byte_tokens for b in raw):
            return [self._byte_tokens[b] for b in raw]
        return toks

    # --- evaluation -------------------------------------------------------------------
    def encode_image(self, chunk: Chunk) -> np.ndarray:
        """Run the vision encoder on an image chunk (with the ``n_threads`` mtmd's context was
        made with); returns a (n_tokens, n_embd) float32 copy."""
        with self.mtmd_lock:
            if not self.mctx:
                raise BackendError("image encoding failed: the model is closed")
            rc = self.mtmd.mtmd_encode_chunk(self.mctx, chunk.handle)
            if rc != 0:
                raise BackendError(f"image encoding failed (code {rc})")
            ptr = self.mtmd.mtmd_get_output_embd(self.mctx)
            arr = np.ctypeslib.as_array(ptr, shape=(chunk.n_tokens * self.n_embd_inp,))
            return arr.reshape(chunk.n_tokens, self.n_embd_inp).copy()

    def decode_image(self, chunk: Chunk, embd: np.ndarray, n_past: int, seq_id: int = 0) -> int:
        """Feed an image chunk's embeddings at ``n_past``; returns the new n_past."""
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        new_past = self.llama_cpp.llama_pos(0)
        with self.mtmd_lock:
            rc = self.mtmd.mtmd_helper_decode_image_chunk(
                self.mctx,
                self._llm.ctx,
                chunk.handle,
                embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                n_past,
                seq_id,
                self.n_batch,
                ctypes.byref(new_past),
                self._post_decode_cb,
                None,
            )
        if rc != 0:
            raise BackendError(f"decoding image embeddings failed (code {rc})")
        return int(new_past.value)

    def image_positions(self, chunk: Chunk, n_past: int, indices) -> np.ndarray:
        """(len(indices), 4) decoder positions (t, y, x, z) mtmd gives those image tokens."""
        m = self.mtmd
        if chunk.kind == "audio":  # 1-D positions on every section (mtmd-helper: set_position_mrope_1d)
            return np.repeat((n_past + np.asarray(indices, np.int32))[:, None], 4, axis=1)
        img = m.mtmd_input_chunk_get_tokens_image(chunk.handle)
        out = np.zeros((len(indices), 4), dtype=np.int32)
        for k, i in enumerate(indices):
            p = m.mtmd_image_tokens_get_decoder_pos(img, n_past, int(i))
            out[k] = (p.t, p.y, p.x, p.z)
        return out

    def decode_embeddings(
        self, embd: np.ndarray, positions: np.ndarray, non_causal: bool = False, seq_id: int = 0
    ) -> None:
        """Feed arbitrary embedding rows (e.g. merged image tokens) with explicit positions.

        ``positions``: (n,) for 1-D RoPE, (n, 4) section-major M-RoPE (t, y, x, z). A non-causal
        image goes in one ubatch, as mtmd does.
        """
        lc = self.llama_cpp
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        n = len(embd)
        pos = positions.reshape(n, -1).astype(np.int32)
        if pos.shape[1] == 1:
            pos = np.concatenate([pos, np.zeros((n, 3), np.int32)], axis=1)
        batch = lc.llama_batch_ext_init(self._llm.ctx)
        step = n if non_causal else self.n_batch
        if non_causal:
            lc.llama_set_causal_attn(self._llm.ctx, False)
        try:
            for off in range(0, n, step):
                lc.llama_batch_ext_clear(batch)
                part = slice(off, min(n, off + step))
                self._add_rows(batch, embd[part], [seq_id] * (part.stop - off), pos[part])
                rc = lc.llama_process(self._llm.ctx, lc.LLAMA_PROCESS_TYPE_DECODE, batch)
                if rc != 0:
                    raise BackendError(f"decoding merged image tokens failed (code {rc})")
        finally:
            if non_causal:
                lc.llama_set_causal_attn(self._llm.ctx, True)
            lc.llama_batch_ext_free(batch)

    def _add_rows(self, batch, rows: np.ndarray, seqs: list[int], pos: np.ndarray) -> list[int]:
        """Add embedding ``rows`` (contiguous float32) of sequences ``seqs`` at positions ``pos``
        (``(n, 4)``: t, y, x, z; only the first where positions are 1-D) to ``batch``; their
        indices in it."""
        lc, d = self.llama_cpp, rows.shape[1]
        base, p4, out = rows.ctypes.data, (lc.llama_pos * 4)(), []
        for i in range(len(rows)):
            e = lc.llama_embd(ctypes.cast(base + i * d * 4, ctypes.POINTER(ctypes.c_float)), 1, d)
            idx = lc.llama_batch_ext_add_embd(batch, seqs[i], e)
            if idx < 0:
                raise BackendError(f"could not add an embedding row to the batch (code {idx})")
            p4[:] = pos[i].tolist()
            lc.llama_batch_ext_set_pos(batch, idx, p4)
            out.append(idx)
        return out

    @property
    def mixes_tokens(self) -> bool:
        """Whether text tokens may go into an embedding batch as their rows (``tokrows``):
        an architecture that allows it, 1-D positions."""
        return self._token_rows is not None

    def decode_rows(
        self, tokens: list[tuple[int, int, int, bool]], embd: tuple[int, np.ndarray, np.ndarray] | None
    ) -> None:
        """One embedding batch: text tokens ``(seq_id, token, pos, output)`` (``decode_multi``'s
        entries, as their ``token_embd`` rows; needs ``mixes_tokens``) and then ``embd`` =
        ``(seq_id, rows, positions)``, a causal picture slice. Outputs are indexed as in
        ``decode_multi``."""
        lc = self.llama_cpp
        assert self._token_rows is not None, "the model does not mix tokens and embeddings"
        n_tok = len(tokens)
        n_emb = 0 if embd is None else len(embd[1])
        rows = np.empty((n_tok + n_emb, self.n_embd_inp), dtype=np.float32)
        self._token_rows.rows([t[1] for t in tokens], rows[:n_tok])
        pos = np.zeros((n_tok + n_emb, 4), dtype=np.int32)
        pos[:n_tok, 0] = [t[2] for t in tokens]
        seqs = [t[0] for t in tokens]
        if embd is not None:
            rows[n_tok:] = embd[1]
            pos[n_tok:, 0] = embd[2]
            seqs += [embd[0]] * n_emb
        if self._batch_ext is None:
            self._batch_ext = lc.llama_batch_ext_init(self._llm.ctx)
        b = self._batch_ext
        lc.llama_batch_ext_clear(b)
        idx = self._add_rows(b, rows, seqs, pos)
        for i, t in enumerate(tokens):
            if t[3]:
                lc.llama_batch_ext_set_output_logits(b, idx[i], True)
        rc = lc.llama_process(self._llm.ctx, lc.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed (code {rc}) on a batch of {n_tok} tokens and {n_emb} picture rows")

    def decode_tokens(self, tokens: list[int], n_past: int, logits_last: bool = True, seq_id: int = 0) -> int:
        """Evaluate text tokens at positions n_past..; returns the new n_past."""
        lc = self.llama_cpp
        b = self._batch
        i = 0
        while i < len(tokens):
            part = tokens[i : i + self.n_batch]
            b.n_tokens = len(part)
            for j, tok in enumerate(part):
                b.token[j] = tok
                b.pos[j] = n_past + i + j
                b.n_seq_id[j] = 1
                b.seq_id[j][0] = seq_id
                b.logits[j] = False
            last = i + len(part) >= len(tokens)
            if last and logits_last:
                b.logits[len(part) - 1] = True
            rc = lc.llama_decode(self._llm.ctx, b)
            if rc != 0:
                raise BackendError(f"llama_decode failed (code {rc}) at position {n_past + i}")
            i += len(part)
        return n_past + len(tokens)

    def decode_multi(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama.cpp batch of text tokens from several sequences: ``(seq_id, token, pos,
        output)`` each (at most ``n_batch``). Sample an output with ``sample(s, index)``."""
        lc = self.llama_cpp
        if self._batch_ext is None:
            self._batch_ext = lc.llama_batch_ext_init(self._llm.ctx)
        b = self._batch_ext
        lc.llama_batch_ext_clear(b)
        pos = (lc.llama_pos * 4)()
        for seq, tok, p, out in entries:
            idx = lc.llama_batch_ext_add_token(b, seq, tok)
            if idx < 0:
                raise BackendError(f"could not add token {tok} of sequence {seq} to the batch (code {idx})")
            pos[0] = p
            lc.llama_batch_ext_set_pos(b, idx, pos)
            if out:
                lc.llama_batch_ext_set_output_logits(b, idx, True)
        rc = lc.llama_process(self._llm.ctx, lc.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise BackendError(
                f"llama_decode failed (code {rc}) on a batch of {len(entries)} tokens from several sequences"
            )

    def seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Let sequence ``dst`` share ``src``'s KV cells with positions in [p0, p1) (unified
        cache: no copy, the cells gain a sequence)."""
        mem = self.llama_cpp.llama_get_memory(self._llm.ctx)
        self.llama_cpp.llama_memory_seq_cp(mem, src, dst, p0, p1)

    def logits(self, index: int = -1) -> np.ndarray:
        """Logits of batch output ``index`` (-1: the last token evaluated with logits on; a
        view: copy to keep)."""
        ptr = self.llama_cpp.llama_get_logits_ith(self._llm.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position sequence ``seq_id`` holds in the KV cache (-1: none)."""
        mem = self.llama_cpp.llama_get_memory(self._llm.ctx)
        return int(self.llama_cpp.llama_memory_seq_pos_max(mem, seq_id))

    def kv_remove(self, p0: int, p1: int = -1, seq_id: int = 0) -> None:
        """Forget KV cells with positions in [p0, p1) (p1 = -1: to the end)."""
        mem = self.llama_cpp.llama_get_memory(self._llm.ctx)
        self.llama_cpp.llama_memory_seq_rm(mem, seq_id, p0, p1)

    def state_save(self, seq_id: int, max_bytes: int | None = None) -> bytes | None:
        """A copy of sequence ``seq_id``'s KV cells (``state_seq_get_data``; None: over ``max_bytes``)."""
        lc = self.llama_cpp
        n = int(lc.llama_state_seq_get_size(self._llm.ctx, seq_id))
        if n <= 0 or (max_bytes is not None and n > max_bytes):
            return None
        buf = (ctypes.c_ubyte * n)()
        got = int(lc.llama_state_seq_get_data(self._llm.ctx, buf, n, seq_id))
        return bytes(memoryview(buf)[:got]) if got > 0 else None

    def state_load(self, data: bytes | memoryview, seq_id: int) -> bool:
        """Put cells saved by ``state_save`` into sequence ``seq_id`` (empty); False when llama.cpp
        cannot (no room for them). ``data`` is read where it lies (a view of a file's buffer)."""
        lc = self.llama_cpp
        n = len(data)
        if isinstance(data, memoryview) and not data.readonly:
            buf: Any = (ctypes.c_ubyte * n).from_buffer(data)
        else:  # (bytes: llama.cpp only reads them)
            buf = ctypes.cast(ctypes.c_char_p(bytes(data)), ctypes.POINTER(ctypes.c_ubyte))
        return int(lc.llama_state_seq_set_data(self._llm.ctx, buf, n, seq_id)) == n

    def kv_clear(self) -> None:
        mem = self.llama_cpp.llama_get_memory(self._llm.ctx)
        self.llama_cpp.llama_memory_clear(mem, True)

    # --- sampling ---------------------------------------------------------------------
    def check_grammar(self, grammar: str | None) -> None:
        """Parse ``grammar`` with llama.cpp now (an ``InputError`` if it cannot): a request
        learns that its response format is unusable before any picture is encoded."""
        if not grammar:
            return
        lc = self.llama_cpp
        g = lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not g:
            raise InputError("the grammar for the response format could not be parsed by llama.cpp")
        lc.llama_sampler_free(g)

    def make_sampler(self, params: SamplingParams):
        """A llama.cpp sampler chain for ``params`` (free with ``free_sampler``): the grammar
        first when there is one (only tokens it allows remain), then greedy or the draw."""
        lc = self.llama_cpp
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if params.grammar:
            g = lc.llama_sampler_init_grammar(self._vocab, params.grammar.encode(), b"root")
            if not g:
                lc.llama_sampler_free(chain)
                raise InputError("the grammar for the response format could not be parsed by llama.cpp")
            lc.llama_sampler_chain_add(chain, g)
            lc.llama_sampler_chain_add(chain, Utf8Guard.attach(lc, self.token_bytes))  # (its bytes valid UTF-8)
        if params.temperature <= 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(params.top_k))
        if 0 < params.top_p < 1:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
        if 0 < params.min_p < 1:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**31)
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain

    def sample(self, sampler, index: int = -1) -> int:
        """Sample from the logits of batch entry ``index`` (-1: the last output) and accept the
        token into the sampler's state."""
        return int(self.llama_cpp.llama_sampler_sample(sampler, self._llm.ctx, index))

    def accept(self, sampler, token: int) -> None:
        """Tell the sampler ``token`` was chosen (one put in, not sampled: its grammar and
        penalties follow)."""
        self.llama_cpp.llama_sampler_accept(sampler, token)

    def free_sampler(self, sampler) -> None:
        self.llama_cpp.llama_sampler_free(sampler)

    # --- vocab ------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        hit = self._eog.get(token)
        if hit is None:
            hit = self._eog[token] = bool(self.llama_cpp.llama_vocab_is_eog(self._vocab, token))
        return hit

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        """A token's text as bytes (a piece of a UTF-8 character, for byte tokens); remembered
        per token: generation asks for every token it samples."""
        if special:
            return self._llm.detokenize([token], special=True)
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._llm.detokenize([token], special=False)
        return piece

    def token_text(self, token: int) -> str:
        """A special token's text (``<s>``, ``<|im_end|>``); "" for none (-1)."""
        return self.token_bytes(token, special=True).decode("utf-8", "ignore") if token >= 0 else ""
