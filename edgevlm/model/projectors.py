"""Projector facts, in one table: what each mtmd projector type does with an image.

For every projector type edgevlm knows: its *kind* (``fixed``: one square view; ``tiled``: tiles
and an overview, each its own chunk; ``dynamic``: the size follows the image), its *positions*
(``1d``, or ``mrope``: an image advances the position by max(nx, ny)), whether its output tokens
lie on a spatial *grid* (visual token merging needs one), the *family* module in
``model.families`` whose token arithmetic covers it, and which *encoder graph* the planner
replays exactly (else a conservative bound is used). Every other module asks this table
(``facts``); nothing else keeps a list of projector types.

The arithmetic mirrors the vendored llama.cpp (``tools/mtmd/mtmd-image.cpp``, ``clip.cpp``) so
that it can be decided *before* the encoder runs. Tests compare it with mtmd's own counts
(``mtmd_input_chunk_get_n_tokens`` / ``_n_pos``). A projector type without arithmetic is counted
by mtmd itself once the projector is loaded (``ProjectorInfo.counter``, a placeholder bitmap
tokenized without encoding); before that, ``image_tokens`` says it cannot.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

from ..errors import UnsupportedModel
from .gguf_info import ProjectorInfo
from .tokens import ImageTokens, View, smart_resize

__all__ = [
    "DEFAULT_DYNAMIC_IMAGE_TOKENS",
    "encoder_patches",
    "facts",
    "image_tokens",
    "ImageTokens",
    "largest_image_tokens",
    "position_kind",
    "ProjectorFacts",
    "smart_resize",
    "token_bound",
    "View",
    "view_patches",
    "view_tokens",
]

# a dynamic-resolution encoder's picture when no budget is asked for (its default budget)
DEFAULT_DYNAMIC_IMAGE_TOKENS = 1024


@dataclass(frozen=True)
class ProjectorFacts:
    """What one projector type does with an image (see the module doc)."""

    kind: str  # "fixed" | "tiled" | "dynamic"
    positions: str = "1d"  # "1d" | "mrope"
    grid: bool = True  # output tokens on a 2-D grid (mergeable)
    family: str | None = None  # module in model.families with its token arithmetic
    encoder_graph: str | None = None  # the clip graph the planner replays exactly (None: a bound)
    merge: int = 1  # spatial merge of the output grid (dynamic: from the GGUF, default 2)
    non_causal: bool = False  # image tokens attend both ways: a chunk must fit one micro-batch

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"

    @property
    def arithmetic(self) -> bool:
        """edgevlm's Python token arithmetic covers it (before anything is loaded)."""
        return _arithmetic(self.family) is not None


@cache
def _arithmetic(family: str | None) -> Callable[..., ImageTokens] | None:
    if family is None:
        return None
    try:
        return importlib.import_module(f"{__package__}.families.{family}").image_tokens
    except (ImportError, AttributeError):
        return None


_MLP = ProjectorFacts("fixed", family="llava", encoder_graph="mlp")
PROJECTORS: dict[str, ProjectorFacts] = {
    "mlp": _MLP,
    "mlp_norm": _MLP,
    "ldp": ProjectorFacts("fixed", grid=False),
    "ldpv2": ProjectorFacts("fixed", grid=False),
    "resampler": ProjectorFacts("tiled", grid=False),  # MiniCPM-V 2.5/2.6: slices + overview
    "minicpmv": ProjectorFacts("tiled", grid=False, family="minicpmv", encoder_graph="minicpmv"),
    "idefics3": ProjectorFacts("tiled", family="idefics3", encoder_graph="idefics3"),
    # a chunk holds an [IMG_BREAK] embedding after each row: not a plain grid, not mergeable
    "pixtral": ProjectorFacts("dynamic", grid=False, family="pixtral", encoder_graph="pixtral"),
    "llama4": ProjectorFacts("tiled", grid=False),  # 336² tiles + a global view
    "gemma3": ProjectorFacts("fixed", non_causal=True, family="gemma3", encoder_graph="gemma3"),
    "internvl": ProjectorFacts("tiled", family="internvl", encoder_graph="internvl"),
    "qwen2vl_merger": ProjectorFacts("dynamic", "mrope", family="qwen", encoder_graph="qwen2vl_merger", merge=2),
    "qwen2.5vl_merger": ProjectorFacts("dynamic", "mrope", family="qwen", encoder_graph="qwen2.5vl_merger", merge=2),
    "qwen3vl_merger": ProjectorFacts("dynamic", "mrope", family="qwen3vl", encoder_graph="qwen3vl_merger", merge=2),
}


