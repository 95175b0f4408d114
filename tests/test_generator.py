"""The generated model pairs: deterministic, real formats, and real multimodal inference."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector, load_text_model
from edgevlm_testkit import make_model_pair

from .conftest import ALL_FAMILIES

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = {
    "llava15": "USER: {m}\nWhat is in the picture?\nASSISTANT:",
    "llava16": "USER: {m}\nWhat is in the picture?\nASSISTANT:",
    "qwen2vl": "<|im_start|>user\n{m}What is in the picture?<|im_end|>\n<|im_start|>assistant\n",
    "qwen25vl": "<|im_start|>user\n{m}What is in the picture?<|im_end|>\n<|im_start|>assistant\n",
    "pixtral": "[INST]{m}What is in the picture?[/INST]",
    "qwen3vl": "<|im_start|>user\n{m}What is in the picture?<|im_end|>\n<|im_start|>assistant\n",
    "gemma3": "<start_of_turn>user\n{m}What is in the picture?<end_of_turn>\n<start_of_turn>model\n",
    "idefics3": "<|im_start|>User:{m}What is in the picture?<end_of_utterance>\nAssistant:",
    "internvl": "<|im_start|>user\n{m}What is in the picture?<|im_end|>\n<|im_start|>assistant\n",
}


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_same_arguments_give_identical_bytes(tmp_path, family):
    a = make_model_pair(tmp_path / "a", family, "tiny", 7)
    b = make_model_pair(tmp_path / "b", family, "tiny", 7)
    c = make_model_pair(tmp_path / "c", family, "tiny", 8)
    assert sha(a.model) == sha(b.model) and sha(a.mmproj) == sha(b.mmproj)
    assert sha(a.model) != sha(c.model) and sha(a.mmproj) != sha(c.mmproj)


def test_script_writes_pair(tmp_path):
    out = tmp_path / "x"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_vlm.py"), str(out), "--family", "llava16", "--seed", "3"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "model.gguf").stat().st_size > 0 and (out / "mmproj.gguf").stat().st_size > 0
    ref = make_model_pair(tmp_path / "ref", "llava16", "tiny", 3)
    assert sha(out / "model.gguf") == sha(ref.model)


def test_script_rejects_unknown_family(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_vlm.py"), str(tmp_path), "--family", "nope"],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and "invalid choice" in r.stderr


@pytest.mark.parametrize(
    "family,arch,ptype,pinpoints",
    [
        ("llava15", "llama", "mlp", False),
        ("llava16", "llama", "mlp", True),
        ("qwen2vl", "qwen2vl", "qwen2vl_merger", False),
        ("qwen25vl", "qwen2vl", "qwen2.5vl_merger", False),
    ],
)
def test_formats(model_pair, family, arch, ptype, pinpoints):
    pair = model_pair(family)
    text = load_text_model(pair.model)
    proj = load_projector(pair.mmproj)
    assert text.arch == arch and text.file_type == "Q4_0"
    assert proj.projector_type == ptype and proj.file_type == "F16"
    assert (proj.image_grid_pinpoints is not None) == pinpoints
    assert proj.n_mmproj_embd == text.n_embd
    size = pair.model.stat().st_size + pair.mmproj.stat().st_size
    assert size < 8 * 2**20  # "a few MB"


def greedy(backend: Backend, prompt: str, image: Path, n: int) -> tuple[list[int], list]:
    """Prompt with one image through mtmd, then n greedy tokens; returns tokens and chunks."""
    rgb = np.asarray(Image.open(image).convert("RGB"))
    bm = backend.bitmap_from_rgb(rgb, "img")
    try:
        with backend.tokenize(prompt.format(m=backend.marker), [bm]) as chunks:
            n_past = 0
            for c in chunks:
                if c.kind == "text":
                    n_past = backend.decode_tokens(c.tokens, n_past)
                else:
                    n_past = backend.decode_image(c, backend.encode_image(c), n_past)
            kinds = [(c.kind, c.n_tokens) for c in chunks]
    finally:
        backend.free_bitmap(bm)
    out = []
    backend.first_logits = backend.logits().copy()
    for _ in range(n):
        logits = backend.logits()
        assert np.isfinite(logits).all()
        tok = int(np.argmax(logits))
        out.append(tok)
        n_past = backend.decode_tokens([tok], n_past)
    return out, kinds


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_each_family_generates_from_an_image(model_pair, images, family):
    pair = model_pair(family)
    with Backend(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as be:
        toks, kinds = greedy(be, PROMPTS[family], images["gradient"], 6)
        first = be.first_logits
        assert any(k == "image" and n > 0 for k, n in kinds)
        assert len(toks) == 6 and all(0 <= t < be.n_vocab for t in toks)
        # The image matters: another picture changes what the model predicts.
        be.kv_clear()
        greedy(be, PROMPTS[family], images["noise"], 1)
    assert np.abs(first - be.first_logits).max() > 1e-2


@pytest.mark.parametrize("family", ["llava15", "qwen2vl"])
def test_real_shape_preset_runs(model_pair, images, family):
    """Real per-layer shapes (LLaVA-1.5-7B / Qwen2-VL-2B widths, 2 layers) load and generate."""
    pair = model_pair(family, "real")
    text = load_text_model(pair.model)
    proj = load_projector(pair.mmproj)
    if family == "llava15":
        assert (text.n_embd, text.n_head, text.n_ff, text.n_vocab) == (4096, 32, 11008, 32000)
        assert (proj.n_embd, proj.image_size, proj.patch_size) == (1024, 336, 14)
    else:
        assert (text.n_embd, text.n_head_kv, text.n_vocab) == (1536, 2, 151936)
        assert proj.n_embd == 1280
    with Backend(pair.model, pair.mmproj, n_ctx=1024, n_threads=2) as be:
        toks, kinds = greedy(be, PROMPTS[family], images["square"], 2)
    assert len(toks) == 2
    assert any(k == "image" and n == (576 if family == "llava15" else 144) for k, n in kinds)
