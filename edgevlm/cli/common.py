"""Click pieces shared by the ``edgevlm`` commands: the one-line error, the error mapper,
parameter types, and the planner and sampling options (with the library's defaults)."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, replace

import click

from ..audio.budget import AudioBudget
from ..backend.sampling import SamplingParams
from ..backend.system import MAX_THREADS
from ..cluster.connect import DEFAULT_BATCH
from ..errors import EdgeVLMError
from ..model.kv_types import KV_CHOICES
from ..plan.context import AUTO_CTX_MAX
from ..plan.devices import DEFAULT_GPU_OVERHEAD, GPU_OVERHEAD, Probe, format_size, parse_size, probe
from ..plan.footprint import HOST_RESERVE
from ..plan.planner import Wishes
from ..serve.options import DEFAULT_PARALLEL, ServeOptions, serve_sequences
from ..vision.images import DEFAULT_MAX_PIXELS
from ..vision.merge import MergeSpec
from ..vision.video import VideoBudget

__all__ = [
    "AutoInt",
    "CLIError",
    "ImageSize",
    "JsonSchemaFile",
    "Merge",
    "Size",
    "Tiles",
    "echo_err",
    "handle_errors",
    "json_schema_option",
    "max_pixels_option",
    "merge_option",
    "plan_options",
    "Planning",
    "RayRun",
    "Reply",
    "ray_options",
    "sampling_options",
    "threads_option",
    "tiles_option",
]


class CLIError(click.ClickException):
    """A one-line error with our exit code."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        # click annotates exit_code as a ClassVar, yet reads it from the instance (``ctx.exit(e.exit_code)``)
        self.exit_code = exit_code  # type: ignore[misc]


yes_option = click.option(
    "--yes",
    "-y",
    is_flag=True,
    help="Download a model over 1 GiB without asking (off a terminal: also the default one, when no --model is given).",
)


def check_writable(path: str, what: str = "--out", folder_ok: bool = False) -> None:
    """A file (``folder_ok``: or a folder, such as a parquet dataset) to be written, checked before
    anything is downloaded or loaded: the nearest folder that exists on its way must be writable."""
    import os

    full = os.path.abspath(path)
    if os.path.isdir(full) and not folder_ok:
        raise CLIError(f"{what} {path}: is a folder, not a file", 2)
    folder = full if os.path.isdir(full) else os.path.dirname(full)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise CLIError(f"{what} {path}: {folder} is a file, not a folder", 2)
    if not os.access(folder, os.W_OK):
        raise CLIError(f"{what} {path}: cannot write in {folder} (permission denied)", 2)


def handle_errors(fn):
    """Map library errors to a ClickException at the edge."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgeVLMError as exc:
            raise CLIError(str(exc), exc.exit_code) from None

    return wrapper


class ImageSize(click.ParamType):
    """``WxH`` (e.g. ``1024x768``) or one number for a square."""

    name = "WxH"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        text = str(value).lower().replace("×", "x")
        try:
            parts = [int(p) for p in text.split("x")]
        except ValueError:
            self.fail(f"'{value}' is not WIDTHxHEIGHT (e.g. 1024x768)", param, ctx)
        if len(parts) == 1:
            parts = parts * 2
        if len(parts) != 2 or min(parts) <= 0:
            self.fail(f"'{value}' is not WIDTHxHEIGHT with positive sides", param, ctx)
        return tuple(parts)


class Tiles(click.ParamType):
    """``auto``, ``off`` or a number of tiles."""

    name = "auto|off|N"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value in ("auto", "off"):
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"'{value}' is not auto, off or a number", param, ctx)
        if n < 0:
            self.fail("the number of tiles cannot be negative", param, ctx)
        return n if n > 0 else "off"


class AutoInt(click.ParamType):
    """An integer, or ``auto`` (None) to let the planner choose."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        if str(value).lower() == "auto":
            return None
        try:
            return int(value)
        except ValueError:
            self.fail(f"'{value}' is not a whole number or 'auto'", param, ctx)


