"""Video under a token budget: which frames of a clip the model sees, at what size, and what they
cost — decided before anything is encoded, with the same exact arithmetic as pictures
(``model.projectors.image_tokens``: edgevlm's counts checked against mtmd, or mtmd's own).

Decoding is a stream (PyAV for MP4/WebM/MOV/MKV/AVI, Pillow for animated GIF/WebP) in two passes,
and never holds more than a few frames:

1. **Candidates.** Timestamps at ``min(--fps, the clip's own rate)`` over the clip, at most
   ``MAX_CANDIDATES`` (a longer clip is sampled evenly instead). Each candidate becomes a 32×32
   colour thumbnail and is compared with the last *distinct* one (``frame_difference``: the mean
   absolute difference, 0..1, or the share of pixels clearly changed when larger, so a small
   moving object counts): below ``VideoBudget.similar`` it is a near-duplicate and skipped, so
   a static shot costs one frame. A mean difference of ``SCENE_CUT`` or more from the previous
   candidate marks a scene cut.
   Frames are read forward; once the keyframe spacing is known, a candidate further away than it
   is reached by seeking, and the keyframe a seek lands on stands for the candidate when it lies
   within half the candidates' spacing (its own time is the label): a long clip sampled sparsely
   costs about one decoded frame per candidate, not the whole clip.
2. **Frames × tokens per frame, jointly.** With B tokens for the clip (``min(budget, room)``) and
   N distinct candidates, the rule is *more frames first, then resolution*: the most frames k
   (≤ N, ≤ ``max_frames``) such that each still gets ``floor`` tokens — ``MIN_FRAME_TOKENS``
   (64), or less when a whole frame costs less, never under the projector's minimum — and then
   the largest frame size (aspect kept, never upscaled, never over the per-picture budget the
   encoder memory was planned for: ``image_budget_tokens``) with k × tokens(size) ≤ B; a frame is
   then handed over no larger than ``COMPACT_VIEWS`` encoder views in pixels when mtmd makes the
   same chunks of it (``compact_view``'s test). For a fixed-size encoder (LLaVA-1.5:
   576 tokens whatever the size) only the count is free: k = B // 576. For a tiled one the floor
   is its smallest picture (overview only; SmolVLM's aspect-fixed tiling). ``VideoPlan.rule``
   says which case applied and what bound k.
3. **Which k.** Scene cuts first (the opening frame counts as one), strongest first; then the
   clip is cut into k equal stretches of time and each stretch still without a frame gives its
   most different one (largest difference from its distinct neighbours), so the frames spread
   over the clip and each shows its stretch's most eventful moment; the chosen frames go to the
   model in time order, each after its timestamp as text (``[0:12.5]``).
4. **Temporal merging (Qwen2-VL, 2.5-VL, 3-VL): opt-in.** mtmd merges two *mergeable* bitmaps
   of the same size whose markers are adjacent (no text between, not even a newline) into one
   chunk of one frame's tokens and positions; 5 adjacent give 3 chunks; anything else is one
   chunk per frame (checked through the bindings with placeholder bitmaps:
   ``tests/test_video.py``). By default (``VideoBudget.merge`` False) every frame is planned as
   its own chunk, which is what a prompt with a label before each frame gets. With
   ``merge=True`` such projectors get frames in pairs — a scene cut starts a new pair, so two
   scenes are never fused into one temporal patch — and a pair costs one frame's tokens (counted
   on its first frame, 0 on its second); the caller must then send each pair as the plan says:
   ``VideoPlan.groups()``/``prompt()`` (one label per pair, markers adjacent) and
   ``mtmd_bitmap_set_mergeable`` on each frame whose ``PlannedFrame.mergeable`` is set, or mtmd
   makes two chunks of the pair and the clip costs more than planned.

Then the kept frames alone are decoded again (seeking to each) straight at their planned size.
A clip too short to have a frame, or not a clip, is an ``InputError``; a budget below one frame
is one too (``ContextExceeded`` when the room, not the budget, is what is short).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import numpy as np

from ..errors import ContextExceeded, EdgeVLMError, InputError
from ..model.gguf_info import ProjectorInfo
from ..model.projectors import facts
from . import framecost
from .clipread import VIDEO_EXTS, decode_bytes_of, is_video_file, is_video_path, looks_like_video, one_line, open_clip
from .framecost import DEFAULT_VIDEO_PICTURES, FrameCosts, aspect_kept, best_size, compact_size, default_video_tokens
from .images import LoadedImage, from_rgb

__all__ = [
    "FRAME_TEXT",
    "FRAME_TEXT_MARGIN",
    "DEFAULT_VIDEO_PICTURES",
    "MAX_CANDIDATES",
    "MERGE_PROJECTORS",
    "MIN_FRAME_TOKENS",
    "PlannedFrame",
    "SCENE_CUT",
    "VIDEO_EXTS",
    "VideoBudget",
    "VideoPlan",
    "default_video_tokens",
    "format_timestamp",
    "frame_difference",
    "frame_text_tokens",
    "is_video_file",
    "is_video_path",
    "looks_like_video",
    "plan_video",
]

MAX_CANDIDATES = 300  # candidate timestamps looked at, whatever the clip's length
SIMILAR = 0.02  # difference (0..1, ``frame_difference``) under which a frame repeats the last distinct one
CHANGED = 0.1  # a thumbnail pixel whose grey level moved this much (0..1) has changed
SCENE_CUT = 0.15  # mean |Δ| from the previous candidate that marks a cut
MIN_FRAME_TOKENS = 64  # the floor a frame keeps before more frames are preferred to sharper ones
COMPACT_VIEWS = 4  # frames are kept at most this many encoder views in pixels when mtmd counts the same
# projectors whose encoder merges two consecutive frames into one chunk (temporal patch of 2)
# the text the prompt puts beside each frame (``chat_format.user_content``: "label: <marker>\n"),
# at the widest label of a clip under an hour, with a token of margin for the tokenizer's joins
FRAME_TEXT = "[00:00.0]: \n"
FRAME_TEXT_MARGIN = 1
MERGE_PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")


def frame_text_tokens(tokenize: Callable[[str], list[int]]) -> int:
    """What each frame's label and newline take in the prompt, for ``plan_video(frame_text=)``,
    with the model's tokenizer."""
    return len(tokenize(FRAME_TEXT)) + FRAME_TEXT_MARGIN


