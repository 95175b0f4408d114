"""Models by name: registry, resolution, pull (resume, sha256), header-only plans, offline mode,
models/rm — all against a local stand-in for the hub (edgevlm_testkit.hub_server), no internet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from edgevlm.errors import InputError, ModelFileError
from edgevlm_testkit import cached_model_pair
from edgevlm_testkit.hub_server import FakeHub, serve_registry_names

ROOT = Path(__file__).resolve().parent.parent
LLAVA_REPO, QWEN_REPO, OTHER_REPO = "test-org/llava-tiny-GGUF", "test-org/qwen-tiny-GGUF", "someone/other-GGUF"
LLAVA_Q4, LLAVA_Q8, LLAVA_PROJ = "llava-tiny-Q4_0.gguf", "llava-tiny-Q8_0.gguf", "mmproj-llava-tiny-f16.gguf"
QWEN_Q4, QWEN_PROJ = "qwen-tiny-Q4_0.gguf", "mmproj-qwen-tiny-f16.gguf"

TEST_REGISTRY = {
    "schema": 1,
    "models": [
        {
            "name": "llava-tiny",
            "aliases": ["llava"],
            "title": "tiny LLaVA-1.5",
            "params": "1M",
            "repo": LLAVA_REPO,
            "template_family": "llava15",
            "projector_type": "mlp",
            "license": "mit",
            "default_quant": "q4_0",
            "files": {"q4_0": {"file": LLAVA_Q4, "size": 339136}, "q8_0": {"file": LLAVA_Q8, "size": 339136}},
            "mmproj": {"file": LLAVA_PROJ, "size": 339776},
        },
        {
            "name": "qwen-tiny",
            "title": "tiny Qwen2.5-VL",
            "params": "1M",
            "repo": QWEN_REPO,
            "template_family": "chatml",
            "projector_type": "qwen2.5vl_merger",
            "license": "apache-2.0",
            "default_quant": "q4_0",
            "files": {"q4_0": {"file": QWEN_Q4, "size": 344128}},
            "mmproj": {"file": QWEN_PROJ, "size": 521408},
        },
    ],
}


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs():
    return {"llava15": cached_model_pair("llava15"), "qwen25vl": cached_model_pair("qwen25vl")}


@pytest.fixture
def hub(pairs):
    h = FakeHub()
    lp, qp = pairs["llava15"], pairs["qwen25vl"]
    h.add_file(LLAVA_REPO, LLAVA_Q4, lp.model)
    h.add_file(LLAVA_REPO, LLAVA_Q8, lp.model)
    h.add_file(LLAVA_REPO, LLAVA_PROJ, lp.mmproj)
    h.add_file(LLAVA_REPO, "README.md", b"# tiny llava\n")
    h.add_file(QWEN_REPO, QWEN_Q4, qp.model)
    h.add_file(QWEN_REPO, QWEN_PROJ, qp.mmproj)
    h.add_file(OTHER_REPO, "other-Q4_0.gguf", lp.model)
    h.add_file(OTHER_REPO, "mmproj-other-f16.gguf", lp.mmproj)
    h.start()
    yield h
    h.stop()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    """HF_ENDPOINT at the local hub, a fresh HF_HOME and edgevlm cache, the test registry."""
    reg = tmp_path / "registry.json"
    reg.write_text(json.dumps(TEST_REGISTRY))
    values = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "EDGEVLM_CACHE": str(tmp_path / "edgevlm"),
        "EDGEVLM_REGISTRY": str(reg),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for k in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN",
        "EDGEVLM_MODEL",
    ):
        monkeypatch.delenv(k, raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def cli(*args: str, extra_env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The commands through the real entry point, in a subprocess."""
    e = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200", **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-m", "edgevlm", *args], capture_output=True, text=True, timeout=timeout, env=e
    )


