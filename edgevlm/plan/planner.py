"""The memory plan: choose GPU layers, context, KV types, the micro-batch, the image budget and
where the vision encoder runs, from measured free memory — before anything is allocated.

Levers, pulled in this order until everything fits on every device (host RAM included); each
one that is pulled is recorded with the bytes it saved (``Plan.levers``, ``plan --explain``):

1. all layers on the GPU, flash attention, f16 KV, the encoder on the GPU, the wished context,
   micro-batch 512, the image budget;
2. the context, shrunk towards the minimum (the image budget × images kept + text room);
3. KV cache q8_0 (K and V matched: CUDA's fast kernels need matching pairs; needs FA);
4. the micro-batch, 512 → 256 → 128 → 64: the text compute buffer holds a micro-batch's logits
   (n_vocab × n_ubatch × 4 bytes: 297 MiB at 152k vocabulary); only prefill slows, and less than
   any lever after it costs (``scripts/bench_ubatch.py``);
5. the image budget of dynamic-resolution models, down to 256 tokens (the encoder's buffer and
   the context shrink with it; a user's ``--image-tokens`` is kept);
6. fewer GPU layers, one at a time (generation slows with every layer on the CPU) — weighed
   against the KV cache on the host (llama.cpp's ``offload_kqv`` off, more layers on the GPU)
   and a smaller KV type by the decode speed each is predicted to reach (``weigh``, priced by
   the GPU's measured table in ``prices``); ``Plan.options`` lists what was weighed;
7. the vision encoder to the CPU;
8. KV cache q4_0;
9. refuse, stating the shortfall in MiB.

After layers moved to the CPU, earlier sacrifices that are no longer needed are undone. Values
the user set (``--ctx``, ``--ngl``, ``--kv``, ``--kv-offload``, ``--ubatch``, ``--image-tokens``) are kept and
checked: the plan says so, and refuses if they cannot fit. The arithmetic is ``footprint.py``'s.
"""

from __future__ import annotations

from dataclasses import replace

from ..model.audio import refusal, window_tokens
from ..model.gguf_info import ProjectorInfo, read_gguf
from ..model.kv_types import KV_CHOICES, KV_DEFAULT, KV_Q4, KV_Q8, is_quantized
from ..model.projectors import facts, largest_image_tokens, view_tokens
from ..vision.merge import MergeSpec
from .check import can_check, check_plan, learn
from .context import AUTO_CTX_MAX, ContextBudget
from .devices import Probe, format_size
from .estimate import kv_cells
from .footprint import (
    DEFAULT_DYNAMIC_IMAGE_TOKENS,
    GUARD_SLACK,
    MIB,
    Config,
    DevicePlan,
    Footprint,
    LeverStep,
    Plan,
    Wishes,
)
from .offload import device_refuses
from .prices import PriceTable, prices_for, representative_fill, traffic
from .weigh import PlacementOption, choose, describe, priced

__all__ = ["DYNAMIC_IMAGE_FLOOR", "LEVERS", "UBATCH_STEPS", "Plan", "Planner", "Wishes", "image_budget", "make_plan"]

LEVERS = (
    "context",
    f"kv {KV_Q8}",
    "micro-batch",
    "image budget",
    "kv on host",
    "gpu layers",
    "encoder",
    f"kv {KV_Q4}",
)
UBATCH_STEPS = (512, 256, 128, 64)
DYNAMIC_IMAGE_STEPS = (768, 512, 384, 256)
DYNAMIC_IMAGE_FLOOR = 256  # the image budget never goes below this on its own


