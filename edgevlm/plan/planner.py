"""The memory plan: choose GPU layers, context, KV types, batch sizes and where the vision
encoder runs, from measured free memory — before anything is allocated.

Degradation order, tried until everything fits on every device (host RAM included):

1. all layers on the GPU, flash attention, f16 KV, the encoder on the GPU, the wished context;
2. shrink the context towards the minimum (the image budget × images kept + text room);
3. KV cache q8_0 (K and V matched: CUDA's fast kernels need matching pairs; needs FA);
4. fewer GPU layers, one at a time;
5. the vision encoder to the CPU;
6. KV cache q4_0;
7. refuse, stating the shortfall in MiB.

Values the user set (``--ctx``, ``--ngl``, ``--kv``, ``--image-tokens``) are kept and checked:
the plan says so, and refuses if they cannot fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..backend.system import cpu_repacks
from ..errors import InputError
from ..model.kv_types import KV_CHOICES
from ..model.gguf_info import GGUFFile, ProjectorInfo, TextModelInfo, projector_info, read_gguf, text_model_info
from ..model.projectors import encoder_patches, facts, largest_image_tokens, view_patches
from ..vision.merge import MergeSpec
from .context import DEFAULT_REPLY_TOKENS, ContextBudget
from .devices import Device, Probe, format_size
from .estimate import (
    TextTensors,
    clip_compute_bytes,
    kv_bytes,
    kv_cells,
    layer_devices,
    text_compute_bytes,
    weight_bytes,
)

__all__ = ["DEFAULT_DYNAMIC_IMAGE_TOKENS", "HOST_RESERVE", "MIB", "Breakdown", "DevicePlan",
           "host_compute_bytes", "make_plan", "Plan", "Planner", "Wishes"]

MIB = 2**20
DEFAULT_DYNAMIC_IMAGE_TOKENS = 1024
HOST_RESERVE = 512 * MIB  # Python, the process, image decoding: kept free on the host


@dataclass(frozen=True)
class Wishes:
    """What the user asked for; None means "choose for me"."""

    n_ctx: int | None = None
    min_ctx: int | None = None
    image_tokens: int | None = None  # per image
    images: int = 1  # images kept in context at once
    kv: str = "auto"  # auto | f16 | q8_0 | q4_0
    n_gpu_layers: int | None = None
    flash_attn: bool | None = None
    mmproj_on_gpu: bool | None = None
    n_batch: int = 512
    n_ubatch: int = 512
    margin: float = 0.05  # fraction of usable memory kept free (larger when free is unknown)
    reply_tokens: int = DEFAULT_REPLY_TOKENS  # the reply reserve the image count is planned with
    merge: str = "off"  # visual token merging: ratio/tokens shrink what an image costs in context

    def __post_init__(self) -> None:
        if self.kv != "auto" and self.kv not in KV_CHOICES:
            raise InputError(f"KV cache type {self.kv!r}: use auto or one of {', '.join(KV_CHOICES)}")
        for name in ("n_ctx", "min_ctx", "image_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InputError(f"{name} {v}: give a positive number, or None to let the plan choose")
        for name in ("images", "reply_tokens", "n_batch", "n_ubatch"):
            if getattr(self, name) < (0 if name == "images" else 1):
                raise InputError(f"{name} {getattr(self, name)}: out of range")
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

    def to_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes,
            "free_known": self.free_known, "predicted": self.predicted.to_dict(),
            "headroom_bytes": self.headroom_bytes,
        }


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

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("devices", "reasons")}
        d["devices"] = [dv.to_dict() for dv in self.devices]
        d["reasons"] = list(self.reasons)
        return d

    def backend_options(self) -> dict:
        """Keyword arguments for ``Backend`` that realise this plan."""
        return dict(
            n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
            n_gpu_layers=self.n_gpu_layers, flash_attn=self.flash_attn, type_k=self.type_k,
            type_v=self.type_v, offload_kqv=self.offload_kqv, mmproj_use_gpu=self.mmproj_on_gpu,
            image_max_tokens=self.image_max_tokens if self.image_max_tokens > 0 else None,
            op_offload=self.n_gpu_layers > 0,
        )


@dataclass
class _Config:
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


class Planner:
    """Predicts per-device bytes for a configuration and searches the degradation order."""

    def __init__(self, text_gf: GGUFFile, proj_gf: GGUFFile | None, probe: Probe, wishes: Wishes,
                 repack: bool | None = None):
        self.text_gf = text_gf
        self.text: TextModelInfo = text_model_info(text_gf)
        self.proj: ProjectorInfo | None = projector_info(proj_gf) if proj_gf is not None else None
        self.proj_weights = proj_gf.weight_bytes if proj_gf is not None else 0
        self.tensors = TextTensors.from_gguf(text_gf, self.text.n_layer)
        self.probe = probe
        self.wishes = wishes
        self.repack = cpu_repacks() if repack is None else repack
        self.gpus = probe.gpus
        self.host = probe.host
        self.budgets = [self._budget(d) for d in self.gpus] + [self._budget(self.host)]

    # --- arithmetic -------------------------------------------------------------------
    def _budget(self, d: Device) -> int:
        margin = self.wishes.margin if d.free_known else max(self.wishes.margin, 0.15)
        usable = d.usable_bytes
        if d.kind == "cpu":
            usable = max(0, usable - HOST_RESERVE)
        return int(usable * (1 - margin))

    def encoder_patches(self, tokens: int) -> int:
        """Patches the encoder sees for one chunk of the largest admitted image."""
        return encoder_patches(self.proj, tokens) if self.proj is not None else 0

    def predict(self, c: _Config) -> list[Breakdown]:
        """Breakdown per device: GPUs in probe order, then the host."""
        t = self.text
        splits = [float(g.usable_bytes or 1) for g in self.gpus]
        devs = layer_devices(t.n_layer, c.ngl, splits)
        host_w, gpu_w = weight_bytes(self.tensors, devs, self.repack)
        kv = kv_bytes(t.n_layer, t.n_head_kv, t.head_dim, c.n_ctx, c.type_k, c.type_v, devs[: t.n_layer],
                      c.offload_kqv, t.n_swa, None, c.n_ubatch)
        compute = text_compute_bytes(t, c.n_ctx, c.n_ubatch, c.n_batch, c.flash_attn, c.type_k, c.type_v)
        enc = 0
        if self.proj is not None:
            enc = clip_compute_bytes(self.proj, self.encoder_patches(c.image_tokens), c.flash_attn)
        out = []
        for i, _ in enumerate(self.gpus):
            has_layers = i in devs
            out.append(Breakdown(
                weights=gpu_w.get(i, 0), kv=kv.get(i, 0),
                # with no layer on a GPU the plan turns op offload off: no GPU compute buffer
                compute=compute if has_layers else 0,
                mmproj_weights=self.proj_weights if (c.mmproj_gpu and i == 0) else 0,
                mmproj_compute=enc if (c.mmproj_gpu and i == 0) else 0,
            ))
        all_gpu = bool(self.gpus) and all(d >= 0 for d in devs)
        host_compute = host_compute_bytes(t, kv_cells(c.n_ctx), c.n_ubatch) if all_gpu else compute
        out.append(Breakdown(
            weights=host_w.total, kv=kv.get(-1, 0), compute=host_compute,
            mmproj_weights=0 if (c.mmproj_gpu and self.gpus) else self.proj_weights,
            mmproj_compute=0 if (c.mmproj_gpu and self.gpus) else enc,
            other=t.n_vocab * 4,
        ))
        return out

    def shortfall(self, c: _Config) -> int:
        if c.type_v != "f16" and not c.flash_attn:
            return 0  # not a memory question: refused before (quantized V needs FA)
        return max(0, max(b.total - budget for b, budget in zip(self.predict(c), self.budgets)))

    # --- search -----------------------------------------------------------------------
    def plan(self) -> Plan:
        w, t = self.wishes, self.text
        reasons: list[str] = []
        per_image = self._image_budget(reasons)
        self.per_image_kv = per_image
        if per_image and w.merge != "off":
            spec = MergeSpec.parse(w.merge)
            if spec.target(per_image) is not None:
                self.per_image_kv = spec.target(per_image)
                reasons.append(f"--merge {spec}: an image keeps {self.per_image_kv} of its {per_image} "
                               f"tokens in context (the encoder still sees all of them)")
        min_ctx = w.min_ctx or ContextBudget.min_ctx(w.images, self.per_image_kv, w.reply_tokens)
        want_ctx = w.n_ctx or max(min_ctx, min(t.n_ctx_train or 8192, 8192))
        if w.n_ctx is not None and w.n_ctx < w.images * per_image + 64:
            reasons.append(f"--ctx {w.n_ctx} holds fewer than {w.images} image(s) of {per_image} tokens")
        max_layers = t.n_layer + 1
        gpu = bool(self.gpus)
        fa = True if w.flash_attn is None else w.flash_attn
        kv_choices = self._kv_choices(fa, reasons)
        c = _Config(
            ngl=(max_layers if w.n_gpu_layers is None or w.n_gpu_layers < 0 else min(w.n_gpu_layers, max_layers)) if gpu else 0,
            n_ctx=want_ctx, type_k=kv_choices[0], type_v=kv_choices[0], flash_attn=fa,
            mmproj_gpu=gpu if w.mmproj_on_gpu is None else (w.mmproj_on_gpu and gpu),
            image_tokens=per_image, n_batch=min(w.n_batch, kv_cells(want_ctx)),
            n_ubatch=min(w.n_ubatch, w.n_batch),
        )
        if not gpu:
            reasons.append("no GPU in the plan: the whole model runs from host RAM")
        if c.type_v != "f16" and not c.flash_attn:
            reasons.append(f"cannot run: a {c.type_v} V cache needs flash attention, which is off")
            return self._finish(c, reasons, fits=False)
        if self.shortfall(c) == 0:
            reasons.append(f"fits as wished: {self._summary(c)}")
            return self._finish(c, reasons)
        # 2. shrink the context
        if w.n_ctx is None:
            c = self._shrink_ctx(c, min_ctx, reasons)
            if self.shortfall(c) == 0:
                return self._finish(c, reasons)
        # 3. q8_0 KV
        if "q8_0" in kv_choices and c.type_k == "f16":
            c = self._quantize_kv(c, "q8_0", "KV cache q8_0 (K and V matched): about half the f16 size",
                                  want_ctx, reasons)
            if self.shortfall(c) == 0:
                return self._finish(c, reasons)
        # 4./5. fewer GPU layers, then the encoder to the CPU (and as many layers back as fit)
        if gpu:
            c = self._place(c, max_layers, reasons)
            if self.shortfall(c) == 0:
                return self._finish(self._relax(c, want_ctx, reasons), reasons)
        # 6. q4_0 KV
        if "q4_0" in kv_choices and c.type_k != "q4_0":
            c = self._quantize_kv(c, "q4_0", "KV cache q4_0: a quarter of f16, some quality loss",
                                  want_ctx, reasons)
            if self.shortfall(c) == 0:
                return self._finish(c, reasons)
        # 7. refuse
        short = self.shortfall(c)
        reasons.append(f"does not fit: {short / MIB:,.0f} MiB short on "
                       f"{self._worst_device(c)} even at {self._summary(c)}")
        return self._finish(c, reasons, fits=False)

    def _quantize_kv(self, c: _Config, kind: str, reason: str, want_ctx: int, reasons: list[str]) -> _Config:
        """A smaller KV type, then the context grown back towards the wish with the room it frees."""
        c = replace(c, type_k=kind, type_v=kind)
        reasons.append(reason)
        return self._grow_ctx(c, want_ctx) if self.wishes.n_ctx is None else c

    def _relax(self, c: _Config, want_ctx: int, reasons: list[str]) -> _Config:
        """After layers moved to the host, undo earlier sacrifices that are no longer needed."""
        w = self.wishes
        if w.kv == "auto" and c.type_k != "f16" and self.shortfall(replace(c, type_k="f16", type_v="f16")) == 0:
            c = replace(c, type_k="f16", type_v="f16")
            reasons.append("KV cache back to f16: with layers on the host it fits")
        if w.n_ctx is None and c.n_ctx < kv_cells(want_ctx):
            before = c.n_ctx
            c = self._grow_ctx(c, want_ctx)
            if c.n_ctx > before:
                reasons.append(f"context back up to {c.n_ctx}: with layers on the host it fits")
        return c

    def _place(self, c: _Config, max_layers: int, reasons: list[str]) -> _Config:
        w = self.wishes
        encoder_options = [c.mmproj_gpu] + ([False] if c.mmproj_gpu and w.mmproj_on_gpu is None else [])
        fixed = w.n_gpu_layers is not None and w.n_gpu_layers >= 0
        best = None
        for enc in encoder_options:
            cc = replace(c, mmproj_gpu=enc)
            for ngl in ([cc.ngl] if fixed else range(cc.ngl, -1, -1)):
                if self.shortfall(replace(cc, ngl=ngl)) == 0:
                    best = replace(cc, ngl=ngl)
                    break
            if best is not None:
                break
        if best is None:  # nothing fits: report the smallest GPU footprint tried
            best = replace(c, mmproj_gpu=encoder_options[-1], ngl=c.ngl if fixed else 0)
        if best.ngl < c.ngl:
            reasons.append(f"{best.ngl} of {max_layers} layers on the GPU, the rest on the CPU")
        if c.mmproj_gpu and not best.mmproj_gpu:
            reasons.append("vision encoder on the CPU (slower encoding, frees GPU memory)")
        return best

    def _image_budget(self, reasons: list[str]) -> int:
        p, w = self.proj, self.wishes
        if p is None:
            return 0
        if facts(p).dynamic:
            n = w.image_tokens or DEFAULT_DYNAMIC_IMAGE_TOKENS
            reasons.append(f"image budget {n} tokens per image "
                           f"({'as asked' if w.image_tokens else 'default for dynamic-resolution models'}); "
                           f"the encoder is counted at that largest image")
            return n
        per_view = view_patches(p)
        if facts(p).kind == "tiled":
            n = largest_image_tokens(p, w.image_tokens or 10**6)
            kind = "tiled: overview + pinpoint tiles"
        elif w.image_tokens and w.image_tokens >= 2 * per_view:
            n = w.image_tokens // per_view * per_view  # AnyRes: global view + tiles
            kind = f"fixed size: global view + {n // per_view - 1} tile(s) of {per_view}"
        else:
            n = per_view
            kind = "fixed size"
        if w.image_tokens and w.image_tokens < per_view:
            reasons.append(f"--image-tokens {w.image_tokens} is below this projector's {per_view} per view")
        reasons.append(f"image budget {n} tokens per image ({p.projector_type}, {kind})")
        return n

    def _kv_choices(self, fa: bool, reasons: list[str]) -> list[str]:
        w, t = self.wishes, self.text
        if w.kv != "auto":
            if w.kv != "f16" and t.head_dim % 32:
                reasons.append(f"KV {w.kv} needs head_dim divisible by 32 (this model: {t.head_dim})")
            if w.kv != "f16" and not fa:
                reasons.append(f"KV {w.kv} needs flash attention for V; flash attention is off")
            return [w.kv]
        out = ["f16"]
        if t.head_dim % 32 == 0 and fa:
            out += ["q8_0", "q4_0"]
        return out

    def _shrink_ctx(self, c: _Config, min_ctx: int, reasons: list[str]) -> _Config:
        start = c.n_ctx
        lo, hi = kv_cells(min_ctx), kv_cells(c.n_ctx)
        if self.shortfall(replace(c, n_ctx=lo)) > 0:
            c.n_ctx = lo
        else:
            while hi - lo > 256:  # largest context (multiple of 256) that fits
                mid = (lo + hi) // 2 // 256 * 256
                if self.shortfall(replace(c, n_ctx=mid)) == 0:
                    lo = mid
                else:
                    hi = mid
            c.n_ctx = lo
        c.n_batch = min(c.n_batch, kv_cells(c.n_ctx))
        if c.n_ctx < start:
            reasons.append(f"context {start} → {c.n_ctx} tokens (minimum {kv_cells(min_ctx)})")
        return c

    def _grow_ctx(self, c: _Config, want: int) -> _Config:
        while c.n_ctx + 256 <= kv_cells(want) and self.shortfall(replace(c, n_ctx=c.n_ctx + 256)) == 0:
            c.n_ctx += 256
        return c

    def _worst_device(self, c: _Config) -> str:
        names = [g.name for g in self.gpus] + [self.host.name]
        gaps = [b.total - budget for b, budget in zip(self.predict(c), self.budgets)]
        return names[max(range(len(gaps)), key=gaps.__getitem__)]

    def _summary(self, c: _Config) -> str:
        return (f"ctx {kv_cells(c.n_ctx)}, KV {c.type_k}, {c.ngl}/{self.text.n_layer + 1} layers on GPU, "
                f"encoder on {'GPU' if c.mmproj_gpu else 'CPU'}")

    def _finish(self, c: _Config, reasons: list[str], fits: bool = True) -> Plan:
        preds = self.predict(c) if (c.type_v == "f16" or c.flash_attn) else \
            self.predict(replace(c, type_v="f16"))
        devs = []
        for d, b, budget in zip(list(self.gpus) + [self.host], preds, self.budgets):
            devs.append(DevicePlan(d.name, d.kind, d.free_bytes, d.total_bytes, budget, d.free_known, b))
        for note in self.probe.notes:
            reasons.append(note)
        per_image = getattr(self, "per_image_kv", c.image_tokens) or 0
        rule = ContextBudget(kv_cells(c.n_ctx))
        max_images = rule.images_that_fit(per_image, self.wishes.reply_tokens)
        reasons.append(f"{max_images} image(s) of {per_image} tokens fit in the context with "
                       f"{rule.text_room} tokens kept for text and "
                       f"{rule.reply_reserve(self.wishes.reply_tokens)} for the reply")
        for dv in devs:
            reasons.append(f"{dv.name}: {format_size(dv.predicted.total)} predicted of "
                           f"{format_size(dv.budget_bytes)} budget ({format_size(dv.headroom_bytes)} headroom)")
        refusal = None if fits else next(
            (r for r in reversed(reasons) if r.startswith(("does not fit", "cannot run"))), "does not fit")
        return Plan(
            refusal=refusal,
            model=self.text.path, mmproj=self.proj.path if self.proj else "",
            n_gpu_layers=c.ngl, n_ctx=kv_cells(c.n_ctx), n_batch=c.n_batch, n_ubatch=c.n_ubatch,
            type_k=c.type_k, type_v=c.type_v, flash_attn=c.flash_attn, offload_kqv=c.offload_kqv,
            mmproj_on_gpu=c.mmproj_gpu, image_max_tokens=c.image_tokens or 0, max_images_in_context=max_images,
            devices=tuple(devs), reasons=tuple(reasons), fits=fits,
            shortfall_bytes=0 if fits and not refusal else self.shortfall(c), repack=self.repack,
        )


def host_compute_bytes(t: TextModelInfo, cells: int, n_ubatch: int) -> int:
    """Host-side compute when every layer is on a GPU: inputs, mask and the logits copy."""
    return n_ubatch * t.n_embd * 4 + cells * n_ubatch * 2 + t.n_vocab * 4 * 2


def make_plan(model: str, mmproj: str | None, probe: Probe, wishes: Wishes | None = None) -> Plan:
    return Planner(read_gguf(model), read_gguf(mmproj) if mmproj else None, probe,
                   wishes or Wishes()).plan()
