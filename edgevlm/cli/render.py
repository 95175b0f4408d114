"""How plans and inspect reports look on a terminal (rich tables and bars)."""

from __future__ import annotations

from ..plan.devices import format_size

__all__ = ["render_check", "render_inspect", "render_plan"]

_BAR = (("weights", "blue"), ("kv", "magenta"), ("compute", "yellow"), ("encoder", "green"))


def render_plan(p, file=None, explain: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True, file=file)
    t = Table(title="plan", show_header=False, box=None, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("fits", "yes" if p.fits else f"NO — {format_size(p.shortfall_bytes)} short"),
        ("n_gpu_layers", p.n_gpu_layers),
        ("n_ctx", p.n_ctx),
        ("n_batch / n_ubatch", f"{p.n_batch} / {p.n_ubatch}"),
        ("KV cache", f"K {p.type_k}, V {p.type_v}" + ("" if p.offload_kqv or not p.n_gpu_layers else ", on the host")),
        ("flash attention", "on" if p.flash_attn else "off"),
        ("vision encoder", "GPU" if p.mmproj_on_gpu else "CPU"),
        ("image budget", f"{p.image_max_tokens} tokens; {p.max_images_in_context} image(s) in context"),
        (
            "host kept",
            f"{format_size(p.host_reserve)} for the process"
            + (f" + {format_size(p.host_allowance)} for requests in flight" if p.host_allowance else ""),
        ),
    ]
    if p.audio_encoder:  # its own compute buffer (counted in the encoder column below)
        where = "GPU" if p.mmproj_on_gpu else "CPU"
        rows.insert(7, ("audio encoder", f"{p.audio_encoder}, {format_size(p.audio_encoder_bytes)} compute on {where}"))
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
        parts = {
            "weights": b.weights + b.other,
            "kv": b.kv,
            "compute": b.compute,
            "encoder": b.mmproj_weights + b.mmproj_compute,
        }
        scale = max(d.budget_bytes, b.total, 1)
        bar = Text(f"{d.name:>6} ")
        used = 0
        for key, colour in _BAR:
            n = round(parts[key] / scale * width)
            bar.append("█" * n, style=colour)
            used += n
        bar.append("░" * max(0, width - used), style="dim")
        bars.append(bar)
        dt.add_row(
            f"{d.name} ({d.kind})",
            sz(d.free_bytes),
            sz(parts["weights"]),
            sz(b.kv),
            sz(b.compute),
            sz(parts["encoder"]),
            sz(b.total),
            Text(sz(d.headroom_bytes), style="red" if d.headroom_bytes < 0 else "green"),
        )
    console.print(dt)
    for bar in bars:
        console.print(bar)
    legend = Text("  ")
    for key, colour in _BAR:
        legend.append("█", style=colour).append(f" {key}  ")
    legend.append("░", style="dim").append(" headroom")
    console.print(legend)
    if p.levers or explain:
        render_levers(console, p, explain)
    if p.options and explain:
        render_options(console, p)
    console.print("why:")
    for r in p.reasons:
        console.print(f"  - {r}")


def render_levers(console, p, explain: bool) -> None:
    """The degradation order as it went: each lever pulled, what changed, and the MiB it saved
    on the device that was short (``explain``: the levers not needed too)."""
    from rich.table import Table

    from ..plan.planner import LEVERS

    t = Table(title="levers, in the order tried", box=None, title_justify="left")
    for col in ("lever", "change", "short before", "short after", "saved"):
        t.add_column(col, justify="left" if col in ("lever", "change") else "right")
    pulled = {lv.lever: lv for lv in p.levers}
    done = False
    for name in LEVERS:
        lv = pulled.get(name)
        if lv is not None:
            t.add_row(
                name,
                lv.change,
                f"{lv.shortfall_before / 2**20:,.0f} MiB",
                f"{lv.shortfall_after / 2**20:,.0f} MiB",
                f"{lv.saved_bytes / 2**20:,.0f} MiB on {lv.device}",
            )
            done = lv.shortfall_after == 0
        elif explain:
            t.add_row(name, "not needed" if done or not p.levers else "not pulled", "", "", "")
    console.print(t)