def format_timestamp(t: float) -> str:
    """``[m:ss.s]`` (``[h:mm:ss.s]`` from an hour): the text put before a frame."""
    tenths = max(0, int(t * 10 + 0.5))
    minutes, rest = divmod(tenths, 600)
    sec = f"{rest // 10:02d}.{rest % 10}"
    if minutes >= 60:
        return f"[{minutes // 60}:{minutes % 60:02d}:{sec}]"
    return f"[{minutes}:{sec}]"


@dataclass(frozen=True)
class VideoBudget:
    """How a clip is budgeted: the whole clip's tokens (None: the caller's ``room`` decides), a
    cap on frames, a cap on frames per second (not a promise: llama.cpp's own sampling is a fixed
    4 fps), the near-duplicate threshold (``frame_difference`` of 32×32 grey thumbnails, 0..1), and whether
    Qwen-style encoders get frames in mergeable pairs (off by default: see the module doc for
    what the caller must then do)."""

    tokens: int | None = None
    max_frames: int | None = None
    fps: float = 4.0
    similar: float = SIMILAR
    merge: bool = False


@dataclass(frozen=True)
class PlannedFrame:
    t: float  # seconds from the clip's start
    size: tuple[int, int]  # pixels handed to mtmd (the planned size; kept frames only matter)
    # its cost (exact, projectors.image_tokens); a merged pair's tokens are counted on its first
    # frame and 0 on its second; 0 for a frame not kept
    tokens: int
    kept: bool
    reason: str  # "kept" | "scene cut" (kept) | "similar" | "over budget" | "max frames"
    label: str  # the timestamp text put before the frame, e.g. "[0:12.5]"
    index: int = 0  # candidate number (0-based, in time order)
    diff: float = 0.0  # frame_difference from the last distinct candidate (0..1; 1.0 for the first)
    # True on both frames of a merged pair: mtmd_bitmap_set_mergeable, markers adjacent
    mergeable: bool = False