class Size(click.ParamType):
    """A memory size: ``8GiB``, ``6G``, ``512MiB``."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except EdgeVLMError as exc:
            self.fail(str(exc), param, ctx)


@dataclass(frozen=True)
class Planning:
    """What the planner options of a command say: the wishes and the devices to plan for."""

    wishes: Wishes
    device: str | None = None
    free_memory: tuple[str, ...] = ()
    gpu_overhead: int | None = None
    host_allowance: int | None = None  # --host-allowance as given (None: the command's default)

    def serving(self, parallel: int | None, merge: MergeSpec, cache_ram: int = 0) -> Wishes:
        """The wishes of a command that serves requests in flight (``serve``, ``batch``): the host
        allowance given, else the server's; a picture per request generated at once; and the
        output buffer counted for the most conversations any planned context keeps."""
        most = serve_sequences(self.wishes.n_ctx or AUTO_CTX_MAX, parallel or DEFAULT_PARALLEL)
        return replace(
            self.wishes,
            host_allowance=ServeOptions.host_allowance if self.host_allowance is None else self.host_allowance,
            images=max(self.wishes.images, parallel or 1),
            merge=str(merge),
            cache_ram=cache_ram,
            sequences=most,
        )

    def probe(self) -> Probe:
        return probe(self.device, list(self.free_memory), self.gpu_overhead)

    @property
    def probe_args(self) -> dict:
        return dict(device=self.device, free_memory=list(self.free_memory), gpu_overhead=self.gpu_overhead)


def plan_options(fn):
    """Options shared by every command that loads through the planner; the command gets them as
    one ``planning`` argument (a ``Planning``)."""

    @functools.wraps(fn)
    def wrapper(
        *args,
        ctx,
        ngl,
        kv,
        kv_offload,
        ubatch,
        image_tokens,
        n_images,
        host_reserve,
        host_allowance,
        free_memory,
        device,
        gpu_overhead,
        **kwargs,
    ):
        wishes = Wishes(
            n_ctx=ctx,
            image_tokens=image_tokens,
            images=n_images,
            kv=kv,
            kv_offload=kv_offload,
            n_gpu_layers=ngl,
            n_ubatch=ubatch,
            host_reserve=HOST_RESERVE if host_reserve is None else host_reserve,
            host_allowance=host_allowance or 0,
        )
        return fn(*args, planning=Planning(wishes, device, tuple(free_memory), gpu_overhead, host_allowance), **kwargs)

    for opt in reversed(
        [
            click.option(
                "--ctx",
                type=AutoInt(),
                default="auto",
                show_default=True,
                help="Context size in tokens, or auto (largest that fits, up to 8192).",
            ),
            click.option(
                "--ngl",
                type=AutoInt(),
                default="auto",
                show_default=True,
                help="Layers on the GPU (-1 = all), or auto.",
            ),
            click.option(
                "--kv",
                type=click.Choice(["auto", *KV_CHOICES]),
                default="auto",
                show_default=True,
                help="KV cache type.",
            ),
            click.option(
                "--kv-offload/--no-kv-offload",
                default=None,
                help="The KV cache on the GPU, or on the host (attention on the CPU, more room for layers) "
                "[default: weighed by measured decode speed when not every layer fits].",
            ),
            click.option(
                "--ubatch",
                type=AutoInt(),
                default="auto",
                show_default=True,
                help="Micro-batch in tokens, or auto (512, lowered when memory is short).",
            ),
            click.option("--image-tokens", type=click.IntRange(1), help="Token budget per image."),
            click.option(
                "--images",
                "n_images",
                type=click.IntRange(0),
                default=1,
                show_default=True,
                help="Images to keep in context at once.",
            ),
            click.option(
                "--host-reserve",
                type=Size(),
                default=None,
                help=f"Free RAM left to the process itself, not planned for [default: {format_size(HOST_RESERVE)}].",
            ),
            click.option(
                "--host-allowance",
                type=Size(),
                default=None,
                help="RAM planned for requests in flight and waiting: bodies, decoded pictures, views "
                f"[default: serve and batch {format_size(ServeOptions.host_allowance)}, others 0].",
            ),
            click.option(
                "--free-memory",
                multiple=True,
                metavar="[DEV=]SIZE",
                help="What-if free memory per GPU (repeatable), e.g. 8GiB or CUDA0=6GiB; cpu=SIZE for RAM.",
            ),
            click.option("--device", help="cpu, or one GPU by name (CUDA0); default: all."),
            click.option(
                "--gpu-overhead",
                type=Size(),
                help="Memory kept free per GPU beside llama.cpp's buffers [default: measured per backend: "
                + ", ".join(f"{k} {format_size(v)}" for k, v in GPU_OVERHEAD.items())
                + f"; {format_size(DEFAULT_GPU_OVERHEAD)} elsewhere].",
            ),
        ]
    ):
        wrapper = opt(wrapper)
    return wrapper


@dataclass(frozen=True)
class Reply:
    """What the sampling options say: a reply's length, its sampler and its stop strings."""

    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


