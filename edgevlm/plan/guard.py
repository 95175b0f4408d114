"""The runtime guard: before each request, predict what it adds and check it against memory
measured at that moment and the context left.

An image adds KV cells (its tokens) and may grow the vision encoder's compute buffer (it is
reserved for the largest image seen so far). If the encoder's growth will not fit the memory
free right now, a dynamic-resolution image is shrunk before encoding (and the user is told); a
fixed-size image is refused. A request the guard admitted must never reach an allocation
failure inside llama.cpp. How many image cells a request may bring is the context budget's
business (``context.ContextBudget``); the guard checks one image against it.

A recording (``admit_audio``) adds its tokens, and the audio encoder's compute buffer — a clip
context of its own, the same for every 30 s window (``Plan.audio_encoder_bytes``) — the first
time: it is reserved at the first encode (or at load, with mtmd's warm-up: set
``reserved_audio`` then), never grows, and is never released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ContextExceeded, MemoryBusy, UnsupportedModel
from ..model.audio import refusal
from ..model.gguf_info import ProjectorInfo
from ..model.projectors import encoder_patches, facts, image_tokens
from ..vision.budget import fit_size
from ..vision.images import LoadedImage, resized
from .devices import Probe, format_size
from .estimate import clip_compute_bytes
from .footprint import GUARD_SLACK
from .offload import gpu_backend
from .planner import Plan
from .sched import Backend

__all__ = ["Admission", "Guard", "SAFETY", "after_load"]

SAFETY = GUARD_SLACK  # allocator slack kept free on top of the prediction (the plan leaves it)


@dataclass(frozen=True)
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
    reserved_audio: int = 0  # the audio encoder's compute, once allocated (its first encode)
    notices: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _encoder_gpu: Backend | None = field(default=None, init=False, repr=False)
    _gpu_read: bool = field(default=False, init=False, repr=False)

    def _encoder_device(self) -> Backend | None:
        """The GPU the encoder runs on, as the scheduler sees it (read once: its facts are fixed)."""
        if not self._gpu_read:
            gpus = self.measure().gpus if self.plan.mmproj_on_gpu else []
            self._encoder_gpu = gpu_backend(gpus[0]) if gpus else None
            self._gpu_read = True
        return self._encoder_gpu

    @property
    def _mtmd_cap(self) -> int | None:
        """The token limit mtmd itself was given (dynamic projectors only)."""
        return (self.plan.image_max_tokens or None) if self.plan.mtmd_image_limit else None

    def _tokens(self, w: int, h: int) -> int:
        return image_tokens(self.proj, w, h, max_tokens=self._mtmd_cap).n_tokens

    def encoder_bytes(self, w: int, h: int) -> int:
        """The encoder's compute buffer for a ``w``×``h`` picture (its largest chunk)."""
        it = image_tokens(self.proj, w, h, max_tokens=self._mtmd_cap)
        v = max(it.views, key=lambda v: v.n_tokens)
        return clip_compute_bytes(
            self.proj,
            encoder_patches(self.proj, v.n_tokens),
            self.plan.flash_attn,
            grid=(v.nx, v.ny),
            gpu=self._encoder_device(),  # scheduled as on that device
        )

    def _free_now(self) -> int:
        pr = self.measure()
        if self.plan.mmproj_on_gpu and pr.gpus:
            return pr.gpus[0].usable_bytes
        return pr.host.usable_bytes

    def admit(self, image: LoadedImage, cells_free: int) -> Admission:
        """Admit (maybe shrink) one image for a request with ``cells_free`` KV cells left for
        pictures. Thread-safe: concurrent requests see each other's encoder reservations."""
        with self.lock:
            return self._admit(image, cells_free)

    @property
    def reserved_bytes(self) -> int:
        """Both encoders' compute buffers allocated so far (what ``after_load``'s ``encoder``
        callback should answer)."""
        return self.reserved_encoder + self.reserved_audio

    def admit_audio(self, tokens: int, cells_free: int) -> int:
        """Admit one recording of ``tokens`` tokens (every window of it) for a request with
        ``cells_free`` KV cells left: ``ContextExceeded`` when they do not fit, ``MemoryBusy``
        when the audio encoder's buffer is not allocated yet and does not fit the memory free
        now. Thread-safe, like ``admit``: returns the tokens."""
        with self.lock:
            a = self.proj.audio
            why = "the projector has no audio encoder" if a is None else refusal(a)
            if why is not None:
                raise UnsupportedModel(f"audio: {why}")
            if tokens > cells_free:
                raise ContextExceeded(
                    f"audio: needs {tokens} tokens but only {max(cells_free, 0)} are left in the context "
                    f"(/reset, a shorter recording, or a larger --ctx)"
                )
            growth = max(0, self.plan.audio_encoder_bytes - self.reserved_audio)
            if growth:
                free = self._free_now() - SAFETY
                if growth > free:
                    raise MemoryBusy(
                        f"audio: encoding needs {format_size(growth)} more memory but only "
                        f"{format_size(max(free, 0))} is free now; close other programs or plan again"
                    )
                self.reserved_audio = self.plan.audio_encoder_bytes
            return tokens

    def _admit(self, image: LoadedImage, cells_free: int) -> Admission:
        w, h = image.width, image.height
        tokens = self._tokens(w, h)
        need = self.encoder_bytes(w, h)
        growth = max(0, need - self.reserved_encoder)
        free = self._free_now() - SAFETY
        if growth <= free and tokens <= cells_free:
            self.reserved_encoder = max(self.reserved_encoder, need)
            return Admission(image, tokens, need)
        if not facts(self.proj).dynamic:
            if tokens > cells_free:
                raise ContextExceeded(
                    f"{image.source}: needs {tokens} tokens but only {max(cells_free, 0)} are left in "
                    f"the context (/reset, or a larger --ctx)"
                )
            raise MemoryBusy(
                f"{image.source}: encoding needs {format_size(growth)} more memory but only "
                f"{format_size(max(free, 0))} is free now; close other programs or plan again"
            )
        # Dynamic resolution: the largest downscale whose tokens and encoder growth both fit.
        size = fit_size(
            w,
            h,
            lambda a, b: (
                self._tokens(a, b) <= cells_free and max(0, self.encoder_bytes(a, b) - self.reserved_encoder) <= free
            ),
            steps=24,
        )
        if size is None or self._tokens(*size) > cells_free:
            raise ContextExceeded(
                f"{image.source}: no size of this image fits: {max(cells_free, 0)} tokens left in the "
                f"context and {format_size(max(free, 0))} free memory"
            )
        sw, sh = size
        small = resized(image, sw, sh)
        t2, need2 = self._tokens(sw, sh), self.encoder_bytes(sw, sh)
        notice = (
            f"{image.source}: reduced to {sw}x{sh} ({tokens} → {t2} image tokens) to fit "
            f"{'the context left' if tokens > cells_free else 'the memory free now'}"
        )
        self.notices.append(notice)
        self.reserved_encoder = max(self.reserved_encoder, need2)
        return Admission(small, t2, need2, notice)


def after_load(measure: Callable[[], Probe], plan: Plan, encoder: Callable[[], int]) -> Callable[[], Probe]:
    """A what-if probe (``--free-memory``: what was free before loading) as the guard needs it
    at run time: each what-if device less what the loaded plan holds there — all but the
    encoders' buffers, which are ``encoder()`` (``Guard.reserved_bytes``: the largest picture's so
    far and the audio encoder's once allocated) where the encoders are."""
    enc_on = next((d.name for d in plan.devices if d.kind != "cpu"), None) if plan.mmproj_on_gpu else None

    def now() -> Probe:
        pr = measure()
        out = []
        for d in pr.devices:
            put = next((x.predicted for x in plan.devices if x.name == d.name), None)
            if d.source != "what-if" or put is None:
                out.append(d)
                continue
            is_enc = d.name == enc_on or (enc_on is None and d.kind == "cpu")
            held = put.total - put.mmproj_compute + (encoder() if is_enc else put.mmproj_compute)
            out.append(replace(d, free_bytes=max(0, d.free_bytes - held)))
        return replace(pr, devices=tuple(out))

    return now
