"""An independent reference for the logits after a prompt: mtmd's own stock path on a backend of
its own, one sequence, nothing of edgevlm's step loop.

The decode loop of ``test_generator.greedy`` over a prompt edgevlm rendered: its text tokens go
through ``llama_decode`` (``Backend.decode_tokens``); each picture is tokenized again from its
pixels by mtmd on the reference backend and its chunks are encoded and decoded by
``mtmd_helper_decode_image_chunk`` (``Backend.decode_image``: mtmd's positions, mtmd's batching).
No scheduler, no prefix sharing, no picture slices, no ``decode_embeddings``/``decode_rows``."""

from __future__ import annotations

import numpy as np

from edgevlm.backend.llama import Backend
from edgevlm.runtime.items import Prompt
from edgevlm.vision.images import LoadedImage

__all__ = ["stock_logits"]


def stock_logits(ref: Backend, prompt: Prompt, images: dict[str, LoadedImage]) -> np.ndarray:
    """The logits after ``prompt`` evaluated from an empty cache on ``ref`` through mtmd's stock
    path. ``images``: each image unit's key in ``prompt`` → the picture it was made from."""
    ref.kv_clear()
    n_past, pending, tokenized = 0, [], {}
    try:
        for item in prompt.items:
            if item.is_text:
                pending.append(item.key[1])
                continue
            assert not item.merged, "the stock path has no merging"
            if pending:
                n_past, pending = ref.decode_tokens(pending, n_past, logits_last=False), []
            key, index = item.key[1], item.key[2]
            if key not in tokenized:
                image = images[key]
                bitmap = ref.bitmap_from_rgb(image.rgb, image.sha256[:16])
                try:
                    tokenized[key] = ref.tokenize(ref.marker, [bitmap], add_special=False)
                finally:
                    ref.free_bitmap(bitmap)
            chunk = tokenized[key][index]
            assert chunk.kind == "image"
            assert chunk.n_tokens == item.n_tokens
            n_past = ref.decode_image(chunk, ref.encode_image(chunk), n_past)
        assert pending, "a prompt ends with text (the reply's header)"
        ref.decode_tokens(pending, n_past)
    finally:
        for chunks in tokenized.values():
            chunks.close()
    return ref.logits().copy()
