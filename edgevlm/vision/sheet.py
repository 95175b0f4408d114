"""A contact sheet of the frames a clip's plan kept (``edgevlm budget CLIP --overlay``)."""

from __future__ import annotations

import math
from typing import cast

from ..errors import InputError
from .images import LoadedImage
from .video import VideoPlan

__all__ = ["draw_contact_sheet"]


def draw_contact_sheet(frames: list[LoadedImage], plan: VideoPlan, path: str, max_side: int = 2048) -> None:
    """A PNG grid of the kept frames with their timestamps and tokens (``budget --overlay``)."""
    from PIL import Image, ImageDraw, ImageFont

    kept = plan.kept
    n = max(1, len(frames))
    cols = max(1, math.ceil(math.sqrt(n * 1.5)))
    rows = math.ceil(n / cols)
    aspect = plan.height / plan.width if plan.width else 0.75
    pad = 4
    cell_w = max(64, min((max_side - pad) // cols - pad, max((f.width for f in frames), default=320) * 2))
    cell_h = max(32, int(cell_w * aspect))
    title_h = max(24, cell_w // 12)
    sheet = Image.new("RGB", (cols * (cell_w + pad) + pad, title_h + rows * (cell_h + pad) + pad), (24, 24, 24))
    draw = ImageDraw.Draw(sheet)
    font = cast(ImageFont.FreeTypeFont, ImageFont.load_default(size=max(11, cell_w // 16)))
    title = (
        f"{len(kept)} of {len(plan.frames)} candidate frames · {plan.total_tokens} / {plan.budget} tokens · "
        f"{plan.frame_size[0]}x{plan.frame_size[1]}" + (" · merged pairs" if plan.merge else "")
    )
    draw.text((pad * 2, pad), title, fill=(255, 255, 0), font=font)
    for n_img, (img, f) in enumerate(zip(frames, kept, strict=False)):
        r, c = divmod(n_img, cols)
        x0, y0 = pad + c * (cell_w + pad), title_h + pad + r * (cell_h + pad)
        thumb = Image.fromarray(img.rgb)
        thumb.thumbnail((cell_w, cell_h), Image.Resampling.BICUBIC)
        if thumb.size[0] < cell_w // 2:  # small frames are enlarged to be seen
            s = min(cell_w / thumb.size[0], cell_h / thumb.size[1])
            thumb = thumb.resize((max(1, int(thumb.size[0] * s)), max(1, int(thumb.size[1] * s))))
        sheet.paste(thumb, (x0 + (cell_w - thumb.size[0]) // 2, y0 + (cell_h - thumb.size[1]) // 2))
        colour = (255, 120, 60) if f.reason == "scene cut" else (120, 200, 255)
        if f.mergeable:
            colour = (120, 255, 140)
        draw.rectangle([x0, y0, x0 + cell_w - 1, y0 + cell_h - 1], outline=colour, width=2)
        text = (
            f"{f.label} " + (f"{f.tokens} tok" if f.tokens else "pair") + (" · cut" if f.reason == "scene cut" else "")
        )
        draw.text(
            (x0 + 6, y0 + cell_h - font.size - 8),
            text,
            fill=(255, 255, 255),
            font=font,
            stroke_width=2,
            stroke_fill=(0, 0, 0),
        )
    try:
        sheet.save(path, format="PNG")
    except OSError as exc:
        raise InputError(f"{path}: cannot write the contact sheet ({exc.strerror or exc})") from None
