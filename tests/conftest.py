"""Shared fixtures: generated model pairs (cached on disk across runs) and real images."""

from __future__ import annotations

# edgevlm first: it loads llama.cpp's libraries before numpy is imported (edgevlm.backend.native)
import edgevlm  # noqa: F401

# isort: split
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
from PIL import Image

from edgevlm_testkit import FAMILIES, cached_model_pair

ALL_FAMILIES = list(FAMILIES)  # every generated family: each runs the family-wide tests


def skip_unless_required(feature: str, reason: str) -> NoReturn:
    """Skip for ``reason``, or fail when ``EDGEVLM_REQUIRE`` (a comma-separated list; .ci/run
    sets ``page,train``) names ``feature``: what CI installs to run must not skip unnoticed."""
    if feature in os.environ.get("EDGEVLM_REQUIRE", "").split(","):
        pytest.fail(f"{reason}, and EDGEVLM_REQUIRE names {feature!r}: it must run here")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_pair():
    """``model_pair(family, preset="tiny", seed=0)`` → ModelPair, generated once per cache."""

    def get(family: str = "llava15", preset: str = "tiny", seed: int = 0):
        return cached_model_pair(family, preset, seed)

    return get


@pytest.fixture(scope="session", params=ALL_FAMILIES)
def any_pair(request, model_pair):
    return model_pair(request.param)


def make_image(path: Path, width: int, height: int, seed: int = 0, mode: str = "noise") -> Path:
    rng = np.random.default_rng(seed)
    if mode == "noise":
        arr = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    else:  # a gradient with a coloured square: structured content
        y, x = np.mgrid[0:height, 0:width]
        arr = np.stack(
            [x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), np.full_like(x, 128)], axis=-1
        ).astype(np.uint8)
        arr[height // 4 : height // 2, width // 4 : width // 2] = rng.integers(0, 255, 3)
    Image.fromarray(arr).save(path)
    return path


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    return {
        "noise": make_image(d / "noise.png", 320, 240, seed=1),
        "gradient": make_image(d / "gradient.png", 640, 400, seed=2, mode="gradient"),
        "square": make_image(d / "square.jpg", 336, 336, seed=3),
    }


def run_cli(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real ``edgevlm`` console entry point in a subprocess."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "edgevlm", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


STRICT_KEY = "sekrit"


@pytest.fixture(scope="module")
def strict_server(model_pair):
    """A real ``edgevlm serve`` on the tiny LLaVA pair for the API tests: one sequence and no
    queue (a second request while one runs is refused), a 2048 context (four 576-token pictures
    never fit), replies of 16 tokens unless asked, and the API key ``STRICT_KEY``."""
    from .test_serve import Served

    s = Served(model_pair("llava15"), "--parallel", "1", "--queue", "0", "--ctx", "2048", "--max-tokens", "16",
               "--api-key", STRICT_KEY)  # fmt: skip
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def on_a_terminal(args: list[str], prompt: bytes, answer: bytes, env: dict | None = None, timeout: float = 120):
    """``edgevlm ARGS`` with a pseudo-terminal on stdin and stderr (and stdout, unless it is
    piped): waits for ``prompt``, types ``answer``, and returns (exit code, everything the
    terminal showed). POSIX only."""
    import pty
    import select

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "edgevlm", *args], stdin=slave, stdout=slave, stderr=slave,
                         env=env or dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200"))  # fmt: skip
    os.close(slave)
    seen, deadline = b"", time.monotonic() + timeout
    try:
        while prompt not in seen and time.monotonic() < deadline and p.poll() is None:
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 4096)
        assert prompt in seen, seen
        os.write(master, answer)
        rc = p.wait(timeout=timeout)
        while select.select([master], [], [], 0.5)[0]:
            try:
                seen += os.read(master, 4096)
            except OSError:  # the other side closed
                break
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return rc, seen
