"""The runtime guard: before each request, predict what it adds and check it against memory
measured at that moment and the context left.

An image adds KV cells (its tokens) and may grow the vision encoder's compute buffer (it is
reserved for the largest image seen so far). If the encoder's growth will not fit the memory
free right now, a dynamic-resolution image is shrunk before encoding (and the user is told); a
fixed-size image is refused. A request the guard admitted must never reach an allocation
failure inside llama.cpp.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .devices import Probe, format_size
from .errors import InputError
from .estimate import clip_compute_bytes
from .families import image_tokens
from .gguf_info import ProjectorInfo
from .images import LoadedImage, resized
from .planner import DYNAMIC_PROJECTORS, Plan

SAFETY = 64 * 2**20  # allocator slack kept free on top of the prediction


@dataclass
class Admission:
    image: LoadedImage
    tokens: int
    encoder_bytes: int
    notice: str | None = None


@dataclass
class Guard:
    plan: Plan
    proj: ProjectorInfo
    measure: Callable[[], Probe]  # the real probe, or what-if numbers in tests
    reserved_encoder: int = 0  # encoder compute already allocated (largest image so far)
    notices: list[str] = field(default_factory=list)

    def _tokens(self, w: int, h: int) -> int:
        return image_tokens(self.proj, w, h, max_tokens=self.plan.image_max_tokens or None).n_tokens

    def _encoder_bytes(self, w: int, h: int) -> int:
        it = image_tokens(self.proj, w, h, max_tokens=self.plan.image_max_tokens or None)
        merge = int(self.proj.spatial_merge_size or 2) if self.proj.projector_type in DYNAMIC_PROJECTORS else 1
        per_view = max(v.n_tokens for v in it.views) * merge * merge
        if self.proj.projector_type not in DYNAMIC_PROJECTORS:
            per_view = (self.proj.image_size // self.proj.patch_size) ** 2
        return clip_compute_bytes(self.proj, per_view, self.plan.flash_attn)

    def _free_now(self) -> int:
        pr = self.measure()
        if self.plan.mmproj_on_gpu and pr.gpus:
            return pr.gpus[0].usable_bytes
        return pr.host.usable_bytes

    def admit(self, image: LoadedImage, cells_free: int) -> Admission:
        """Admit (maybe shrink) one image for a request with ``cells_free`` KV cells left."""
        w, h = image.width, image.height
        tokens = self._tokens(w, h)
        need = self._encoder_bytes(w, h)
        growth = max(0, need - self.reserved_encoder)
        free = self._free_now() - SAFETY
        dynamic = self.proj.projector_type in DYNAMIC_PROJECTORS
        if growth <= free and tokens <= cells_free:
            self.reserved_encoder = max(self.reserved_encoder, need)
            return Admission(image, tokens, need)
        if not dynamic:
            if tokens > cells_free:
                raise InputError(
                    f"{image.source}: needs {tokens} tokens but only {cells_free} are left in the "
                    f"context (/reset, or a larger --ctx)")
            raise InputError(
                f"{image.source}: encoding needs {format_size(growth)} more memory but only "
                f"{format_size(max(free, 0))} is free now; close other programs or plan again")
        # Dynamic resolution: the largest downscale whose tokens and encoder growth both fit.
        lo, hi = 0.0, 1.0
        for _ in range(24):
            mid = (lo + hi) / 2
            sw, sh = max(1, int(w * mid)), max(1, int(h * mid))
            ok = self._tokens(sw, sh) <= cells_free and \
                max(0, self._encoder_bytes(sw, sh) - self.reserved_encoder) <= free
            lo, hi = (mid, hi) if ok else (lo, mid)
        sw, sh = max(1, int(w * lo)), max(1, int(h * lo))
        if lo == 0.0 or self._tokens(sw, sh) > cells_free:
            raise InputError(
                f"{image.source}: no size of this image fits: {cells_free} tokens left in the "
                f"context and {format_size(max(free, 0))} free memory")
        small = resized(image, sw, sh)
        t2, need2 = self._tokens(sw, sh), self._encoder_bytes(sw, sh)
        notice = (f"{image.source}: reduced to {sw}x{sh} ({tokens} → {t2} image tokens) to fit "
                  f"{'the context left' if tokens > cells_free else 'the memory free now'}")
        self.notices.append(notice)
        self.reserved_encoder = max(self.reserved_encoder, need2)
        return Admission(small, t2, need2, notice)

