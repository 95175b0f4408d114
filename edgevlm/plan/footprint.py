"""What a plan is and what a configuration costs: ``Wishes`` in, ``Plan`` out (per-device
``Breakdown``s and the ``LeverStep``s tried), and ``Footprint``: the bytes one ``Config`` takes
on each device (weights, KV, compute, encoder) and each device's budget. The order in which the
levers are pulled is ``planner.py``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..backend.system import cpu_repacks
from ..errors import InputError
from ..model.audio import AudioEncoderInfo, refusal
from ..model.gguf_info import GGUFFile, ProjectorInfo, TextModelInfo, projector_info, text_model_info
from ..model.kv_types import KV_CHOICES, is_quantized
from ..model.projectors import DEFAULT_DYNAMIC_IMAGE_TOKENS, encoder_patches
from ..vision.merge import MergeSpec
from .context import DEFAULT_REPLY_TOKENS
from .devices import UNKNOWN_FREE_MARGIN, Device, Probe
from .estimate import (
    TextTensors,
    WhisperTensors,
    audio_compute_bytes,
    clip_compute_bytes,
    kv_bytes,
    layer_devices,
    text_compute_bytes,
    weight_bytes,
)
from .offload import device_refuses, device_tensor_bytes, gpu_backend, host_repacks, placed_compute
from .weigh import PlacementOption

__all__ = [
    "DEFAULT_DYNAMIC_IMAGE_TOKENS",
    "GUARD_SLACK",
    "HOST_RESERVE",
    "MIB",
    "Breakdown",
    "Config",
    "DevicePlan",
    "Footprint",
    "LeverStep",
    "Plan",
    "Wishes",
]

MIB = 2**20
# Free RAM the plan leaves to the process itself (--host-reserve): measured here, Python with
# edgevlm and llama.cpp's runtime take ~65 MiB, and decoding, resizing and tiling a 12-megapixel
# JPEG adds ~170 MiB at its peak; the buffers the plan counts (weights, KV, compute, encoder) are
# not in it.
HOST_RESERVE = 256 * MIB
# What the runtime guard keeps free on the encoder's device on top of its prediction (allocator
# slack, plan.guard): the plan leaves it on the first GPU, so that a plan that fits admits its
# largest picture there (on the host, --host-reserve covers it).
GUARD_SLACK = 64 * MIB


@dataclass(frozen=True)
class Wishes:
    """What the user asked for; None means "choose for me"."""

    n_ctx: int | None = None
    min_ctx: int | None = None
    image_tokens: int | None = None  # per image
    images: int = 1  # images kept in context at once
    kv: str = "auto"  # auto, or one of KV_CHOICES
    n_gpu_layers: int | None = None
    flash_attn: bool | None = None
    mmproj_on_gpu: bool | None = None
    n_batch: int = 512
    n_ubatch: int | None = None  # micro-batch; None: 512, lowered when memory is short
    margin: float = 0.05  # fraction of usable memory kept free (larger when free is unknown)
    host_reserve: int = HOST_RESERVE  # bytes of free RAM left to the process (Python, decoding)
    # bytes of RAM planned for requests in flight and waiting (bodies, decoded pixels, views,
    # embeddings): what a server hands out in leases (plan.host.HostAllowance); 0 for one user
    host_allowance: int = 0
    cache_ram: int = 0  # bytes of RAM for idle conversations moved out of the KV cache (--cache-ram)
    sequences: int = 1  # sequence ids the context keeps (its output buffer holds logits for each)
    reply_tokens: int = DEFAULT_REPLY_TOKENS  # the reply reserve the image count is planned with
    merge: str = "off"  # visual token merging: ratio/tokens shrink what an image costs in context
    # the KV cache on the GPU (True) or on the host (False: llama.cpp's offload_kqv off); None:
    # the planner weighs both when not every layer fits (plan.weigh, by measured prices)
    kv_offload: bool | None = None

    def __post_init__(self) -> None:
        if self.kv != "auto" and self.kv not in KV_CHOICES:
            raise InputError(f"KV cache type {self.kv!r}: use auto or one of {', '.join(KV_CHOICES)}")
        for name in ("n_ctx", "min_ctx", "image_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"{name} {v}: give a positive number, or None to let the plan choose")
        for name in (
            "images",
            "reply_tokens",
            "n_batch",
            "n_ubatch",
            "host_reserve",
            "host_allowance",
            "cache_ram",
            "sequences",
        ):
            v = getattr(self, name)
            if v is not None and v < (0 if name in ("images", "host_reserve", "host_allowance", "cache_ram") else 1):
                raise InputError(f"{name} {v}: out of range")
        MergeSpec.parse(self.merge)


@dataclass(frozen=True)
class Breakdown:
    weights: int = 0
    kv: int = 0
    compute: int = 0
    mmproj_weights: int = 0
    mmproj_compute: int = 0
    other: int = 0  # logits buffer, host reserve for the process

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.mmproj_weights + self.mmproj_compute + self.other

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d


@dataclass(frozen=True)
class DevicePlan:
    name: str
    kind: str
    free_bytes: int
    total_bytes: int
    budget_bytes: int  # what the plan may use: free − driver overhead − margin
    free_known: bool
    predicted: Breakdown

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.predicted.total

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "free_known": self.free_known,
            "predicted": self.predicted.to_dict(),
            "headroom_bytes": self.headroom_bytes,
        }


@dataclass(frozen=True)
class LeverStep:
    """One lever of the degradation order, as the search pulled it."""

    lever: str  # "context" | "kv q8_0" | "micro-batch" | "image budget" | "gpu layers" | ...
    change: str  # what changed: "8192 → 4096", "512 → 128", ...
    shortfall_before: int  # bytes missing on the worst device before it
    shortfall_after: int  # ... and after
    device: str = ""  # where the shortfall was

    @property
    def saved_bytes(self) -> int:
        return self.shortfall_before - self.shortfall_after


@dataclass(frozen=True)
class Plan:
    model: str
    mmproj: str
    n_gpu_layers: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    flash_attn: bool
    offload_kqv: bool
    mmproj_on_gpu: bool
    image_max_tokens: int
    max_images_in_context: int
    devices: tuple[DevicePlan, ...]
    reasons: tuple[str, ...]
    fits: bool
    shortfall_bytes: int = 0
    repack: bool = True
    refusal: str | None = None  # why it cannot run, when fits is False
    levers: tuple[LeverStep, ...] = ()  # what was tried, in order, and what each saved
    # mtmd gets image_max_tokens as its own limit: dynamic projectors only (for a tiled one such
    # as SmolVLM's it would switch mtmd to another tiling than the budget counted)
    mtmd_image_limit: bool = True
    host_reserve: int = HOST_RESERVE  # RAM left to the process itself (not in the buffers above)
    host_allowance: int = 0  # RAM planned for requests in flight and waiting (a server's leases)
    cache_ram: int = 0  # RAM for idle conversations' KV cells moved out of the context
    sequences: int = 1  # sequence ids (conversations kept) the plan counted the output buffer for
    # the audio encoder (its projector type, "" when none is planned) and its compute buffer on
    # the encoder's device: a clip context of its own, beside the vision encoder's (both are in
    # ``Breakdown.mmproj_compute``); the runtime guard reserves it before the first recording
    audio_encoder: str = ""
    audio_encoder_bytes: int = 0
    # when not every layer fitted: the placements weighed by predicted decode speed, the chosen
    # one marked, and the price table they were priced by ("measured for X" / "default (...)")
    options: tuple[PlacementOption, ...] = ()
    prices: str = ""

    @property
    def host_buffers(self) -> int:
        """What the buffers on the host are predicted to take (weights, KV, compute, encoder)."""
        return next((d.predicted.total for d in self.devices if d.kind == "cpu"), 0)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("devices", "reasons", "levers", "options")}
        d["devices"] = [dv.to_dict() for dv in self.devices]
        d["reasons"] = list(self.reasons)
        d["levers"] = [asdict(lv) for lv in self.levers]
        d["options"] = [o.to_dict() for o in self.options]
        return d

    def backend_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Backend`` that realise this plan."""
        return dict(
            n_ctx=self.n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_gpu_layers=self.n_gpu_layers,
            flash_attn=self.flash_attn,
            type_k=self.type_k,
            type_v=self.type_v,
            offload_kqv=self.offload_kqv,
            mmproj_use_gpu=self.mmproj_on_gpu,
            image_max_tokens=self.image_max_tokens if self.image_max_tokens > 0 and self.mtmd_image_limit else None,
            op_offload=self.n_gpu_layers > 0,
        )


