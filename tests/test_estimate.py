"""The estimator against llama.cpp itself: every family, several shapes and settings.

Bounds: weights and KV within 0.5 %, compute buffers within 5 %, and the vision encoder never
under-estimated (all within the 0.005 MiB rounding of llama.cpp's log lines).
"""

from __future__ import annotations

import pytest

from edgevlm.backend.system import cpu_repacks
from edgevlm_testkit.measure import Config, measure

from .conftest import ALL_FAMILIES

DYNAMIC = {"qwen2vl", "qwen25vl", "qwen3vl", "pixtral"}  # image budgets apply to these
MATRIX = []
for fam in ALL_FAMILIES:
    img = 256 if fam in DYNAMIC else None
    MATRIX += [
        Config(fam, n_ctx=256, flash_attn=True, image_max_tokens=img),
        Config(fam, n_ctx=1000, flash_attn=False, image_max_tokens=img),
        Config(
            fam,
            n_ctx=2048,
            type_k="q8_0",
            type_v="q8_0",
            flash_attn=True,
            n_ubatch=256,
            image_max_tokens=64 if img else None,
        ),
        Config(
            fam,
            n_ctx=4096,
            type_k="q4_0",
            type_v="q4_0",
            flash_attn=True,
            n_ubatch=128,
            n_batch=256,
            image_max_tokens=1024 if img else None,
        ),
        Config(
            fam,
            n_ctx=1024,
            type_k="q8_0",
            type_v="f16",
            flash_attn=False,
            n_ubatch=512,
            image_max_tokens=1024 if img else None,
        ),
    ]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.label.replace(" ", "-"))
def test_estimate_matches_llama_cpp(model_pair, cfg):
    pair = model_pair(cfg.family)
    comps = {c.name: c for c in measure(str(pair.model), str(pair.mmproj), cfg)}
    for name in ("weights (mapped)", "weights (repack)", "kv", "mmproj weights"):
        # an iSWA model (Gemma 3) logs two KV lines, each rounded to 0.01 MiB
        assert comps[name].within(0.005, abs_mib=0.011 if name == "kv" else 0.006), (name, comps[name])
    assert comps["compute"].within(0.05), comps["compute"]
    enc = comps["mmproj compute"]
    assert enc.predicted >= enc.measured - 0.006 * 2**20, enc  # never under
    assert enc.within(0.05), enc


def test_tied_embeddings_are_counted_as_llama_cpp_loads_them(tmp_path):
    """No output.weight (Qwen2-VL-2B, Qwen2.5-VL-3B, Gemma 3): llama.cpp loads token_embd a second
    time for the output layer — on the CPU repacked beside the mapped input copy."""
    from dataclasses import replace

    from edgevlm_testkit.qwen import write_qwen
    from edgevlm_testkit.shapes import QWEN_PRESETS

    text, vision = QWEN_PRESETS["tiny"]
    model, mmproj = write_qwen(tmp_path, replace(text, tied=True, n_vocab=4096), vision, 0, "qwen2vl")
    comps = {c.name: c for c in measure(str(model), str(mmproj), Config("qwen2vl", n_ctx=512, image_max_tokens=64))}
    for name in ("weights (mapped)", "weights (repack)"):
        assert comps[name].within(0.005), (name, comps[name])
    if cpu_repacks():  # (not on an AMX build: edgevlm loads without extra buffer types there)
        # the output copy is most of the repacked bytes here: without it the plan would be far under
        assert comps["weights (repack)"].measured > 4096 * 128 * 18 // 32  # Q4_0: 18 bytes per 32


def test_weights_go_where_the_plan_says_and_never_to_amx(model_pair):
    """llama.cpp's load log against ``cpu_repacks``: a CPU_REPACK buffer exactly when the plan
    counts one, and never an AMX buffer — ggml's AMX matmul segfaults in the first decode with
    the pinned llama.cpp (llama.cpp#20824), so edgevlm loads without extra buffer types on AMX
    builds. The answer below is that first decode."""
    import edgevlm

    pair = model_pair("llava15")
    eng = edgevlm.load(str(pair.model), str(pair.mmproj), n_ctx=512)
    try:
        log = "\n".join(eng.backend.load_log)
        r = eng.chat("Describe this image", max_tokens=4, temperature=0.0)
        assert r.stats.predicted_n >= 1
    finally:
        eng.close()
    assert "AMX model buffer" not in log
    assert ("CPU_REPACK model buffer" in log) == cpu_repacks(), log
