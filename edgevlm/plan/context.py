"""The context budget: one rule for what a context of ``n_ctx`` KV cells holds.

A context holds pictures, text and the reply being generated. The rule, used by the planner
(``Plan.max_images_in_context``), the guard (how many image tokens a new picture may bring), the
engine and the session (when old pictures give way to their summaries) and captioning (how many
images are in flight):

- **reply reserve**: the cells kept free for a reply of ``max_tokens`` — at most a quarter of
  the context; a longer reply grows into cells nobody reserved, idle conversations moved out
  for it (least recently used first), and stops with finish_reason "context" only when nothing
  idle is left — a stop the caller is told of (``cut_notice``);
- **text room**: the cells kept for the conversation's text (system prompt, messages, template)
  — an eighth of the context, between 64 and 512;
- **image room**: what is left for pictures, ``n_ctx − text room − reply reserve``; a
  conversation keeps as many pictures as their tokens fit in it;
- **prompts in flight** (captioning): each one-turn prompt needs its picture, ~64 tokens of
  instruction and template, and its reply reserve; the system prompt before the picture is
  shared by all of them;
- **text measured before it is tokenized** (``check_text``): no token stands for more bytes of
  text than the vocabulary's longest piece (``Backend.max_token_bytes``), so ``b`` bytes of text
  are at least ``ceil(b / longest)`` tokens; a prompt whose text alone already needs more than
  the context holds is refused by its size, cheaply, before anything tokenizes it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backend.sampling import LIBRARY_REPLY
from ..errors import ContextExceeded

__all__ = [
    "AUTO_CTX_MAX",
    "ContextBudget",
    "DEFAULT_REPLY_TOKENS",
    "IN_FLIGHT_MAX",
    "PROMPT_TEXT",
    "TEXT_ROOM_MAX",
    "TEXT_ROOM_MIN",
]

TEXT_ROOM_MIN, TEXT_ROOM_MAX = 64, 512
PROMPT_TEXT = 64  # a one-turn prompt's text around its picture (template + instruction)
DEFAULT_REPLY_TOKENS = LIBRARY_REPLY.max_tokens  # the reply a plan counts its pictures with
# prompts generated together when the context holds them (serve --parallel auto, caption images in
# flight): beyond ~4 a CPU spends the batch on compute, not on reading weights
IN_FLIGHT_MAX = 4
MIN_PLANNED_CTX = 2048
AUTO_CTX_MAX = 8192  # the largest context --ctx auto plans (less when the model was trained on less)


@dataclass(frozen=True)
class ContextBudget:
    """The rule for one context size (see the module doc)."""

    n_ctx: int
    # the most bytes of text one token stands for (``Backend.max_token_bytes``); None: not known
    # (a vocabulary that normalizes or swallows whitespace), then only the exact check counts
    max_token_bytes: int | None = None

    def reply_reserve(self, max_tokens: int) -> int:
        """Cells kept free for a reply of ``max_tokens`` (at most a quarter of the context)."""
        return max(1, min(int(max_tokens), self.n_ctx // 4))

    def check(self, cells: int, reserve: int) -> None:
        """The one context check: a prompt of ``cells`` with ``reserve`` kept for the reply fits
        the context, else ``ContextExceeded`` (a 400 ``context_length_exceeded`` in a server)."""
        if cells + reserve > self.n_ctx:
            raise ContextExceeded(
                f"this request needs {cells:,} tokens and {reserve:,} for the reply, but the context "
                f"holds {self.n_ctx:,} (shorten the conversation, fewer or smaller images, a smaller "
                f"max_tokens, evict old pictures, or a larger --ctx)"
            )

    def text_floor(self, n_bytes: int) -> int:
        """The fewest tokens ``n_bytes`` of text can become (0 where the vocabulary's longest
        token is not known)."""
        longest = self.max_token_bytes
        return -(-n_bytes // longest) if longest else 0

    def check_text(self, n_bytes: int, reserve: int) -> None:
        """The context check by size, before any tokenizing: ``n_bytes`` of text (``text_bytes``
        of the parts every rendering keeps whole) with ``reserve`` kept for the reply can never
        fit → ``ContextExceeded``. Exact-safe: what it refuses the full check would refuse too."""
        floor = self.text_floor(n_bytes)
        if floor + reserve > self.n_ctx:
            raise ContextExceeded(
                f"this request's text ({n_bytes:,} bytes) is at least {floor:,} tokens, and {reserve:,} "
                f"are kept for the reply, but the context holds {self.n_ctx:,} (shorten the text, a "
                f"smaller max_tokens, or a larger --ctx)"
            )

    @staticmethod
    def text_bytes(*texts: str | None) -> int:
        """The UTF-8 size of ``texts`` as a template renders them (their ends trimmed: some
        templates trim a message), without copying an ASCII text."""
        n = 0
        for t in texts:
            t = (t or "").strip()
            n += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))
        return n

    def cut_notice(self, generated: int, max_tokens: int) -> str:
        """What a caller is told of a reply the context stopped (finish "context")."""
        return (
            f"the context is full: the reply stopped after {generated:,} of its {max_tokens:,} tokens "
            f"(the {self.n_ctx:,}-token context holds the prompts and replies running now, and no idle "
            f"conversation was left to move out; a smaller max_tokens, fewer requests at once, or a larger --ctx)"
        )

    @property
    def text_room(self) -> int:
        return min(TEXT_ROOM_MAX, max(TEXT_ROOM_MIN, self.n_ctx // 8))

    def image_room(self, max_tokens: int) -> int:
        """Cells the pictures of a conversation may take in total."""
        return max(0, self.n_ctx - self.text_room - self.reply_reserve(max_tokens))

    def images_that_fit(self, per_image: int, max_tokens: int) -> int:
        """Pictures of ``per_image`` tokens a conversation keeps in context at once."""
        return self.image_room(max_tokens) // per_image if per_image > 0 else 0

    def prompts_in_flight(self, per_image: int, max_tokens: int, shared_prefix: int, want: int) -> int:
        """One-turn prompts (a picture each) that fit beside each other; at most ``want``, at
        least 1."""
        per_prompt = per_image + PROMPT_TEXT + self.reply_reserve(max_tokens)
        return max(1, min(want, (self.n_ctx - shared_prefix) // max(1, per_prompt)))

    @staticmethod
    def shared_prefix(system: str | None) -> int:
        """An estimate of the cells a system prompt and turn header take (shared by prompts)."""
        return 32 + len(system or "") // 2

    @staticmethod
    def min_ctx(images: int, per_image: int, reply_tokens: int) -> int:
        """The smallest context a plan may shrink to: ``images`` pictures, the full text room
        and the reply."""
        return max(MIN_PLANNED_CTX, images * per_image + TEXT_ROOM_MAX + reply_tokens)