@dataclass
class Config:
    """One configuration the search tries (mutable while it searches)."""

    ngl: int
    n_ctx: int
    type_k: str
    type_v: str
    flash_attn: bool
    mmproj_gpu: bool
    image_tokens: int
    n_batch: int
    n_ubatch: int
    offload_kqv: bool = True
    reasons: list[str] = field(default_factory=list)


class Footprint:
    """Predicts per-device bytes for a configuration, against each device's budget."""

    def __init__(
        self, text_gf: GGUFFile, proj_gf: GGUFFile | None, probe: Probe, wishes: Wishes, repack: bool | None = None
    ):
        self.text_gf = text_gf
        self.text: TextModelInfo = text_model_info(text_gf)
        self.proj: ProjectorInfo | None = projector_info(proj_gf) if proj_gf is not None else None
        # a mixed file's two clip contexts each load their own tensors: together, the whole file
        self.proj_weights = proj_gf.weight_bytes if proj_gf is not None else 0
        self.vision = self.proj is not None and self.proj.has_vision_encoder
        # the audio encoder the plan counts: one this llama.cpp can take (model.audio.refusal)
        a = self.proj.audio if self.proj is not None else None
        self.audio: AudioEncoderInfo | None = a if a is not None and refusal(a) is None else None
        self.audio_tensors = WhisperTensors()  # what the audio graph reads from the tensor table
        if self.audio is not None and proj_gf is not None:
            self.audio_tensors = WhisperTensors.from_gguf(proj_gf)
        self.tensors = TextTensors.from_gguf(text_gf, self.text.n_layer)
        self.probe = probe
        self.wishes = wishes
        self.repack = cpu_repacks() if repack is None else repack
        # per device name: how much more compute llama.cpp's own dry run reserved than the replay
        # predicted, for a configuration already checked (``plan.check``; 1.0 until then)
        self.compute_scale: dict[str, float] = {}
        self.gpus = probe.gpus
        self.host = probe.host
        self.budgets = [self._budget(d) for d in self.gpus] + [self._budget(self.host)]

    # --- arithmetic -------------------------------------------------------------------
    def margin(self, d: Device) -> float:
        return self.wishes.margin if d.free_known else max(self.wishes.margin, UNKNOWN_FREE_MARGIN)

    def _budget(self, d: Device) -> int:
        """What the plan may use on a device: its usable memory (free less a GPU's driver
        overhead; the first GPU also less the guard's slack), less the host reserve on the CPU,
        less the margin."""
        usable = d.usable_bytes
        if self.gpus and d is self.gpus[0]:
            usable = max(0, usable - GUARD_SLACK)
        if d.kind == "cpu":
            w = self.wishes
            usable = max(0, usable - w.host_reserve - w.host_allowance - w.cache_ram)
        return int(usable * (1 - self.margin(d)))

    def encoder_patches(self, tokens: int) -> int:
        """Patches the encoder sees for one chunk of the largest admitted image (0 without a
        vision encoder)."""
        return encoder_patches(self.proj, tokens) if self.proj is not None and self.vision else 0

    def audio_bytes(self, c: Config, host: bool = False) -> int:
        """The audio encoder's compute buffer on the encoder's device (``host``: the host-side
        part when that is a GPU); 0 without an audio encoder the plan counts."""
        if self.audio is None:
            return 0
        on = gpu_backend(self.gpus[0]) if c.mmproj_gpu and self.gpus else None
        if host and on is None:
            return 0
        return audio_compute_bytes(self.audio, c.flash_attn, self.audio_tensors, gpu=on, host=host)

    def predict(self, c: Config) -> list[Breakdown]:
        """Breakdown per device: GPUs in probe order, then the host."""
        t = self.text
        splits = [float(g.usable_bytes or 1) for g in self.gpus]
        devs = layer_devices(t.n_layer, c.ngl, splits)
        gpus = self.gpus
        # with no layer on a GPU the backend loads the text model without GPUs (``Backend``: its
        # host weights are then repacked as on a CPU-only build); with one, llama.cpp's rules
        in_model = gpus if any(d >= 0 for d in devs) else []
        host_w, gpu_w = weight_bytes(
            self.tensors,
            devs,
            lambda w: host_repacks(w, in_model, self.repack),
            stays_host=lambda w, d: device_refuses(w, gpus[d]),
            on_gpu=lambda w, d: device_tensor_bytes(w, gpus[d]),
        )
        kv = kv_bytes(
            t.n_layer,
            t.n_head_kv,
            t.head_dim,
            c.n_ctx,
            c.type_k,
            c.type_v,
            devs[: t.n_layer],
            c.offload_kqv,
            t.n_swa,
            None,
            c.n_ubatch,
        )
        if in_model:  # ggml's scheduler splits the graph between the GPUs and the host
            gpu_compute, host_compute = placed_compute(
                t,
                self.tensors,
                devs,
                self.gpus,
                c.n_ctx,
                c.n_ubatch,
                c.n_batch,
                c.flash_attn,
                c.type_k,
                c.type_v,
                self.repack,
                c.offload_kqv,
                op_offload=True,
            )
        else:
            gpu_compute = [0] * len(self.gpus)
            host_compute = text_compute_bytes(t, c.n_ctx, c.n_ubatch, c.n_batch, c.flash_attn, c.type_k, c.type_v)
        enc = enc_host = 0
        enc_gpu = c.mmproj_gpu and bool(self.gpus)
        if self.vision:
            assert self.proj is not None  # (self.vision says there is one)
            patches = self.encoder_patches(c.image_tokens)
            on = gpu_backend(self.gpus[0]) if enc_gpu else None  # mtmd puts the encoder on the first GPU
            enc = clip_compute_bytes(self.proj, patches, c.flash_attn, gpu=on)
            if enc_gpu:  # the pixels and positions the CPU fills stay in a host buffer
                enc_host = clip_compute_bytes(self.proj, patches, c.flash_attn, gpu=on, host=True)
        # the audio encoder's own buffer, on the same device (mtmd gives both contexts one use_gpu)
        enc += self.audio_bytes(c)
        enc_host += self.audio_bytes(c, host=True)
        scale = self.compute_scale
        out = []
        for i, g in enumerate(self.gpus):
            out.append(
                Breakdown(
                    weights=gpu_w.get(i, 0),
                    kv=kv.get(i, 0),
                    compute=int(gpu_compute[i] * scale.get(g.name, 1.0)),
                    mmproj_weights=self.proj_weights if (c.mmproj_gpu and i == 0) else 0,
                    mmproj_compute=enc if (c.mmproj_gpu and i == 0) else 0,
                )
            )
        out.append(
            Breakdown(
                weights=host_w.total,
                kv=kv.get(-1, 0),
                compute=int(host_compute * scale.get(self.host.name, 1.0)),
                mmproj_weights=0 if enc_gpu else self.proj_weights,
                mmproj_compute=enc_host if enc_gpu else enc,
                other=t.n_vocab * 4 * self.wishes.sequences,  # the output buffer: logits per sequence
            )
        )
        return out

    def shortfall(self, c: Config) -> int:
        if is_quantized(c.type_v) and not c.flash_attn:
            return 0  # not a memory question: refused before (quantized V needs FA)
        return max(0, max(b.total - budget for b, budget in zip(self.predict(c), self.budgets, strict=True)))

    def worst_device(self, c: Config) -> tuple[str, int]:
        """The device furthest over its budget, and by how much (bytes, ≤ 0 when it fits)."""
        names = [g.name for g in self.gpus] + [self.host.name]
        gaps = [b.total - budget for b, budget in zip(self.predict(c), self.budgets, strict=True)]
        i = max(range(len(gaps)), key=gaps.__getitem__)
        return names[i], gaps[i]
