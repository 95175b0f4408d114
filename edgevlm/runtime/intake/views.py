"""The intake's views: a picture or a clip, from wherever it comes, made into the budgeted,
guarded views a turn sends (``Intake``). This is the one place that budgets a picture or plans
a clip (the package's doc says what is decided here).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ...audio.budget import AudioBudget
from ...audio.plan import AudioPiece, AudioPlan, plan_audio
from ...errors import InputError, UnsupportedModel
from ...model.audio import audio_tokens, piece_samples, refusal
from ...model.gguf_info import ProjectorInfo
from ...model.projectors import encoder_patches, facts, image_tokens
from ...plan.guard import Guard
from ...plan.host import Lease
from ...plan.planner import image_budget
from ...vision.budget import ImageBudget, ImagePlan, compact_view, render_views
from ...vision.detail import DEFAULT_SCORER
from ...vision.images import DEFAULT_MAX_PIXELS, LoadedImage, decode_bytes, load_image
from ...vision.video import VideoBudget, VideoPlan, plan_video
from ..conversation import Conversation, Message, Picture
from .fetch import Fetcher, url_scheme
from .media import MediaRef, file_key, media_kind, thumbnail_uri
from .turn import Asked, ReplySpec, Turn, copy_message

__all__ = ["LOW_DETAIL_TOKENS", "Admitted", "Intake", "PictureOptions", "Views", "make_turn"]

LOW_DETAIL_TOKENS = 256  # detail "low": a dynamic encoder's budget, and no tiles
_WHAT = {"image": "pictures", "video": "video"}


class PictureOptions(Protocol):
    """What a caller's options say about its pictures and clips (``EngineOptions`` says it)."""

    @property
    def image_tokens(self) -> int | None: ...  # per-picture budget (None: the plan's)

    @property
    def tiles(self) -> str | int: ...

    @property
    def max_image_pixels(self) -> int: ...

    @property
    def video(self) -> VideoBudget: ...

    @property
    def audio(self) -> AudioBudget: ...


