"""The numbers a reader sees in docs/*.md and README.md come from committed benchmark runs
(docs/results/*.json, written by the benchmarks: scripts/resultfile.py), rendered between
``<!-- results:STEM:PART -->`` markers by ``scripts/render_docs.py`` (the GPU runs' own checks:
tests/test_gpu_results.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
RESULTS = ROOT / "docs" / "results"
GPU_RESULTS = sorted(RESULTS.glob("gpu-check-*.json"))
RUNS = sorted(set(RESULTS.glob("*.json")) - set(GPU_RESULTS))
BENCHMARKS = sorted([*SCRIPTS.glob("bench_*.py"), SCRIPTS / "soak_serve.py"])


def _module(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _referenced() -> set[tuple[str, str]]:
    render = _module("render_docs")
    return {
        (stem, part)
        for doc in render.docs()
        for stem, part, _ in render.blocks_in(doc.read_text())
        if not render.is_pending(stem)
    }


def test_docs_and_readme_show_what_the_committed_results_hold():
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "render_docs.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_committed_run_is_shown_somewhere():
    """Each run in docs/results/ renders into at least one block: a run nobody shows is a number
    nobody checks."""
    stems = {s for s, _ in _referenced()}
    assert {p.stem for p in RESULTS.glob("*.json")} <= stems


@pytest.mark.parametrize("stem_part", sorted(_referenced()), ids=lambda sp: ":".join(sp))
def test_a_changed_number_changes_the_block(stem_part, tmp_path):
    """Every block depends on its file: each number (and string) of the run is changed in turn
    until the rendering changes; a block that nothing in its file changes is transcribed, not
    rendered."""
    render = _module("render_docs")
    stem, part = stem_part
    for f in RESULTS.glob("*.json"):
        (tmp_path / f.name).write_text(f.read_text())
    d = json.loads((RESULTS / f"{stem}.json").read_text())
    before = render.part(stem, part, tmp_path)
    paths: list[tuple] = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, (*path, i))
        elif isinstance(x, (int, float, str)) and not isinstance(x, bool):
            paths.append(path)

    walk(d.get("result", d), ("result",) if "result" in d else ())
    for path in paths:
        e = json.loads((RESULTS / f"{stem}.json").read_text())
        node = e
        for k in path[:-1]:
            node = node[k]
        v = node[path[-1]]
        node[path[-1]] = v + "1" if isinstance(v, str) else v * 3 + 7
        (tmp_path / f"{stem}.json").write_text(json.dumps(e))
        try:
            after = render.part(stem, part, tmp_path)
        except Exception:  # a number the renderer cannot take (a count made fractional): try the next
            continue
        if after != before:
            return
    pytest.fail(f"nothing in {stem}.json changes the block {part}")


def test_a_block_that_differs_or_names_no_file_fails_the_check(tmp_path, monkeypatch):
    render = _module("render_docs")
    stem, part = sorted(_referenced())[0]
    good = f"<!-- results:{stem}:{part} -->\n{render.part(stem, part)}\n<!-- /results:{stem}:{part} -->\n"
    page = tmp_path / "page.md"
    monkeypatch.setattr(render, "docs", lambda: [page])
    monkeypatch.setattr(render, "ROOT", tmp_path)
    page.write_text("# page\n\n" + good)
    assert render.check() == []
    page.write_text("# page\n\n" + good.replace(f"{part} -->\n", f"{part} -->\n| a hand-typed 9.9× |\n", 1))
    assert [p for p in render.check() if "differs" in p]
    gone = "bench_nothing-20000101-0000000:table"
    page.write_text(f"# page\n\n<!-- results:{gone} -->\n|x|\n<!-- /results:{gone} -->\n")
    assert [p for p in render.check() if "does not exist" in p]
    page.write_text(f"# page\n\n<!-- results:{stem}:no-such-part -->\n<!-- /results:{stem}:no-such-part -->\n")
    assert [p for p in render.check() if "no part" in p]
    page.write_text(f"# page\n\n<!-- results:{stem}:{part} -->\n| a table whose end marker was lost |\n")
    assert [p for p in render.check() if "no end marker" in p]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_each_run_names_its_commit_machine_date_command_and_load(path):
    d = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", d["commit"])
    assert path.stem.endswith(d["commit"][:7])
    assert path.stem.startswith(d["benchmark"])
    assert d["command"][0] == f"{d['benchmark']}.py"
    m = d["machine"]
    assert m["cpu"]
    assert m["cores"]
    assert {"avx2", "avx512", "amx"} <= set(m)
    assert m["llama_cpp_build"]
    assert re.match(r"\d{4}-\d\d-\d\dT", d["date"])
    assert d["date"][:10].replace("-", "") in path.stem
    assert d["load"]["wall_s"] > 0
    assert "others_cpu_share" in d["load"]
    assert d["result"]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_every_benchmark_writes_its_run_through_resultfile(script):
    """Each benchmark makes a ``Run`` named after itself and saves its result with it (into
    docs/results/ unless told otherwise): no benchmark keeps a JSON of its own shape elsewhere."""
    text = script.read_text()
    assert re.search(rf'Run\("{script.stem}"', text)
    assert "run.save(" in text
    assert "write_text(json.dumps(" not in text.split("def main", 1)[1]


def test_a_run_file_holds_the_result_and_what_it_depends_on(tmp_path):
    resultfile = _module("resultfile")
    run = resultfile.Run("bench_example", "tag")
    path = run.save({"rows": [1, 2]}, tmp_path / "x.json")
    d = json.loads(path.read_text())
    assert d["result"] == {"rows": [1, 2]}
    assert d["benchmark"] == "bench_example"
    assert d["tag"] == "tag"
    assert d["commit"] == resultfile.commit()[0]
    assert d["machine"]["cores"]
    assert d["load"]["wall_s"] >= 0
    default = run.path(d["commit"])
    assert default.parent == RESULTS
    assert default.name == f"bench_example-tag-{d['date'][:10].replace('-', '')}-{d['commit'][:7]}.json"


def test_bench_serve_runs_render_every_column_serve_md_shows(tmp_path):
    """docs/serve.md's tables are not re-measured yet; their renderer is ready for the next run:
    a run's chats and decode rows (the fields bench_serve.py writes) give each column the page
    shows — ratios against llama-server, turn-3 TTFT, the ITL beside a new picture and without,
    for edgevlm and llama-server."""
    render = _module("render_docs")
    resultfile = _module("resultfile")

    def chat(server, n, shared, rps, ttft, itl_a, itl):
        return {
            "server": server,
            "clients": n,
            "shared_picture": shared,
            "req_per_s": rps,
            "ttft_p50_turn3": ttft,
            "itl_p95_admitting_ms": itl_a,
            "itl_p95_ms": itl,
        }

    result = {
        "chats": [
            chat("edgevlm", 4, False, 0.77, 0.43, 67.0, 41.0),
            chat("llama-server", 4, False, 0.94, 0.82, 3872.0, 133.0),
            chat("edgevlm", 4, True, 2.26, 0.46, 43.0, 64.0),
            chat("llama-server", 4, True, 0.95, 0.67, 5686.0, 50.0),
        ],
        "decode": [
            {"server": "edgevlm", "streams": 8, "tok_per_s": 7505.0},
            {"server": "llama-server", "streams": 8, "tok_per_s": 6279.0},
        ],
    }
    resultfile.Run("bench_serve", "shared").save(result, tmp_path / "bench_serve-shared-20000101-abcdef0.json")
    stem = "bench_serve-shared-20000101-abcdef0"
    own = render.part(stem, "chats", tmp_path)
    assert "| 4 | 0.77 | 0.94 | – | **0.82×** | 0.43 s | 0.82 s | – | **0.52×** | 67 / 41 | 3872 / 133 |" in own
    assert "| 4 | 2.26 | 0.95 | – | **2.38×** |" in render.part(stem, "chats-shared", tmp_path)
    assert "| 8 | 7,505 | 6,279 | – | **1.20×** |" in render.part(stem, "decode", tmp_path)
    row = render.part(stem, "readme", tmp_path)
    assert "4–4 users" in row
    assert "2.38–2.38× with a shared picture, 0.82–0.82× with a picture each" in row


def test_bench_serve_runs_render_the_cpu_each_request_cost(tmp_path):
    """Issue #48: the chats and decode tables gain each server's CPU seconds (per request, per
    1,000 tokens) and edgevlm's ÷ llama-server's; a run without them shows "–" there."""
    render = _module("render_docs")
    resultfile = _module("resultfile")

    def chat(server, n, rps, cpu):
        row = {"server": server, "clients": n, "shared_picture": False, "req_per_s": rps, "ttft_p50_turn3": 0.5}
        row |= {"itl_p95_admitting_ms": 60.0, "itl_p95_ms": 40.0}
        return row | ({"cpu_s": cpu * 10, "cpu_s_per_request": cpu} if cpu is not None else {})

    result = {
        "args": {"profile": "throughput"},
        "chats": [chat("edgevlm", 8, 0.9, 2.31), chat("llama-server", 8, 0.9, 2.71), chat("edgevlm", 16, 0.9, None)],
        "decode": [
            {"server": "edgevlm", "streams": 8, "tok_per_s": 7505.0, "cpu_s": 1.0, "cpu_s_per_1k_tokens": 0.5},
            {"server": "llama-server", "streams": 8, "tok_per_s": 6279.0, "cpu_s": 1.0, "cpu_s_per_1k_tokens": 0.25},
        ],
    }
    resultfile.Run("bench_serve").save(result, tmp_path / "bench_serve-20000101-abcdef0.json")
    stem = "bench_serve-20000101-abcdef0"
    own = render.part(stem, "chats", tmp_path)
    assert own.startswith("`edgevlm serve --profile throughput`:")
    assert "| 60 / 40 | 60 / 40 | 2.31 | 2.71 | – | **0.85×** |" in own
    assert own.splitlines()[-1].startswith("| 16 | 0.90 | – |")
    assert own.splitlines()[-1].endswith("| – | – | – | – |")
    decode = render.part(stem, "decode", tmp_path)
    assert "| 8 | 7,505 | 6,279 | – | **1.20×** | 0.50 | 0.25 | – | **2.00×** |" in decode
    assert "CPU-s per request 0.85–0.85× llama-server's" in render.part(stem, "readme", tmp_path)


def _caption_side(wall, gen, cpu, others=0.01, **extra):
    return {"wall_s": wall, "generated": gen, "cpu_s": cpu, "cpu_s_per_image": cpu / 24, "busy_others": others} | extra


def test_bench_caption_runs_render_the_four_sides_their_cpu_and_the_targets(tmp_path):
    """Issue #48: caption, batch, the llama-server script and the library loop, each with images/s,
    completion tokens/s and total, CPU seconds per picture, caption ÷ the side (per run) and the
    targets met or missed — a side that was skipped is said so."""
    render = _module("render_docs")
    resultfile = _module("resultfile")
    sides = {
        "caption": [_caption_side(48.0, 768, 96.0, engine_share=0.97)],
        "batch": [_caption_side(50.0, 768, 99.0)],
        "library": [_caption_side(72.0, 768, 130.0)],
    }
    summary = {
        k: {"wall_s": v[0]["wall_s"], "images_per_s": 24 / v[0]["wall_s"], "tok_per_s": 768 / v[0]["wall_s"]}
        | {"generated": 768, "cpu_s": v[0]["cpu_s"], "cpu_s_per_image": v[0]["cpu_s_per_image"], "errors": 0}
        for k, v in sides.items()
    }
    ratios = {
        "caption_vs_library": {"median": 1.5, "paired": [1.5], "cpu": 0.738},
        "batch_vs_caption": {"median": 0.96, "paired": [0.96], "cpu": 1.031},
    }
    config = {"family": "llava15", "preset": "real", "images": 24, "size": [640, 480], "runs": 1, "threads": 2}
    config |= {"n_ctx": 4096, "parallel": 4, "scheduler_profile": "throughput"}
    config["skipped"] = {"llama-server": "no llama-server binary"}
    result = {
        "config": config,
        "by_max_tokens": {"32": {"sides": sides, "summary": summary, "ratios": ratios, "caption_engine_share": 0.97}},
        "targets": {
            "32": {
                "caption_ge_1.2x_llama_server": None,
                "caption_ge_1.3x_library": True,
                "batch_within_5pct_of_caption": True,
                "caption_engine_share_ge_0.95": True,
            }
        },
    }
    resultfile.Run("bench_caption").save(result, tmp_path / "bench_caption-20000101-abcdef0.json")
    stem = "bench_caption-20000101-abcdef0"
    table = render.part(stem, "table", tmp_path)
    assert "24 pictures of 640×480, 1 run(s) side by side, 4 in flight" in table
    assert "| 32 | `edgevlm caption` | 0.500 | 16.0 | 768 | 4.00 | 48.0 | – | – | 1 % |" in table
    batch = "| 32 | `edgevlm batch` | 0.480 | 15.4 | 768 | 4.12 | 50.0 | **1.04×** (batch -4.0 %) | 0.97× | 1 % |"
    assert batch in table
    assert "| 32 | llama-cpp-python loop | 0.333 | 10.7 | 768 | 5.42 | 72.0 | **1.50×** (1.50) | 0.74× | 1 % |" in table
    assert "caption ≥ 1.3× the library loop: met; batch within 5 % of caption: met" in table
    assert "1.2× the llama-server" not in table
    assert "`llama-server` script skipped: no llama-server binary." in table
    row = render.part(stem, "readme", tmp_path)
    assert "| 1.50× the llama-cpp-python loop's images/s; `edgevlm batch` -4 % against caption |" in row


def test_bench_caption_runs_made_before_the_four_sides_still_render(tmp_path):
    """A run of edgevlm against the loop alone (before issue #48) renders as it did."""
    render = _module("render_docs")
    resultfile = _module("resultfile")
    old = [{"wall_s": 20.0, "prompt_evaluated": 4944, "busy_others": 0.01}]
    lib = [{"wall_s": 24.0, "prompt_evaluated": 5592, "busy_others": 0.0}]
    result = {
        "config": {"family": "llava15", "preset": "real", "images": 8, "runs": 1, "threads": 2, "edgevlm_slots": 4},
        "by_max_tokens": {
            "16": {
                "edgevlm": old,
                "library": lib,
                "ratio_median_of_pairs": 1.2,
                "paired_ratios": [1.2],
                "edgevlm_engine_share": 0.992,
                "edgevlm_images_per_s": 0.4,
                "library_images_per_s": 0.333,
            }
        },
    }
    resultfile.Run("bench_caption").save(result, tmp_path / "bench_caption-20000101-abcdef0.json")
    stem = "bench_caption-20000101-abcdef0"
    assert "| 16 | 0.400 | 0.333 | **1.20×** (1.20) | 618 vs 699 | 99.2 % |" in render.part(stem, "table", tmp_path)
    assert "1.20× the images/s" in render.part(stem, "readme", tmp_path)


def _restore_kv(a_ms: float, load_ms: float, turn_ms: float, c_ms: float) -> dict:
    """One KV type of a bench_restore run: (a), (b) = load + turn, (c), one run each."""

    def row(ttft, n, cached, encoded, busy):
        return {
            "ttft_total_ms": ttft,
            "prompt_n": n,
            "cached_n": cached,
            "images_encoded": encoded,
            "busy_others": busy,
        }

    b_ms = load_ms + turn_ms
    parts = {"read_and_checksum": 150.0, "decode_pictures": 30.0, "binding": 9.0, "state_seq_set_data": 60.0}
    restored = {"ttft_ms": b_ms, "process_to_first_token_ms": 2500.0, "load_ms": load_ms, "turn_ttft_ms": turn_ms}
    restored |= {"second_turn_ttft_ms": 700.0, "render_ms": 20.0, "load_parts_ms": parts}
    summary = {
        "same_process": {"ttft_ms": a_ms, "render_ms": 1.0},
        "restored": restored,
        "resent": {"ttft_ms": c_ms, "process_to_first_token_ms": c_ms + 1500.0, "render_ms": 25.0},
        "resent_over_restored": round(c_ms / b_ms, 2),
        "restored_over_same_process": round(b_ms / a_ms, 2),
        "restored_over_same_process_paired": [round(b_ms / a_ms, 2)],
        "resent_over_restored_wall": round((c_ms + 1500.0) / 2500.0, 2),
        "same_reply_as_same_process": {"restored": 1, "resent": 1},
        "targets": {"restored_ge_5x_faster_than_resent": c_ms / b_ms >= 5, "restored_within_1.5x": b_ms / a_ms <= 1.5},
    }
    mib = 2**20
    file = {"bytes": 63 * mib, "kv_bytes": 62 * mib, "picture_bytes": mib // 10, "cells": 2006, "pictures": 3}
    file |= {
        "save_ms": 500.0,
        "bytes_per_1k_cells": round(63 * mib / 2.006),
        "kv_bytes_per_1k_cells": round(62 * mib / 2.006),
    }
    runs = {
        "same_process": [row(a_ms, 32, 2006, 0, 0.1)],
        "restored": [row(b_ms, 32, 2006, 0, 0.2)],
        "resent": [row(c_ms, 2038, 0, 3, 0.3)],
    }
    return {"runs": runs, "summary": summary, "file": file}


def test_bench_restore_runs_render_the_three_ways_their_targets_and_the_file(tmp_path):
    """Issue #55's benchmark: per KV type the next turn's TTFT three ways — (b) as the file's
    load plus the turn —, each target met or not, the file's MiB per 1,000 cells; the example
    shows the command as typed (the pair's files by name) and the refusal's line and exit code."""
    render = _module("render_docs")
    resultfile = _module("resultfile")
    cfg = {"family": "llava15", "preset": "real", "n_ctx": 4096, "threads": 2, "reply_tokens": 8}
    cfg |= {
        "runs": 1,
        "resent_runs": 1,
        "targets": {"resent_over_restored_ge": 5.0, "restored_over_same_process_le": 1.5},
    }
    f16, q8 = _restore_kv(800.0, 300.0, 900.0, 20000.0), _restore_kv(800.0, 150.0, 850.0, 4000.0)
    argv = ["edgevlm", "chat", "-m", "/cache/x/model.gguf", "--mmproj", "/cache/x/mmproj.gguf", "--kv", "f16"]
    argv += ["--session", "talk.evlm", "--json", "Which one?"]
    out = {"text": "ab", "stats": {"prompt_n": 32, "cached_n": 2006, "images_encoded": 0, "image_encode_ms": 0.0}}
    out["stats"] |= {"ttft_ms": 950.5, "n_ctx_used": 2045, "itl_ms_mean": 1.0}
    out["session"] = {"path": "talk.evlm", "restored_tokens": 2006}
    f16["cli"] = {"argv": argv, "returncode": 0, "output": out}
    refused = {"argv": [*argv[:7], "q8_0", *argv[8:]], "returncode": 2}
    refused["stderr"] = "Error: talk.evlm: made with KV cache f16, this one has q8_0 (--kv f16)"
    result = {"config": cfg, "by_kv": {"f16": f16, "q8_0": q8}, "refusal": refused}
    resultfile.Run("bench_restore").save(result, tmp_path / "bench_restore-20000101-abcdef0.json")
    stem = "bench_restore-20000101-abcdef0"
    table = render.part(stem, "table", tmp_path)
    assert (
        "| f16 | (b) new process, restored from the file | **1,200** | 1,200 | 300 + 900 | 2.5 | 32/2006 | 0 |" in table
    )
    assert (
        "| q8_0 | (c) new process, whole history re-sent | **4,000** | 4,000 | – | 5.5 | 2038/0 | 3 | 30 % |" in table
    )
    assert "- f16: (c) ÷ (b) = **16.67×** (target ≥ 5×: met); (b) ÷ (a) = **1.50×** (target ≤ 1.5×: met;" in table
    assert "- q8_0: (c) ÷ (b) = **4.00×** (target ≥ 5×: **not met**); (b) ÷ (a) = **1.25×**" in table
    assert "| f16 | 2,006 | 63.0 | 62.0 | 0.10 | **31.41** | 30.91 | 500 |" in table
    assert "| f16 | 150 | 30 | 9 | 60 | 51 | 20 | 880 | 1 | 799 | 700 |" in table
    example = render.part(stem, "example", tmp_path)
    assert (
        "$ edgevlm chat -m model.gguf --mmproj mmproj.gguf --kv f16 --session talk.evlm --json 'Which one?'" in example
    )
    assert '"cached_n": 2006' in example
    assert "itl_ms_mean" not in example
    assert "$ edgevlm chat -m model.gguf --mmproj mmproj.gguf --kv q8_0" in example
    assert "--json 'Which one?'  # exit code 2\n" in example
    assert example.endswith("this one has q8_0 (--kv f16)\n```")


def test_a_pending_block_says_which_script_makes_its_run_and_nothing_else(tmp_path, monkeypatch):
    """A block for a run nobody has made yet (``STEM-pending``) holds the one line naming its
    script: any other text in it, or a script that does not exist, fails the check."""
    render = _module("render_docs")
    page = tmp_path / "page.md"
    monkeypatch.setattr(render, "docs", lambda: [page])
    monkeypatch.setattr(render, "ROOT", tmp_path)
    line = render.part("bench_suite-pending", "readme")
    assert "`python scripts/bench_suite.py`" in line
    block = "<!-- results:bench_suite-pending:readme -->\n{}\n<!-- /results:bench_suite-pending:readme -->\n"
    page.write_text(block.format(line))
    assert render.check() == []
    page.write_text(block.format("| 39 min |"))
    assert [p for p in render.check() if "differs" in p]
    page.write_text("<!-- results:bench_nothing-pending:readme -->\n<!-- /results:bench_nothing-pending:readme -->\n")
    assert [p for p in render.check() if "no scripts/bench_nothing.py" in p]


def test_no_table_in_readme_holds_a_typed_number():
    """README's tables hold numbers only inside rendered blocks: a table typed by hand (as the
    video table was, with peak RSS its run never measured) fails here."""
    render = _module("render_docs")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    outside = re.sub(r"```.*?```", "", render.BLOCK.sub("", text), flags=re.S)
    typed = [ln for ln in outside.splitlines() if ln.startswith("|") and re.search(r"(?<!\w)\d[\d,.]*(?!\w)", ln)]
    assert not typed, typed
