"""Messages → the items a sequence holds: the model's chat format (its own template or the
family's), each text piece tokenized, each picture's mtmd chunks from the image cache, assistant
replies put back as the exact token ids generated (so a resent conversation matches the KV cache
token for token), and merged image chunks sized as the merge will leave them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..backend.llama import Backend, Chunk
from ..errors import ContextExceeded
from ..vision.merge import MergeSpec, mergeable
from .chat_format import PromptFormatter
from .conversation import Message
from .items import ImageCache, ImageUnit, Item, Prompt, text_items

__all__ = ["PromptRenderer"]


class PromptRenderer:
    def __init__(self, backend: Backend, images: ImageCache):
        self.backend = backend
        self.images = images
        info = backend.text_info
        self.formatter = PromptFormatter(
            info.chat_template,
            info.arch,
            backend.proj_info.projector_type,
            backend.marker,
            bos_token=backend.token_bytes(backend.bos_id).decode("utf-8", "ignore") if backend.bos_id >= 0 else "",
            eos_token=backend.token_text(backend.eos_id),
            strip_bos=backend.add_bos,
        )

    def merging(self, merge: MergeSpec) -> bool:
        """Whether ``merge`` applies to this model's image tokens (they must lie on a grid)."""
        return merge.enabled and mergeable(self.backend.proj_info.projector_type)

    def render(
        self,
        messages: Sequence[Message],
        system: str | None = None,
        merge: MergeSpec = MergeSpec(),
        keep_images: bool = True,
        tools: list[dict[str, Any]] | None = None,
        think: bool | None = None,
        tool_required: str | None = None,
        limit: int | None = None,
    ) -> Prompt:
        """The prompt of a conversation that asks for the next assistant reply (``tools``,
        ``think``, ``tool_required``: as ``PromptFormatter.render`` takes them). With ``limit``, a
        prompt found longer than that many cells ends as ``ContextExceeded`` as soon as a text
        piece's tokens show it, before they become items (a long text: most of the time and
        memory a render takes)."""
        be = self.backend
        msgs: list[tuple[str, str, list[str | None], dict[str, Any]]] = []
        if system:
            msgs.append(("system", system, [], {}))
        imgs = []
        assistant: list[list[int]] = []
        for m in messages:
            msgs.append((m.role, m.content_text, m.view_labels, m.extra))
            imgs.extend(m.images)
            if m.role == "assistant":  # the exact ids generated, when known (else its text)
                assistant.append(m.tokens if m.tokens is not None else be.tokenize_text(m.text))
        items: list[Item] = text_items([be.bos_id]) if be.add_bos else []
        units: dict[str, ImageUnit] = {}
        merging = self.merging(merge)
        cells = len(items)  # (text cells so far: pictures' are counted once the prompt is whole)
        for piece in self.formatter.render(msgs, tools, think, tool_required):
            if piece.kind == "text":
                tokens = be.tokenize_text(piece.text)
                if limit is not None and cells + len(tokens) > limit:
                    raise ContextExceeded(
                        f"this request needs more than {limit:,} tokens before its reply (shorten the text, "
                        f"fewer images, a smaller max_tokens, or a larger --ctx)"
                    )
                items += text_items(tokens)
                cells += len(tokens)
            elif piece.kind == "assistant":
                items += text_items(assistant[piece.index])
                cells += len(assistant[piece.index])
            else:
                unit = self.images.get(imgs[piece.index], keep=keep_images)
                units[unit.key] = unit
                for ci, c in enumerate(unit.chunks):
                    if c.kind == "text":
                        items += text_items(c.tokens or [])
                    else:
                        items.append(self._image_item(unit, ci, c, merge if merging else None))
        return Prompt(tuple(items), units)

    def _image_item(self, unit: ImageUnit, ci: int, c: Chunk, merge: MergeSpec | None) -> Item:
        if merge is None:
            return Item(("i", unit.key, ci), c.n_tokens, c.n_pos)
        done = unit.merged.get((ci, merge))
        n_out = done.n_out if done is not None else (merge.target(c.n_tokens) or c.n_tokens)
        return Item(("i", unit.key, ci, merge), n_out, c.n_pos if self.backend.use_mrope else n_out)
