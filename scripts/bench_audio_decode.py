#!/usr/bin/env python3
"""A one-hour MP3 through ``edgevlm.audio``: what a token budget saves in memory and time, against
decoding the whole file at once as llama.cpp's helper does (issue #56).

    python scripts/bench_audio_decode.py                    # about 2 minutes on 2 cores, once the file exists
    python scripts/bench_audio_decode.py --minutes 5        # a quick check of the script

The file (written once with PyAV, cached under ``--work``, default ``~/.cache/edgevlm/bench``) is
a speech-like synthetic signal — voiced "syllables" (harmonics of a 110–220 Hz pitch, loudness
rising and falling 4 times a second, a little noise) in stretches of 2–12 s, with pauses of
0.3–4 s of faint noise (-65 dBFS) between them — mono 16 kHz MP3 at 32 kbps (libmp3lame). How
long writing it took is printed and kept in the JSON.

Each case runs in a fresh child process of this script, which reports its own peak RSS when done
(Linux: the peak is reset once the imports are done, ``5 > /proc/self/clear_refs``, then read as
``VmHWM``; elsewhere ``ru_maxrss``), so nothing of one case stays in another's numbers, and the
imports' own transient peak is in none:

- **baseline** — the child imports numpy, ``edgevlm.audio`` and ``av``, nothing else;
- **first second** — the same child decodes the file's first second through ``iter_samples``
  and stops: what using FFmpeg's decoder at all costs (its code paged in, its buffers);
- **plan, budget N** — ``plan_audio`` under an N-token budget (default 2,000) with the Whisper
  family's numbers: 479,680-sample windows (29.98 s), 750 tokens each; decoding stops at the cut;
- **plan, no budget** — the same without a budget, silences dropped: the whole hour decoded and
  every piece kept (what an unbounded decode of the kept speech holds);
- **whole file** — the peer: the file decoded into one float32 array sized from its header, as
  mtmd's helper does with miniaudio (``mtmd_helper_bitmap_init_from_buf``: ``resize(frame_count)``
  then read), here with PyAV.

Above-baseline memory is each case's peak minus the baseline child's (the same imports). The budgeted case's "lease" is
what edgevlm says it holds: the pieces kept (2 × 479,680 × 4 B) plus the decoder's peak
(one decoded frame, its resampled copy, FFmpeg's buffers: ``AudioStream.hold_bytes``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "testkit"))
sys.path.insert(0, str(ROOT / "scripts"))

FILE_VERSION = 1  # bump when the signal changes (the cache key)
WINDOW = 479_680  # Whisper family: one 30 s mel window (mtmd: 1 chunk up to 479,839 samples)
PER_WINDOW = 750  # qwen2a / Qwen2.5-Omni tokens per window
RATE = 16000


def whisper_tokens(n: int) -> int:
    return PER_WINDOW * (1 + (n // 160 + 1) // 3000)


def speech_chunks(seconds: float, rate: int = RATE, seed: int = 56):
    """The signal in blocks of a few seconds (never the whole hour in memory)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    done = 0.0
    phase = 0.0
    while done < seconds:
        talk = float(rng.uniform(2.0, 12.0))
        pause = float(rng.uniform(0.3, 4.0))
        f0 = float(rng.uniform(110.0, 220.0))
        n = round(min(talk, seconds - done) * rate)
        if n <= 0:
            break
        t = np.arange(n) / rate
        voice = sum(np.sin(2 * np.pi * f0 * k * t + k + phase) / k for k in range(1, 6))
        env = 0.25 + 0.75 * np.abs(np.sin(2 * np.pi * 2.0 * t))
        yield (0.12 * env * voice + 0.01 * rng.standard_normal(n)).astype(np.float32)
        done += n / rate
        phase += 1.0
        m = round(min(pause, max(0.0, seconds - done)) * rate)
        if m:
            yield (10 ** (-65 / 20) * rng.standard_normal(m)).astype(np.float32)
            done += m / rate


def write_mp3(path: Path, seconds: float, bit_rate: int) -> float:
    """Encode the signal; returns the seconds it took."""
    import av
    import numpy as np

    t0 = time.perf_counter()
    tmp = path.with_suffix(".part")
    with av.open(str(tmp), "w", format="mp3") as out:
        st = out.add_stream("libmp3lame", rate=RATE)
        st.layout = "mono"
        st.bit_rate = bit_rate
        cc = st.codec_context
        rs = av.AudioResampler(format=cc.format.name, layout="mono", rate=RATE, frame_size=cc.frame_size or None)
        for chunk in speech_chunks(seconds):
            src = av.AudioFrame.from_ndarray(
                np.clip(chunk * 32767, -32768, 32767).astype(np.int16)[None, :], format="s16", layout="mono"
            )
            src.sample_rate = RATE
            for f in rs.resample(src):
                for p in st.encode(f):
                    out.mux(p)
        for f in rs.resample(None):
            for p in st.encode(f):
                out.mux(p)
        for p in st.encode(None):
            out.mux(p)
    tmp.rename(path)
    return time.perf_counter() - t0