class Planner(Footprint):
    """``Planner(text_gguf, mmproj_gguf, probe, wishes).plan()`` → a ``Plan``."""

    def plan(self) -> Plan:
        w, t = self.wishes, self.text
        self.reasons: list[str] = []
        self.steps: list[LeverStep] = []
        self.options: list[PlacementOption] = []
        self.priced_by: PriceTable | None = None
        per_image = self._image_budget()
        min_ctx = w.min_ctx or ContextBudget.min_ctx(w.images, self._kv_tokens(per_image), w.reply_tokens)
        self.want_ctx = w.n_ctx or max(min_ctx, min(t.n_ctx_train or AUTO_CTX_MAX, AUTO_CTX_MAX))
        if w.n_ctx is not None and w.n_ctx < w.images * per_image + 64:
            self.reasons.append(f"--ctx {w.n_ctx} holds fewer than {w.images} image(s) of {per_image} tokens")
        self.max_layers = t.n_layer + 1
        gpu = bool(self.gpus)
        fa = True if w.flash_attn is None else w.flash_attn
        kv_choices = self._kv_choices(fa)
        ubatch = min(w.n_ubatch or UBATCH_STEPS[0], w.n_batch)
        c = Config(
            ngl=(
                self.max_layers
                if w.n_gpu_layers is None or w.n_gpu_layers < 0
                else min(w.n_gpu_layers, self.max_layers)
            )
            if gpu
            else 0,
            n_ctx=self.want_ctx,
            type_k=kv_choices[0],
            type_v=kv_choices[0],
            flash_attn=fa,
            mmproj_gpu=gpu if w.mmproj_on_gpu is None else (w.mmproj_on_gpu and gpu),
            image_tokens=per_image,
            n_batch=min(w.n_batch, kv_cells(self.want_ctx)),
            n_ubatch=ubatch,
            offload_kqv=gpu and w.kv_offload is not False,
        )
        self._host_budget_reason()
        for i, g in enumerate(self.gpus):
            self.reasons.append(
                f"{g.name} budget {format_size(self.budgets[i])}: {format_size(g.free_bytes)} free − "
                f"{format_size(g.overhead_bytes)} for the driver (--gpu-overhead) − "
                + (f"{format_size(GUARD_SLACK)} the guard keeps free for pictures − " if i == 0 else "")
                + f"{self.margin(g):.0%} margin"
            )
        if not gpu:
            self.reasons.append("no GPU in the plan: the whole model runs from host RAM")
        if is_quantized(c.type_v) and not c.flash_attn:
            self.reasons.append(f"cannot run: a {c.type_v} V cache needs flash attention, which is off")
            return self._finish(c, fits=False)
        if self.shortfall(c) == 0:
            self.reasons.append(f"fits as wished: {self._summary(c)}")
            return self._finish(c)
        levers = [
            lambda c: self._shrink_ctx(c, min_ctx) if w.n_ctx is None else c,
            lambda c: self._quantize_kv(c, KV_Q8) if KV_Q8 in kv_choices and c.type_k == KV_DEFAULT else c,
            self._shrink_ubatch,
            self._shrink_image_budget,
        ]
        for lever in levers:
            c = lever(c)
            if self.shortfall(c) == 0:
                return self._finish(c)
        if gpu:
            c = self._weigh(c, min_ctx, kv_choices)
            if self.shortfall(c) == 0:
                return self._finish(c)
        if KV_Q4 in kv_choices and c.type_k != KV_Q4:
            c = self._quantize_kv(c, KV_Q4)
            if self.shortfall(c) == 0:
                return self._finish(c)
        name, short = self.worst_device(c)
        self.reasons.append(f"does not fit: {short / MIB:,.0f} MiB short on {name} even at {self._summary(c)}")
        return self._finish(c, fits=False)

    # --- one lever ---------------------------------------------------------------------------
    def _pulled(self, lever: str, before: Config, after: Config, change: str, reason: str) -> Config:
        """Record a lever that changed the configuration: what it saved, and why."""
        name, short = self.worst_device(before)
        self.steps.append(LeverStep(lever, change, max(0, short), self.shortfall(after), name))
        self.reasons.append(reason)
        return after

    def _shrink_ctx(self, c: Config, min_ctx: int) -> Config:
        lo, hi = kv_cells(min_ctx), kv_cells(c.n_ctx)
        if lo >= hi:
            return c
        if self.shortfall(replace(c, n_ctx=lo)) == 0:
            while hi - lo > 256:  # largest context (multiple of 256) that fits
                mid = (lo + hi) // 2 // 256 * 256
                if self.shortfall(replace(c, n_ctx=mid)) == 0:
                    lo = mid
                else:
                    hi = mid
        after = replace(c, n_ctx=lo, n_batch=min(c.n_batch, kv_cells(lo)))
        return self._pulled(
            "context",
            c,
            after,
            f"{kv_cells(c.n_ctx)} → {lo}",
            f"context {kv_cells(c.n_ctx)} → {lo} tokens (minimum {kv_cells(min_ctx)})",
        )

    def _quantize_kv(self, c: Config, kind: str) -> Config:
        """A smaller KV type, then the context grown back towards the wish with the room it frees."""
        after = replace(c, type_k=kind, type_v=kind)
        if self.wishes.n_ctx is None:
            after = self._grow_ctx(after, self.want_ctx)
        why = (
            f"KV cache {kind} (K and V matched): about half the {KV_DEFAULT} size"
            if kind == KV_Q8
            else f"KV cache {kind}: a quarter of {KV_DEFAULT}, some quality loss"
        )
        return self._pulled(f"kv {kind}", c, after, f"{c.type_k} → {kind}", why)

    def _shrink_ubatch(self, c: Config) -> Config:
        """The micro-batch, halved until it fits (a user's ``--ubatch`` is kept). Floor: 64, or a
        whole image chunk for encoders whose image tokens attend both ways."""
        if self.wishes.n_ubatch is not None:
            return c
        floor = UBATCH_STEPS[-1]
        if self.proj is not None and facts(self.proj).non_causal:
            floor = max(floor, c.image_tokens)
        steps = [u for u in UBATCH_STEPS if floor <= u < c.n_ubatch]
        if not steps:
            return c
        after = c
        for u in steps:
            after = replace(c, n_ubatch=u)
            if self.shortfall(after) == 0:
                break
        saved = self.predict(c)[-1].compute - self.predict(after)[-1].compute
        return self._pulled(
            "micro-batch",
            c,
            after,
            f"{c.n_ubatch} → {after.n_ubatch}",
            f"micro-batch {c.n_ubatch} → {after.n_ubatch} tokens: the text compute buffer "
            f"is {format_size(saved)} smaller; prefill is a little slower, generation is not",
        )

    def _shrink_image_budget(self, c: Config) -> Config:
        """A dynamic-resolution model's per-image budget, lowered step by step to the floor (a
        user's ``--image-tokens`` is kept); the context may shrink with it."""
        if self.proj is None or not facts(self.proj).dynamic or self.wishes.image_tokens:
            return c
        steps = [b for b in DYNAMIC_IMAGE_STEPS if DYNAMIC_IMAGE_FLOOR <= b < c.image_tokens]
        after = c
        for b in steps:
            after = replace(c, image_tokens=b)
            if self.wishes.n_ctx is None:
                min_ctx = self.wishes.min_ctx or ContextBudget.min_ctx(
                    self.wishes.images, self._kv_tokens(b), self.wishes.reply_tokens
                )
                if kv_cells(min_ctx) < after.n_ctx and self.shortfall(after) > 0:
                    after = replace(after, n_ctx=kv_cells(min_ctx))
            if self.shortfall(after) == 0:
                break
        if after is c:
            return c
        return self._pulled(
            "image budget",
            c,
            after,
            f"{c.image_tokens} → {after.image_tokens} tokens",
            f"image budget {c.image_tokens} → {after.image_tokens} tokens per image (floor "
            f"{DYNAMIC_IMAGE_FLOOR}): larger pictures are resized before encoding, and the "
            f"encoder's buffer shrinks",
        )

    def _place(self, c: Config) -> Config:
        w = self.wishes
        encoder_options = [c.mmproj_gpu] + ([False] if c.mmproj_gpu and w.mmproj_on_gpu is None else [])
        fixed = w.n_gpu_layers is not None and w.n_gpu_layers >= 0
        best = None
        for enc in encoder_options:
            cc = replace(c, mmproj_gpu=enc)
            for ngl in [cc.ngl] if fixed else range(cc.ngl, -1, -1):
                if self.shortfall(replace(cc, ngl=ngl)) == 0:
                    best = replace(cc, ngl=ngl)
                    break
            if best is not None:
                break
        if best is None:  # nothing fits: report the smallest GPU footprint tried
            best = replace(c, mmproj_gpu=encoder_options[-1], ngl=c.ngl if fixed else 0)
        if best.ngl < c.ngl:
            self._pulled(
                "gpu layers",
                c,
                replace(c, ngl=best.ngl),
                f"{c.ngl} → {best.ngl}",
                f"{best.ngl} of {self.max_layers} layers on the GPU, the rest on the CPU",
            )
        if c.mmproj_gpu and not best.mmproj_gpu:
            self._pulled(
                "encoder",
                replace(c, ngl=best.ngl),
                best,
                "GPU → CPU",
                "vision encoder on the CPU (slower encoding, frees GPU memory)",
            )
        return best

    def _relax(self, c: Config, min_ctx: int, keep_kv: bool = False) -> Config:
        """After layers moved to the host, undo earlier sacrifices that are no longer needed:
        the micro-batch, the KV type (unless ``keep_kv``: an option weighed with it), the image
        budget, the context."""
        w = self.wishes
        if w.n_ubatch is None:
            for u in UBATCH_STEPS:
                if u <= c.n_ubatch:
                    break
                if self.shortfall(replace(c, n_ubatch=u)) == 0:
                    self.reasons.append(f"micro-batch back up to {u}: with layers on the host it fits")
                    c = replace(c, n_ubatch=u)
                    break
        if (
            w.kv == "auto"
            and not keep_kv
            and c.type_k != KV_DEFAULT
            and self.shortfall(replace(c, type_k=KV_DEFAULT, type_v=KV_DEFAULT)) == 0
        ):
            c = replace(c, type_k=KV_DEFAULT, type_v=KV_DEFAULT)
            self.reasons.append("KV cache back to f16: with layers on the host it fits")
        if self.proj is not None and facts(self.proj).dynamic and not w.image_tokens:
            for b in (DEFAULT_DYNAMIC_IMAGE_TOKENS,) + DYNAMIC_IMAGE_STEPS:
                if b <= c.image_tokens:
                    break
                if self.shortfall(replace(c, image_tokens=b)) == 0:
                    self.reasons.append(f"image budget back up to {b}: with layers on the host it fits")
                    c = replace(c, image_tokens=b)
                    break
        if w.n_ctx is None and c.n_ctx < kv_cells(self.want_ctx):
            before = c.n_ctx
            c = self._grow_ctx(c, self.want_ctx)
            if c.n_ctx > before:
                self.reasons.append(f"context back up to {c.n_ctx}: with layers on the host it fits")
        return c

    def _weigh(self, c: Config, min_ctx: int, kv_choices: list[str]) -> Config:
        """Fewer layers, the KV cache on the host, a smaller KV type: each starting point goes
        through the layer search and the relaxing after it; the one predicted to decode fastest
        wins (``weigh.choose``); a user's ``--kv`` and ``--kv-offload`` leave one of them."""
        w = self.wishes
        places = [True, False] if w.kv_offload is None else [w.kv_offload]
        starts = [replace(c, type_k=k, type_v=k, offload_kqv=on) for k in kv_choices for on in places]
        if len(starts) == 1:
            got = self._place(starts[0])
            return self._relax(got, min_ctx) if self.shortfall(got) == 0 else got
        self.priced_by = prices = prices_for(self.gpus[0])
        fill = representative_fill(self.want_ctx)
        options, kept = [], []
        for start in starts:
            marks = len(self.steps), len(self.reasons)
            got = self._place(start)
            fits = self.shortfall(got) == 0
            got = self._relax(got, min_ctx, keep_kv=True) if fits else got
            del self.steps[marks[0] :], self.reasons[marks[1] :]  # only the chosen one is told
            if not got.offload_kqv and got.ngl <= 1 and len(places) > 1:
                continue  # no layer's cache would be on the GPU: the same as keeping it there
            t = self.text
            cost = traffic(self.tensors, t.n_layer, t.n_head_kv, t.head_dim, self.gpus, got.ngl,
                           got.type_k, got.type_v, got.offload_kqv, fill)  # fmt: skip
            *on_gpus, host = self.predict(got)
            options.append(priced(got.type_k, got.offload_kqv, got.ngl, self.max_layers, kv_cells(got.n_ctx), fits,
                                  cost, prices, on_gpus[0].total, host.total))  # fmt: skip
            kept.append(start)
        self.options, best = choose(options)
        self.reasons.append(describe(self.options, best, prices, fill))
        start = kept[self.options.index(best)] if best is not None else c
        last = start.type_k == KV_Q4 != c.type_k  # the last lever: told after the layers
        if start.type_k != c.type_k and not last:
            if is_quantized(start.type_k):
                start = self._pulled(f"kv {start.type_k}", c, start, f"{c.type_k} → {start.type_k}",
                                     f"KV cache {start.type_k}: the fastest placement that fits uses it")  # fmt: skip
            else:
                self.reasons.append(f"KV cache back to {start.type_k}: the fastest placement that fits uses it")
        if not start.offload_kqv and c.offload_kqv:
            start = self._pulled("kv on host", replace(c, type_k=start.type_k, type_v=start.type_v), start,
                                 "GPU → host", "KV cache on the host (offload_kqv off): attention runs on the CPU, "
                                 "and its room on the GPU holds layers")  # fmt: skip
        got = self._place(start)
        if last:
            before = replace(got, type_k=c.type_k, type_v=c.type_v)
            why = f"KV cache {KV_Q4}: a quarter of {KV_DEFAULT}, some quality loss; nothing else fits"
            self._pulled(f"kv {KV_Q4}", before, got, f"{c.type_k} → {KV_Q4}", why)
        return self._relax(got, min_ctx, keep_kv=True) if self.shortfall(got) == 0 else got

    def _grow_ctx(self, c: Config, want: int) -> Config:
        while c.n_ctx + 256 <= kv_cells(want) and self.shortfall(replace(c, n_ctx=c.n_ctx + 256)) == 0:
            c = replace(c, n_ctx=c.n_ctx + 256)
        return c

    # --- facts the search starts from --------------------------------------------------------
    def _kv_tokens(self, per_image: int) -> int:
        """What one image keeps in the context (after merging, when merging says how much)."""
        if per_image and self.wishes.merge != "off":
            return MergeSpec.parse(self.wishes.merge).target(per_image) or per_image
        return per_image

    def _image_budget(self) -> int:
        p, w = self.proj, self.wishes
        if p is None:
            return 0
        n, reasons = image_budget(p, w.image_tokens)
        self.reasons.extend(reasons)
        kept = self._kv_tokens(n)
        if kept != n:
            self.reasons.append(
                f"--merge {w.merge}: an image keeps {kept} of its {n} tokens in context "
                f"(the encoder still sees all of them)"
            )
        return n

    def _kv_choices(self, fa: bool) -> list[str]:
        w, t = self.wishes, self.text
        if w.kv != "auto":
            if is_quantized(w.kv) and t.head_dim % 32:
                self.reasons.append(f"KV {w.kv} needs head_dim divisible by 32 (this model: {t.head_dim})")
            if is_quantized(w.kv) and not fa:
                self.reasons.append(f"KV {w.kv} needs flash attention for V; flash attention is off")
            return [w.kv]
        out = [KV_DEFAULT]
        if t.head_dim % 32 == 0 and fa:
            out += [k for k in KV_CHOICES if is_quantized(k)]
        return out

    def _host_budget_reason(self) -> None:
        h, w = self.host, self.wishes
        self.reasons.append(
            f"{h.name} budget {format_size(self.budgets[-1])}: {format_size(h.usable_bytes)} free − "
            f"{format_size(w.host_reserve)} kept for the process (--host-reserve) − "
            + (
                f"{format_size(w.host_allowance)} for requests in flight (--host-allowance) − "
                if w.host_allowance
                else ""
            )
            + (f"{format_size(w.cache_ram)} for idle conversations (--cache-ram) − " if w.cache_ram else "")
            + f"{self.margin(h):.0%} margin"
        )

    def _offload_notes(self, c: Config) -> list[str]:
        """What llama.cpp does on the host when layers are on a GPU, in the user's terms."""
        if not self.gpus or c.ngl <= 0:
            return []
        g = self.gpus[0]
        out = []
        if g.host_buffer:
            out.append(f"the CPU's compute buffer is {g.host_buffer} (pinned host memory), planned against RAM")
        kept = [w.name.replace("(tied)", " (tied to token_embd)") for w in self.tensors.tensors
                if w.layer >= 0 and device_refuses(w, g)]  # fmt: skip
        if kept and c.ngl > self.text.n_layer:
            out.append(
                f"{', '.join(kept)} stay{'s' if len(kept) == 1 else ''} on the host: {g.name} takes tensors up to "
                f"{format_size(g.max_tensor)}, so the logits are computed there (a larger micro-batch costs RAM)"
            )
        if c.ngl <= self.text.n_layer and self.repack and g.host_buffer:
            out.append(
                f"the host's layers stay in the model file's mapped pages, not repacked for the CPU: with a GPU in "
                f"the model llama.cpp offers them {g.host_buffer} first, and {g.name} multiplies them for large "
                "batches (op offload: their weights are copied up into its compute buffer)"
            )
        return out

    def _audio_notes(self, c: Config) -> list[str]:
        """The audio encoder: its own compute buffer, or why it is not counted."""
        a = self.proj.audio if self.proj is not None else None
        if a is None:
            return []
        why = refusal(a)
        if why is not None:
            return [f"audio not planned: {why}"]
        return [
            f"audio encoder ({a.projector_type}, {a.n_layer} block(s) of {a.n_embd}): a compute buffer of its own, "
            f"{format_size(self.audio_bytes(c))} on {'the GPU' if c.mmproj_gpu and self.gpus else 'the CPU'} "
            f"for a 30 s window (every window's size, whatever the recording's length); "
            f"{ContextBudget(kv_cells(c.n_ctx)).images_that_fit(window_tokens(a), self.wishes.reply_tokens)} "
            f"window(s) of {window_tokens(a)} tokens fit in the context beside the reply"
        ]

    def _summary(self, c: Config) -> str:
        return (
            f"ctx {kv_cells(c.n_ctx)}, KV {c.type_k}{'' if c.offload_kqv or not self.gpus else ' on the host'}, "
            f"micro-batch {c.n_ubatch}, "
            f"{c.ngl}/{self.text.n_layer + 1} layers on GPU, encoder on {'GPU' if c.mmproj_gpu else 'CPU'}"
        )

    def _finish(self, c: Config, fits: bool = True) -> Plan:
        reasons = self.reasons
        preds = (
            self.predict(c)
            if (not is_quantized(c.type_v) or c.flash_attn)
            else self.predict(replace(c, type_v=KV_DEFAULT))
        )
        devs = []
        for d, b, budget in zip(list(self.gpus) + [self.host], preds, self.budgets, strict=True):
            devs.append(DevicePlan(d.name, d.kind, d.free_bytes, d.total_bytes, budget, d.free_known, b))
        reasons.extend(self.probe.notes)
        reasons.extend(self._offload_notes(c))
        per_image = self._kv_tokens(c.image_tokens)
        rule = ContextBudget(kv_cells(c.n_ctx))
        max_images = rule.images_that_fit(per_image, self.wishes.reply_tokens)
        if self.proj is None or self.proj.has_vision_encoder:  # (an audio-only one: its windows, below)
            reasons.append(
                f"{max_images} image(s) of {per_image} tokens fit in the context with "
                f"{rule.text_room} tokens kept for text and "
                f"{rule.reply_reserve(self.wishes.reply_tokens)} for the reply"
            )
        reasons.extend(self._audio_notes(c))
        for dv in devs:
            reasons.append(
                f"{dv.name}: {format_size(dv.predicted.total)} predicted of "
                f"{format_size(dv.budget_bytes)} budget ({format_size(dv.headroom_bytes)} headroom)"
            )
        refusal = (
            None
            if fits
            else next((r for r in reversed(reasons) if r.startswith(("does not fit", "cannot run"))), "does not fit")
        )
        return Plan(
            refusal=refusal,
            model=self.text.path,
            mmproj=self.proj.path if self.proj else "",
            n_gpu_layers=c.ngl,
            n_ctx=kv_cells(c.n_ctx),
            n_batch=c.n_batch,
            n_ubatch=c.n_ubatch,
            type_k=c.type_k,
            type_v=c.type_v,
            flash_attn=c.flash_attn,
            offload_kqv=c.offload_kqv,
            mmproj_on_gpu=c.mmproj_gpu,
            image_max_tokens=c.image_tokens or 0,
            max_images_in_context=max_images,
            devices=tuple(devs),
            reasons=tuple(reasons),
            fits=fits,
            shortfall_bytes=0 if fits and not refusal else self.shortfall(c),
            repack=self.repack,
            levers=tuple(self.steps),
            mtmd_image_limit=self.proj is None or facts(self.proj).dynamic,
            host_reserve=self.wishes.host_reserve,
            host_allowance=self.wishes.host_allowance,
            cache_ram=self.wishes.cache_ram,
            sequences=self.wishes.sequences,
            audio_encoder=self.audio.projector_type if self.audio is not None else "",
            audio_encoder_bytes=self.audio_bytes(c),
            options=tuple(self.options),
            prices=self.priced_by.label if self.priced_by is not None else "",
        )


