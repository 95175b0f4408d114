"""Batch captioning over the runtime's scheduler: inputs (files, folders, globs, lists →
images), a background thread that prepares them (``prepare``), the caption loop with images in
flight (``runner``), the record log and the files beside it (``outputs``, ``sidecars``), caption
text (``text``), settings (``settings``) and a resumable run over files (``job``)."""

from .job import CaptionJob, CaptionSummary
from .outputs import CaptionRecord
from .runner import Captioner, CaptionResult, caption_images
from .settings import CaptionSettings, caption_slots, model_identity
from .text import DEFAULT_PROMPT, check_template, clean_caption, compose, render_prompt

__all__ = [
    "DEFAULT_PROMPT",
    "CaptionJob",
    "CaptionRecord",
    "CaptionResult",
    "CaptionSettings",
    "CaptionSummary",
    "Captioner",
    "caption_images",
    "caption_slots",
    "check_template",
    "clean_caption",
    "compose",
    "model_identity",
    "render_prompt",
]