def child(case: str, path: str, budget: int) -> dict[str, Any]:
    import av
    import numpy as np

    import edgevlm.audio as audio

    start_rss = reset_peak()
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    if case == "baseline":
        out["tokens"] = None
    elif case == "first":
        with audio.iter_samples(path, "x") as stream:
            n = 0
            for block in stream:
                n += block.size
                if n >= RATE:
                    break
        out.update(tokens=None, decoded_s=round(n / RATE, 2))
    elif case in ("budget", "nobudget"):
        held: list[int] = []
        plan, pieces = audio.plan_audio(
            path,
            Path(path).name,
            window_samples=WINDOW,
            tokens_for=whisper_tokens,
            budget_tokens=budget if case == "budget" else None,
            hold=held.append,
        )
        with audio.iter_samples(path, "x") as stream:  # the decoder's own peak, as it leases it
            out["decoder_hold_bytes"] = stream.hold_bytes
        out.update(
            tokens=plan.total_tokens,
            pieces=len(pieces),
            decoded_s=round(plan.decoded_s, 2),
            speech_s=round(plan.speech_s, 2),
            silence_dropped_s=round(plan.silence_dropped_s, 2),
            left_out_s=None if plan.left_out_s is None else round(plan.left_out_s, 2),
            cut=plan.cut,
            notes=list(plan.notes),
            plan_hold_bytes=held[0] if held else None,
            pieces_bytes=sum(p.samples.nbytes for p in pieces),
        )
    elif case == "whole":
        with av.open(path) as c:
            s = c.streams.audio[0]
            declared = float(s.duration * s.time_base) if s.duration else c.duration / 1e6
            x = np.empty(int(declared * RATE) + RATE, dtype=np.float32)  # the header's length, as miniaudio
            rs = av.AudioResampler(format="flt", layout="mono", rate=RATE)
            n = 0
            for frame in itertools.chain(c.decode(s), [None]):  # frame by frame, then the flush
                for f in rs.resample(frame):
                    a = f.to_ndarray().reshape(-1)
                    x[n : n + a.size] = a
                    n += a.size
        out.update(tokens=whisper_tokens(n), decoded_s=round(n / RATE, 2), array_bytes=int(x.nbytes))
    else:
        raise SystemExit(f"unknown case {case}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    peak = status_kib("VmHWM")
    if start_rss is None or peak is None:  # no peak reset here: the whole process's high-water mark
        out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux
        out["own_start_mib"] = None
    else:
        out["peak_rss_mib"] = round(peak / 1024, 1)
        out["own_start_mib"] = round(start_rss / 1024, 1)
    return out


def status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> int | None:
    """Reset this process's peak RSS to its current RSS (Linux: ``5 > /proc/self/clear_refs``),
    so the imports' transient peak is not the case's; returns the RSS then (KiB), None where
    the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return status_kib("VmRSS")


def run_case(case: str, path: Path, budget: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", case, "--file", str(path), "--budget", str(budget)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{case} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--bit-rate", type=int, default=32000)
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "edgevlm" / "bench"))
    ap.add_argument("--out", help="JSON path (default: docs/results/bench_audio_decode-<date>-<commit>.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.file, args.budget)))
        return

    import av
    from resultfile import Run

    run = Run("bench_audio_decode")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"speech-{args.minutes:g}min-{args.bit_rate // 1000}k-v{FILE_VERSION}.mp3"
    write_s = None
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write_s = write_mp3(path, args.minutes * 60, args.bit_rate)
        print(f"  {write_s:.1f} s to write {path.stat().st_size / 2**20:.1f} MiB", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for case in ("baseline", "first", "budget", "nobudget", "whole"):
        rows[case] = run_case(case, path, args.budget)
        print(f"  {case}: {rows[case]}", flush=True)
    base = rows["baseline"]["peak_rss_mib"]
    names = {
        "baseline": "baseline (imports only)",
        "first": "first second decoded, then stop",
        "budget": f"plan_audio, {args.budget:,}-token budget",
        "nobudget": "plan_audio, no budget (silence dropped)",
        "whole": "whole file into one array (peer)",
    }
    print(f"\n{'case':42} {'peak RSS MiB':>12} {'above base':>10} {'seconds':>8} {'tokens':>7}")
    for case, r in rows.items():
        above = round(r["peak_rss_mib"] - base, 1)
        r["above_baseline_mib"] = above
        print(f"{names[case]:42} {r['peak_rss_mib']:12.1f} {above:10.1f} {r['seconds']:8.2f} {r['tokens'] or '':>7}")
    b = rows["budget"]
    lease = 2 * WINDOW * 4 + b["decoder_hold_bytes"]
    print(
        f"\nbudgeted lease: pieces {b['pieces_bytes'] / 2**20:.2f} MiB"
        f" + decoder {b['decoder_hold_bytes'] / 2**20:.2f} MiB"
        f" = {lease / 2**20:.2f} MiB; measured above baseline {b['above_baseline_mib']} MiB"
        f" (the plan leases {b['plan_hold_bytes'] / 2**20:.2f} MiB);"
        f" above the first-second child {b['peak_rss_mib'] - rows['first']['peak_rss_mib']:.1f} MiB"
    )
    result = {
        "file": {
            "name": path.name,
            "minutes": args.minutes,
            "bytes": path.stat().st_size,
            "bit_rate": args.bit_rate,
            "rate": RATE,
            "write_s": None if write_s is None else round(write_s, 1),
        },
        "budget_tokens": args.budget,
        "window_samples": WINDOW,
        "tokens_per_window": PER_WINDOW,
        "lease_mib": round(lease / 2**20, 2),
        "budget_above_first_second_mib": round(b["peak_rss_mib"] - rows["first"]["peak_rss_mib"], 1),
        "rows": [{"case": c, "label": names[c], **r} for c, r in rows.items()],
        "python": platform.python_version(),
        "av": av.__version__,
    }
    print(run.save(result, args.out))


if __name__ == "__main__":
    main()