def image_budget(p: ProjectorInfo, image_tokens: int | None = None) -> tuple[int, list[str]]:
    """The largest image a plan counts (tokens per picture) before memory has a say, and why:
    ``--image-tokens`` as asked (a fixed-size encoder rounds it to whole views), else the
    projector's default — ``DEFAULT_DYNAMIC_IMAGE_TOKENS`` for dynamic resolution, one view for a
    fixed-size encoder, the most tiles for a tiled one. ``chat``, ``serve``, ``caption`` and
    ``budget`` all start from it; the plan may lower a dynamic budget to fit memory."""
    reasons: list[str] = []
    if not p.has_vision_encoder:
        return 0, [f"no image budget: the projector has no vision encoder ({p.projector_type}, audio only)"]
    if facts(p).dynamic:
        n = image_tokens or DEFAULT_DYNAMIC_IMAGE_TOKENS
        reasons.append(
            f"image budget {n} tokens per image "
            f"({'as asked' if image_tokens else 'default for dynamic-resolution models'}); "
            f"the encoder is counted at that largest image"
        )
        return n, reasons
    per_view = view_tokens(p)
    if facts(p).kind == "tiled":
        n = largest_image_tokens(p, image_tokens or 10**6)
        kind = "tiled: tiles + overview"
    elif image_tokens and image_tokens >= 2 * per_view:
        n = image_tokens // per_view * per_view  # AnyRes: global view + tiles
        kind = f"fixed size: global view + {n // per_view - 1} tile(s) of {per_view}"
    else:
        n = per_view
        kind = "fixed size"
    if image_tokens and image_tokens < per_view:
        reasons.append(f"--image-tokens {image_tokens} is below this projector's {per_view} per view")
    reasons.append(f"image budget {n} tokens per image ({p.projector_type}, {kind})")
    return n, reasons


