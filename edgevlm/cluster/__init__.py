"""Captioning and batch files on a Ray cluster (``pip install 'edgevlm[ray]'``).

``connect`` reaches Ray (a local instance, or a running cluster) and ``layout`` sizes the actor
pool; ``actors`` holds the stateful actors (one model load each); ``caption`` and ``batch`` are
the drivers, which write records and answers through the same resumable files as the
single-machine commands; ``run`` is the Python API. Ray itself is imported only when one of
these runs, so ``import edgevlm.cluster`` works without it.
"""

from .caption import caption_dataset
from .run import answer_batch_file, caption_files

__all__ = ["answer_batch_file", "caption_dataset", "caption_files"]
