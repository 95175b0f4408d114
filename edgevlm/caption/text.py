"""Caption text: the instruction template (``{name}`` ``{filename}`` ``{path}`` ``{existing}``),
cleanup of what models like to say first ("Sure! Here is a caption: The image shows ..."), and
how a new caption joins one already there (``--existing append|prepend``)."""

from __future__ import annotations

import os
import re
import string

from ..errors import InputError
from .inputs import InputItem

__all__ = [
    "DEFAULT_AUDIO_PROMPT",
    "DEFAULT_PROMPT",
    "PLACEHOLDERS",
    "check_template",
    "clean_caption",
    "compose",
    "render_prompt",
]

DEFAULT_PROMPT = "Write a one-sentence caption for this image."
DEFAULT_AUDIO_PROMPT = "Write a one-sentence caption for this recording."  # a recording's, when --prompt is not given
PLACEHOLDERS = ("name", "filename", "path", "existing")


def check_template(template: str) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise InputError(f"--prompt: {exc} (write {{{{ and }}}} for literal braces)") from None
    for f in fields:
        if f not in PLACEHOLDERS:
            raise InputError(
                f"--prompt: unknown placeholder {{{f}}} (use " + ", ".join("{" + p + "}" for p in PLACEHOLDERS) + ")"
            )


def render_prompt(template: str, item: InputItem, existing: str | None, kind: str = "image") -> str:
    """The prompt of one input; a recording asked with the default prompt is asked about a recording."""
    if kind == "audio" and template == DEFAULT_PROMPT:
        template = DEFAULT_AUDIO_PROMPT
    return template.format_map(
        {
            "name": item.name,
            "filename": os.path.basename(item.path),
            "path": item.path,
            "existing": (existing or "").strip(),
        }
    )


_PREAMBLES = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"^(sure|certainly|of course|okay|ok)\b[,.!:]?\s*",
        r"^(here is|here's|below is)\s+(a|an|the|my)?\s*([\w-]+\s+){0,3}(caption|description)\b[^:\n]*?[:.]\s*",
        r"^(caption|description)\s*:\s*",
        r"^(in\s+)?(this|the)\s+(image|picture|photo|photograph|scene|illustration)\s*,?\s*"
        r"(we can see|we see|you can see|there is|there are|i see)\s+",
        r"^(this|the)\s+(image|picture|photo|photograph|scene|illustration|artwork)\s+"
        r"(shows|depicts|features|displays|contains|captures|presents|portrays|illustrates|is of)\s+",
        r"^(an?\s+)?(image|picture|photo|photograph)\s+(of|showing|depicting)\s+",
    )
]
_QUOTES = [('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019")]


def clean_caption(text: str, truncated: bool = False) -> str:
    """Drop preambles ("Sure! Here is a caption:", "The image shows"), wrapping quotes and line
    breaks; after ``max_tokens`` cut an unfinished last sentence (if a finished one exists)."""
    t = " ".join(text.split())
    changed = True
    while changed and t:
        changed = False
        for rx in _PREAMBLES:
            new = rx.sub("", t, count=1)
            if new != t and new:
                t, changed = new, True
        for a, b in _QUOTES:
            if len(t) >= 2 and t.startswith(a) and t.endswith(b):
                t, changed = t[1:-1].strip(), True
    if truncated:
        ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", t)]
        if ends and ends[-1] < len(t) and ends[-1] >= len(t) // 3:
            t = t[: ends[-1]]
    return t[:1].upper() + t[1:] if t else t


def compose(existing: str | None, caption: str, policy: str, separator: str) -> str:
    """The text to write given what was there: overwrite/skip → caption; append/prepend join."""
    old = (existing or "").strip()
    if not old or policy in ("overwrite", "skip"):
        return caption
    return old + separator + caption if policy == "append" else caption + separator + old