def run_here(*args: str):
    """The same commands in this process (click's runner): for the cheap checks."""
    from click.testing import CliRunner

    from edgevlm.cli import main

    res = CliRunner().invoke(main, list(args))
    return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def blobs(env_dir: Path, repo: str) -> list[Path]:
    d = env_dir / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "blobs"
    return sorted(d.iterdir()) if d.is_dir() else []


def content_gets(hub: FakeHub) -> list:
    return [r for r in hub.requests if r.method == "GET" and r.path.startswith("/cdn/")]


def without_paths(plan) -> dict:
    d = plan.to_dict()
    d.pop("model")
    d.pop("mmproj")
    return d


# --- the registry ----------------------------------------------------------------------------


def test_registry_lists_the_issue_models():
    from edgevlm.hub.registry import load_registry

    reg = load_registry(ROOT / "edgevlm" / "data" / "registry.json")
    for name in (
        "llava-1.5-7b",
        "llava-1.6-mistral-7b",
        "qwen2.5-vl-3b",
        "qwen2.5-vl-7b",
        "gemma-3-4b",
        "smolvlm-500m",
        "minicpm-v-2.6",
        "moondream2",
    ):
        e = reg.get(name)
        assert e is not None, name
        assert e.repo.count("/") == 1 and e.license and e.template_family and e.projector_type
        assert e.mmproj.file.endswith(".gguf") and "mmproj" in e.mmproj.file.lower()
        assert all(f.file.endswith(".gguf") and f.size for f in e.files.values())
        assert e.default_quant in e.files
        if "q4_k_m" in e.files:
            assert e.default_quant == "q4_k_m"


def test_one_registry_file():
    """The registry lives once, as package data (no second copy to keep equal)."""
    from edgevlm.hub.registry import registry_path

    found = sorted(
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("registry.json")
        if not {".venv", ".git", "build"} & set(p.relative_to(ROOT).parts)
    )
    assert found == ["edgevlm/data/registry.json"], found
    if "EDGEVLM_REGISTRY" not in os.environ:
        assert registry_path() == ROOT / "edgevlm" / "data" / "registry.json"


def test_registry_errors_are_one_line(tmp_path):
    from edgevlm.hub.registry import load_registry

    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_registry(bad)
    bad.write_text(json.dumps({"models": [{"name": "x"}]}))
    with pytest.raises(InputError, match=r"models\[0\]"):
        load_registry(bad)


# --- resolution ------------------------------------------------------------------------------


def test_resolve_names_quants_aliases(env):
    from edgevlm.hub.registry import resolve

    r = resolve("llava-tiny")
    assert r.kind == "registry" and r.quant == "q4_0" and r.model.remote.file == LLAVA_Q4
    assert r.mmproj.remote.file == LLAVA_PROJ and not r.is_local and r.missing()
    assert resolve("LLaVA:Q8_0").model.remote.file == LLAVA_Q8
    with pytest.raises(InputError, match="no quantisation 'q2_k'.*q4_0, q8_0"):
        resolve("llava-tiny:q2_k")


def test_unknown_name_suggests_close_names(env):
    from edgevlm.hub.registry import resolve

    with pytest.raises(InputError, match="did you mean llava-tiny"):
        resolve("llava-tiyn")
    r = cli("pull", "qwen-tinny")
    assert_one_line_error(r, 2, "'qwen-tinny'", "did you mean qwen-tiny")
    r = run_here("plan", "--model", "lava-tiny")
    assert_one_line_error(r, 2, "did you mean llava-tiny")


def test_real_registry_suggestions():
    from edgevlm.hub.registry import load_registry, unknown_name_message

    reg = load_registry(ROOT / "edgevlm" / "data" / "registry.json")
    assert "llava-1.5-7b" in unknown_name_message("llava-1.5-7", reg)
    assert "qwen2.5-vl-3b" in unknown_name_message("qwen", reg)