@dataclass
class Views:
    """A picture or a clip made ready: its views (compact) in prompt order, their labels, its
    planned tokens, notes, the key its summary is remembered by, and its plan."""

    kind: str  # image | video | audio
    name: str
    views: list[Any]  # LoadedImage (a picture's, a clip's frames) | AudioPiece (a recording's pieces)
    labels: list[str | None]
    tokens: int
    notes: list[str]
    key: str
    plan: ImagePlan | VideoPlan | AudioPlan
    width: int
    height: int
    original: LoadedImage | None = None  # a picture's full decode, when the intake keeps it (``/recall``)
    notices: list[str] = field(default_factory=list)  # the guard's (a view shrunk)
    decoded: tuple[str, ...] = ()  # what decoding the picture did (said by whoever decoded it)
    given: str = ""  # the name its caller gave (``name`` falls back to "image 2")

    @property
    def times(self) -> tuple[float, ...] | None:
        """A clip's kept frames: their seconds (None for a picture)."""
        if not isinstance(self.plan, VideoPlan):
            return None
        return tuple(round(f.t, 3) for f in self.plan.kept)

    @property
    def audio_tokens(self) -> int:
        """The tokens its recording's pieces take (0 for a picture or a clip)."""
        return self.tokens if self.kind == "audio" else 0

    def picture(self, number: int) -> Picture:
        """Its entry in a conversation's pictures (what a summary replaces, by ``key``)."""
        image = self.original if self.original is not None else self.views[0]
        return Picture(number, replace(image, source=self.given, sha256=self.key), self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """What ``edgevlm budget --json`` and ``/v1/edgevlm/budget`` show."""
        out: dict[str, Any] = {"kind": self.kind, "name": self.name}
        if self.kind != "audio":
            out.update(width=self.width, height=self.height)
        out.update(self.plan.to_dict())
        if self.kind == "video":
            out["thumbnails"] = [thumbnail_uri(v.rgb) for v in self.views]
        return out


@dataclass(frozen=True)
class Admitted:
    """Views past the guard (maybe shrunk), the image cells they take, and what to tell."""

    views: list[Any]  # LoadedImage | AudioPiece
    tokens: int
    notices: list[str]


class Intake:
    """How one caller's pictures and clips become views (module doc). ``proj`` and ``budget``:
    the projector and the per-picture budget; ``video``: a clip's budget; ``frame_text``: the
    tokens a frame's label takes; ``n_embd``: the text model's embedding width (for what a view
    holds); ``guard``: admission against free memory (None: none); ``fetcher``: how strings become
    bytes, by its ``FetchRules`` (default: a caller's own machine — any file, public URLs);
    ``keep_originals``: a picture's full decode stays with it."""

    def __init__(
        self,
        proj: ProjectorInfo,
        budget: ImageBudget,
        *,
        video: VideoBudget = VideoBudget(),
        audio: AudioBudget = AudioBudget(),
        max_pixels: int = DEFAULT_MAX_PIXELS,
        frame_text: int = 0,
        n_embd: int = 0,
        guard: Guard | None = None,
        fetcher: Fetcher | None = None,
        keep_originals: bool = False,
        host_wait_s: float = 30.0,
    ):
        self.proj, self.budget, self.video, self.audio = proj, budget, video, audio
        self.max_pixels, self.frame_text, self.n_embd = max_pixels, frame_text, n_embd
        self.guard, self.keep_originals = guard, keep_originals
        self.fetcher = fetcher if fetcher is not None else Fetcher()
        self.host_wait_s = host_wait_s

    @classmethod
    def for_caller(
        cls,
        proj: ProjectorInfo,
        options: PictureOptions,
        planned: int | None,
        mtmd_max_tokens: int | None,
        *,
        scorer: str = DEFAULT_SCORER,
        frame_text: int = 0,
        n_embd: int = 0,
        guard: Guard | None = None,
        fetcher: Fetcher | None = None,
        keep_originals: bool = False,
        host_wait_s: float = 30.0,
    ) -> Intake:
        """The intake of a caller with ``options`` on a model pair — the one place its budget is
        made (``LoadedModel.intake()`` and ``edgevlm budget`` both call it). A picture gets the
        options' ``image_tokens``, else ``planned`` (the plan's per-picture cap; None or 0: no
        limit), the options' tiles, and mtmd's own cap ``mtmd_max_tokens`` (what the pair is
        loaded with); a clip gets the options' ``video`` under that per-picture budget, each
        frame's label costing ``frame_text`` tokens (``frame_text_tokens`` of the model's
        tokenizer); a picture or frame over the options' ``max_image_pixels`` is refused; a
        recording gets the options' ``audio`` budget under the room it is given.
        ``scorer``: how tiles are scored (``edgevlm budget --scorer``; the others use the
        default). The rest is ``Intake``'s own."""
        tokens = options.image_tokens if options.image_tokens is not None else (planned or None)
        return cls(
            proj,
            ImageBudget(proj, tokens, options.tiles, mtmd_max_tokens, scorer),
            video=options.video,
            audio=options.audio,
            max_pixels=options.max_image_pixels,
            frame_text=frame_text,
            n_embd=n_embd,
            guard=guard,
            fetcher=fetcher,
            keep_originals=keep_originals,
            host_wait_s=host_wait_s,
        )

    @classmethod
    def for_projector(cls, proj: ProjectorInfo, options: PictureOptions, *, scorer: str = DEFAULT_SCORER) -> Intake:
        """``for_caller`` with a projector alone (``edgevlm budget`` without the text model): no
        plan, so the numbers a plan starts from before memory has a say — the per-picture cap of
        ``plan.planner.image_budget`` (the options' ``image_tokens``, else the projector's
        default) and, as a plan gives mtmd, that cap as mtmd's own for dynamic projectors; no
        frame labels counted (no tokenizer). A clip with no ``video.tokens`` and no room gets
        ``DEFAULT_VIDEO_PICTURES`` pictures' worth (``plan_video``'s default). Unknown projector
        types: ``UnsupportedModel``."""
        planned = image_budget(proj, options.image_tokens)[0]
        return cls.for_caller(proj, options, planned, planned if facts(proj).dynamic else None, scorer=scorer)

    @property
    def model_name(self) -> str:
        """The projector as a refusal names it: its file and its own name."""
        return f"{os.path.basename(self.proj.path)} ({self.proj.name})"

    @classmethod
    def for_audio(cls, proj: ProjectorInfo, options: PictureOptions) -> Intake:
        """The intake ``edgevlm budget`` plans a recording with from a projector alone: the
        options' audio budget, no picture budget (none is needed)."""
        return cls(proj, ImageBudget(proj, None), audio=options.audio)

    def budget_for(self, detail: str = "auto") -> ImageBudget:
        """The image budget of a picture sent with ``detail``."""
        if detail != "low":
            return self.budget
        return replace(self.budget, tiles="off", tokens=min(self.budget.tokens or LOW_DETAIL_TOKENS, LOW_DETAIL_TOKENS))

    def plan_image(self, image: LoadedImage, detail: str = "auto") -> ImagePlan:
        """The views of one decoded picture (decided before encoding)."""
        return self.budget_for(detail).plan(image)

    def view_bytes(self, view: Any) -> int:
        """Host memory one view holds until its request ends: its pixels (a recording's piece:
        its samples), mtmd's preprocessed float copy of every chunk (a piece's log-mel), and the
        embeddings of its tokens."""
        if isinstance(view, AudioPiece):
            a = self.proj.audio
            mel = (a.n_mel if a is not None else 128) * 3000 * 4
            return int(view.samples.nbytes) + mel + view.tokens * self.n_embd * 4
        it = image_tokens(self.proj, view.width, view.height)
        preprocessed = sum(encoder_patches(self.proj, v.n_tokens) for v in it.views) * self.proj.patch_size**2 * 3 * 4
        return int(view.rgb.nbytes) + preprocessed + it.n_tokens * self.n_embd * 4

    # --- one picture or clip ------------------------------------------------------------------
    def own_file(self, source: Any) -> bool:
        """Whether ``source`` names a file of the caller's own (``FetchRules.allow_paths`` None:
        chat, the library, captioning): it is named by its path, and a clip is read from it as
        a stream."""
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if not isinstance(source, str) or self.fetcher.rules.allow_paths is not None:
            return False
        return url_scheme(source.strip()) not in ("http", "https", "data")

    def read(self, ref: MediaRef, label: str, deadline: float | None = None) -> bytes | None:
        """The source's bytes (None for one given decoded): a string or a path by the fetcher's
        rules — a ``data:`` URI, an http(s) URL fetched (by ``deadline`` too), a file."""
        src = ref.source
        if isinstance(src, (bytes, bytearray)):
            return bytes(src)
        if isinstance(src, (str, os.PathLike)):
            return self.fetcher.fetch(os.fspath(src), label, deadline)
        return None

    def views(self, ref: MediaRef, room: int | None = None, lease: Lease | None = None, label: str = "") -> Views:
        """``ref`` made ready: a picture budgeted into views, a clip's frames chosen under
        ``room`` (None: its own budget only); what it holds taken on ``lease``."""
        src = ref.source
        own = self.own_file(src)
        if not ref.name and own:
            label = os.fspath(src)  # a file is named by its path
        label = ref.name or label or (ref.kind if ref.kind in ("video", "audio") else "image")
        deadline = time.monotonic() + self.host_wait_s
        if not self.proj.has_vision_encoder and ref.kind in ("image", "video"):  # (stated: refused before reading)
            raise InputError(f"{label}: {self.model_name} has no vision encoder; it cannot take {_WHAT[ref.kind]}")
        if own and media_kind(ref) == "audio":
            made = self._audio(ref, label, src, room, lease, deadline)  # (read as a stream from its file)
            made.given = ref.name
            return made
        if own and media_kind(ref) == "video":
            made = self._clip(ref, label, src, room, lease, deadline)  # (read as a stream from its file)
            made.given = ref.name
            return made
        data = None if isinstance(src, LoadedImage) else self.read(ref, label)
        held = len(data) if data is not None and not ref.leased else 0
        kind = "image" if isinstance(src, LoadedImage) else media_kind(ref, data)
        if not self.proj.has_vision_encoder and kind != "audio":
            raise InputError(f"{label}: {self.model_name} has no vision encoder; it cannot take {_WHAT[kind]}")
        video = kind == "video"
        peak = decode_bytes(data, label) if kind == "image" and data is not None and lease is not None else 0
        if lease is not None:  # the bytes and their decode's peak at once: never one held waiting for the other
            lease.grow(held + peak, deadline)
        try:
            if kind == "audio":
                made = self._audio(ref, label, data if data is not None else ref.source, room, lease, deadline)
            elif video:
                made = self._clip(ref, label, data if data is not None else ref.source, room, lease, deadline)
            else:
                made = self._picture(ref, label, data, lease, deadline, peak)
        finally:
            if lease is not None:
                lease.shrink(held)  # the bytes are dropped
        made.given = ref.name
        return made

    def _picture(
        self, ref: MediaRef, label: str, data: bytes | None, lease: Lease | None, deadline: float, peak: int = 0
    ) -> Views:
        """A picture's views, decoded under ``peak`` bytes of ``lease`` taken already (its
        decode's peak, ``decode_bytes``); what the views keep stays held, the rest is given back
        — nothing is given back before the views are held, so it never waits for memory while
        holding its decode."""
        try:
            src = ref.source
            if isinstance(src, LoadedImage):
                img = src
            else:
                img = load_image(data if data is not None else src, self.max_pixels, name=label)
            del data
            plan = self.plan_image(img, ref.detail)
            pairs = [(lb, compact_view(v, self.proj)) for lb, v in render_views(img, plan)]
            original = img if self.keep_originals else None
            key, size, img_notes = img.sha256, (img.width, img.height), img.notes
            del img
            held = sum(self.view_bytes(v) for _, v in pairs)
        except BaseException:
            if lease is not None:
                lease.shrink(peak)
            raise
        if lease is not None and held <= peak:
            lease.shrink(peak - held)  # (the peak becomes the views)
        elif lease is not None:
            lease.grow(held - peak, deadline)
        return Views(
            "image",
            label,
            [v for _, v in pairs],
            [lb for lb, _ in pairs],
            plan.total_tokens,
            list(plan.notes),
            key,
            plan,
            *size,
            original=original,
            decoded=img_notes,
        )

    def _audio(
        self, ref: MediaRef, label: str, source: Any, room: int | None, lease: Lease | None, deadline: float
    ) -> Views:
        """A recording's pieces under the audio budget and ``room``: decoded as a stream, long
        silences dropped (unless the budget keeps them), cut to what fits, each piece labelled
        with the times it covers; refused at once by a model that cannot hear it."""
        a = self.proj.audio
        if a is None:
            raise InputError(f"{label}: {self.model_name} has no audio encoder; it cannot take audio")
        why = refusal(a)
        if why is not None:
            raise UnsupportedModel(f"{label}: {self.model_name} cannot take audio: {why}")
        if not isinstance(source, (str, bytes, os.PathLike)):
            raise InputError(f"{label}: a recording is given as a path or its bytes")
        decoding = 0

        def hold(n: int) -> None:
            nonlocal decoding
            if lease is not None:
                lease.grow(n, deadline)
            decoding += n

        budget = self.audio.within(None if room is None else max(room, 0))
        try:
            plan, pieces = plan_audio(
                source,
                label,
                window_samples=piece_samples(a),
                tokens_for=lambda n: audio_tokens(a, n),
                budget_tokens=budget,
                keep_silence=self.audio.keep_silence,
                limits=self.audio.limits,
                rate=a.sample_rate,
                hold=hold,
            )
            if not pieces:
                what = "no audio in it" if plan.decoded_s <= 0 else "nothing but silence (--keep-silence sends it)"
                raise InputError(f"{label}: {what}")
            if lease is not None:
                lease.grow(sum(self.view_bytes(p) for p in pieces), deadline)
        finally:
            if lease is not None:
                lease.shrink(decoding)
        return Views(
            "audio",
            label,
            list(pieces),
            [p.label for p in pieces],
            plan.total_tokens,
            list(plan.notes),
            file_key(source),
            plan,
            0,
            0,
        )

    def _clip(
        self, ref: MediaRef, label: str, source: Any, room: int | None, lease: Lease | None, deadline: float
    ) -> Views:
        """A clip's frames chosen under the video budget and ``room`` (decoded as a stream: one
        frame at a time beside the kept ones), each labelled with its timestamp."""
        if not isinstance(source, (str, bytes, os.PathLike)):
            raise InputError(f"{label}: a video is given as a path or its bytes")
        decoding = 0  # the decode's peak, held while frames are decoded

        def hold(n: int) -> None:
            nonlocal decoding
            if lease is not None:
                lease.grow(n, deadline)
            decoding = n

        try:
            plan, frames = plan_video(  # (a clip that cannot fit: ContextExceeded, a 400)
                source,
                self.proj,
                replace(self.video, merge=False),  # (frames go one by one: no temporal pairs)
                room=None if room is None else max(room, 0),
                image_budget_tokens=self.budget.tokens,
                mtmd_max_tokens=self.budget.mtmd_max_tokens,
                name=label,
                frame_text=self.frame_text,
                max_pixels=self.max_pixels,
                hold=hold,
            )
            views = [compact_view(f, self.proj) for f in frames]
            del frames
            if lease is not None:
                lease.grow(sum(self.view_bytes(v) for v in views), deadline)
        finally:
            if lease is not None:
                lease.shrink(decoding)
        kept = plan.kept
        notes = [f"{len(kept)} frame(s) of {plan.duration:.1f} s, {plan.total_tokens:,} tokens ({plan.rule})"]
        return Views(
            "video",
            label,
            views,
            [f.label for f in kept],
            plan.total_tokens,
            notes + list(plan.notes),
            file_key(source),
            plan,
            plan.width,
            plan.height,
        )

    # --- a message's media --------------------------------------------------------------------
    def admit(self, views: Iterable[Any], cells_free: int) -> Admitted:
        """Run each view past the guard (memory free now, ``cells_free`` image cells left), in
        order; a view may come back shrunk (with a notice) or be refused (an error)."""
        views = list(views)
        if self.guard is None:
            return Admitted(views, 0, [])
        out: list[Any] = []
        notices: list[str] = []
        used = 0
        for view in views:
            if isinstance(view, AudioPiece):  # (a piece is never shrunk: it fits, or is refused)
                used += self.guard.admit_audio(view.tokens, cells_free - used)
                out.append(view)
                continue
            adm = self.guard.admit(view, cells_free - used)
            used += adm.tokens
            if adm.notice:
                notices.append(adm.notice)
            out.append(adm.image)
        return Admitted(out, used, notices)

    def message(
        self, media: Iterable[Any], room: int, *, first: int = 1, lease: Lease | None = None
    ) -> tuple[list[Views], int]:
        """A message's pictures and clips made ready and admitted, in the message's order:
        pictures first, then the clips and recordings share the room the pictures leave (each an
        equal part).
        ``media``: ``MediaRef``s, decoded ``LoadedImage``s, or ``Views`` made already (by
        ``views``: captioning's prefetch) — those are only admitted. ``first``: the number of
        its first picture (default names: "image 3"). Returns the views (admitted, with their
        notices) and the image cells they take."""
        items = [m if isinstance(m, (MediaRef, Views)) else MediaRef(m, "image", name=m.source) for m in media]
        kinds = [m.kind if isinstance(m, Views) else media_kind(m) for m in items]
        clips_left = kinds.count("video") + kinds.count("audio")
        done: dict[int, Views] = {}
        used = 0
        for j in sorted(range(len(items)), key=lambda j: kinds[j] != "image"):
            item = items[j]
            share = None
            if kinds[j] != "image":
                share = (room - used) // clips_left
                clips_left -= 1
            if isinstance(item, Views):
                made = replace(item, notes=list(item.notes))  # (made already: the caller's stays as it is)
            else:
                made = self.views(replace(item, kind=kinds[j]), share, lease, f"{kinds[j]} {first + j}")
                made.notes = [f"{made.name}: {n}" for n in made.notes]
            adm = self.admit(made.views, room - used)
            used += adm.tokens if self.guard is not None else made.tokens
            made.views, made.notices = adm.views, adm.notices
            done[j] = made
        return [done[j] for j in range(len(items))], used

    def turn(self, asked: Iterable[Asked], reply: ReplySpec, room: int, **how: Any) -> Turn:
        """The turn of ``asked`` with ``reply``, its media made ready here (``turn.make_turn``:
        ``history``, ``full_room``, the template's switches, ``evict``, ``lease``)."""
        return make_turn(self, asked, reply, room, **how)


def make_turn(
    intake: Intake,
    asked: Iterable[Asked],
    reply: ReplySpec,
    room: int,
    *,
    history: Conversation | None = None,
    full_room: int | None = None,
    system: str | None = None,
    tools: Iterable[Mapping[str, Any]] = (),
    tool_required: str | None = None,
    think: bool | None = None,
    evict: bool = False,
    lease: Lease | None = None,
) -> Turn:
    """The turn of ``asked`` (after ``history``, a conversation kept by the caller: its
    messages and pictures come first, unchanged) with ``reply``: every message's pictures and
    clips made ready and admitted by ``intake``, numbered after the history's. ``room``: the
    image cells the turn's new pictures may take — the last message's (all of them, without
    ``evict``) must fit it; with ``evict`` an earlier message's may give way to a summary later,
    so each is planned as if it were the last, against ``full_room`` (default ``room``). What
    they hold is taken on ``lease``."""
    asked = list(asked)
    messages = [copy_message(m) for m in history.messages] if history is not None else []
    pictures = [replace(p) for p in history.pictures] if history is not None else []
    first_new = len(pictures)
    notes: list[str] = []
    heard: list[float | None] = []
    notices: list[str] = []
    places: list[int] = [-1] * len(messages)  # (the history's messages are the caller's own)
    left = room
    for i, a in enumerate(asked):
        bound = i == len(asked) - 1 or not evict
        made, used = intake.message(
            list(a.media),
            left if bound else (room if full_room is None else full_room),
            first=len(pictures) + 1,
            lease=lease,
        )
        if bound:
            left -= used
        views: list[LoadedImage] = []
        labels: list[str | None] = []
        numbers: list[int] = []
        for v in made:
            notes += v.notes
            if isinstance(v.plan, AudioPlan):
                heard.append(v.plan.duration_s)
            notices += v.notices
            pictures.append(v.picture(len(pictures) + 1))
            views += v.views
            labels += v.labels
            numbers += [len(pictures)] * len(v.views)
        messages.append(
            Message(
                a.role,
                a.text,
                views,
                tokens=None if a.tokens is None else list(a.tokens),
                labels=labels,
                sources=[v.name for v in made],
                pictures=numbers,
                tool_calls=[dict(c) for c in a.tool_calls],
                tool_call_id=a.tool_call_id,
                name=a.name,
            )
        )
        places.append(a.place)
    return Turn(
        tuple(messages),
        tuple(pictures),
        reply,
        system,
        tuple(tools),
        tool_required,
        think,
        evict,
        tuple(places),
        tuple(notes),
        tuple(notices),
        len(pictures) - first_new,
        tuple(heard),
    )
