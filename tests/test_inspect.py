"""``edgevlm inspect`` reports what llama.cpp and mtmd themselves see in the same files."""

from __future__ import annotations

import json

import llama_cpp
import pytest

from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector, load_text_model
from edgevlm.model.projectors import image_tokens

from .conftest import ALL_FAMILIES, run_cli

SIZES = [
    (1, 1),
    (28, 28),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (640, 480),
    (672, 672),
    (1000, 200),
    (200, 1000),
    (1024, 768),
    (1920, 1080),
    (2000, 1),
    (4000, 3000),
    (3840, 2160),
    (7680, 4320),
    (8192, 8192),
    (10000, 100),
    (50, 5000),
    (333, 999),
]


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def loaded(request, model_pair):
    pair = model_pair(request.param)
    with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2) as be:
        yield pair, be


def test_text_values_equal_llama_cpp(loaded):
    pair, be = loaded
    info = load_text_model(pair.model)
    m = be.llama.model
    assert info.n_layer == llama_cpp.llama_model_n_layer(m)
    assert info.n_embd == llama_cpp.llama_model_n_embd(m)
    assert info.n_head == llama_cpp.llama_model_n_head(m)
    assert info.n_head_kv == llama_cpp.llama_model_n_head_kv(m)
    assert info.n_ctx_train == llama_cpp.llama_model_n_ctx_train(m)
    assert info.weight_bytes == llama_cpp.llama_model_size(m)
    assert info.n_vocab == llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(m))
    assert sum(info.weight_bytes_per_layer) + info.weight_bytes_outside_layers == info.weight_bytes
    assert len(info.weight_bytes_per_layer) == info.n_layer


def test_image_tokens_equal_mtmd(loaded):
    pair, be = loaded
    proj = load_projector(pair.mmproj)
    for w, h in SIZES:
        chunks = be.count_image(w, h)
        imgs = [c for c in chunks if c.kind == "image"]
        texts = [c for c in chunks if c.kind == "text"]
        mine = image_tokens(proj, w, h)
        assert (mine.n_tokens, mine.n_pos, mine.n_chunks) == (
            sum(c.n_tokens for c in imgs),
            sum(c.n_pos for c in imgs),
            len(imgs),
        ), (w, h)
        assert mine.text_tokens == sum(c.n_tokens for c in texts), (w, h)
        if be.use_mrope:
            assert (mine.views[0].nx, mine.views[0].ny) == (imgs[0].nx, imgs[0].ny)


def test_inspect_json_pair(loaded):
    pair, be = loaded
    r = run_cli("inspect", str(pair.model), "--mmproj", str(pair.mmproj), "--json", "--image-size", "1024x768")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    m, p = rep["model"], rep["mmproj"]
    for key in (
        "arch",
        "n_layer",
        "n_embd",
        "n_head",
        "n_head_kv",
        "head_dim",
        "n_ff",
        "n_vocab",
        "n_ctx_train",
        "file_type",
        "weight_bytes",
        "weight_bytes_per_layer",
        "weight_bytes_outside_layers",
    ):
        assert key in m, key
    for key in ("projector_type", "image_size", "patch_size", "n_layer", "n_embd", "n_mmproj_embd"):
        assert key in p, key
    assert rep["pair"]["compatible"] is True
    assert m["n_layer"] == llama_cpp.llama_model_n_layer(be.llama.model)
    mt = be.count_image(1024, 768)
    assert p["image_tokens"]["n_tokens"] == sum(c.n_tokens for c in mt if c.kind == "image")


def test_inspect_human_table(model_pair):
    pair = model_pair("llava16")
    r = run_cli("inspect", str(pair.model), "--mmproj", str(pair.mmproj))
    assert r.returncode == 0, r.stderr
    for word in ("n_layer", "n_head / n_head_kv", "pinpoints", "image tokens @ 336x336", "pair: compatible", "Q4_0"):
        assert word in r.stdout, word


def test_inspect_projector_alone(model_pair):
    pair = model_pair("qwen2vl")
    r = run_cli("inspect", str(pair.mmproj), "--json", "--image-size", "640x480")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert "model" not in rep and rep["mmproj"]["projector_type"] == "qwen2vl_merger"
    assert rep["mmproj"]["image_tokens"]["n_tokens"] == 23 * 17


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("chat", "caption", "plan", "inspect"):
        assert cmd in r.stdout