def test_resolve_local_path_finds_mmproj_next_to_it(tmp_path, pairs):
    from edgevlm.hub.registry import resolve
    from edgevlm_testkit.llava import write_clip_mlp
    from edgevlm_testkit.shapes import LLAVA_PRESETS

    p = pairs["llava15"]
    r = resolve(str(p.model))
    assert r.kind == "local" and r.mmproj.local == str(p.mmproj) and r.is_local

    d = tmp_path / "models"
    d.mkdir()
    shutil.copy(p.model, d / "llava-v1.5-7b-Q4_K_M.gguf")
    with pytest.raises(InputError, match=r"no vision projector next to it .*pass --mmproj"):
        resolve(str(d / "llava-v1.5-7b-Q4_K_M.gguf"))
    assert resolve(str(d / "llava-v1.5-7b-Q4_K_M.gguf"), need_mmproj=False).mmproj is None
    # two projectors, only one fits the model's width: that one, whatever the names say
    write_clip_mlp(d / "mmproj-other-f16.gguf", LLAVA_PRESETS["tiny"][1], 96, 5, "other")
    shutil.copy(p.mmproj, d / "llava-v1.5-7b-mmproj-model-Q8_0.gguf")
    r = resolve(str(d / "llava-v1.5-7b-Q4_K_M.gguf"))
    assert os.path.basename(r.mmproj.local) == "llava-v1.5-7b-mmproj-model-Q8_0.gguf"
    with pytest.raises(ModelFileError, match="no such file"):
        resolve(str(d / "missing.gguf"))


def test_resolve_hf_specs(env):
    from edgevlm.hub.registry import resolve

    r = resolve(f"hf:{LLAVA_REPO}/{LLAVA_Q8}")
    assert r.kind == "hf" and r.model.remote.file == LLAVA_Q8 and r.mmproj.remote.file == LLAVA_PROJ
    assert resolve(f"hf:{QWEN_REPO}").model.remote.file == QWEN_Q4  # the only text GGUF there
    assert resolve(f"hf:{LLAVA_REPO}:q8_0").model.remote.file == LLAVA_Q8
    with pytest.raises(InputError, match="several files match q4_0|no q4_k_m file"):
        resolve(f"hf:{LLAVA_REPO}")  # Q4_0 and Q8_0, no Q4_K_M: say which exist
    with pytest.raises(InputError, match="no such repository"):
        resolve("hf:nobody/nothing-GGUF/x.gguf")


def test_demo_family_is_generated_and_says_random_weights():
    from edgevlm.hub.registry import resolve

    r = resolve("demo:llava15")
    assert r.kind == "demo" and r.is_local and os.path.isfile(r.model.local) and os.path.isfile(r.mmproj.local)
    assert any("RANDOM weights" in n for n in r.notes)


def test_demo_without_the_trained_pair_falls_back_to_random_weights(monkeypatch, tmp_path):
    from edgevlm.hub import demo
    from edgevlm.hub.registry import resolve

    monkeypatch.setattr(demo, "trained_demo_dirs", lambda: [tmp_path])
    r = resolve("demo")
    assert any("RANDOM weights" in n for n in r.notes)


def test_generated_pairs_come_from_the_entry_point_and_are_named_when_missing(monkeypatch, tmp_path):
    """demo:FAMILY asks the edgevlm.generated_pairs entry point group (the test kit declares it);
    without a provider it is one clear InputError, and the trained ``demo`` still resolves."""
    import edgevlm_testkit
    from edgevlm.hub import demo
    from edgevlm.hub.registry import resolve

    assert demo.generated_pairs() is edgevlm_testkit.generated_pairs
    assert set(demo.generated_pairs().FAMILIES) == set(edgevlm_testkit.FAMILIES) | set(edgevlm_testkit.AUDIO_FAMILIES)
    monkeypatch.setattr(demo, "entry_points", lambda group: [])
    assert demo.generated_pairs() is None
    with pytest.raises(
        InputError,
        match=r"^'demo:qwen2vl': generated pairs come from the edgevlm-testkit "
        r"package \(pip install -e \./testkit",
    ):
        resolve("demo:qwen2vl")
    if demo.trained_demo_pair() is not None:
        assert resolve("demo").model.local == str(demo.trained_demo_pair()[0])
    monkeypatch.setattr(demo, "trained_demo_dirs", lambda: [tmp_path])
    with pytest.raises(InputError, match="edgevlm-testkit"):
        resolve("demo")


