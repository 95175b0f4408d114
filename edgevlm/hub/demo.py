"""Where ``--model demo`` finds the toy VLM trained on edgevlm's synthetic world.

The pair (``edgevlm-demo.gguf`` + ``mmproj-edgevlm-demo.gguf``, trained by
``scripts/train_demo.py``) is committed under ``models/`` in the source tree; a wheel installs it
under ``<prefix>/share/edgevlm/models``. ``EDGEVLM_DEMO_DIR`` points elsewhere. When none holds
it, ``demo`` falls back to the generated random-weight pair (and says so).

Generated pairs (``demo:FAMILY``, random weights) are not part of edgevlm: a distribution
installed beside it provides them through the ``edgevlm.generated_pairs`` entry point group
(the source checkout's ``testkit/``, ``edgevlm-testkit``). The entry point names an object with
``FAMILIES`` (family names) and ``cached_model_pair(family, preset)``, which returns something
with ``.model`` and ``.mmproj`` paths.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

__all__ = [
    "DEMO_MMPROJ",
    "DEMO_MODEL",
    "GENERATED_PAIRS_GROUP",
    "NO_GENERATED_PAIRS",
    "TRAINED_NOTE",
    "generated_pairs",
    "trained_demo_dirs",
    "trained_demo_pair",
]

DEMO_MODEL = "edgevlm-demo.gguf"
DEMO_MMPROJ = "mmproj-edgevlm-demo.gguf"
TRAINED_NOTE = (
    "demo: edgevlm's toy VLM, trained here on a synthetic world of coloured circles, squares, "
    "triangles and capital letters; it knows nothing else (ask about colours, shapes, counts, "
    "letters, or 'Describe the image.'). Use a registry name (edgevlm models) for a real model."
)
GENERATED_PAIRS_GROUP = "edgevlm.generated_pairs"
NO_GENERATED_PAIRS = (
    "generated pairs come from the edgevlm-testkit package (pip install -e ./testkit from the source checkout)"
)


def trained_demo_dirs() -> list[Path]:
    """Folders searched for the trained pair, in order."""
    dirs = []
    env = os.environ.get("EDGEVLM_DEMO_DIR")
    if env:
        dirs.append(Path(env))
    dirs.append(Path(__file__).resolve().parents[2] / "models")  # a source checkout
    dirs.append(Path(sys.prefix) / "share" / "edgevlm" / "models")  # a wheel's data files
    return dirs


def trained_demo_pair() -> tuple[Path, Path] | None:
    for d in trained_demo_dirs():
        m, p = d / DEMO_MODEL, d / DEMO_MMPROJ
        if m.is_file() and p.is_file():
            return m, p
    return None


def generated_pairs():
    """The installed provider of generated random-weight pairs (``demo:FAMILY``), or None.

    It has ``FAMILIES`` and ``cached_model_pair(family, preset)``; with several installed, the
    first by entry point name is used.
    """
    eps = sorted(entry_points(group=GENERATED_PAIRS_GROUP), key=lambda ep: ep.name)
    return eps[0].load() if eps else None