@dataclass(frozen=True)
class VideoPlan:
    duration: float
    width: int
    height: int
    source_fps: float
    frames: list[PlannedFrame]  # every candidate looked at, kept or not, in time order
    total_tokens: int  # kept frames only
    budget: int  # the token budget applied
    rule: str  # how frame count × tokens per frame was chosen, in words
    notes: tuple[str, ...] = ()
    projector_type: str = ""
    frame_size: tuple[int, int] = (0, 0)  # the size every kept frame is sent at
    merge: bool = False  # frames go in mergeable pairs (Qwen temporal merge)
    sample_fps: float = 0.0  # rate the candidates were taken at

    @property
    def kept(self) -> list[PlannedFrame]:
        return [f for f in self.frames if f.kept]

    @property
    def labels(self) -> list[str]:
        return [f.label for f in self.kept]

    def groups(self) -> list[tuple[str, list[int]]]:
        """(label, indexes into ``kept``) per mtmd chunk, in order: a merged pair is one group
        (its first frame's label; the two markers go adjacent), any other frame its own."""
        out: list[tuple[str, list[int]]] = []
        kept = self.kept
        i = 0
        while i < len(kept):
            if kept[i].mergeable and i + 1 < len(kept) and kept[i + 1].mergeable:
                out.append((kept[i].label, [i, i + 1]))
                i += 2
            else:
                out.append((kept[i].label, [i]))
                i += 1
        return out

    def prompt(self, marker: str, sep: str = "\n") -> str:
        """The clip's part of a prompt: each group's label, a space, its markers (adjacent), then
        ``sep`` — what mtmd counts as ``total_tokens`` of image tokens."""
        return "".join(f"{label} {marker * len(idx)}{sep}" for label, idx in self.groups())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["frames"] = [dict(asdict(f), size=list(f.size)) for f in self.frames]
        d["frame_size"] = list(self.frame_size)
        d["notes"] = list(self.notes)
        d["labels"] = self.labels
        d["kept_frames"] = len(self.kept)
        return d


# --- planning -----------------------------------------------------------------------------


@dataclass
class _Candidate:
    index: int
    t: float
    key: Any
    diff: float  # from the last distinct candidate
    diff_prev: float  # from the previous candidate
    distinct: bool
    cut: bool
    novelty: float = 0.0
    reason: str = ""
    chosen: bool = False


def frame_difference(a: np.ndarray, b: np.ndarray) -> float:
    """How different two colour thumbnails (0..1) are, 0..1: the mean absolute difference, or the
    share of pixel values that changed by ``CHANGED`` or more when that is larger — a small object
    moving over a still scene (a 200-px square on 1080p) changes the mean by under 1% but a few
    percent of the pixels clearly. Each thumbnail pixel is the area average of a block of the
    frame (20×11 pixels at 640×360), as the eye sees it from afar: a codec's noise, small and of
    either sign from pixel to pixel, averages away there, so a still clip stays one frame after
    lossy coding (a busy still through libx264 at crf 51, a keyframe every 4 frames: 0.0103 at
    most, half of ``SIMILAR``; tests/test_video.py). A moving object counts from about 1% of
    the picture (a 48-px square at 640×360 does, a 32-px one does not)."""
    d = np.abs(a - b)
    return max(float(d.mean()), float((d >= CHANGED).mean()))


def _sample_times(duration: float, src_fps: float, cap: float) -> tuple[list[float], float]:
    rate = min(cap, src_fps) if src_fps > 0 else cap
    n = max(1, math.ceil(duration * rate - 1e-9))
    if n > MAX_CANDIDATES:
        n = MAX_CANDIDATES
        rate = n / duration
    return [i / rate for i in range(n)], rate


def _choose(distinct: list[_Candidate], k: int, duration: float) -> None:
    """Mark ``k`` of the distinct candidates chosen: scene cuts (the opening frame one of them),
    strongest first; then the clip is cut into k equal stretches of time and each stretch without
    a frame yet gives its most different frame (difference from its distinct neighbours), the
    most different stretches first; stretches with nothing distinct left (a static shot) leave
    the rest to the frames most different and furthest in time from those chosen."""
    if k >= len(distinct):
        for c in distinct:
            c.chosen = True
        return
    for i, c in enumerate(distinct):
        after = distinct[i + 1].diff if i + 1 < len(distinct) else 0.0
        c.novelty = max(c.diff if i else 0.0, after, 1e-6)
    cuts = sorted((c for c in distinct if c.cut or c is distinct[0]), key=lambda c: (-c.diff_prev, c.t))
    chosen: list[_Candidate] = []
    for c in cuts[:k]:
        c.chosen = True
        chosen.append(c)
    width = duration / k if duration > 0 else 1.0

    def stretch(c: _Candidate) -> int:
        return min(k - 1, int(c.t / width))

    covered = {stretch(c) for c in chosen}
    best: dict[int, _Candidate] = {}
    for c in distinct:
        s = stretch(c)
        if not c.chosen and s not in covered and (s not in best or c.novelty > best[s].novelty):
            best[s] = c
    for c in sorted(best.values(), key=lambda c: (-c.novelty, c.t))[: k - len(chosen)]:
        c.chosen = True
        chosen.append(c)
    while len(chosen) < k:
        pick, pick_score = None, -1.0
        for c in distinct:
            if c.chosen:
                continue
            gap = min(abs(c.t - o.t) for o in chosen)
            score = c.novelty * min(1.0, gap / width)
            if score > pick_score:
                pick, pick_score = c, score
        assert pick is not None
        pick.chosen = True
        chosen.append(pick)


