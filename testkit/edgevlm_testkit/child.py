"""One device measurement in a process of its own.

On Mesa 22.3's lavapipe, a q8_0 KV cache with flash attention and a 64-row micro-batch corrupts
the heap once several hundred cells are filled (plain llama-cpp-python 0.3.36 does it too, no
edgevlm code involved: docs/gpu.md, Limits); the process dies later, mostly while the model is
freed — after everything was measured (SIGABRT under ``llama_free`` in CI, SIGSEGV or
``corrupted double-linked list`` in ``llama_batch_free`` here). In the test process that crash
would end the whole device suite.
So a measurement runs here, in a child: it hands its result to ``emit`` before the model is
freed, the child writes it out at once, and the parent reads it whatever happened next.

    python -m edgevlm_testkit.child MODULE:FUNCTION KWARGS_JSON OUT_JSON

``run_in_child`` is the parent's side (``Outcome``: what came back and how the child ended);
``measured_in_child`` is what the device tests call.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DriverCrash", "Outcome", "measured_in_child", "run_in_child"]


class DriverCrash(UserWarning):
    """A child measured, then died of a signal freeing the model (shown, never an error: pytest's
    ``filterwarnings`` lets this category through)."""


@dataclass(frozen=True)
class Outcome:
    result: Any  # what the function emitted (JSON: dataclasses as dicts), None if it never did
    returncode: int  # negative: the signal that ended the child
    stderr: str

    @property
    def died_after(self) -> str | None:
        """What ended the child after it had emitted its result (None: it exited cleanly)."""
        if self.returncode == 0:
            return None
        if self.returncode < 0:
            return signal.Signals(-self.returncode).name
        return f"exit {self.returncode}"

    def tail(self, n: int = 3000) -> str:
        return self.stderr[-n:]


def run_in_child(target: str, timeout: float = 300, **kwargs: Any) -> Outcome:
    """``target`` (``module:function``, taking ``emit``) called with ``kwargs`` in a child
    Python with this one's environment."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        here = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        p = subprocess.run(
            [sys.executable, "-m", "edgevlm_testkit.child", target, json.dumps(kwargs), str(out)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        result = json.loads(out.read_text()) if out.exists() else None
    return Outcome(result, p.returncode, p.stderr)


def measured_in_child(target: str, **kwargs: Any) -> Any:
    """What ``target`` measured, in a child. A child that died of a signal (the driver) gives a
    ``DriverCrash`` warning: after measuring, nothing is lost; before, it measures once more, in
    a new child — the corruption strikes at random, a crash of edgevlm's own would strike twice.
    Any other failure is an ``AssertionError`` with the child's stderr."""
    got = run_in_child(target, **kwargs)
    if got.result is None and got.returncode < 0:
        warnings.warn(f"{target}: {got.died_after} before measuring; measuring again", DriverCrash, stacklevel=2)
        got = run_in_child(target, **kwargs)
    assert got.result is not None, f"{target} measured nothing ({got.died_after}):\n{got.tail()}"
    if got.died_after is not None:
        assert got.returncode < 0, f"{target} failed after measuring ({got.died_after}):\n{got.tail()}"
        warnings.warn(f"{target}: measured; then {got.died_after} freeing the model", DriverCrash, stacklevel=2)
    return got.result


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, (list, tuple)):
        return [_plain(o) for o in obj]
    return obj


def main(argv: list[str]) -> int:
    target, kwargs, out = argv[0], json.loads(argv[1]), Path(argv[2])
    import edgevlm  # noqa: F401  (llama.cpp's libraries before numpy: a CUDA load needs that order)

    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)

    def emit(result: Any) -> None:
        tmp = out.with_suffix(".part")
        tmp.write_text(json.dumps(_plain(result)))
        tmp.replace(out)

    fn(**kwargs, emit=emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
