"""A sequence's items and a chat's conversation as a saved file holds them.

Items are JSON: a text token is its id; an image chunk is ``["i", unit key, chunk, cells,
positions]`` (``+ [mode, value]`` when merged) — the unit key is the picture's content hash and
budget, so a restored sequence matches the same picture sent again, in any process. A
conversation keeps its messages and pictures as data; every picture's pixels (the views sent,
and the whole picture ``/recall`` sends again) are lossless PNG sections named by their pixel
hash, stored once however often they appear, and checked against it when read back; a
recording's pieces likewise, as raw float32 samples named by their hash (``pcm:``).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from ...audio.plan import AudioPiece
from ...errors import SavedStateError
from ...vision.images import LoadedImage
from ...vision.merge import MergeSpec
from ..conversation import Conversation, Message, Picture
from ..items import Item
from ..session import Summaries

__all__ = ["decode_conversation", "decode_items", "encode_conversation", "encode_items"]


def encode_items(items: tuple[Item, ...] | list[Item]) -> list[Any]:
    out: list[Any] = []
    for it in items:
        if it.is_text:
            out.append(int(it.key[1]))
        else:
            row = ["i", str(it.key[1]), int(it.key[2]), it.n_tokens, it.n_pos]
            if it.merged:
                spec: MergeSpec = it.key[3]
                row += [spec.mode, spec.value]
            out.append(row)
    return out


def decode_items(rows: list[Any], where: str) -> tuple[Item, ...]:
    try:
        out = []
        for r in rows:
            if isinstance(r, int):
                out.append(Item(("t", r), 1, 1))
            elif len(r) == 5:
                out.append(Item(("i", str(r[1]), int(r[2])), int(r[3]), int(r[4])))
            else:
                spec = MergeSpec(str(r[5]), float(r[6]))
                out.append(Item(("i", str(r[1]), int(r[2]), spec), int(r[3]), int(r[4])))
        return tuple(out)
    except (TypeError, ValueError, IndexError):
        raise SavedStateError(f"{where}: corrupted (its items are not readable)") from None


def _pixel_hash(rgb: np.ndarray) -> str:
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    digest = hashlib.sha256(f"{rgb.shape[1]}x{rgb.shape[0]}".encode())
    digest.update(rgb.data.cast("B"))
    return digest.hexdigest()


class _Images:
    """Pictures to PNG sections, each stored once."""

    def __init__(self) -> None:
        self.sections: dict[str, bytes] = {}

    def ref(self, image: Any) -> dict[str, Any]:
        if isinstance(image, AudioPiece):
            samples = np.ascontiguousarray(image.samples, dtype="<f4")
            pcm = hashlib.sha256(samples.data.cast("B")).hexdigest()
            self.sections.setdefault(f"pcm:{pcm}", samples.tobytes())
            return {
                "pcm": pcm,
                "sha256": image.sha256,
                "source": image.source,
                "spans": [list(s) for s in image.spans],
                "tokens": image.tokens,
            }
        px = _pixel_hash(image.rgb)
        name = f"px:{px}"
        if name not in self.sections:
            buf = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(image.rgb)).save(buf, format="PNG", compress_level=1)
            self.sections[name] = buf.getvalue()
        return {
            "px": px,
            "sha256": image.sha256,
            "source": image.source,
            "format": image.format,
            "notes": list(image.notes),
        }


def encode_conversation(conv: Conversation, summaries: Summaries) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """The conversation as JSON and its pictures' PNG sections."""
    images = _Images()
    messages = []
    for m in conv.messages:
        messages.append(
            {
                "role": m.role,
                "text": m.text,
                "images": [images.ref(v) for v in m.images],
                "tokens": m.tokens,
                "labels": m.labels,
                "sources": m.sources,
                "pictures": m.pictures,
                "notes": m.notes,
                "tool_calls": m.tool_calls,
                "tool_call_id": m.tool_call_id,
                "name": m.name,
            }
        )
    pictures = [
        {"number": p.number, "image": images.ref(p.image), "tokens": p.tokens, "summary": p.summary}
        for p in conv.pictures
    ]
    data = {
        "messages": messages,
        "pictures": pictures,
        "summaries": {"texts": summaries.texts, "generated": summaries.generated},
    }
    return data, sorted(images.sections.items())


def decode_conversation(
    data: dict[str, Any], sections: Mapping[str, bytes | memoryview], where: str
) -> tuple[Conversation, Summaries]:
    decoded: dict[str, np.ndarray] = {}

    def sound(ref: dict[str, Any]) -> AudioPiece:
        pcm = str(ref["pcm"])
        blob = sections.get(f"pcm:{pcm}")
        if blob is None:
            raise SavedStateError(f"{where}: corrupted (recording {pcm[:12]} is missing)")
        if hashlib.sha256(bytes(blob)).hexdigest() != pcm:
            raise SavedStateError(f"{where}: corrupted (recording {pcm[:12]} does not match its hash)")
        return AudioPiece(
            samples=np.frombuffer(bytes(blob), dtype="<f4").astype(np.float32),
            spans=tuple((float(a), float(b)) for a, b in ref["spans"]),
            tokens=int(ref["tokens"]),
            sha256=str(ref["sha256"]),
            source=str(ref["source"]),
        )

    def image(ref: dict[str, Any]) -> Any:
        if "pcm" in ref:
            return sound(ref)
        px = str(ref["px"])
        rgb = decoded.get(px)
        if rgb is None:
            blob = sections.get(f"px:{px}")
            if blob is None:
                raise SavedStateError(f"{where}: corrupted (picture {px[:12]} is missing)")
            try:
                with Image.open(io.BytesIO(blob)) as im:
                    rgb = np.asarray(im.convert("RGB"))
            except (OSError, ValueError):
                raise SavedStateError(f"{where}: corrupted (picture {px[:12]} is not readable)") from None
            if _pixel_hash(rgb) != px:
                raise SavedStateError(f"{where}: corrupted (picture {px[:12]} does not match its hash)")
            decoded[px] = rgb
        return LoadedImage(rgb, str(ref["source"]), str(ref["format"]), str(ref["sha256"]), tuple(ref["notes"]))

    try:
        conv = Conversation()
        for m in data["messages"]:
            conv.messages.append(
                Message(
                    role=str(m["role"]),
                    text=str(m["text"]),
                    images=[image(r) for r in m["images"]],
                    tokens=None if m["tokens"] is None else [int(t) for t in m["tokens"]],
                    labels=list(m["labels"]),
                    sources=list(m["sources"]),
                    pictures=[int(n) for n in m["pictures"]],
                    notes=list(m["notes"]),
                    tool_calls=list(m["tool_calls"]),
                    tool_call_id=str(m["tool_call_id"]),
                    name=str(m["name"]),
                )
            )
        for p in data["pictures"]:
            conv.pictures.append(Picture(int(p["number"]), image(p["image"]), int(p["tokens"]), p["summary"]))
        s = data["summaries"]
        summaries = Summaries(dict(s["texts"]), int(s["generated"]))
    except (KeyError, TypeError, ValueError):
        raise SavedStateError(f"{where}: corrupted (its conversation is not readable)") from None
    return conv, summaries