def facts(proj: ProjectorInfo | str) -> ProjectorFacts:
    """The table's row for a projector (a LLaVA ``mlp`` with pinpoints is ``tiled``); an
    unknown type gets a conservative row: fixed size, 1-D positions, no grid, no arithmetic."""
    ptype = proj if isinstance(proj, str) else proj.projector_type
    row = PROJECTORS.get(ptype, ProjectorFacts("fixed", grid=False))
    if not isinstance(proj, str):
        if row.kind == "fixed" and proj.image_grid_pinpoints:  # mtmd tiles by the pinpoints
            row = replace(row, kind="tiled")
        if row.dynamic and proj.spatial_merge_size:
            row = replace(row, merge=int(proj.spatial_merge_size))
    return row


def position_kind(projector_type: str) -> str:
    return facts(projector_type).positions


def view_patches(proj: ProjectorInfo) -> int:
    """Patches of one fixed-size view (336/14 → 576): what a fixed or tiled view costs."""
    return (proj.image_size // proj.patch_size) ** 2


def encoder_patches(proj: ProjectorInfo, tokens: int) -> int:
    """Patches the encoder sees for one chunk of ``tokens`` output tokens: a dynamic encoder
    sees merge² patches per token, a fixed one always its whole view."""
    f = facts(proj)
    return tokens * f.merge * f.merge if f.dynamic else view_patches(proj)


def view_tokens(proj: ProjectorInfo) -> int:
    """Tokens of one view (a fixed encoder's image, a tiled one's overview or tile): from the
    family's arithmetic, else mtmd's count once loaded, else the bound (patches, no pooling)."""
    s = proj.image_size
    if _arithmetic(facts(proj).family) is not None or proj.counter is not None:
        return image_tokens(proj, s, s).views[-1].n_tokens
    return view_patches(proj)


def token_bound(proj: ProjectorInfo) -> int:
    """The most tokens one image can cost, from the GGUF alone — for projector types edgevlm has
    no arithmetic for, before mtmd is loaded (the planner reserves this much; never under what
    mtmd makes): dynamic kinds, ``clip.vision.image_max_pixels`` (else mtmd's 4096-token default
    area) over the patch area, one token per patch before any merge plus a break token per row;
    fixed and tiled kinds, one token per patch of each view (pooling and pixel shuffle only
    reduce it), times the view limit the GGUF states (``clip.vision.max_tiles`` or
    ``clip.minicpmv_max_slice_nums``, ``clip.vision.preproc_max_tiles``, + the overview), else
    10 views for a tiled kind or a type the table does not know."""
    f = facts(proj)
    p = proj.patch_size
    if f.dynamic:
        area = proj.image_max_pixels or 4096 * (p * max(f.merge, 1)) ** 2
        side = int(area**0.5) // p + 1
        return (area // (p * p)) + side
    views = 1
    if f.kind == "tiled" or proj.projector_type not in PROJECTORS:  # an unknown type may tile
        limit = (
            proj.meta.get("clip.vision.preproc_max_tiles")
            or proj.meta.get("clip.vision.max_tiles")
            or proj.meta.get("clip.minicpmv_max_slice_nums")
        )
        views = int(limit) + 1 if limit else 10
    return view_patches(proj) * views


def largest_image_tokens(proj: ProjectorInfo, budget: int) -> int:
    """Tokens of the largest image a per-image ``budget`` admits (all chunks)."""
    f = facts(proj)
    if f.dynamic:
        return budget
    if _arithmetic(f.family) is None and proj.counter is None:
        return min(budget, token_bound(proj))
    per = view_tokens(proj)
    if f.kind == "tiled":
        return max(per, min(budget, image_tokens(proj, 10**4, 10**4).n_tokens) // per * per)
    return image_tokens(proj, proj.image_size, proj.image_size).n_tokens


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    """Tokens and positions mtmd will produce for a ``width``×``height`` image: edgevlm's
    arithmetic for the projector's family, else mtmd's own count when the projector is loaded
    (``proj.counter``)."""
    if width <= 0 or height <= 0:
        raise UnsupportedModel(f"an image of {width}x{height} pixels has no tokens (sides must be positive)")
    f = facts(proj)
    count = _arithmetic(f.family)
    if count is not None:
        return count(proj, width, height, min_tokens, max_tokens)
    if proj.counter is not None:
        return proj.counter(width, height, min_tokens, max_tokens)
    raise UnsupportedModel(
        f"{proj.path or 'projector'}: image token counts for projector type "
        f"'{proj.projector_type}' are not known to edgevlm yet (they are once the projector is loaded)"
    )