def _pairs(chosen: list[_Candidate], merge: bool, at_cuts: bool) -> list[list[int]]:
    """The chosen frames (indexes) in mtmd chunks: consecutive pairs when merging, a scene cut
    starting a new pair when ``at_cuts`` (two scenes are not fused into one temporal patch)."""
    out: list[list[int]] = []
    i, n = 0, len(chosen)
    while i < n:
        if merge and i + 1 < n and not (at_cuts and chosen[i + 1].cut):
            out.append([i, i + 1])
            i += 2
        else:
            out.append([i])
            i += 1
    return out


def _choose_count(
    costs: FrameCosts,
    w: int,
    h: int,
    n_distinct: int,
    max_frames: int | None,
    budget: int,
    per_frame: int,
    unit: int,
) -> tuple[int, tuple[int, int] | None, int, str]:
    """(frames k, size, floor, what bound k): the most frames whose chunks each keep ``floor``
    tokens, then the largest size k frames fit at (k = 0 and the smallest frame's tokens in
    place of the floor when not even one frame fits)."""

    def best(limit: int) -> tuple[int, int] | None:
        return best_size(costs, w, h, limit, per_frame)

    full = best(budget + per_frame + costs.overhead)  # (the per-picture cap bounds its image tokens)
    t_full = costs.tokens(*full) if full else costs.tokens(w, h)
    scaled = [(max(1, round(w / d)), max(1, round(h / d))) for d in (1, 2, 4, 8, 16, 32, 64)]
    t_min = min(costs.tokens(a, b) for a, b in scaled if aspect_kept(w, h, a, b))
    floor = max(t_min, min(MIN_FRAME_TOKENS, t_full))

    def chunks(k: int) -> int:
        return -(-k // unit)

    def ok(k: int) -> bool:
        s = best(budget // chunks(k))
        return s is not None and (k == 1 or costs.tokens(*s) >= floor)

    hi = min(n_distinct, max_frames or n_distinct)
    if hi < 1 or not ok(1):
        return 0, None, t_min, "budget"
    lo = 1
    while lo < hi:  # the largest k that ok (monotone: more frames, less per chunk)
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    k = lo
    if k == n_distinct:
        bound = "distinct"
    elif max_frames is not None and k == max_frames:
        bound = "max_frames"
    else:
        bound = "budget"
    return k, best(budget // chunks(k)), floor, bound


def _too_small(
    name: str,
    proj: ProjectorInfo,
    budget: int,
    room: int | None,
    costs: FrameCosts,
    w: int,
    h: int,
    per_picture: int,
    unit: int,
) -> NoReturn:
    smallest = _choose_count(costs, w, h, 1, 1, budget, per_picture, unit)[2]
    if smallest <= budget:  # the clip's budget holds a frame: the per-picture budget is what none fits
        raise InputError(
            f"{name}: the per-picture budget of {per_picture} tokens (--image-tokens) is below what one frame "
            f"costs with {proj.projector_type}"
        )
    err = ContextExceeded if room is not None and room == budget else InputError
    raise err(
        f"{name}: a budget of {budget} tokens is below one frame "
        f"({smallest} tokens at least with {proj.projector_type})"
    )


def plan_video(
    source: str | bytes | os.PathLike[str],
    proj: ProjectorInfo,
    budget: VideoBudget,
    room: int | None = None,
    image_budget_tokens: int | None = None,
    name: str = "video",
    mtmd_max_tokens: int | None = None,
    frame_text: int = 0,
    max_pixels: int | None = None,
    hold: Callable[[int], None] | None = None,
) -> tuple[VideoPlan, list[LoadedImage]]:
    """Choose a clip's frames and their size under a token budget; decode only those.

    ``source``: a path or the file's bytes. ``room``: the tokens the context has left for the clip
    (the plan never exceeds ``min(budget.tokens, room)``). ``image_budget_tokens``: the
    per-picture budget the encoder memory was planned for (no frame costs more; default: the
    projector's). ``mtmd_max_tokens``: mtmd's own image_max_tokens when it differs from that
    budget (a dynamic projector's count follows it; default: ``image_budget_tokens`` for
    dynamic projectors, as ``edgevlm budget`` and the plan set it). ``frame_text``: the tokens
    each frame's label and newline take in the prompt (``FRAME_TEXT`` tokenized): counted against
    the budget with the frame, so a clip's whole footprint stays within the room.
    ``max_pixels``: frames larger than this are refused (``--max-pixels``, as for pictures).
    ``hold(nbytes)``: called once the size is known and before any frame is decoded, with the
    host memory decoding will take at its peak (``clipread.decode_bytes_of``): a server leases it.

    Returns the plan and the kept frames (``LoadedImage``, ``source=name``), in time order, at
    their planned size. A file that is not a readable clip is an ``InputError`` naming it.
    """
    if not isinstance(source, bytes):
        source = os.fspath(source)
        if not source:
            raise InputError(f"{name}: no video given")
    if budget.fps <= 0:
        raise InputError(f"{name}: --fps must be positive (got {budget.fps})")
    if budget.max_frames is not None and budget.max_frames < 1:
        raise InputError(f"{name}: --max-frames must be at least 1 (got {budget.max_frames})")
    kind = facts(proj).kind
    per_picture = framecost.per_picture(proj, image_budget_tokens)
    notes: list[str] = []
    limits = [x for x in (budget.tokens, room) if x is not None]
    if limits:
        total_budget = min(limits)
        if room is not None and (budget.tokens is None or room < budget.tokens):
            notes.append(f"budget {room} tokens: the room left in the context")
    else:
        total_budget = DEFAULT_VIDEO_PICTURES * per_picture
        notes.append(
            f"budget {total_budget} tokens: {DEFAULT_VIDEO_PICTURES} pictures of {per_picture} "
            "(no budget or room given)"
        )
    if total_budget <= 0:
        raise ContextExceeded(f"{name}: no room left in the context for a clip ({total_budget} tokens)")
    cap = mtmd_max_tokens if mtmd_max_tokens is not None else (per_picture if kind == "dynamic" else None)
    costs = FrameCosts(proj, cap, frame_text)
    merge = budget.merge and proj.projector_type in MERGE_PROJECTORS
    unit = 2 if merge else 1

    clip = open_clip(source, name, max_pixels)
    try:
        if hold is not None:
            hold(decode_bytes_of(clip))
        w, h = clip.width, clip.height
        if _choose_count(costs, w, h, 1, 1, total_budget, per_picture, unit)[0] == 0:
            _too_small(name, proj, total_budget, room, costs, w, h, per_picture, unit)
        times, rate = _sample_times(clip.duration, clip.fps, budget.fps)
        if rate < min(budget.fps, clip.fps or budget.fps) - 1e-9:
            notes.append(
                f"long clip: candidates every {1 / rate:.1f} s ({MAX_CANDIDATES} at most), "
                f"not {min(budget.fps, clip.fps):g} per second"
            )
        cands: list[_Candidate] = []
        last_distinct: np.ndarray | None = None
        prev: np.ndarray | None = None
        for i, (ft, key, thumb) in enumerate(clip.scan(times)):
            diff = 1.0 if last_distinct is None else frame_difference(thumb, last_distinct)
            dprev = 1.0 if prev is None else float(np.abs(thumb - prev).mean())
            new = last_distinct is None or diff >= budget.similar
            cands.append(_Candidate(i, ft, key, diff, dprev, new, prev is not None and dprev >= SCENE_CUT))
            prev = thumb
            if new:
                last_distinct = thumb
        if not cands:
            raise InputError(f"{name}: no frame could be decoded (zero-length or damaged clip)")
        if cands[-1].t < times[-1] - max(1.0, 2.0 / rate):
            notes.append(f"the clip ends at {cands[-1].t:.1f} s, before the {clip.duration:.1f} s its header says")

        distinct = [c for c in cands if c.distinct]
        k, size, floor, bound = _choose_count(
            costs, w, h, len(distinct), budget.max_frames, total_budget, per_picture, unit
        )
        if k == 0 or size is None:
            _too_small(name, proj, total_budget, room, costs, w, h, per_picture, unit)
        _choose(distinct, k, clip.duration)
        chosen = [c for c in cands if c.chosen]
        groups = _pairs(chosen, merge, at_cuts=True)
        if len(groups) > -(-k // unit):  # pairs kept apart at cuts: more chunks, each smaller
            fitted = best_size(costs, w, h, total_budget // len(groups), per_picture)
            if fitted is not None and costs.tokens(*fitted) >= min(floor, costs.tokens(*size)):
                size = fitted
                notes.append(f"{len(groups) - -(-k // unit)} scene cut(s) start a new pair (one chunk more each)")
            else:
                groups = _pairs(chosen, merge, at_cuts=False)
        size = compact_size(costs, *size, max_pixels=COMPACT_VIEWS * proj.image_size**2)
        per_chunk = costs.image(*size)
        text = costs.tokens(*size) - per_chunk
        if text:
            notes.append(f"each frame's timestamp and the text around it: {text} tokens more (within the budget)")
        rule = _rule(
            kind,
            proj.projector_type,
            k,
            len(distinct),
            len(cands),
            size,
            per_chunk,
            floor,
            total_budget,
            bound,
            len(groups) if merge else 0,
        )
        if len(distinct) < len(cands):
            notes.append(
                f"{len(cands) - len(distinct)} near-duplicate frame(s) skipped (difference < {budget.similar})"
            )
        if any(len(g) == 2 for g in groups):
            notes.append(
                "temporal merge: frames go to mtmd in pairs (both bitmaps mergeable, markers adjacent, one "
                "label per pair): a pair costs one frame's tokens, counted on its first frame"
            )
        if size != (w, h):
            notes.append(f"frames resized {w}x{h} → {size[0]}x{size[1]} ({per_chunk} tokens each)")

        frames: list[PlannedFrame] = []
        pos = {id(c): n for n, c in enumerate(chosen)}
        first = {g[0] for g in groups}  # a chunk's tokens are counted on its first frame
        paired = {i for g in groups if len(g) == 2 for i in g}
        for c in cands:
            label = format_timestamp(c.t)
            if c.chosen:
                n = pos[id(c)]
                tokens = per_chunk if n in first else 0
                reason = "scene cut" if c.cut else "kept"
                frames.append(PlannedFrame(c.t, size, tokens, True, reason, label, c.index, c.diff, n in paired))
            else:
                if not c.distinct:
                    reason = "similar"
                elif bound == "max_frames":
                    reason = "max frames"
                else:
                    reason = "over budget"
                frames.append(PlannedFrame(c.t, size, 0, False, reason, label, c.index, c.diff))
        total = sum(f.tokens for f in frames)
        assert total <= total_budget, (total, total_budget)
        images: list[LoadedImage] = []
        for c, rgb in zip(chosen, clip.frames([c.key for c in chosen], size), strict=True):
            images.append(from_rgb(rgb, name, "video", (f"frame {format_timestamp(c.t)} of {name}",)))
    except EdgeVLMError:
        raise
    except Exception as exc:  # anything else FFmpeg or Pillow raise: one line, not a traceback
        raise InputError(f"{name}: unreadable video ({one_line(exc)})") from None
    finally:
        clip.close()
    plan = VideoPlan(
        duration=clip.duration,
        width=clip.width,
        height=clip.height,
        source_fps=clip.fps,
        frames=frames,
        total_tokens=total,
        budget=total_budget,
        rule=rule,
        notes=tuple(notes),
        projector_type=proj.projector_type,
        frame_size=size,
        merge=merge,
        sample_fps=rate,
    )
    return plan, images


def _rule(
    kind: str,
    ptype: str,
    k: int,
    n_distinct: int,
    n_cands: int,
    size: tuple[int, int],
    per_chunk: int,
    floor: int,
    budget: int,
    bound: str,
    merged_chunks: int,
) -> str:
    chunks = merged_chunks or k
    spent = f"{k} frame(s)" + (f" in {chunks} chunk(s) (pairs merged)" if merged_chunks else "")
    spent += f" of {per_chunk} tokens at {size[0]}x{size[1]} = {chunks * per_chunk} ≤ {budget}"
    why = {
        "distinct": f"all {n_distinct} distinct of {n_cands} candidates fit",
        "max_frames": "--max-frames caps the count",
        "budget": "the budget caps the count",
    }[bound]
    if kind == "fixed":
        return (
            f"fixed-size encoder ({ptype}): every frame costs {per_chunk} tokens whatever its size, so only the "
            f"count is chosen: {why}; {spent}"
        )
    what = "dynamic-resolution" if kind == "dynamic" else "tiled"
    return (
        f"{what} encoder ({ptype}): frames first, each keeping at least {floor} tokens, then resolution: {why}; {spent}"
    )