def _sampler_options(d: SamplingParams, of: str = "", max_temp: float | None = None) -> list:
    """--temp, --top-k, --top-p, --min-p with ``d``'s defaults (``of``: whose, in the help)."""
    return [
        click.option("--temp", default=d.temperature, show_default=True, type=click.FloatRange(0, max_temp),
                     help=f"Temperature{of} (0 = greedy)."),
        click.option("--top-k", default=d.top_k, show_default=True, type=click.IntRange(0), help=f"top_k{of}."),
        click.option("--top-p", default=d.top_p, show_default=True, type=click.FloatRange(0, 1), help=f"top_p{of}."),
        click.option("--min-p", default=d.min_p, show_default=True, type=click.FloatRange(0, 1), help=f"min_p{of}."),
    ]  # fmt: skip


def _apply(wrapper, options: list):
    for opt in reversed(options):
        wrapper = opt(wrapper)
    return wrapper


def sampling_options(max_tokens: int, d: SamplingParams):
    """-n/--max-tokens, --temp, --top-k, --top-p, --min-p, --seed, --stop, their defaults from
    the command's own options (``ReplyDefaults``, ``CaptionSettings``); the command gets them as
    one ``reply`` argument (a ``Reply``)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, max_tokens, temp, top_k, top_p, min_p, seed, stop, **kwargs):
            sampling = SamplingParams(temp, top_k, top_p, min_p, seed)
            return fn(*args, reply=Reply(max_tokens, sampling, tuple(stop)), **kwargs)

        return _apply(wrapper, [
            click.option("--max-tokens", "-n", default=max_tokens, show_default=True, type=click.IntRange(1)),
            *_sampler_options(d),
            click.option("--seed", type=int, help="Seed for sampling (reproducible with --temp > 0)."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        ])  # fmt: skip

    return deco


def request_defaults_options(fn):
    """-n/--max-tokens, --temp, --top-k, --top-p, --min-p, --reasoning-budget of ``serve`` and
    ``batch``: the reply of requests that name none (defaults: ``ServeOptions``); the command gets
    ``max_tokens``, ``reasoning_budget`` and one ``sampling`` argument."""

    @functools.wraps(fn)
    def wrapper(*args, temp, top_k, top_p, min_p, **kwargs):
        return fn(*args, sampling=SamplingParams(temp, top_k, top_p, min_p), **kwargs)

    return _apply(wrapper, [
        click.option("--max-tokens", "-n", default=ServeOptions.max_tokens, show_default=True,
                     type=click.IntRange(1), help="Reply length for requests that name no max_tokens."),
        *_sampler_options(ServeOptions.sampling, " of requests that name none", 2.0),
        click.option("--reasoning-budget", default=ServeOptions.reasoning_budget, show_default=True,
                     type=click.IntRange(-1), metavar="N",
                     help="Thinking models: most tokens of a <think> block, then </think> is put in "
                          "(-1 no cap, 0 no reasoning)."),
    ])  # fmt: skip


@dataclass(frozen=True)
class RayRun:
    """What --ray, --actors and --ray-batch say (``address`` None: not on Ray)."""

    address: str | None
    actors: int | None
    batch: int


def ray_options(what: str, action: str):
    """--ray, --actors, --ray-batch (``what`` goes to an actor per call); one ``ray`` argument."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, ray_address, actors, ray_batch, **kwargs):
            if actors is not None and ray_address is None:
                raise CLIError("--actors needs --ray", 2)
            return fn(*args, ray=RayRun(ray_address, actors, ray_batch), **kwargs)

        for opt in reversed(
            [
                click.option(
                    "--ray",
                    "ray_address",
                    metavar="ADDRESS",
                    help=f"{action} on Ray: local (a Ray instance started here), auto, HOST:PORT or "
                    "ray://HOST:PORT (pip install 'edgevlm[ray]').",
                ),
                click.option(
                    "--actors",
                    type=AutoInt(),
                    default="auto",
                    show_default=True,
                    help="--ray: actors, each loading the model once (auto: one per GPU, else one per node).",
                ),
                click.option(
                    "--ray-batch",
                    default=DEFAULT_BATCH,
                    show_default=True,
                    type=click.IntRange(1),
                    help=f"--ray: {what} per actor call (what a killed actor's retry redoes).",
                ),
            ]
        ):
            wrapper = opt(wrapper)
        return wrapper

    return deco


def tiles_option(fn):
    return click.option(
        "--tiles",
        type=Tiles(),
        default="auto",
        show_default=True,
        help="Detail tiles for fixed-size encoders (LLaVA-1.5) within --image-tokens.",
    )(fn)


