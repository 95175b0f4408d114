#!/usr/bin/env python3
"""Write a random-weight GGUF vision-language pair: OUTDIR/model.gguf and OUTDIR/mmproj.gguf.

    python scripts/make_tiny_vlm.py /tmp/x                      # LLaVA-1.5, tiny
    python scripts/make_tiny_vlm.py /tmp/q --family qwen2vl --preset real --seed 3

Same arguments, byte-identical files. The weights are random: output is gibberish, but every
format, shape and code path in llama.cpp is the real one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgevlm_testkit import AUDIO_FAMILIES, FAMILIES, PRESETS, make_model_pair


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--family", default="llava15", choices=[*FAMILIES, *AUDIO_FAMILIES])
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    pair = make_model_pair(args.outdir, args.family, args.preset, args.seed)
    dt = time.perf_counter() - t0
    for p in (pair.model, pair.mmproj):
        print(f"{p}  {p.stat().st_size / 2**20:.2f} MiB")
    print(f"{args.family}/{args.preset} seed {args.seed} in {dt:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
