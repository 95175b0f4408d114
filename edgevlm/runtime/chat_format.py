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

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..backend.system import template_renderer
from ..errors import InputError
from .toolformat import TemplateCaps, detect_format, fallback_instructions, probe_caps

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
        self._caps: TemplateCaps | None = None

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

    @property
    def caps(self) -> TemplateCaps:
        """What the template renders by itself (tools, tool calls, tool results, thinking)."""
        if self._caps is None:
            self._caps = probe_caps(self._render, self.template)
        return self._caps

    @property
    def tool_format(self) -> str:
        """The tool-call format replies are parsed in (``toolformat``): the template's own, or
        hermes, which the fallback instructions teach."""
        return detect_format(self.template) if self.caps.tools else "hermes"

    def starts_thinking(self, think: bool | None = None) -> bool:
        """Whether the generation prompt opens a ``<think>`` block (the reply starts inside it)."""
        if not self.caps.thinking:
            return False
        kw = {} if think is None else {"enable_thinking": think}
        try:
            return self._render([{"role": "user", "content": "hi"}], **kw).rstrip().endswith("<think>")
        except Exception:
            return False

    def render(
        self,
        messages: list[tuple[str, str, list[str | None]]] | list[tuple[str, str, list[str | None], dict[str, Any]]],
        tools: list[dict[str, Any]] | None = None,
        think: bool | None = None,
        tool_required: str | None = None,
    ) -> list[Piece]:
        """``messages`` = [(role, text, image labels[, extra])]; assistant text is a sentinel.
        ``extra``: an assistant's ``tool_calls`` ([{"id", "name", "arguments": dict}]), a tool
        result's ``tool_call_id`` and ``name``. ``tools`` (OpenAI's shape) go to the template,
        or — when it has no place for them — into the system prompt as instructions, and calls
        and results become text the same way (``tool_required``: "any" or a name, said there)."""
        caps = self.caps if (tools or any(len(m) > 3 for m in messages)) else TemplateCaps()
        # Mistral's templates want ids of nine letters and digits
        ids = _mistral_id if caps.tools and self.tool_format == "mistral" else str
        rendered: list[dict[str, Any]] = []
        n_assistant = 0
        for msg in messages:
            role, text, labels = msg[0], msg[1], msg[2]
            extra: dict[str, Any] = msg[3] if len(msg) > 3 else {}
            if role == "assistant":
                d: dict[str, Any] = {"role": role, "content": _SENTINEL.format(n_assistant)}
                n_assistant += 1
                calls = extra.get("tool_calls") or []
                if calls and caps.tools and caps.tool_calls:
                    d["tool_calls"] = [
                        {
                            "id": ids(c["id"]),
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls
                    ]
                elif calls:  # as the fallback instructions ask for them
                    d["content"] += "".join(
                        "\n<tool_call>\n"
                        + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                        + "\n</tool_call>"
                        for c in calls
                    )
                rendered.append(d)
            elif role == "tool":
                content = self.user_content(text, labels)
                if caps.tools and caps.tool_role:  # (a template without tools: taught as the fallback says)
                    rendered.append(
                        {
                            "role": "tool",
                            "content": content,
                            "tool_call_id": ids(extra.get("tool_call_id", "")),
                            "name": extra.get("name", ""),
                        }
                    )
                    continue
                said = f"<tool_response>\n{content}\n</tool_response>"
                if rendered and rendered[-1].get("edgevlm_results"):  # results of one turn: one user message
                    rendered[-1]["content"] += "\n" + said
                else:
                    rendered.append({"role": "user", "content": said, "edgevlm_results": True})
            elif role == "user":
                content = self.user_content(text, labels)
                if rendered and rendered[-1].get("edgevlm_results"):  # after the results: one user turn
                    rendered[-1]["content"] += "\n" + content
                else:
                    rendered.append({"role": role, "content": content})
            else:
                rendered.append({"role": role, "content": text})
        kw: dict[str, Any] = {}
        if think is not None and self.caps.think_switch:
            kw["enable_thinking"] = think
        if tools and caps.tools:
            kw["tools"] = tools
        elif tools:
            teach = fallback_instructions(tools, tool_required)
            if rendered and rendered[0]["role"] == "system":
                rendered[0]["content"] = rendered[0]["content"] + "\n\n" + teach
            else:
                rendered.insert(0, {"role": "system", "content": teach})
        for d in rendered:
            d.pop("edgevlm_results", None)
        try:
            prompt = self._render(rendered, **kw)
        except Exception as exc:  # raise_exception() in the template, or a template that breaks
            detail = str(exc).strip() or type(exc).__name__
            raise InputError(f"the model's chat template refused these messages: {detail}") from None
        if self.strip_bos and self.bos_token and prompt.startswith(self.bos_token):
            prompt = prompt[len(self.bos_token) :]  # llama.cpp adds BOS itself
        return split_pieces(prompt, self.marker)


def _mistral_id(cid: str) -> str:
    """A tool call's id as Mistral's templates accept it: nine letters and digits (another id
    maps to a stable one, the same for a call and its result)."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", cid):
        return cid
    digest = hashlib.sha1(cid.encode()).hexdigest()[:9]
    return "".join(c.upper() if i % 2 else c for i, c in enumerate(digest))


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