CHECK_ROUNDS = 3


def make_plan(model: str, mmproj: str | None, probe: Probe, wishes: Wishes | None = None, check: bool = True) -> Plan:
    """The plan for a model pair on ``probe``'s devices. With layers on a GPU and the model file
    here, the plan's compute buffers are then set against llama.cpp's own dry run of it
    (``plan.check``, a tenth of a second, nothing allocated); where llama.cpp reserves more than
    the replay of its scheduler counted, the plan counts that much more on that device for every
    configuration and searches again (``check=False``: the replay alone)."""
    planner = Planner(read_gguf(model), read_gguf(mmproj) if mmproj else None, probe, wishes or Wishes())
    p = planner.plan()
    if not check or not p.fits or p.n_gpu_layers == 0 or not can_check(model, [g.name for g in planner.gpus]):
        return p
    learned: list[str] = []
    try:
        rows = check_plan(p)
        for _ in range(CHECK_ROUNDS):
            under = learn(planner.compute_scale, rows)
            if not under:
                break
            learned += [
                f"{r.device} compute: llama.cpp's dry run reserves {format_size(r.reserved)} where the replay of "
                f"its scheduler counted {format_size(r.predicted)}; the plan counts "
                f"×{planner.compute_scale[r.device]:.2f} there for every configuration it tries"
                for r in under
            ]
            p = planner.plan()
            if not p.fits or p.n_gpu_layers == 0:
                return replace(p, reasons=(*p.reasons, *learned))
            rows = check_plan(p)
    except Exception as exc:  # the replay's plan stands; the check is a second opinion, never a gate
        return replace(p, reasons=(*p.reasons, *learned, f"llama.cpp's dry run could not check this plan ({exc})"))
    computes = [r for r in rows if r.buffer == "compute"]
    left = [r for r in computes if r.under]
    over = ", ".join(f"{r.device} {format_size(r.reserved - r.predicted)} over" for r in left)
    note = (
        f"compute buffers checked against llama.cpp's own dry run of the plan: {len(computes) - len(left)}/"
        f"{len(computes)} within it" + (f" ({over})" if over else "")
    )
    return replace(p, reasons=(*p.reasons, *learned, note))
