"""``edgevlm serve``: the OpenAI-compatible server (``edgevlm.serve``) on uvicorn."""

from __future__ import annotations

import contextlib
import math
import os
import sys

import click

from ..plan.devices import format_size
from ..runtime.sched_options import PROFILES, SchedulerOptions
from ..serve.options import ServeOptions
from .common import (
    AutoInt,
    Size,
    audio_options,
    echo_err,
    handle_errors,
    max_pixels_option,
    merge_option,
    plan_options,
    request_defaults_options,
    threads_option,
    tiles_option,
    video_options,
    yes_option,
)

__all__ = ["serve"]


@click.command()
@click.option(
    "--model",
    "-m",
    help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
    "(default: the registry's small default that fits, see edgevlm models; $EDGEVLM_MODEL).",
)
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8080,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port (0: any free one, printed at start).",
)
@click.option(
    "--ollama-port",
    default=ServeOptions.ollama_port,
    type=click.IntRange(0, 65535),
    help="Also answer Ollama's API on this port (11434 is Ollama's own): /api/chat, /api/generate, "
    "/api/tags ... and GET / for clients that talk to Ollama (Open WebUI); /api/... is on --port too.",
)
@click.option(
    "--parallel",
    type=AutoInt(),
    default="auto",
    show_default=True,
    help="Requests generated together in one batch (auto: up to 4, as many as the context holds).",
)
@click.option(
    "--profile",
    type=click.Choice(PROFILES),
    default=SchedulerOptions.profile,
    show_default=True,
    help="latency: running streams keep their pace while pictures come in (chat clients); "
    "throughput: the least CPU per request, for servers whose clients only run batch jobs.",
)
@click.option(
    "--queue",
    default=ServeOptions.queue,
    show_default=True,
    type=click.IntRange(0),
    help="Requests that may wait for a free sequence; more get 503 with Retry-After.",
)
@click.option(
    "--cache-ram",
    type=Size(),
    default=None,
    help="Host RAM for idle conversations moved out of the KV cache, copied back when they "
    f"return (planned) [default: {format_size(ServeOptions.cache_ram)}]; 0: drop them.",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    help="A folder for idle conversations pushed out of RAM, kept across restarts: a restarted server with the "
    "same model answers a returning conversation from it. A graceful stop writes the rest there too.",
)
@click.option(
    "--cache-disk",
    type=Size(),
    default=None,
    help=f"The most --cache-dir holds, least recently used out [default: {format_size(ServeOptions.cache_disk)}].",
)
@click.option(
    "--api-key",
    envvar="EDGEVLM_API_KEY",
    help="Key every API asks for (Bearer, or Anthropic's x-api-key), /status and /metrics too; /health stays "
    "open ($EDGEVLM_API_KEY).",
)
@click.option(
    "--max-body",
    type=Size(),
    default=ServeOptions.max_body_bytes,
    help=f"Largest request body (images inline); larger gets 413 [default: "
    f"{format_size(ServeOptions.max_body_bytes)}].",
)
@click.option(
    "--body-timeout",
    default=ServeOptions.body_timeout_s,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds a request body may take to arrive, plus 1 s per --body-min-rate bytes that came; "
    "a slower body gets 408 and gives its memory back (a request takes its place once its body is in).",
)
@click.option(
    "--host-wait",
    default=ServeOptions.host_wait_s,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds a request may wait for host memory (--host-allowance) that others hold; then 503.",
)
@click.option(
    "--header-timeout",
    default=ServeOptions.header_timeout_s,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Seconds a new connection may take to send its request line and headers; then it is closed.",
)
@click.option(
    "--body-min-rate",
    type=Size(),
    default=ServeOptions.body_min_rate,
    help="The slowest a body may arrive on average, in bytes a second (see --body-timeout) "
    f"[default: {format_size(ServeOptions.body_min_rate)}].",
)
@request_defaults_options
@click.option(
    "--timeout",
    default=ServeOptions.timeout_s,
    show_default=True,
    type=click.FloatRange(1),
    help="Seconds a request may take, waiting included.",
)
@click.option(
    "--shutdown-grace",
    default=ServeOptions.shutdown_grace_s,
    show_default=True,
    type=click.FloatRange(0),
    help="On SIGTERM or Ctrl-C: seconds replies in progress may take to finish before they end "
    "(cut short, with their last event); waiting requests get 503 at once. A second signal stops at once.",
)
@click.option(
    "--allow-private-urls",
    is_flag=True,
    help="Fetch image URLs that resolve to loopback, private or link-local addresses.",
)
@click.option(
    "--allow-path",
    multiple=True,
    type=click.Path(file_okay=False, exists=True),
    help="A folder whose files requests may name as images (repeatable).",
)
@click.option("--model-id", help="The model's name in /v1/models (default: the model file's name).")
@tiles_option
@video_options
@audio_options
@merge_option
@plan_options
@threads_option
@max_pixels_option("Refuse images with more pixels than this (decompression-bomb guard).")
@click.option("--verbose", "-v", is_flag=True, help="llama.cpp's logs and an access log.")
@yes_option
@handle_errors
def serve(
    model,
    mmproj,
    host,
    port,
    ollama_port,
    parallel,
    profile,
    queue,
    cache_ram,
    cache_dir,
    cache_disk,
    api_key,
    max_body,
    body_timeout,
    body_min_rate,
    host_wait,
    header_timeout,
    max_tokens,
    sampling,
    reasoning_budget,
    timeout,
    shutdown_grace,
    allow_private_urls,
    allow_path,
    model_id,
    tiles,
    video,
    audio,
    merge,
    planning,
    threads,
    max_pixels,
    verbose,
    yes,
) -> None:
    """Serve a model to apps and agents, with pictures, planned to never run out of memory.

    \b
    One port (--port) speaks every API:
      OpenAI chat completions   POST /v1/chat/completions
      OpenAI Responses          POST /v1/responses, GET|DELETE /v1/responses/ID
      Anthropic Messages        POST /v1/messages, /v1/messages/count_tokens
      OpenAI transcriptions     POST /v1/audio/transcriptions (a model with an audio encoder)
      Ollama                    /api/chat, /api/generate, /api/tags, /api/show ...
                                (also on a port of its own: --ollama-port 11434)
      models                    GET /v1/models
      a picture's (recording's) cost  POST /v1/edgevlm/budget
      the web page              GET /
      state                     GET /health (open), /status, /metrics

    \b
    edgevlm serve -m llava-1.5-7b --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    import uvicorn

    from ..api import load
    from ..plan.planner import make_plan
    from ..runtime.engine import EngineOptions
    from ..serve.app import create_app
    from ..serve.listen import Listener, bind, header_deadline
    from ..serve.ollama_routes import ollama_app
    from ..serve.options import serve_layout
    from .common import CLIError
    from .loading import model_paths
    from .render import render_plan

    if parallel is not None and parallel < 1:
        raise CLIError(f"--parallel {parallel}: give 1 or more, or auto", 2)
    # the ports first: one in use is a line now, not uvicorn's error after planning and loading
    sockets = bind(host, port)
    ollama_sockets = bind(host, ollama_port, "--ollama-port") if ollama_port is not None else None
    cache_ram = ServeOptions.cache_ram if cache_ram is None else cache_ram
    cache_disk = ServeOptions.cache_disk if cache_disk is None else cache_disk
    if cache_dir:
        check_cache_dir(cache_dir, cache_disk)
    wishes = planning.serving(parallel, merge, cache_ram)
    spec = model
    model, mmproj = model_paths(model, mmproj, probe_args=planning.probe_args, wishes=wishes, yes=yes)
    measure = planning.probe
    plan = make_plan(model, mmproj, measure(), wishes)
    render_plan(plan, file=sys.stderr)
    if not plan.fits:
        raise CLIError(plan.refusal or "does not fit", 1)
    sequences, slots = serve_layout(plan.n_ctx, plan.image_max_tokens, max_tokens, parallel, wishes.sequences)
    name = spec if spec and not os.path.isfile(spec) else os.path.splitext(os.path.basename(model))[0]
    options = ServeOptions(
        model_id=model_id or name,
        api_key=api_key,
        ollama_port=ollama_port,
        queue=queue,
        max_body_bytes=max_body,
        body_timeout_s=body_timeout,
        body_min_rate=body_min_rate,
        host_wait_s=host_wait,
        header_timeout_s=header_timeout,
        max_tokens=max_tokens,
        sampling=sampling,
        reasoning_budget=reasoning_budget,
        timeout_s=timeout,
        shutdown_grace_s=shutdown_grace,
        allow_private_urls=allow_private_urls,
        allow_paths=tuple(allow_path),
        host_allowance=plan.host_allowance,
        cache_ram=plan.cache_ram,
        cache_dir=cache_dir,
        cache_disk=cache_disk,
    )
    engine_options = EngineOptions(
        image_tokens=wishes.image_tokens,
        tiles=tiles,
        merge=merge,
        max_image_pixels=max_pixels,
        video=video,
        audio=audio,  # (--audio-tokens: one request's recordings at most; --max-audio-seconds: longer is a 400)
    )
    outcome = {"code": 0}

    def load_model():
        vlm = load(
            model,
            mmproj,
            plan=plan,
            options=engine_options,
            measure=measure,
            n_threads=threads,
            n_seq_max=sequences,
            parallel=slots,
            scheduler_options=SchedulerOptions(profile=profile, cache_dir=cache_dir, cache_disk=cache_disk),
            verbose=verbose,
        )
        where = [f"http://{h}:{p}" for h, p in bound(server)] or [f"http://{host}:{port}"]
        beside = server.beside
        ollama = ", ".join(f"http://{h}:{p}" for h, p in bound(beside)) if beside is not None else ""
        if server.should_exit:  # (stopping already: a port it could not listen on, Ctrl-C)
            return vlm
        # the page first: the address a person opens; the API's base URL is what clients are given
        page, api = ", ".join(f"{w}/" for w in where), ", ".join(f"{w}/v1" for w in where)
        echo_err(
            f"ready: the page {page} · API {api} · model {options.model_id} · {vlm.scheduler.max_running} request(s) "
            f"at once · {vlm.scheduler.n_slots} conversations kept · context {vlm.n_ctx} · queue {queue}"
            + (f" · Ollama's API: {ollama or f'http://{host}:{ollama_port}'}" if beside is not None else "")
        )
        return vlm

    def failed(exc: BaseException) -> None:
        echo_err(f"Error: {exc}")
        outcome["code"] = getattr(exc, "exit_code", 1)
        server.should_exit = True

    def stopping(since: float) -> None:  # the first SIGTERM / Ctrl-C (serve.listen)
        app.state.server.drain(since)
        if server.signalled_at is not None:
            echo_err(f"stopping: replies in progress get up to {shutdown_grace:g} s (a second signal stops at once)")

    app = create_app(load_model, options, on_error=failed)
    level = "info" if verbose else "warning"
    # uvicorn's own bound on the connections left once the grace is over (their last events sent)
    common = dict(
        log_level=level,
        access_log=verbose,
        timeout_graceful_shutdown=math.ceil(shutdown_grace) + 1,
        http=header_deadline(options.header_timeout_s),  # (a socket trickling its headers is closed)
    )
    server = Listener(
        uvicorn.Config(app, host=host, port=port, lifespan="on", **common),
        None
        if ollama_port is None
        else uvicorn.Config(ollama_app(app), host=host, port=ollama_port, lifespan="off", **common),
        ollama_sockets,
        on_stop=stopping,
    )
    echo_err(
        f"edgevlm serve: loading {os.path.basename(model)} ({slots} request(s) at once); "
        f"GET /health answers 503 until it is ready"
    )
    server.run(sockets)
    if server.beside is not None and server.beside.failed:
        echo_err(f"Error: --ollama-port {ollama_port}: cannot listen on {host}:{ollama_port}")
        outcome["code"] = outcome["code"] or 1
    sys.exit(outcome["code"] or (0 if server.started else 1))


def bound(server) -> list[tuple[str, int]]:
    """The addresses uvicorn listens on (the real port when --port 0)."""
    out = []
    for srv in getattr(server, "servers", []) or []:
        for sock in srv.sockets or []:
            name = sock.getsockname()
            out.append((name[0], name[1]))
    return out


def check_cache_dir(folder: str, size: int) -> None:
    """``--cache-disk`` planned like the RAM tier: what the folder's disk has free (with the
    cache's own files, which it may replace) must hold it. One line otherwise, exit 2."""
    import shutil

    from .common import CLIError

    probe = os.path.abspath(folder)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # (the folder is made when the model loads)
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        raise CLIError(f"--cache-dir {folder}: {exc.strerror or exc}", 2) from None
    own = 0
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(".evlm"):
                with contextlib.suppress(OSError):
                    own += os.path.getsize(os.path.join(folder, name))
    if size > free + own:
        raise CLIError(
            f"--cache-disk {format_size(size)}: {folder} has {format_size(free + own)} for it "
            f"(free space and its own files); give less",
            2,
        )
