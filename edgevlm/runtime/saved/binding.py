"""What a saved conversation is bound to: KV cells mean something only to the model that made
them, in a context like the one they were made in.

A file is bound to the model and projector files — by their size and a fingerprint of their
contents (their first MiB, where the GGUF header is, and 32 samples of 64 KiB spread over the
weights: the same architecture with other weights differs), never their paths — and to the
context: ``n_ctx``, the K and V cache types, flash attention, and the image budget the pictures
were tokenized at. ``Binding.differs`` names the first difference, in words a user can act on.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Binding", "FileId", "binding_of", "file_id"]

HEAD = 2**20  # the GGUF header and the start of the weights
SAMPLES = 32
SAMPLE = 64 * 2**10


@dataclass(frozen=True)
class FileId:
    name: str  # the file's name when it was saved (shown, never compared)
    size: int
    fingerprint: str

    def same(self, other: FileId) -> bool:
        return self.size == other.size and self.fingerprint == other.fingerprint


@functools.lru_cache(maxsize=16)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEAD))
        if size > HEAD:
            step = max(1, (size - HEAD) // SAMPLES)
            for i in range(SAMPLES):
                f.seek(HEAD + i * step)
                digest.update(f.read(SAMPLE))
            f.seek(max(0, size - SAMPLE))
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def file_id(path: str) -> FileId:
    st = os.stat(path)
    return FileId(os.path.basename(path), st.st_size, _fingerprint(os.path.abspath(path), st.st_size, st.st_mtime_ns))


@dataclass(frozen=True)
class Binding:
    model: FileId
    mmproj: FileId
    n_ctx: int
    type_k: str
    type_v: str
    flash_attn: bool
    image_budget: str  # mtmd's image-token limits, "min-max" (0: the projector's own)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Binding:
        return cls(
            FileId(**d["model"]),
            FileId(**d["mmproj"]),
            int(d["n_ctx"]),
            str(d["type_k"]),
            str(d["type_v"]),
            bool(d["flash_attn"]),
            str(d["image_budget"]),
        )

    def differs(self, here: Binding) -> str | None:
        """Why a file bound to ``self`` cannot be used with ``here`` (None: it can)."""
        if not self.model.same(here.model):
            return (
                f"made with another model ({self.model.name}, {self.model.size:,} bytes; this one is {here.model.name})"
            )
        if not self.mmproj.same(here.mmproj):
            return (
                f"made with another projector ({self.mmproj.name}, {self.mmproj.size:,} bytes; "
                f"this one is {here.mmproj.name})"
            )
        if self.n_ctx != here.n_ctx:
            return f"made with a context of {self.n_ctx:,} tokens, this one has {here.n_ctx:,} (--ctx {self.n_ctx})"
        if (self.type_k, self.type_v) != (here.type_k, here.type_v):
            return (
                f"made with KV cache {_kv(self.type_k, self.type_v)}, this one has "
                f"{_kv(here.type_k, here.type_v)} (--kv {self.type_k})"
            )
        if self.flash_attn != here.flash_attn:
            return f"made with flash attention {_on(self.flash_attn)}, this one has it {_on(here.flash_attn)}"
        if self.image_budget != here.image_budget:
            return f"made with image budget {self.image_budget}, this one is {here.image_budget}"
        return None


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _kv(k: str, v: str) -> str:
    return k if k == v else f"{k}/{v}"


def binding_of(backend: Any) -> Binding:
    """The binding of what ``backend`` (a loaded ``Backend``) holds now."""
    return Binding(
        file_id(backend.model_path),
        file_id(backend.mmproj_path),
        int(backend.n_ctx),
        str(backend.type_k),
        str(backend.type_v),
        bool(backend.flash_attn),
        str(backend.image_budget),
    )