# --- pull ------------------------------------------------------------------------------------


def test_pull_downloads_and_verifies(env, hub):
    r = cli("pull", "llava-tiny")
    assert r.returncode == 0, r.stderr
    assert "downloaded, sha256 ok" in r.stdout and LLAVA_Q4 in r.stdout and LLAVA_PROJ in r.stdout
    from edgevlm.hub.registry import resolve

    res = resolve("llava-tiny")
    assert res.is_local
    import hashlib

    assert hashlib.sha256(Path(res.model.local).read_bytes()).hexdigest() == hub.sha256(LLAVA_REPO, LLAVA_Q4)
    n_gets = len(content_gets(hub))
    r = cli("pull", "llava-tiny")
    assert r.returncode == 0 and "in the cache" in r.stdout
    assert len(content_gets(hub)) == n_gets  # nothing downloaded again


def test_pull_resumes_after_a_dropped_connection(env, hub):
    from edgevlm.hub.download import pull

    # Bigger than huggingface_hub's 10 MiB write chunk, so the cut lands after a written chunk.
    size = 24 * 2**20
    hub.add_file("test-org/big-GGUF", "big-Q4_0.gguf", os.urandom(size))
    hub.add_file("test-org/big-GGUF", "mmproj-big-f16.gguf", os.urandom(1000))
    hub.drop_once("test-org/big-GGUF", "big-Q4_0.gguf")
    res = pull("hf:test-org/big-GGUF/big-Q4_0.gguf", progress=False)
    model = dict(res.files)["model"]
    assert model.downloaded and model.size == size
    assert model.verified is not None and model.verified.algo == "sha256"
    gets = [g for g in content_gets(hub) if g.path.endswith(hub.sha256("test-org/big-GGUF", "big-Q4_0.gguf"))]
    assert len(gets) == 2 and gets[0].range is None, gets
    start = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= size // 2, gets  # continued from what it had, not from zero
    assert not list((env / "hf" / "hub").rglob("*.incomplete"))


def test_corrupt_download_is_deleted_with_a_clear_error(env, hub):
    hub.corrupt(LLAVA_REPO, LLAVA_Q4)
    r = cli("pull", "llava-tiny")
    assert_one_line_error(r, 1, LLAVA_Q4, "sha256 mismatch", "deleted from the cache")
    left = [p.name for p in (env / "hf" / "hub").rglob("*") if p.is_file() or p.is_symlink()]
    assert not any(n in (LLAVA_Q4, hub.sha256(LLAVA_REPO, LLAVA_Q4)) or n.endswith(".incomplete") for n in left), left
    from edgevlm.hub.registry import resolve

    assert resolve("llava-tiny").model.local is None


def test_small_git_files_are_checked_by_blob_sha1(env, hub):
    from edgevlm.hub.download import download
    from edgevlm.hub.registry import RemoteFile

    res = download(RemoteFile(LLAVA_REPO, "README.md"), progress=False)
    assert res.downloaded and res.verified.algo == "git-sha1"
    assert Path(res.path).read_bytes() == b"# tiny llava\n"


def test_pull_unknown_file_and_repo_errors(env):
    r = cli("pull", f"hf:{LLAVA_REPO}/nope.gguf", "--mmproj", f"hf:{LLAVA_REPO}/{LLAVA_PROJ}")
    assert_one_line_error(r, 2, "nope.gguf", "no such file")
    r = run_here("pull", "hf:nobody/nothing-GGUF/x.gguf", "--mmproj", "hf:nobody/nothing-GGUF/m.gguf")
    assert_one_line_error(r, 2, "no such repository")