def render_options(console, p) -> None:
    """The placements the planner weighed when not every layer fitted: each one's layers, KV
    type and place, predicted decode speed and memory, and which it chose and why."""
    from rich.table import Table

    t = Table(
        title=f"placements weighed by predicted decode speed (prices: {p.prices})", box=None, title_justify="left"
    )
    for col in ("", "GPU layers", "KV", "KV on", "ctx", "tokens/s", "GPU", "host", "why"):
        t.add_column(col, justify="right" if col in ("GPU layers", "ctx", "tokens/s", "GPU", "host") else "left")
    for o in p.options:
        t.add_row(
            "→" if o.chosen else "",
            f"{o.n_gpu_layers}/{o.max_layers}",
            o.kv_type,
            o.kv_place,
            str(o.n_ctx),
            f"{o.tokens_per_s:,.1f}",
            _mib(o.gpu_bytes),
            _mib(o.host_bytes),
            o.note,
        )
    console.print(t)


def render_check(rows, file=None) -> None:
    """``plan --check``: each buffer as planned and as llama.cpp's dry run reserved it."""
    from rich.console import Console
    from rich.table import Table

    from ..plan.check import ROUNDING

    console = Console(highlight=False, soft_wrap=True, file=file)
    t = Table(title="the plan against llama.cpp's dry run (nothing allocated)", box=None, title_justify="left")
    for col in ("device", "buffer", "planned", "llama.cpp", "error"):
        t.add_column(col, justify="left" if col in ("device", "buffer") else "right", no_wrap=True)
    for r in rows:
        close = abs(r.predicted - r.reserved) <= ROUNDING
        err = "= (to the log's 0.01 MiB)" if close else f"{r.error:+.2%}"
        t.add_row(r.device, r.buffer, _mib(r.predicted), _mib(r.reserved), err)
    console.print(t)
    under = [r for r in rows if r.under]
    if under:
        console.print(
            "[red]the plan counts less than llama.cpp reserves on "
            + ", ".join(f"{r.device} ({r.buffer}, {(r.reserved - r.predicted) / 2**20:,.2f} MiB)" for r in under)
            + "[/red]"
        )
    else:
        console.print("no buffer above the plan")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def render_inspect(report: dict) -> None:
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
            ("arch", m["arch"]),
            ("name", m["name"]),
            ("file_type", m["file_type"]),
            ("n_layer", m["n_layer"]),
            ("n_embd", m["n_embd"]),
            ("n_head / n_head_kv", f"{m['n_head']} / {m['n_head_kv']}"),
            ("head_dim", m["head_dim"]),
            ("n_ff", m["n_ff"]),
            ("n_vocab", m["n_vocab"]),
            ("n_ctx_train", m["n_ctx_train"]),
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
        title = "projector" if p["audio"] else "vision projector"
        t = Table(title=f"{title}  {p['path']}", show_header=False, box=None, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        rows = [
            ("projector_type", p["projector_type"]),
            ("file_type", p["file_type"]),
            ("output width", p["n_mmproj_embd"]),
            ("weights", _mib(p["weight_bytes"])),
        ]
        if p["has_vision_encoder"]:
            rows[2:2] = [
                ("image_size / patch_size", f"{p['image_size']} / {p['patch_size']}"),
                ("vision n_layer", p["n_layer"]),
                ("vision n_embd", p["n_embd"]),
            ]
        if p["image_grid_pinpoints"]:
            rows.append(("pinpoints", " ".join(f"{w}x{h}" for w, h in p["image_grid_pinpoints"])))
        if p["spatial_merge_size"]:
            rows.append(("spatial merge", p["spatial_merge_size"]))
        for key in ("image_min_pixels", "image_max_pixels"):
            if p[key]:
                rows.append((key, p[key]))
        it = p.get("image_tokens")
        if it is not None:
            rows.append(
                (
                    f"image tokens @ {it['width']}x{it['height']}",
                    f"not known before mtmd loads it; at most {it['bound']} (the planner's bound)"
                    if "error" in it
                    else f"{it['n_tokens']} in {it['n_chunks']} chunk(s), {it['n_pos']} positions",
                )
            )
        a, at = p["audio"], p.get("audio_tokens")
        if a is not None and at is not None:
            rows.append(("audio encoder", f"{a['projector_type']}, {a['n_layer']} block(s) of {a['n_embd']}"))
            rows.append(("audio weights", _mib(a["weight_bytes"])))
            rows.append(("audio tokens", at["refused"] or f"{at['per_30s_window']} per 30 s window"))
        for k, v in rows:
            t.add_row(k, str(v))
        console.print(t)
    if "pair" in report:
        ok = report["pair"]["compatible"]
        console.print("pair: [green]compatible[/]" if ok else "pair: [red]NOT compatible[/]")
