"""The ``edgevlm`` command: a thin click layer over the library.

Each command parses its options, calls the library, formats the result, and turns an
``EdgeVLMError`` into one line on stderr and the error's exit code (never a traceback).
"""

from __future__ import annotations

import json
import sys

import click

# Shared with caption_cmd (no import cycle through this module); importable from here too.
from .cli_types import (  # noqa: F401
    AutoInt,
    CLIError,
    ImageSize,
    Size,
    Tiles,
    handle_errors,
    plan_options,
    sampling_options,
    wishes_from,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgevlm")
def main() -> None:
    """Run GGUF vision-language models through llama.cpp, planned to fit in memory."""


def _not_yet(name: str, issue: int) -> None:
    raise CLIError(f"'edgevlm {name}' is not implemented yet (planned in issue #{issue})", 3)


@main.command()
@click.option("--model", "-m", required=True,
              help="GGUF path, registry name (llava-1.5-7b[:q8_0]), hf:owner/repo/file.gguf, or demo.")
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@handle_errors
def plan(model, mmproj, ctx, ngl, kv, image_tokens, n_images, free_memory, device, gpu_overhead,
         as_json) -> None:
    """Plan GPU layers, context, KV types and the encoder's place from measured free memory.

    \b
    edgevlm plan -m model.gguf --mmproj mmproj.gguf
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --free-memory 8GiB --json
    """
    from .devices import probe
    from .planner import make_plan

    import os

    pr = probe(device, list(free_memory), gpu_overhead)
    wishes = wishes_from(ctx, ngl, kv, image_tokens, n_images)
    if os.path.isfile(model):
        p = make_plan(model, mmproj, pr, wishes)  # local files
    else:
        from .models_cmd import plan_for_spec

        p = plan_for_spec(model, mmproj, pr, wishes)  # names / hf: / demo: header-only if not pulled
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
    else:
        render_plan(p)
    if not p.fits:
        raise CLIError(p.refusal or "does not fit", 1)


_BAR = (("weights", "blue"), ("kv", "magenta"), ("compute", "yellow"), ("encoder", "green"))


def render_plan(p, file=None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .devices import format_size

    console = Console(highlight=False, soft_wrap=True, file=file)
    t = Table(title="plan", show_header=False, box=None, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("fits", "yes" if p.fits else f"NO — {format_size(p.shortfall_bytes)} short"),
        ("n_gpu_layers", p.n_gpu_layers), ("n_ctx", p.n_ctx),
        ("n_batch / n_ubatch", f"{p.n_batch} / {p.n_ubatch}"),
        ("KV cache", f"K {p.type_k}, V {p.type_v}"), ("flash attention", "on" if p.flash_attn else "off"),
        ("vision encoder", "GPU" if p.mmproj_on_gpu else "CPU"),
        ("image budget", f"{p.image_max_tokens} tokens; {p.max_images_in_context} image(s) in context"),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    width = 40

    def sz(n: int) -> str:
        return f"{n / 2**30:.1f}G" if abs(n) >= 2**30 else f"{n / 2**20:.0f}M"

    dt = Table(title="memory per device (M = MiB, G = GiB)", box=None, title_justify="left")
    for col in ("device", "free", "weights", "KV", "compute", "encoder", "total", "headroom"):
        dt.add_column(col, justify="left" if col == "device" else "right", no_wrap=True)
    bars = []
    for d in p.devices:
        b = d.predicted
        parts = {"weights": b.weights + b.other, "kv": b.kv, "compute": b.compute,
                 "encoder": b.mmproj_weights + b.mmproj_compute}
        scale = max(d.budget_bytes, b.total, 1)
        bar = Text(f"{d.name:>6} ")
        used = 0
        for key, colour in _BAR:
            n = round(parts[key] / scale * width)
            bar.append("█" * n, style=colour)
            used += n
        bar.append("░" * max(0, width - used), style="dim")
        bars.append(bar)
        dt.add_row(f"{d.name} ({d.kind})", sz(d.free_bytes), sz(parts["weights"]), sz(b.kv),
                   sz(b.compute), sz(parts["encoder"]), sz(b.total),
                   Text(sz(d.headroom_bytes), style="red" if d.headroom_bytes < 0 else "green"))
    console.print(dt)
    for bar in bars:
        console.print(bar)
    legend = Text("  ")
    for key, colour in _BAR:
        legend.append("█", style=colour).append(f" {key}  ")
    legend.append("░", style="dim").append(" headroom")
    console.print(legend)
    console.print("why:")
    for r in p.reasons:
        console.print(f"  - {r}")


@main.command()
@click.argument("prompt", required=False)
@click.option("--model", "-m",
              help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
                   "(default: the largest registry model that fits; $EDGEVLM_MODEL).")
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@click.option("--image", "-i", "images", multiple=True, type=click.Path(dir_okay=False),
              help="Image for the first message (repeatable).")
@click.option("--system", help="System prompt.")
@sampling_options(max_tokens=512, temp=0.2)
@click.option("--tiles", type=Tiles(), default="auto", show_default=True,
              help="Detail tiles for fixed-size encoders (LLaVA-1.5) within --image-tokens.")
@click.option("--evict", type=click.Choice(["summary", "off"]), default="summary", show_default=True,
              help="When the context is full: replace old images by their summary, or fail.")
@click.option("--summary-prompt", help="Prompt used to summarise an image ({n}, {name}).")
@click.option("--merge", "merge_spec", default="off", show_default=True,
              help="Merge similar adjacent image tokens: off, threshold:T, ratio:R or tokens:N.")
@plan_options
@click.option("--threads", type=click.IntRange(1), help="CPU threads (default: physical cores, ≤ 8).")
@click.option("--max-pixels", default=100_000_000, show_default=True, type=click.IntRange(1),
              help="Refuse images with more pixels than this (decompression-bomb guard).")
@click.option("--stats", "show_stats", is_flag=True, help="Print a one-line stats footer to stderr.")
@click.option("--json", "as_json", is_flag=True, help="One-shot: print one JSON object {text, stats}.")
@click.option("--verbose", "-v", is_flag=True, help="Show llama.cpp's own logs.")
@handle_errors
def chat(prompt, model, mmproj, images, system, max_tokens, temp, top_k, top_p, min_p, seed, stop,
         tiles, evict, summary_prompt, merge_spec, ctx, ngl, kv, image_tokens, n_images, free_memory, device, gpu_overhead, threads, max_pixels,
         show_stats, as_json, verbose) -> None:
    """Chat with a vision-language model about images.

    \b
    One-shot:     edgevlm chat -m model.gguf --mmproj mmproj.gguf -i photo.jpg "Describe it"
    Interactive:  edgevlm chat -m model.gguf --mmproj mmproj.gguf
    Scripted:     printf '/image a.png\\nWhat is it?\\n' | edgevlm chat -m ... --mmproj ...
    """
    from .chat_cli import run_chat
    from .models_cmd import model_paths

    model, mmproj = model_paths(
        model, mmproj, quiet=as_json,
        probe_args=dict(device=device, free_memory=list(free_memory), gpu_overhead=gpu_overhead),
        wishes=wishes_from(ctx, ngl, kv, image_tokens, n_images))
    code = run_chat(
        prompt=prompt, model=model, mmproj=mmproj, images=list(images), system=system,
        gen=dict(max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                 seed=seed, stop=list(stop)),
        load_options=dict(n_ctx=ctx, n_gpu_layers=ngl, kv=kv, image_tokens=image_tokens,
                          images=n_images, device=device, free_memory=list(free_memory),
                          gpu_overhead=gpu_overhead, n_threads=threads),
        max_pixels=max_pixels, show_stats=show_stats, as_json=as_json, verbose=verbose,
        image_tokens=image_tokens, tiles=tiles, evict=evict, summary_prompt=summary_prompt,
        merge=merge_spec,
    )
    sys.exit(code)


@main.command()
@click.argument("image", type=click.Path(dir_okay=False))
@click.option("--mmproj", required=True, type=click.Path(dir_okay=False), help="Vision projector GGUF.")
@click.option("--image-tokens", type=click.IntRange(1), help="Token budget for this image.")
@click.option("--tiles", type=Tiles(), default="auto", show_default=True,
              help="Detail tiles for fixed-size encoders (LLaVA-1.5).")
@click.option("--scorer", type=click.Choice(["edges", "entropy", "compress"]), default="edges",
              show_default=True, help="How tile detail is scored.")
@click.option("--overlay", type=click.Path(dir_okay=False), help="Write a PNG showing the views.")
@click.option("--max-pixels", default=100_000_000, show_default=True, type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Print the image plan as JSON.")
@handle_errors
def budget(image, mmproj, image_tokens, tiles, scorer, overlay, max_pixels, as_json) -> None:
    """Show how an image is split and budgeted before the encoder runs.

    \b
    edgevlm budget photo.jpg --mmproj mmproj.gguf --image-tokens 2304 --overlay views.png
    """
    from .budget import draw_overlay, plan_image
    from .gguf_info import load_projector
    from .images import load_image

    proj = load_projector(mmproj)
    img = load_image(image, max_pixels)
    ip = plan_image(img, proj, image_tokens, tiles, scorer=scorer)
    if overlay:
        draw_overlay(img, ip, overlay)
    if as_json:
        click.echo(json.dumps({"image": image, "projector_type": proj.projector_type, **ip.to_dict()}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    title = (f"{image} {img.width}x{img.height} · {ip.kind} · total {ip.total_tokens} tokens"
             + (f" (budget {image_tokens})" if image_tokens else ""))
    t = Table(title=title, title_justify="left", box=None)
    for col in ("view", "box", "sent as", "tokens", "score", "selected"):
        t.add_column(col, justify="right" if col in ("tokens", "score") else "left")
    for v in ip.views:
        t.add_row(v.label, "{},{}–{},{}".format(*v.box), f"{v.size[0]}x{v.size[1]}", str(v.tokens),
                  "" if v.score is None else f"{v.score:.2f}", "yes" if v.selected else "-")
    console.print(t)
    for n in ip.notes:
        console.print(f"note: {n}")
    if overlay:
        console.print(f"overlay written to {overlay}")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--mmproj", type=click.Path(dir_okay=False), help="Vision projector to check against FILE.")
@click.option("--image-size", type=ImageSize(), default=None,
              help="Image size for the token count (default: the projector's native size).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def inspect(file, mmproj, image_size, as_json) -> None:
    """Show what a GGUF model or projector holds (metadata and tensor table only).

    \b
    edgevlm inspect model.gguf
    edgevlm inspect model.gguf --mmproj mmproj.gguf --json
    """
    from .inspect import inspect_files, pair_error

    report = inspect_files(file, mmproj, image_size)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _render_inspect(report)
    err = pair_error(report)
    if err is not None:
        raise err


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _render_inspect(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    if "model" in report:
        m = report["model"]
        t = Table(title=f"text model  {m['path']}", show_header=False, box=None, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        per = m["weight_bytes_per_layer"]
        rows = [
            ("arch", m["arch"]), ("name", m["name"]), ("file_type", m["file_type"]),
            ("n_layer", m["n_layer"]), ("n_embd", m["n_embd"]),
            ("n_head / n_head_kv", f"{m['n_head']} / {m['n_head_kv']}"), ("head_dim", m["head_dim"]),
            ("n_ff", m["n_ff"]), ("n_vocab", m["n_vocab"]), ("n_ctx_train", m["n_ctx_train"]),
            ("weights", _mib(m["weight_bytes"])),
            ("  per layer", _mib(max(per)) if per else "-"),
            ("  outside layers", _mib(m["weight_bytes_outside_layers"])),
            ("chat template", "yes" if m["has_chat_template"] else "no (family fallback)"),
        ]
        if m["n_swa"]:
            rows.insert(9, ("sliding window", m["n_swa"]))
        for k, v in rows:
            t.add_row(k, str(v))
        console.print(t)
    if "mmproj" in report:
        p = report["mmproj"]
        t = Table(title=f"vision projector  {p['path']}", show_header=False, box=None, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        it = p["image_tokens"]
        rows = [
            ("projector_type", p["projector_type"]), ("file_type", p["file_type"]),
            ("image_size / patch_size", f"{p['image_size']} / {p['patch_size']}"),
            ("vision n_layer", p["n_layer"]), ("vision n_embd", p["n_embd"]),
            ("output width", p["n_mmproj_embd"]), ("weights", _mib(p["weight_bytes"])),
        ]
        if p["image_grid_pinpoints"]:
            rows.append(("pinpoints", " ".join(f"{w}x{h}" for w, h in p["image_grid_pinpoints"])))
        if p["spatial_merge_size"]:
            rows.append(("spatial merge", p["spatial_merge_size"]))
        for key in ("image_min_pixels", "image_max_pixels"):
            if p[key]:
                rows.append((key, p[key]))
        rows.append((f"image tokens @ {it['width']}x{it['height']}",
                     f"{it['n_tokens']} in {it['n_chunks']} chunk(s), {it['n_pos']} positions"))
        for k, v in rows:
            t.add_row(k, str(v))
        console.print(t)
    if "pair" in report:
        ok = report["pair"]["compatible"]
        console.print("pair: [green]compatible[/]" if ok else "pair: [red]NOT compatible[/]")


from .caption_cmd import caption  # noqa: E402  (defined in its own module, registered here)

main.add_command(caption)

from .models_cmd import models, pull, rm  # noqa: E402

for _cmd in (pull, models, rm):
    main.add_command(_cmd)

if __name__ == "__main__":  # pragma: no cover
    main()
