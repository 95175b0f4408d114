"""``edgevlm inspect``: one report over a text model, a projector, or a pair."""

from __future__ import annotations

from typing import Any

from ..errors import ModelPairError, UnsupportedModel
from .audio import refusal, window_tokens
from .gguf_info import check_pair, projector_info, read_gguf, text_model_info
from .projectors import image_tokens, token_bound

__all__ = ["inspect_files", "pair_error"]


def inspect_files(file: str, mmproj: str | None = None, image_size: tuple[int, int] | None = None) -> dict[str, Any]:
    """Return ``{"model": ..., "mmproj": ..., "pair": ...}`` (keys present as they apply).

    FILE may be a text model or, alone, a projector. With both, ``pair.compatible`` says
    whether the projector's output width equals the text model's n_embd.
    """
    gf = read_gguf(file)
    report: dict[str, Any] = {}
    proj_gf = None
    if mmproj is None and gf.is_projector:
        proj_gf = gf
    else:
        text = text_model_info(gf)
        report["model"] = text.to_dict()
        if mmproj is not None:
            proj_gf = read_gguf(mmproj)
    if proj_gf is not None:
        proj = projector_info(proj_gf)
        d = proj.to_dict()
        w, h = image_size or (proj.image_size, proj.image_size)
        if not proj.has_vision_encoder:  # (audio only: no picture to count)
            pass
        else:
            try:
                d["image_tokens"] = {"width": w, "height": h, **image_tokens(proj, w, h).to_dict()}
            except UnsupportedModel as exc:  # the file is still worth describing
                d["image_tokens"] = {"width": w, "height": h, "error": str(exc), "bound": token_bound(proj)}
        if proj.audio is not None:
            why = refusal(proj.audio)
            d["audio_tokens"] = {"per_30s_window": None if why else window_tokens(proj.audio), "refused": why}
        report["mmproj"] = d
        if "model" in report:
            try:
                check_pair(text, proj)
                report["pair"] = {"compatible": True, "reason": None}
            except ModelPairError as exc:
                report["pair"] = {"compatible": False, "reason": str(exc)}
    return report


def pair_error(report: dict[str, Any]) -> ModelPairError | None:
    pair = report.get("pair")
    if pair and not pair["compatible"]:
        return ModelPairError(pair["reason"])
    return None