# --- plans from the header alone -------------------------------------------------------------


@pytest.mark.parametrize("name,family", [("llava-tiny", "llava15"), ("qwen-tiny", "qwen25vl")])
def test_header_only_plan_equals_full_file_plan(env, hub, pairs, name, family):
    from edgevlm.hub.download import pull
    from edgevlm.hub.registry import resolve
    from edgevlm.hub.remote import fetch_header, gguf_from_json, gguf_to_json, plan_resolved
    from edgevlm.model.gguf_info import read_gguf
    from edgevlm.plan.devices import probe
    from edgevlm.plan.planner import Wishes, make_plan

    r = resolve(name)
    hdr = fetch_header(r.model.remote, first_chunk=4096)  # small first read: the ×4 growth path
    size = os.path.getsize(pairs[family].model)
    assert hdr.source == "remote" and 4096 < hdr.bytes_fetched < size
    assert all(g.range and g.range.startswith("bytes=") for g in content_gets(hub))
    local = read_gguf(pairs[family].model)
    assert hdr.gguf.tensors == local.tensors and hdr.gguf.metadata == local.metadata
    assert gguf_from_json(json.loads(json.dumps(gguf_to_json(local))), local.path) == local

    pr = probe(free_memory=["6GiB"])
    wishes = Wishes(images=2)
    remote_plan = plan_resolved(r, pr, wishes)
    assert remote_plan.model.startswith("hf:") and not blobs(env, r.model.remote.repo)  # nothing downloaded
    res = pull(name, progress=False)
    full_plan = make_plan(res.model_path, res.mmproj_path, pr, wishes)
    assert without_paths(remote_plan) == without_paths(full_plan)


