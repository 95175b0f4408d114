"""Captioning and batch files on a real Ray instance (started by the command, ``--ray local``, or
in this process for the Python API), 2 CPUs, real llama.cpp in the actors: 40 images over two
actors, an actor killed mid-run, the driver killed and run again, Parquet shards, a batch file,
and ``--ray`` without Ray installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import make_image, run_cli
from tests.test_batch import body, line, read_out, write_lines
from tests.test_serve import data_uri, png

ray = pytest.importorskip("ray")

N = 40


@pytest.fixture(scope="module")
def pair(model_pair):
    return model_pair("llava15")


@pytest.fixture(scope="module")
def forty(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("forty")
    for i in range(N):
        make_image(d / f"img{i:02d}.png", 48 + i, 40 + (i * 7) % 30, seed=i)
    return d


def caption_cmd(pair, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "edgevlm",
        "caption",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-n",
        "8",
        "--ray",
        "local",
        "--ray-batch",
        "4",
        *args,
    ]


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def actor_pids(kind: str = "CaptionActor") -> set[int]:
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(kind in part for part in (p.info["cmdline"] or [])):
                out.add(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def ray_gone(timeout: float = 60) -> None:
    """Wait until no Ray process of an earlier run is left (each test starts its own)."""
    deadline = time.monotonic() + timeout
    while any(
        "raylet" in " ".join(p.info["cmdline"] or []) or "gcs_server" in " ".join(p.info["cmdline"] or [])
        for p in psutil.process_iter(["cmdline"])
    ):
        assert time.monotonic() < deadline, "Ray processes of an earlier run are still alive"
        time.sleep(0.2)


def run_watching(cmd: list[str], out: Path, when, action, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd``; the first time ``when(records)`` holds, call ``action(proc)``; return the result."""
    ray_gone()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore")
    )
    deadline = time.monotonic() + timeout
    fired = False
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not finish"
        if not fired and when(records(out)):
            action(proc)
            fired = True
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    assert fired, f"the run ended before the event: {stderr}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check_one_each(out: Path, folder: Path) -> list[dict]:
    recs = records(out)
    assert sorted(r["path"] for r in recs) == sorted(str(p) for p in folder.iterdir())
    assert len({r["custom_id"] for r in recs}) == N
    assert all(r["caption"] and not r["error"] for r in recs)
    return recs


