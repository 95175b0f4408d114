"""What shapes a caption (``CaptionSettings``: its digest is part of every record's resume key),
the model's identity in records, and how many images are in flight."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from ..audio.budget import AudioBudget
from ..backend.sampling import SamplingParams
from ..errors import InputError
from ..plan.context import IN_FLIGHT_MAX, ContextBudget
from ..plan.footprint import DEFAULT_DYNAMIC_IMAGE_TOKENS
from ..runtime.jsongrammar import json_grammar
from ..vision.images import DEFAULT_MAX_PIXELS
from ..vision.merge import MergeSpec
from ..vision.video import VideoBudget
from .text import DEFAULT_PROMPT, check_template

__all__ = ["DEFAULT_IN_FLIGHT", "CaptionSettings", "caption_slots", "model_identity"]

DEFAULT_IN_FLIGHT = IN_FLIGHT_MAX
_SAMPLING = SamplingParams()


@dataclass(frozen=True)
class CaptionSettings:
    """Everything that shapes a caption. Its digest is part of every record's resume key."""

    prompt: str = DEFAULT_PROMPT  # may use {name} {filename} {path} {existing}
    system: str | None = None
    prefix: str = ""  # added before the caption (trigger words)
    suffix: str = ""
    clean: bool = False  # strip preambles ("The image shows ..."), quotes, line breaks
    max_tokens: int = 128  # captions are short
    temperature: float = _SAMPLING.temperature  # greedy: the same command gives the same captions
    top_k: int = _SAMPLING.top_k
    top_p: float = _SAMPLING.top_p
    min_p: float = _SAMPLING.min_p
    seed: int | None = None
    stop: tuple[str, ...] = ()
    image_tokens: int | None = None  # per-image budget (None: the plan's)
    tiles: str | int = "auto"
    merge: str = "off"  # visual token merging after the projector (off, ratio:R, ...)
    json_schema: str | None = None  # a JSON Schema (as JSON text) the answer must follow
    video: VideoBudget = VideoBudget()  # a clip's frames (--video-tokens, --max-frames, --fps)
    audio: AudioBudget = AudioBudget()  # a recording's tokens (--audio-tokens, --keep-silence, ...)
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = 1 << 30

    def validate(self) -> None:
        check_template(self.prompt)
        MergeSpec.parse(self.merge)
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise InputError(f"--json-schema: not JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise InputError("--json-schema: a JSON Schema is an object")
            json_grammar(schema, "--json-schema")  # (a schema no grammar holds: said before the run)

    def sampling(self, grammar: str | None = None) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, grammar)

    def digest(self, model_id: str, output: str = "log") -> str:
        """``output``: where captions go (a txt run after a jsonl run must write its sidecars)."""
        d = asdict(self)
        d.pop("max_file_bytes")
        for key, off in (
            ("merge", "off"),
            ("json_schema", None),
            ("video", asdict(VideoBudget())),
            ("audio", asdict(AudioBudget())),
        ):  # older records stay valid
            if d[key] == off:
                d.pop(key)
        if self.temperature <= 0:  # greedy: sampling knobs do not change the caption
            for k in ("top_k", "top_p", "min_p", "seed"):
                d.pop(k)
        d["model"] = model_id
        if output != "log":
            d["output"] = output
        return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:12]


def caption_slots(n_ctx: int, image_tokens: int | None, settings: CaptionSettings, want: int | None = None) -> int:
    """Images in flight for a context of ``n_ctx`` (``want`` None: as many as fit, up to
    ``DEFAULT_IN_FLIGHT``), by the context budget's rule: each needs its image tokens
    (``image_tokens``: the plan's budget; after merging, what merging keeps), its instruction
    and its reply; the system prompt is shared."""
    per_image = settings.image_tokens or image_tokens or DEFAULT_DYNAMIC_IMAGE_TOKENS
    per_image = MergeSpec.parse(settings.merge).target(per_image) or per_image
    rule = ContextBudget(n_ctx)
    return rule.prompts_in_flight(
        per_image, settings.max_tokens, rule.shared_prefix(settings.system), want or DEFAULT_IN_FLIGHT
    )


def model_identity(model: str, mmproj: str) -> tuple[str, str]:
    """(name for records, identity for the resume key): file names and sizes, no hashing."""

    def ident(p: str) -> str:
        try:
            return f"{os.path.basename(p)}:{os.path.getsize(p)}"
        except OSError:
            return os.path.basename(p)

    return os.path.basename(model), f"{ident(model)}+{ident(mmproj)}"
