"""OpenAI's ``POST /v1/audio/transcriptions``: a multipart form → one chat request answered by the
loaded model on the same path a chat request takes (``ChatService``), → OpenAI's transcription
bodies.

The form (``parse_form``, pure): ``file`` (required: the recording, any format PyAV decodes),
``model`` (required; any name is accepted, as on the other routes), ``prompt``, ``language``,
``temperature`` (0 to 1; greedy when absent), ``response_format`` (json, text or verbose_json;
srt, vtt and diarized_json are a 400 saying which are supported), ``timestamp_granularities[]``
(segment; word is a 400: there are no word times). ``stream`` true is a 400.

The request is one user message: the recording and an instruction to transcribe it (with the
language and the prompt when given), its reply at most the server's ``--max-tokens``. The body is
read as any other (``--max-body``: 413 past it; at the server's pace; held on the request's
lease), parsed by Starlette's multipart parser, and the recording goes to the intake as a
``data:`` URI, so the same recording sent as a chat part has the same summary key.

Replies: json ``{"text", "usage"}`` (tokens: input, output, the audio tokens among the input),
text (the transcript as ``text/plain``), verbose_json ``{"task", "language", "duration",
"text", "segments", "usage"}`` whose segments are the recording's pieces as the intake cut it
(start and end in seconds; ``segments``). Notices (a recording cut to the budget) are the
``edgevlm`` object of the JSON bodies and an ``x-edgevlm-notices`` header of the text one.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..audio.plan import AudioPiece
from ..backend.sampling import SamplingParams
from ..errors import shown
from ..plan.host import Lease
from ..runtime.intake import Turn
from .options import ServeOptions
from .request import ChatMessage, ChatRequest, ImageRef, Reply, bad
from .service import ChatService

__all__ = ["FORMATS", "Transcription", "instruction", "parse_form", "segments", "transcription_routes"]

FORMATS = ("json", "text", "verbose_json")
NOT_HERE = ("srt", "vtt", "diarized_json")  # OpenAI's other formats: a 400 naming the supported ones
FIELDS_MAX = 32  # form fields besides the file
FIELD_BYTES = 64 * 1024  # one form field's most bytes (a prompt)
PATH = "/v1/audio/transcriptions"


@dataclass(frozen=True)
class Transcription:
    """A transcription form, parsed: the chat request it becomes and how to answer it."""

    request: ChatRequest
    response_format: str
    language: str
    filename: str


def instruction(language: str = "", prompt: str = "") -> str:
    """What the model is asked (the recording comes with it in one user message)."""
    text = "Transcribe this recording word for word. Answer with the transcript only."
    if language:
        text += f" The speech is in the language {language}."
    if prompt:
        text += f" Text that comes before it, or the spelling of names in it: {prompt}"
    return text


def _field(form: FormData, key: str) -> str:
    v = form.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise bad(f"'{key}' must be a form field, not a file", key)
    return v


def parse_form(form: FormData, uri: str, filename: str, defaults: SamplingParams) -> Transcription:
    """A transcription form (its file already read into ``uri``, a ``data:`` URI) → the chat
    request; a 400 naming the field for anything wrong."""
    model = _field(form, "model")
    if not model:
        raise bad("'model' is required (any name: this server has one model)", "model")
    fmt = _field(form, "response_format") or "json"
    if fmt not in FORMATS:
        why = "is not supported here" if fmt in NOT_HERE else "is not a response format"
        raise bad(f"response_format {shown(fmt)} {why}; give {', '.join(FORMATS)}", "response_format")
    grains = [*form.getlist("timestamp_granularities[]"), *form.getlist("timestamp_granularities")]
    for g in grains:
        if g not in ("segment", "word"):
            raise bad(f"timestamp_granularities[] must be segment, not {shown(g)}", "timestamp_granularities[]")
        if g == "word":
            raise bad(
                "timestamp_granularities[] word is not supported (no word times here); give segment",
                "timestamp_granularities[]",
                "unsupported_parameter",
            )
    if _field(form, "stream").lower() == "true":
        raise bad("'stream' is not supported by this route", "stream", "unsupported_parameter")
    temp = _field(form, "temperature")
    try:
        t = float(temp) if temp else 0.0  # (greedy unless asked)
    except ValueError:
        t = -1.0
    if not 0 <= t <= 1:
        raise bad(f"'temperature' must be a number from 0 to 1, not {shown(temp)}", "temperature")
    language, prompt = _field(form, "language").strip(), _field(form, "prompt")
    sampling = SamplingParams(
        temperature=t, top_k=defaults.top_k, top_p=defaults.top_p, min_p=defaults.min_p, seed=defaults.seed
    )
    audio = ImageRef(uri, "auto", filename[:200], "audio")
    req = ChatRequest((ChatMessage("user", instruction(language, prompt), (audio,)),), model=model, sampling=sampling)
    return Transcription(req, fmt, language, filename)


@dataclass(frozen=True)
class Piece:
    """A piece of the recording the intake kept: the source seconds it covers and the label the
    model was shown with it."""

    start: float
    end: float
    label: str


def pieces_of(turn: Turn) -> list[Piece]:
    """The recording's pieces as the intake cut it (its last message's audio views)."""
    views = turn.messages[-1].images if turn.messages else []
    return [Piece(v.spans[0][0], v.spans[-1][1], v.label) for v in views if isinstance(v, AudioPiece) and v.spans]


def segments(text: str, pieces: Sequence[Piece], temperature: float) -> list[dict[str, Any]]:
    """verbose_json's segments: one per piece, with its times. The model's text is split where it
    repeats the pieces' own labels in order (``[0:00.0–0:30.0]``, as the prompt shows them);
    otherwise the whole text is the first segment's and the rest are empty (the model gives one
    answer for the whole recording). ``avg_logprob`` and ``no_speech_prob`` are 0 (not
    computed), ``tokens`` is empty."""
    out = []
    for i, (p, t) in enumerate(zip(pieces, _split(text, pieces), strict=True)):
        raw = t.encode()
        out.append(
            {
                "id": i,
                "seek": int(p.start * 100),  # (Whisper's: 10 ms frames)
                "start": round(p.start, 3),
                "end": round(p.end, 3),
                "text": t,
                "tokens": [],
                "temperature": temperature,
                "avg_logprob": 0.0,
                "compression_ratio": round(len(raw) / len(zlib.compress(raw)), 3) if raw else 0.0,
                "no_speech_prob": 0.0,
            }
        )
    return out


def _split(text: str, pieces: Sequence[Piece]) -> list[str]:
    if not pieces:
        return []
    at, cuts = 0, []
    for p in pieces:
        k = text.find(p.label, at)
        if k < 0:
            return [text.strip(), *[""] * (len(pieces) - 1)]
        cuts.append(k)
        at = k + len(p.label)
    ends = [*cuts[1:], len(text)]
    return [text[k + len(p.label) : e].strip() for k, p, e in zip(cuts, pieces, ends, strict=True)]


class Server(Protocol):
    """What the route needs of ``app.Server`` (a protocol: no import of the app)."""

    options: ServeOptions
    service: ChatService | None

    async def read(self, request: HTTPRequest, lease: Lease, limit: int, limit_is: str = ...) -> bytes: ...


async def _form(request: HTTPRequest, body: bytes) -> FormData:
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise bad("the body must be multipart/form-data (file, model, ...)", "file")

    async def once() -> Any:
        yield body

    try:
        parser = MultiPartParser(request.headers, once(), max_files=1, max_fields=FIELDS_MAX, max_part_size=FIELD_BYTES)
        return await parser.parse()
    except MultiPartException as exc:
        raise bad(f"the form cannot be read: {exc.message}", "file") from None


def _read_file(upload: UploadFile) -> bytes:
    upload.file.seek(0)
    return upload.file.read()


def _uri(data: bytes) -> str:
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode()


async def transcribe(server: Server, request: HTTPRequest) -> Response:
    """``POST /v1/audio/transcriptions``: read and parse the form under a lease, then the chat
    path (``ChatService.admit``, ``submit``, ``whole``)."""
    service = server.service
    assert service is not None
    lease = service.lease("this recording")
    try:
        body = await server.read(request, lease, server.options.max_body_bytes)
        form = await _form(request, body)
        del body
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise bad("'file' must be the recording, sent as a file", "file")
            data = await run_in_threadpool(_read_file, upload)
            if not data:
                raise bad("'file' is empty", "file")
            uri = await run_in_threadpool(_uri, data)
            filename = upload.filename or "audio"
        finally:
            await form.close()
        lease.resize(len(uri) + len(data))  # (what it holds until the intake took the recording)
        call = parse_form(form, uri, filename, server.options.sampling)
        del data
        del uri
        service.admit(lease)
        pieces: list[Piece] = []
        heard: list[float | None] = []

        def seen(turn: Turn) -> None:
            pieces.extend(pieces_of(turn))
            heard.extend(turn.heard)

        job = await service.submit(call.request, request.is_disconnected, lease, seen=seen)
    except BaseException:
        lease.release()
        raise
    reply = await service.whole(job, call.request, request.is_disconnected)
    # (the recording's length as the intake decoded it, else the end of its last piece kept)
    known = heard[-1] if heard else None
    duration = known if known is not None else max((p.end for p in pieces), default=0.0)
    return answer(call, reply, pieces, duration)


def usage_tokens(reply: Reply) -> dict[str, Any]:
    audio = int(reply.stats.audio_tokens)
    return {
        "type": "tokens",
        "input_tokens": reply.prompt_tokens,
        "output_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "input_token_details": {"audio_tokens": audio, "text_tokens": reply.prompt_tokens - audio},
    }


def answer(call: Transcription, reply: Reply, pieces: Sequence[Piece], duration: float = 0.0) -> Response:
    """The reply in the asked format."""
    text = reply.text.strip()
    notices = reply.extension.get("notices") or []
    if call.response_format == "text":
        headers = {"x-edgevlm-notices": " | ".join(notices).encode("ascii", "replace").decode()} if notices else {}
        return PlainTextResponse(text, headers=headers)
    body: dict[str, Any] = {"text": text}
    if call.response_format == "verbose_json":
        body = {
            "task": "transcribe",
            "language": call.language or "unknown",
            "duration": round(duration, 3),
            "text": text,
            "segments": segments(text, pieces, call.request.sampling.temperature),
            "usage": {"type": "duration", "seconds": round(duration, 3)},
        }
    else:
        body["usage"] = usage_tokens(reply)
    if reply.extension:
        body["edgevlm"] = reply.extension
    return JSONResponse(body)


def transcription_routes(server: Server, guarded: Callable[..., Any]) -> list[Route]:
    """The route, behind the API key and errors in OpenAI's shape (``guarded``)."""

    async def route(request: HTTPRequest) -> Response:
        return await transcribe(server, request)

    return [Route(PATH, guarded(route), methods=["POST"])]