@pytest.mark.slow
def test_forty_images_over_two_actors_match_plain_caption(pair, forty, tmp_path):
    out = tmp_path / "c.jsonl"
    seen: set[int] = set()
    ray_gone()
    proc = subprocess.Popen(
        caption_cmd(pair, str(forty), "--actors", "2", "--out", str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while proc.poll() is None:
        seen |= actor_pids()
        time.sleep(0.1)
    _, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    assert "2 actor(s), 1 thread(s) each" in stderr and f"captioned {N} ·" in stderr
    assert len(seen) >= 2, "two actors captioned"
    recs = check_one_each(out, forty)
    # The same records as edgevlm caption: a plain run over the same folder finds everything done,
    # and a plain caption of two of the images is word for word the Ray one.
    plain = run_cli(
        "caption", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "-n", "8", str(forty), "--out", str(out)
    )
    assert plain.returncode == 0 and f"captioned 0 · skipped {N}" in plain.stderr, plain.stderr
    fresh = tmp_path / "plain.jsonl"
    two = sorted(forty.iterdir())[:2]
    plain = run_cli(
        "caption", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "-n", "8", *map(str, two), "--out", str(fresh)
    )
    assert plain.returncode == 0, plain.stderr
    by_path = {r["path"]: r for r in recs}
    for r in records(fresh):
        ray_rec = by_path[r["path"]]
        assert set(r) == set(ray_rec)
        for key in (
            "custom_id",
            "sha256",
            "caption",
            "settings",
            "model",
            "prompt",
            "width",
            "height",
            "bytes",
            "mtime_ns",
            "image_tokens",
        ):
            assert r[key] == ray_rec[key], key


@pytest.mark.slow
def test_a_killed_actor_leaves_exactly_one_record_per_image(pair, forty, tmp_path):
    out = tmp_path / "c.jsonl"
    killed: list[int] = []

    def kill_an_actor(proc):
        pids = sorted(actor_pids())
        assert pids, "no actor to kill"
        os.kill(pids[0], signal.SIGKILL)  # what ray.kill(actor, no_restart=False) does to its process
        killed.append(pids[0])

    r = run_watching(
        caption_cmd(pair, str(forty), "--actors", "2", "--out", str(out)),
        out,
        lambda recs: len(recs) >= 4,
        kill_an_actor,
    )
    assert r.returncode == 0, r.stderr
    assert killed and killed[0] not in actor_pids()
    check_one_each(out, forty)


@pytest.mark.slow
def test_a_killed_driver_resumes_without_duplicates(pair, forty, tmp_path):
    out = tmp_path / "c.jsonl"
    cmd = caption_cmd(pair, str(forty), "--actors", "2", "--out", str(out))
    r = run_watching(cmd, out, lambda recs: len(recs) >= 8, lambda proc: os.kill(proc.pid, signal.SIGKILL))
    assert r.returncode == -signal.SIGKILL
    before = records(out)
    assert 8 <= len(before) < N and len({x["custom_id"] for x in before}) == len(before)
    ray_gone()  # the local instance died with its driver
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"skipped {len(before)}" in again.stderr
    recs = check_one_each(out, forty)
    assert recs[: len(before)] == before  # what was written stays as it was


@pytest.mark.slow
def test_parquet_shards_resume_and_errors_are_records(pair, forty, tmp_path):
    pa = pytest.importorskip("pyarrow.parquet")
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for p in sorted(forty.iterdir())[:6]:
        (imgs / p.name).write_bytes(p.read_bytes())
    (imgs / "broken.png").write_bytes(b"not a picture")
    out = tmp_path / "caps.parquet"
    cmd = caption_cmd(pair, str(imgs), "--actors", "1", "--format", "parquet", "--out", str(out))
    ray_gone()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stderr  # the broken file is an error record
    assert "failed: " in r.stderr and "broken.png: not an image" in r.stderr
    table = pa.read_table(str(out))
    rows = table.to_pylist()
    assert len(rows) == 7 and len({x["custom_id"] for x in rows}) == 7
    assert [x for x in rows if x["error"]][0]["path"].endswith("broken.png")
    assert json.loads(next(x for x in rows if x["caption"])["stats"])["predicted_n"] > 0
    (imgs / "broken.png").unlink()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "captioned 0 · skipped 6" in again.stderr, again.stderr
    assert "ray:" not in again.stderr  # nothing left to do: no cluster started


@pytest.mark.slow
def test_a_batch_file_on_ray(pair, tmp_path):
    good = {f"g{i}": body(f"Picture {i}?", data_uri(png(60 + i, 50, seed=i))) for i in range(6)}
    lines = [line(k, v) for k, v in good.items()]
    lines.append(line("bad-image", body("What?", data_uri(b"GIF89a broken"))))
    lines.insert(3, "not json at all")
    req = tmp_path / "r.jsonl"
    write_lines(req, lines)
    ray_gone()
    r = run_cli(
        "batch",
        str(req),
        "--out",
        str(tmp_path / "ray.jsonl"),
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--ray",
        "local",
        "--actors",
        "2",
        "--ray-batch",
        "2",
        "--parallel",
        "1",
    )
    assert r.returncode == 4, r.stderr
    assert "2 actor(s)" in r.stderr
    out = read_out(tmp_path / "ray.jsonl")
    by_id = {o["custom_id"]: o for o in out}
    assert len(out) == 8 and set(by_id) == {*good, "bad-image", None}
    assert by_id["bad-image"]["response"]["status_code"] == 400
    assert by_id[None]["error"]["code"] == "invalid_json_line"
    # answered here, one at a time: the same words
    here = run_cli(
        "batch",
        str(req),
        "--out",
        str(tmp_path / "here.jsonl"),
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--parallel",
        "1",
        "--threads",
        "1",
    )  # as each actor: 1 thread
    assert here.returncode == 4, here.stderr
    mine = {o["custom_id"]: o for o in read_out(tmp_path / "here.jsonl")}
    for k in good:
        assert by_id[k]["response"]["status_code"] == 200
        assert (
            by_id[k]["response"]["body"]["choices"][0]["message"]["content"]
            == mine[k]["response"]["body"]["choices"][0]["message"]["content"]
        )


@pytest.mark.slow
def test_the_python_api_on_a_running_ray(pair, forty, tmp_path):
    from edgevlm.caption import CaptionSettings
    from edgevlm.cluster import caption_dataset, caption_files

    ray_gone()
    ray.init(  # as docs/caption.md starts a session of one's own: the actors at this process's priority
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _system_config={"worker_niceness": 0},
    )
    try:
        paths = [str(p) for p in sorted(forty.iterdir())[:5]]
        ds = ray.data.read_binary_files(paths, include_paths=True)
        rows = caption_dataset(
            ds, model=str(pair.model), mmproj=str(pair.mmproj), settings=CaptionSettings(max_tokens=8)
        ).take_all()
        assert sorted(r["path"] for r in rows) == paths and all(r["caption"] for r in rows)
        out = tmp_path / "api.jsonl"
        summary = caption_files(
            paths[:3],
            model=str(pair.model),
            mmproj=str(pair.mmproj),
            out=str(out),
            settings=CaptionSettings(max_tokens=8),
            actors=1,
        )
        assert summary.done == 3 and summary.exit_code == 0
        by_path = {r["path"]: r for r in rows}
        for rec in records(out):  # the same caption, whether Ray Data or the file API made it
            assert rec["caption"] == by_path[rec["path"]]["caption"]
            assert rec["custom_id"] == by_path[rec["path"]]["custom_id"]
    finally:
        ray.shutdown()


def test_ray_missing_is_one_line(pair, forty, tmp_path):
    shim = tmp_path / "shim" / "ray"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = dict(os.environ, PYTHONPATH=str(shim.parent))
    for args in (["caption", str(forty), "--out", str(tmp_path / "c.jsonl")], ["batch", str(tmp_path / "r.jsonl")]):
        write_lines(tmp_path / "r.jsonl", [line("a", body("Hi"))])
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgevlm",
                *args,
                "-m",
                str(pair.model),
                "--mmproj",
                str(pair.mmproj),
                "--ray",
                "local",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            "Error: --ray needs Ray, an optional extra: pip install 'edgevlm[ray]'"
        ]


def test_a_local_instance_runs_its_workers_at_the_callers_priority():
    """Ray's default worker niceness (15) starves the actors beside any busy process."""
    from edgevlm.cluster.connect import connect

    ray_gone()
    with connect("local", num_cpus=1):
        worker_nice = ray.get(ray.remote(num_cpus=1)(lambda: os.nice(0)).remote(), timeout=120)
    assert worker_nice == os.nice(0)
