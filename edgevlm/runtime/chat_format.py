"""Turning a conversation into the prompt text a model expects, with images at mtmd's marker.

The model's own ``tokenizer.chat_template`` is rendered exactly as llama-cpp-python renders it
(``backend.system.template_renderer``: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, HF's
``tojson``). A GGUF without a template gets its family's format; LLaVA-1.5's is
``USER: <image>\\n{text}\\nASSISTANT:`` with the newlines kept.

Assistant replies are rendered as sentinels so the engine can put back the exact tokens the
model generated (re-tokenizing detokenized text would not give the same ids, and the KV cache
prefix would no longer match).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..backend.system import template_renderer
from ..errors import InputError

__all__ = ["CHATML_TEMPLATE", "LLAVA15_TEMPLATE", "Piece", "PromptFormatter", "fallback_template", "split_pieces"]

# Fallback templates, written for the same Jinja environment as the models' own.
LLAVA15_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}{{ '\\n\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'USER: ' }}{{ m['content'] }}{{ '\\nASSISTANT:' }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{{ '\\n' }}"
    "{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' }}{{ m['role'] }}{{ '\\n' }}{{ m['content'] }}{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The LLaVA fallback appends "ASSISTANT:" with every user turn, so add_generation_prompt is implied.

_SENTINEL = "\x00edgevlm-assistant-{}\x00"
_SENTINEL_RE = re.compile("\x00edgevlm-assistant-(\\d+)\x00")


@dataclass(frozen=True)
class Piece:
    """A part of the rendered prompt: text, an image (by index), or an assistant reply (by index)."""

    kind: str  # "text" | "image" | "assistant"
    text: str = ""
    index: int = -1


def fallback_template(arch: str, projector_type: str) -> str:
    if arch == "llama" and projector_type in ("mlp", "mlp_norm", "ldp", "ldpv2"):
        return LLAVA15_TEMPLATE
    return CHATML_TEMPLATE


class PromptFormatter:
    """Renders messages (role, text, number of images) into pieces for the engine."""

    def __init__(
        self,
        template: str | None,
        arch: str,
        projector_type: str,
        marker: str,
        bos_token: str,
        eos_token: str,
        strip_bos: bool,
    ):
        self.source = "gguf" if template else "fallback"
        self.template = template or fallback_template(arch, projector_type)
        self.marker = marker
        self.bos_token = bos_token
        self.strip_bos = strip_bos
        self._render = template_renderer(self.template, bos_token, eos_token)
        self.stop_texts = [eos_token] if eos_token else []

    def user_content(self, text: str, labels: list[str | None]) -> str:
        """Images first, each at a media marker, then the text (LLaVA: ``<image>\\n{text}``).

        Views of one picture (AnyRes tiles) carry a label so the model knows what it sees:
        ``global view: <image>\\ntile row 1 col 2: <image>\\n...``.
        """
        if not labels:
            return text
        if all(lb is None for lb in labels):
            return self.marker * len(labels) + "\n" + text
        return "".join(f"{lb}: {self.marker}\n" if lb else f"{self.marker}\n" for lb in labels) + text

    @property
    def default_stops(self) -> list[str]:
        """Stop strings the format needs beside end-of-generation tokens (LLaVA-1.5's fallback
        has no end token between turns: the model may write the next ``USER:`` itself)."""
        return ["\nUSER:"] if self.template == LLAVA15_TEMPLATE else []

    def render(self, messages: list[tuple[str, str, list[str | None]]]) -> list[Piece]:
        """``messages`` = [(role, text, image labels)]; assistant text is a sentinel."""
        rendered = []
        n_assistant = 0
        for role, text, labels in messages:
            if role == "assistant":
                rendered.append({"role": role, "content": _SENTINEL.format(n_assistant)})
                n_assistant += 1
            elif role == "user":
                rendered.append({"role": role, "content": self.user_content(text, labels)})
            else:
                rendered.append({"role": role, "content": text})
        try:
            prompt = self._render(rendered)
        except Exception as exc:  # raise_exception() in the template, or a template that breaks
            detail = str(exc).strip() or type(exc).__name__
            raise InputError(f"the model's chat template refused these messages: {detail}") from None
        if self.strip_bos and self.bos_token and prompt.startswith(self.bos_token):
            prompt = prompt[len(self.bos_token) :]  # llama.cpp adds BOS itself
        return split_pieces(prompt, self.marker)


def split_pieces(prompt: str, marker: str) -> list[Piece]:
    pieces: list[Piece] = []
    n_image = 0
    pos = 0
    for m in _SENTINEL_RE.finditer(prompt):
        n_image = _split_images(prompt[pos : m.start()], marker, pieces, n_image)
        pieces.append(Piece("assistant", index=int(m.group(1))))
        pos = m.end()
    _split_images(prompt[pos:], marker, pieces, n_image)
    return pieces


def _split_images(text: str, marker: str, out: list[Piece], n_image: int) -> int:
    parts = text.split(marker)
    for i, part in enumerate(parts):
        if part:
            out.append(Piece("text", part))
        if i < len(parts) - 1:
            out.append(Piece("image", index=n_image))
            n_image += 1
    return n_image