def test_plan_by_name_cli_reads_headers_then_works_offline(env, hub):
    r = cli("plan", "--model", "llava-tiny", "--free-memory", "8GiB", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["fits"] and plan["model"] == f"hf:{LLAVA_REPO}/{LLAVA_Q4}"
    assert "from its GGUF headers" in r.stderr
    assert {q.method for q in hub.requests if "/resolve/" in q.path} == {"HEAD"}
    assert content_gets(hub) and all(g.range for g in content_gets(hub))
    assert not blobs(env, LLAVA_REPO)  # the model was not downloaded
    hub.clear_log()
    r2 = cli("plan", "--model", "llava-tiny", "--free-memory", "8GiB", "--json", extra_env={"HF_HUB_OFFLINE": "1"})
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["n_ctx"] == plan["n_ctx"]
    assert [q for q in hub.requests if not q.path.startswith("/api/agent")] == []


def test_real_registry_name_plans_against_the_test_server(hub, tmp_path, monkeypatch):
    """The issue's 'done when': plan --model llava-1.5-7b --free-memory 8GiB from the header."""
    serve_registry_names(hub, ["llava-1.5-7b"])
    for k in ("HF_HUB_OFFLINE", "EDGEVLM_REGISTRY", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    r = cli(
        "plan",
        "--model",
        "llava-1.5-7b",
        "--free-memory",
        "8GiB",
        extra_env={"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "EDGEVLM_CACHE": str(tmp_path / "ev")},
    )
    assert r.returncode == 0, r.stderr
    assert "fits" in r.stdout and "yes" in r.stdout
    assert any(q.path.endswith("/resolve/main/llava-v1.5-7b-Q4_K_M.gguf") for q in hub.requests)


def test_token_goes_to_the_hub_not_to_the_cdn(env, hub, monkeypatch):
    from edgevlm.hub.registry import resolve
    from edgevlm.hub.remote import read_remote_header

    monkeypatch.setenv("HF_TOKEN", "hf_testtoken")
    read_remote_header(resolve("llava-tiny").model.remote)
    heads = [q for q in hub.requests if q.method == "HEAD"]
    assert heads and all(q.authorization == "Bearer hf_testtoken" for q in heads)
    assert content_gets(hub) and all(g.authorization is None for g in content_gets(hub))


# --- offline ---------------------------------------------------------------------------------


def test_offline_mode_uses_the_cache(env, hub, monkeypatch):
    from edgevlm.cli.loading import model_paths
    from edgevlm.errors import DownloadError
    from edgevlm.hub.download import pull

    pull("llava-tiny", progress=False)
    hub.clear_log()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = pull("llava-tiny", progress=False)
    assert all(not d.downloaded for _, d in res.files)
    model, mmproj = model_paths("llava-tiny", None)
    assert os.path.isfile(model) and os.path.isfile(mmproj)
    with pytest.raises(DownloadError, match="offline mode is on"):
        pull("qwen-tiny", progress=False)
    assert [q for q in hub.requests if not q.path.startswith("/api/agent")] == []
    r = cli("pull", "qwen-tiny")
    assert_one_line_error(r, 1, "not in the local cache", "HF_HUB_OFFLINE")


# --- chat/caption plumbing, models, rm -------------------------------------------------------


def test_model_paths_pulls_what_is_missing(env, hub, pairs):
    from edgevlm.cli.loading import model_paths

    model, mmproj = model_paths("qwen-tiny", None, quiet=True)
    assert Path(model).read_bytes() == pairs["qwen25vl"].model.read_bytes()
    assert Path(mmproj).read_bytes() == pairs["qwen25vl"].mmproj.read_bytes()
    n = len(hub.requests)
    assert model_paths("qwen-tiny", None) == (model, mmproj)
    assert len(hub.requests) == n  # cached: no network at all
    lp = pairs["llava15"]
    assert model_paths(str(lp.model), None) == (str(lp.model), str(lp.mmproj))
    assert model_paths(str(lp.model), "x.gguf") == (str(lp.model), "x.gguf")  # two paths: untouched


def test_choose_model_takes_the_registrys_default_order(env, hub, monkeypatch):
    """No --model: the registry's ``default.order``, the first that fits, and why; a registry
    without one: its smallest model that fits — never the largest by default."""
    from edgevlm.hub.listing import choose_model
    from edgevlm.plan.devices import probe

    r, why = choose_model(probe(free_memory=["8GiB"]))
    assert r.entry.name == "llava-tiny" and "the smallest registry model" in why  # (the test registry has no order)
    reg = json.loads(json.dumps(TEST_REGISTRY))
    reg["default"] = {"order": ["qwen-tiny", "llava-tiny"], "why": "the test's choice"}
    (env / "registry.json").write_text(json.dumps(reg))
    r, why = choose_model(probe(free_memory=["8GiB"]))
    assert r.entry.name == "qwen-tiny" and "the default here by the plan" in why and "the test's choice" in why
    reg["default"]["order"] = ["nowhere"]
    (env / "registry.json").write_text(json.dumps(reg))
    with pytest.raises(InputError, match="default.order names nowhere"):
        choose_model(probe())
    (env / "registry.json").write_text(json.dumps(TEST_REGISTRY))
    monkeypatch.setenv("EDGEVLM_MODEL", "llava-tiny")
    r, why = choose_model(probe())
    assert r.entry.name == "llava-tiny" and "EDGEVLM_MODEL" in why


def test_models_lists_registry_and_cache(env, hub):
    from edgevlm.hub.download import pull

    pull("llava-tiny", progress=False)
    pull(f"hf:{OTHER_REPO}/other-Q4_0.gguf", progress=False)
    r = cli("models", "--json", "--free-memory", "8GiB")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["llava-tiny"]["local"] == "yes" and rows["llava-tiny"]["fits"] is True
    assert rows["llava-tiny"]["size"] == 339136 + 339776 and rows["llava-tiny"]["size_exact"]
    assert rows["qwen-tiny"]["local"] == "no" and rows["qwen-tiny"]["fits"] is None  # header not read
    assert f"hf:{OTHER_REPO}/other-Q4_0.gguf" in rows
    r = run_here("models", "--check")
    assert r.returncode == 0 and "qwen-tiny" in r.stdout and "yes" in r.stdout


def test_rm_removes_files_and_keeps_shared_projector(env, hub):
    from edgevlm.hub.download import pull
    from edgevlm.hub.registry import resolve

    pull("llava-tiny", progress=False)
    pull("llava-tiny:q8_0", progress=False)
    r = run_here("rm", "llava-tiny:q8_0")
    assert r.returncode == 0, r.stderr
    assert LLAVA_Q8 in r.stdout and LLAVA_PROJ not in r.stdout  # q4_0 still needs the projector
    assert resolve("llava-tiny").is_local and resolve("llava-tiny:q8_0").model.local is None
    r = cli("rm", "llava-tiny")
    assert r.returncode == 0 and LLAVA_Q4 in r.stdout and LLAVA_PROJ in r.stdout
    assert not (env / "hf" / "hub" / ("models--" + LLAVA_REPO.replace("/", "--"))).exists()
    assert_one_line_error(run_here("rm", "llava-tiny"), 2, "not downloaded")
    assert_one_line_error(run_here("rm", "lava-tiny"), 2, "did you mean llava-tiny")


def test_a_cluster_node_fetches_each_file_once_and_the_driver_none(env, hub, pairs):
    """Ray actors on one node call ``local_files`` at the same time: the files come down once
    (the others wait on the lock, then find them cached); the driver's ``file_identity`` — part
    of the caption resume key — reads the hub's listing and downloads nothing."""
    from edgevlm.caption.settings import model_identity
    from edgevlm.hub.download import file_identity

    ident = file_identity("qwen-tiny")
    assert content_gets(hub) == []
    code = "from edgevlm.hub.download import local_files; print(repr(local_files('qwen-tiny')))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert sorted(r.path.rsplit("/", 1)[-1] for r in content_gets(hub)) == sorted(
        [hub.sha256(QWEN_REPO, QWEN_Q4), hub.sha256(QWEN_REPO, QWEN_PROJ)]
    )
    model, mmproj = eval(outs[0][0])
    assert Path(model).read_bytes() == pairs["qwen25vl"].model.read_bytes()
    assert "+".join(ident) == model_identity(model, mmproj)[1]  # the same key before and after the pull


@pytest.mark.slow
def test_every_registry_model_of_a_generated_family_plans_from_its_headers(hub, tmp_path):
    """Each registry entry whose family edgevlm generates resolves and plans from the GGUF
    headers alone (a generated pair served under its repo and file names)."""
    served = serve_registry_names(hub)
    assert {"qwen3-vl-2b", "gemma-3-4b", "smolvlm-500m", "internvl3-2b", "pixtral-12b", "mistral-small-3.1-24b"} <= set(
        served
    )
    env = {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf"), "EDGEVLM_CACHE": str(tmp_path / "ev")}
    for name in served:
        r = cli("plan", "--model", name, "--free-memory", "16GiB", "--json", extra_env=env)
        assert r.returncode == 0, (name, r.stderr)
        plan = json.loads(r.stdout)
        assert plan["fits"] and plan["n_ctx"] > 0, name
    assert all(q.range for q in content_gets(hub))  # headers only: range reads, no download


# --- the first command: inputs before downloads, large downloads asked for ------------------------


def _first_command(*args: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "edgevlm", "chat", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=e,
        stdin=stdin,
    )


def test_a_missing_picture_is_said_before_anything_is_downloaded(env, hub):
    r = _first_command("--model", "qwen-tiny", "--image", str(env / "photo.jpg"), "Describe this image")
    assert_one_line_error(r, 2, "photo.jpg: no such file")
    assert not blobs(env, QWEN_REPO) and not content_gets(hub)  # nothing pulled, not even started


def test_a_large_default_download_needs_yes_off_a_terminal(env, hub, pairs):
    """No --model, no terminal, and the default (the registry says 3 GB): refused with the size
    and where it would go, nothing downloaded; --yes downloads it; a named model needs no --yes."""
    big = json.loads(json.dumps(TEST_REGISTRY))
    big["models"] = [m for m in big["models"] if m["name"] == "qwen-tiny"]
    big["models"][0]["files"]["q4_0"]["size"] = 3_000_000_000
    (env / "registry.json").write_text(json.dumps(big))
    pic = env / "pic.png"
    Image.new("RGB", (64, 48), "red").save(pic)
    r = _first_command("--image", str(pic), "-n", "2", "What is it?")
    assert_one_line_error(r, 2, "no --model given", "qwen-tiny", "2.79 GiB to download", str(env / "hf"), "--yes")
    assert not blobs(env, QWEN_REPO)
    r = _first_command("--image", str(pic), "-n", "2", "--yes", "What is it?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and blobs(env, QWEN_REPO)


def test_a_large_named_download_proceeds_off_a_terminal(env, hub):
    big = json.loads(json.dumps(TEST_REGISTRY))
    for m in big["models"]:
        if m["name"] == "qwen-tiny":
            m["files"]["q4_0"]["size"] = 3_000_000_000
    (env / "registry.json").write_text(json.dumps(big))
    r = _first_command("--model", "qwen-tiny", "-n", "2", "Hi")
    assert r.returncode == 0, r.stderr
    assert blobs(env, QWEN_REPO)


@pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal")
def test_on_a_terminal_a_large_download_is_asked_for_first(env, hub):
    """On a terminal the command says the size and the destination and waits for an answer; no
    says nothing is downloaded (exit 1)."""
    from .conftest import on_a_terminal

    big = json.loads(json.dumps(TEST_REGISTRY))
    for m in big["models"]:
        if m["name"] == "qwen-tiny":
            m["files"]["q4_0"]["size"] = 3_000_000_000
    (env / "registry.json").write_text(json.dumps(big))
    rc, seen = on_a_terminal(["chat", "--model", "qwen-tiny", "Hi"], b"Download?", b"n\n")
    assert rc == 1 and b"2.79 GiB to download" in seen and b"Download? [Y/n]" in seen, seen
    assert b"not downloaded (answered no)" in seen and not blobs(env, QWEN_REPO)


def test_the_packaged_default_is_small_and_named_in_models():
    """The shipped registry's default order holds small models only (never the 24B one a
    'largest that fits' rule took), and ``edgevlm models`` says which runs without --model."""
    from edgevlm.hub.registry import load_registry

    reg = load_registry()
    sizes = {e.name: e.approx_size() for e in reg.entries}
    assert reg.default and all(sizes[n] < 4 * 2**30 for n in reg.default) and reg.default_why
    r = cli("models")
    assert r.returncode == 0, r.stderr
    assert f"without --model: the first of {', '.join(reg.default)}" in " ".join(r.stdout.split())


def test_models_fits_an_80_column_terminal(tmp_path):
    """One line per model at 80 columns (the table once wrapped each row onto three lines)."""
    e = dict(os.environ, COLUMNS="80", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    e.pop("EDGEVLM_REGISTRY", None)
    r = subprocess.run([sys.executable, "-m", "edgevlm", "models"], capture_output=True, text=True, timeout=120, env=e)
    assert r.returncode == 0, r.stderr
    from edgevlm.hub.registry import load_registry

    table = r.stdout.split("planned for")[0].splitlines()
    assert len(table) == 1 + len(load_registry().entries)  # a header and one line each
    assert all(len(line.rstrip()) <= 80 for line in table), max(table, key=len)