def merge_option(fn):
    return click.option(
        "--merge",
        "merge",
        type=Merge(),
        default="off",
        show_default=True,
        help="Merge similar adjacent image tokens: off, threshold:T, ratio:R or tokens:N.",
    )(fn)


def video_options(fn):
    """--video-tokens, --max-frames, --fps: how a clip's frames are chosen (defaults:
    ``VideoBudget``); the command gets one ``video`` argument."""

    @functools.wraps(fn)
    def wrapper(*args, video_tokens, max_frames, fps, **kwargs):
        return fn(*args, video=VideoBudget(tokens=video_tokens, max_frames=max_frames, fps=fps), **kwargs)

    return _apply(wrapper, [
        click.option("--video-tokens", type=click.IntRange(1), default=VideoBudget.tokens,
                     help="A clip's tokens, all frames together (default: the room the context has left)."),
        click.option("--max-frames", type=click.IntRange(1), default=VideoBudget.max_frames,
                     help="At most this many frames of a clip (default: as the budget allows)."),
        click.option("--fps", type=click.FloatRange(0, min_open=True), default=VideoBudget.fps, show_default=True,
                     help="At most this many frames a second are looked at (a cap, not a promise)."),
    ])  # fmt: skip


def audio_options(fn):
    """--audio-tokens, --keep-silence, --max-audio-seconds: what a recording may cost (defaults:
    ``AudioBudget``); the command gets one ``audio`` argument."""

    @functools.wraps(fn)
    def wrapper(*args, audio_tokens, keep_silence, max_audio_seconds, **kwargs):
        budget = AudioBudget(tokens=audio_tokens, keep_silence=keep_silence, max_seconds=max_audio_seconds)
        return fn(*args, audio=budget, **kwargs)

    return _apply(wrapper, [
        click.option("--audio-tokens", type=click.IntRange(1), default=AudioBudget.tokens,
                     help="A recording's tokens, all its pieces together (default: the room the context has left); "
                          "a longer one is cut to what fits, and the reply says what was left out."),
        click.option("--keep-silence", is_flag=True, default=AudioBudget.keep_silence,
                     help="Keep long silences in recordings (by default they are dropped before encoding)."),
        click.option("--max-audio-seconds", type=click.FloatRange(0, min_open=True), default=AudioBudget.max_seconds,
                     show_default=True, help="Refuse recordings longer than this, before decoding them."),
    ])  # fmt: skip


def threads_option(fn):
    return click.option(
        "--threads", type=click.IntRange(1), help=f"CPU threads (default: physical cores, ≤ {MAX_THREADS})."
    )(fn)


def max_pixels_option(help_text: str):
    return click.option(
        "--max-pixels", default=DEFAULT_MAX_PIXELS, show_default=True, type=click.IntRange(1), help=help_text
    )


def echo_err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Merge(click.ParamType):
    """``off``, ``threshold:T``, ``ratio:R``, ``tokens:N``: visual token merging."""

    name = "off|threshold:T|ratio:R|tokens:N"

    def convert(self, value, param, ctx):
        if isinstance(value, MergeSpec):
            return value
        try:
            return MergeSpec.parse(value)
        except EdgeVLMError as exc:
            self.fail(str(exc), param, ctx)


class JsonSchemaFile(click.ParamType):
    """A JSON Schema file → the parsed schema (a dict); a bad file is one line naming it."""

    name = "FILE"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            with open(value, encoding="utf-8") as fh:
                schema = json.load(fh)
        except OSError as exc:
            self.fail(f"{value}: cannot read ({exc.strerror or exc})", param, ctx)
        except ValueError as exc:
            self.fail(f"{value}: not JSON ({exc})", param, ctx)
        except RecursionError:
            self.fail(f"{value}: nests too deeply to be a JSON Schema", param, ctx)
        if not isinstance(schema, dict):
            self.fail(f"{value}: a JSON Schema is an object, not {type(schema).__name__}", param, ctx)
        from ..runtime.gbnf import LIMITS
        from ..runtime.jsonrules import nests_deeper

        most = 2 * LIMITS.schema_depth  # (JSON levels: a schema in "properties" is two deeper)
        if nests_deeper(schema, most):
            self.fail(f"{value}: nests deeper than {most} levels", param, ctx)
        return schema


def json_schema_option(what: str):
    return click.option(
        "--json-schema",
        "json_schema",
        type=JsonSchemaFile(),
        default=None,
        help=f"Constrain {what} to JSON matching this JSON Schema file (a grammar during sampling).",
    )
