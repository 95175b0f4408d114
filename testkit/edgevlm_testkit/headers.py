"""GGUF headers reshaped for planner tests: a generated pair has two layers of a real model's
shapes; the planner only reads headers, so the same header with its layers repeated stands for
the whole model (a 32-layer LLaVA-1.5-7B) without a multi-GB file."""

from __future__ import annotations

import re
from dataclasses import replace

from edgevlm.model.gguf_info import GGUFFile, TensorInfo

__all__ = ["with_layers"]

_BLK = re.compile(r"^((?:v\.)?blk)\.(\d+)\.(.+)$")  # text layers, or a vision encoder's


def with_layers(gf: GGUFFile, n_layer: int) -> GGUFFile:
    """``gf`` with its first layer's tensors repeated as layers 0..n_layer-1 (offsets laid out
    one after another) and its block count (``{arch}.block_count``, or a projector's
    ``clip.vision.block_count``) set to ``n_layer``."""
    others = [t for t in gf.tensors if not _BLK.match(t.name)]
    layer0 = [t for t in gf.tensors if (m := _BLK.match(t.name)) and m.group(2) == "0"]
    offset = max((t.offset + t.n_bytes for t in others), default=0)
    tensors: list[TensorInfo] = list(others)
    for i in range(n_layer):
        for t in layer0:
            m = _BLK.match(t.name)
            tensors.append(replace(t, name=f"{m.group(1)}.{i}.{m.group(3)}", offset=offset))
            offset += t.n_bytes
    meta = dict(gf.metadata)
    meta["clip.vision.block_count" if gf.is_projector else f"{gf.arch}.block_count"] = n_layer
    return replace(gf, metadata=meta, tensors=tuple(tensors), file_size=offset)
