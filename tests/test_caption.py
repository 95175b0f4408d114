"""``edgevlm caption``: discovery, outputs, resume after SIGKILL / Ctrl-C, sharding, policies.

Real llama.cpp on the tiny generated LLaVA-1.5 pair, the real CLI in subprocesses."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgevlm.caption import CaptionSettings, check_template, clean_caption, render_prompt
from edgevlm.caption.inputs import InputItem, discover, parse_shard, sniff
from edgevlm.caption.outputs import CAPTION_RECORDS, CaptionRecord
from edgevlm.caption.text import compose
from edgevlm.errors import InputError
from edgevlm.jobs.records import RecordLog

from .conftest import run_cli
from .test_errors import assert_clean_error

N = ["-n", "6"]  # short captions keep the suite fast


def cap_args(pair, *extra):
    return ["caption", "--model", str(pair.model), "--mmproj", str(pair.mmproj), *N, *extra]


def png_bomb(path: Path, w: int = 40000, h: int = 40000) -> Path:
    """A valid PNG header announcing w×h pixels in a few bytes (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    return path


def picture(path: Path, seed: int, size=(64, 48), fmt: str | None = None) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(path, format=fmt)
    return path


@pytest.fixture()
def folder(tmp_path):
    """Good pictures (one without an extension) and every kind of bad file."""
    d = tmp_path / "photos"
    (d / "sub").mkdir(parents=True)
    good = [
        picture(d / "a.png", 1),
        picture(d / "b.jpg", 2),
        picture(d / "noext", 3, fmt="PNG"),
        picture(d / "sub" / "c.png", 4),
    ]
    data = good[0].read_bytes()
    bad = {
        "corrupt": d / "corrupt.png",
        "empty": d / "empty.png",
        "notimage": d / "notes.jpg",
        "huge": png_bomb(d / "huge.png"),
    }
    bad["corrupt"].write_bytes(data[: len(data) // 3])
    bad["empty"].write_bytes(b"")
    bad["notimage"].write_text("a shopping list, not a JPEG")
    (d / "README.md").write_text("not an input")
    picture(d / ".hidden.png", 5)
    return {"dir": d, "good": good, "bad": bad}


def records(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # every line valid JSON


def summary_line(stderr: str) -> str:
    return next(ln for ln in stderr.splitlines() if ln.startswith("captioned "))


# --- inputs (no model) -----------------------------------------------------------------------
def test_discovery_by_content_stable_order_and_patterns(folder, tmp_path):
    d = folder["dir"]
    f = discover([str(d)])
    names = [Path(i.path).name for i in f.items]
    # by content (noext), by extension (notes.jpg, empty.png), not README.md or hidden files
    assert names == ["a.png", "b.jpg", "corrupt.png", "empty.png", "huge.png", "noext", "notes.jpg"]
    assert f.ignored == 1 and f.dirs_not_entered == 1
    rec = discover([str(d)], recursive=True)
    assert [i.key for i in rec.items][-1] == "sub/c.png" and len(rec.items) == 8
    assert [i.key for i in discover([str(d)], recursive=True, include=["*.PNG"]).items] == [
        "a.png",
        "corrupt.png",
        "empty.png",
        "huge.png",
        "sub/c.png",
    ]
    assert "sub/c.png" not in [i.key for i in discover([str(d)], recursive=True, exclude=["sub"]).items]
    # a file named twice (argument, glob, directory) is captioned once, first place kept
    twice = discover([str(d / "b.jpg"), str(d / "*.png"), str(d)])
    assert [Path(i.path).name for i in twice.items][:2] == ["b.jpg", "a.png"]
    assert len(twice.items) == 7
    with pytest.raises(InputError, match="no such file or directory"):
        discover([str(d / "missing")])
    lst = tmp_path / "list.txt"
    lst.write_text(f"# a comment\n{d / 'a.png'}\n\n{d / 'gone.png'}\n")
    assert [Path(i.path).name for i in discover(from_list=str(lst)).items] == ["a.png", "gone.png"]
    assert sniff((d / "noext").read_bytes()[:32]) == "PNG" and sniff(b"just text") is None


def test_shards_cover_every_image_once(folder):
    items = discover([str(folder["dir"])], recursive=True).items
    parts = [discover([str(folder["dir"])], recursive=True, shard=(i, 3)).items for i in (1, 2, 3)]
    keys = [it.key for part in parts for it in part]
    assert sorted(keys) == sorted(it.key for it in items) and len(set(keys)) == len(keys)
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "x", "1/0"):
        with pytest.raises(InputError):
            parse_shard(bad)


def test_prompts_cleanup_and_composition():
    item = InputItem("photos/red_car.jpg", "red_car.jpg")
    assert (
        render_prompt("Caption {name} ({filename}); was: {existing}", item, " old ")
        == "Caption red_car (red_car.jpg); was: old"
    )
    check_template("literal {{braces}} and {name}")
    for bad in ("{nam}", "{name.x}", "{"):
        with pytest.raises(InputError, match="--prompt"):
            check_template(bad)
    assert clean_caption("Sure! Here is a caption for the image: The image shows a red car.") == "A red car."
    assert clean_caption('"In this picture, we can see two dogs\non grass."') == "Two dogs on grass."
    assert clean_caption("A cat sleeps. It is on a sofa and", truncated=True) == "A cat sleeps."
    assert clean_caption("A photo of a bridge at night") == "A bridge at night"
    assert compose("tag1, tag2", "a dog", "append", ", ") == "tag1, tag2, a dog"
    assert compose("tag1\n", "a dog", "prepend", " | ") == "a dog | tag1"
    assert compose(None, "a dog", "append", ", ") == "a dog"
    assert compose("old", "new", "overwrite", " ") == "new"
    # greedy: the sampling knobs do not change the key; the prompt and the model do
    base = CaptionSettings()
    assert base.digest("m") == CaptionSettings(top_k=3, seed=9).digest("m")
    assert base.digest("m") != CaptionSettings(prompt="Tags:").digest("m") != base.digest("m2")


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_record_log_cuts_a_torn_tail(tmp_path, fmt):
    path = tmp_path / f"log.{fmt}"

    def rec(i, caption):
        return CaptionRecord(
            f"img-{i}", f"p/{i}.png", "ab" * 32, caption, "m.gguf", "Describe", "s1", created="2025-01-01T00:00:00Z"
        )

    log = RecordLog(str(path), CAPTION_RECORDS, fmt).open()
    log.append(rec(1, "first"))
    log.append(rec(2, 'a caption with "quotes",\nand a line break'))
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole + (b'{"custom_id": "img-3", "pa' if fmt == "jsonl" else b'img-3,p/3.png,ab,"torn\n'))
    log = RecordLog(str(path), CAPTION_RECORDS, fmt).open()
    assert [e.data["custom_id"] for e in log.entries] == ["img-1", "img-2"]
    assert log.repaired_bytes > 0 and path.read_bytes() == whole
    log.close()
    if fmt == "csv":
        rows = list(csv.DictReader(path.open(newline="")))
        assert rows[1]["caption"] == 'a caption with "quotes",\nand a line break'
    other = tmp_path / "notes.txt"
    other.write_text("my own notes\n")
    with pytest.raises(InputError, match="not a caption"):
        RecordLog(str(other), CAPTION_RECORDS, fmt).open()
    assert other.read_text() == "my own notes\n"  # never truncated


# --- the command on a real (tiny) model ------------------------------------------------------------
def test_folder_with_bad_files_jsonl_and_resume(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    out = tmp_path / "captions.jsonl"
    # one image in flight: batched rows are not bit-identical to one-at-a-time ones in llama.cpp,
    # and which images share a step follows measured step times (the fresh run below is compared)
    one = ("--parallel", "1")
    r = run_cli(*cap_args(pair, str(folder["dir"]), "--recursive", "--out", str(out), *one))
    assert r.returncode == 4, r.stderr  # some images failed
    assert r.stdout == "" and "Traceback" not in r.stderr
    recs = records(out)
    assert Counter(Path(x["path"]).name for x in recs) == Counter(
        ["a.png", "b.jpg", "noext", "c.png", "corrupt.png", "empty.png", "notes.jpg", "huge.png"]
    )
    by = {Path(x["path"]).name: x for x in recs}
    for name in ("a.png", "b.jpg", "noext", "c.png"):
        x = by[name]
        assert x["error"] is None and x["caption"] and x["image_tokens"] == 576
        assert x["sha256"] == hashlib.sha256(Path(x["path"]).read_bytes()).hexdigest()
        assert x["model"] == "model.gguf" and x["prompt"] and x["custom_id"].startswith("img-")
        assert x["stats"]["predicted_n"] <= 6 and "cached_n" in x["stats"]
    assert "corrupt or truncated" in by["corrupt.png"]["error"]
    assert "empty file" in by["empty.png"]["error"]
    assert "not an image" in by["notes.jpg"]["error"]
    assert "exceeds the limit" in by["huge.png"]["error"]
    assert all(by[n]["caption"] is None for n in ("corrupt.png", "empty.png", "notes.jpg", "huge.png"))
    line = summary_line(r.stderr)
    assert "captioned 4" in line and "failed 4" in line and "images/s" in line and "tok/s" in line
    assert "failed: " in r.stderr
    # the same command again: nothing to do, nothing appended, still exit 4
    again = run_cli(*cap_args(pair, str(folder["dir"]), "--recursive", "--out", str(out), *one))
    assert again.returncode == 4 and records(out) == recs
    assert "captioned 0 · skipped 8 (4 failed earlier)" in summary_line(again.stderr)
    # greedy decoding: the same captions in a fresh run
    out2 = tmp_path / "again.jsonl"
    run_cli(*cap_args(pair, str(folder["dir"]), "--recursive", "--out", str(out2), *one))
    assert {x["path"]: x["caption"] for x in records(out2)} == {x["path"]: x["caption"] for x in recs}


def _popen(args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        [sys.executable, "-m", "edgevlm", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def _run_until(args, n_images: int, sig: int) -> int:
    """Start the command, send ``sig`` once ``n_images`` image events were reported."""
    p = _popen(args)
    seen = 0
    assert p.stderr is not None
    for line in p.stderr:
        ev = json.loads(line)
        if ev["event"] == "image":
            seen += 1
        if (ev["event"] == "start" and n_images == 0) or (ev["event"] == "image" and seen == n_images):
            p.send_signal(sig)
            break
    p.stderr.read()
    return p.wait(timeout=120)


def test_sigkill_anywhere_then_resume_exactly_one_record_each(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    out = tmp_path / "captions.jsonl"
    args = cap_args(pair, str(folder["dir"]), "-r", "--out", str(out), "--progress", "json")
    for point in (0, 2, 5):  # killed during the first image, after two, after five
        assert _run_until(args, point, signal.SIGKILL) == -signal.SIGKILL
        recs = records(out)  # valid JSONL whatever the moment
        assert len({x["path"] for x in recs}) == len(recs)
    with out.open("ab") as fh:  # a torn record (power loss mid-write)
        fh.write(b'{"custom_id": "img-deadbeef", "path": "photos/')
    r = run_cli(*args)
    assert r.returncode == 4, r.stderr
    recs = records(out)
    assert sorted(Path(x["path"]).name for x in recs) == sorted(
        ["a.png", "b.jpg", "noext", "c.png", "corrupt.png", "empty.png", "notes.jpg", "huge.png"]
    )
    assert sum(1 for x in recs if x["error"]) == 4
    assert json.loads(r.stderr.splitlines()[-1])["event"] == "summary"


@pytest.mark.parametrize("parallel,at_most", [("1", 2), ("4", 6)])
def test_ctrl_c_finishes_the_images_in_progress_and_prints_the_summary(model_pair, tmp_path, parallel, at_most):
    pair = model_pair("llava15")
    d = tmp_path / "many"
    d.mkdir()
    for i in range(8):
        picture(d / f"{i}.png", 10 + i)
    out = tmp_path / "c.jsonl"
    p = _popen(cap_args(pair, str(d), "--out", str(out), "--progress", "json", "-n", "12", "--parallel", parallel))
    events = []
    assert p.stderr is not None
    for line in p.stderr:
        events.append(json.loads(line))
        if events[-1]["event"] == "image":
            p.send_signal(signal.SIGINT)
            break
    events += [json.loads(ln) for ln in p.stderr.read().splitlines()]
    assert p.wait(timeout=120) == 130
    summary = events[-1]
    assert summary["event"] == "summary" and summary["interrupted"] and summary["exit_code"] == 130
    assert any(e["event"] == "note" and "finishing the image(s) in progress" in e["message"] for e in events)
    done = records(out)
    # the image(s) in progress were finished, no new ones started
    assert len(done) == summary["done"] and 1 <= len(done) <= at_most
    r = run_cli(*cap_args(pair, str(d), "--out", str(out), "-n", "12"))
    assert r.returncode == 0, r.stderr
    assert sorted(x["path"] for x in records(out)) == sorted(str(d / f"{i}.png") for i in range(8))


@pytest.mark.parametrize("policy", ["skip", "overwrite", "append", "prepend"])
def test_txt_sidecars_existing_policies(model_pair, tmp_path, policy):
    pair = model_pair("llava15")
    d = tmp_path / "ds"
    d.mkdir()
    picture(d / "one.png", 1)
    picture(d / "two.jpg", 2)
    (d / "two.txt").write_text("tag_a, tag_b")
    log = tmp_path / "log.jsonl"
    args = cap_args(
        pair,
        str(d),
        "--format",
        "txt",
        "--existing",
        policy,
        "--separator",
        ", ",
        "--prefix",
        "ohwx, ",
        "--out",
        str(log),
    )
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    new = {Path(x["path"]).name: x["caption"] for x in records(log)}
    assert (d / "one.txt").read_text() == new["one.png"] and new["one.png"].startswith("ohwx, ")
    two = (d / "two.txt").read_text()
    expected = {
        "skip": "tag_a, tag_b",
        "overwrite": new.get("two.jpg"),
        "append": f"tag_a, tag_b, {new.get('two.jpg')}",
        "prepend": f"{new.get('two.jpg')}, tag_a, tag_b",
    }
    assert two == expected[policy]
    assert ("two.jpg" in new) == (policy != "skip")
    # rerun: nothing captioned, append/prepend not applied twice
    again = run_cli(*args)
    assert again.returncode == 0 and (d / "two.txt").read_text() == two
    assert "captioned 0" in summary_line(again.stderr)
    assert not list(d.glob(".*edgevlm-tmp"))


def test_txt_sidecar_lost_in_a_kill_is_written_on_rerun(model_pair, tmp_path):
    pair = model_pair("llava15")
    d = tmp_path / "ds"
    d.mkdir()
    picture(d / "one.png", 1)
    log = tmp_path / "log.jsonl"
    args = cap_args(pair, str(d), "--format", "txt", "--existing", "append", "--out", str(log))
    (d / "one.txt").write_text("old")
    assert run_cli(*args).returncode == 0
    written = (d / "one.txt").read_text()
    (d / "one.txt").write_text("old")  # as if killed after the record, before the rename
    r = run_cli(*args)
    assert r.returncode == 0 and (d / "one.txt").read_text() == written
    assert "completed 1 caption file" in r.stderr and len(records(log)) == 1


def test_metadata_jsonl_for_imagefolder(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    root = folder["dir"]
    for bad in folder["bad"].values():
        bad.unlink()
    meta = root / "metadata.jsonl"
    meta.write_text(json.dumps({"file_name": "a.png", "text": "kept", "label": 3}) + "\n")
    log = tmp_path / "log.jsonl"
    r = run_cli(*cap_args(pair, str(root), "-r", "--format", "metadata", "--out", str(log)))
    assert r.returncode == 0, r.stderr
    rows = {x["file_name"]: x for x in records(meta)}
    assert set(rows) == {"a.png", "b.jpg", "noext", "sub/c.png"}
    assert rows["a.png"] == {"file_name": "a.png", "text": "kept", "label": 3}  # --existing skip
    assert all(rows[k]["text"] for k in rows)
    r = run_cli(*cap_args(pair, str(root), "-r", "--format", "metadata", "--out", str(log), "--existing", "overwrite"))
    rows = {x["file_name"]: x for x in records(meta)}
    assert rows["a.png"]["label"] == 3 and rows["a.png"]["text"] != "kept"


def test_csv_output_and_resume(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    out = tmp_path / "caps.csv"
    args = cap_args(pair, str(folder["dir"]), "--format", "csv", "--out", str(out), "--clean")
    assert run_cli(*args).returncode == 4
    rows = list(csv.DictReader(out.open(newline="")))
    assert len(rows) == 7 and rows[0].keys() >= {
        "custom_id",
        "path",
        "sha256",
        "caption",
        "error",
        "model",
        "prompt",
        "image_tokens",
        "cached_n",
    }
    assert sum(1 for x in rows if x["error"]) == 4
    assert run_cli(*args).returncode == 4
    assert list(csv.DictReader(out.open(newline=""))) == rows


def test_shards_from_the_command_line(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    paths = []
    for i in (1, 2):
        r = run_cli(
            *cap_args(pair, str(folder["dir"]), "-r", "--shard", f"{i}/2", "--out", str(tmp_path / "part{shard}.jsonl"))
        )
        assert r.returncode in (0, 4), r.stderr
        out = tmp_path / f"part{i}-of-2.jsonl"
        paths += [x["path"] for x in records(out)] if out.exists() else []
    assert len(paths) == len(set(paths)) == 8
    assert_clean_error(run_cli(*cap_args(pair, str(folder["dir"]), "--out", "p{shard}.jsonl")), "{shard}")


def test_list_from_stdin_with_a_missing_file(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    out = tmp_path / "c.jsonl"
    good = [str(p) for p in folder["good"][:2]]
    listing = "\n".join(good + [str(tmp_path / "gone.png")]) + "\n"
    r = run_cli(
        *cap_args(
            pair,
            "--from-list",
            "-",
            "--out",
            str(out),
            "--system",
            "You write short, factual captions for a photo dataset.",
        ),
        input=listing,
    )
    assert r.returncode == 4, r.stderr
    # with images in flight, records are written as images finish: the missing file's first
    by = {x["path"]: x for x in records(out)}
    assert sorted(by) == sorted(good + [str(tmp_path / "gone.png")])
    gone = by[str(tmp_path / "gone.png")]
    assert gone["error"] == "no such file" and gone["error_kind"] == "io"
    # the system prompt is evaluated once: the second image shares it in the KV cache
    assert by[good[0]]["stats"]["cached_n"] == 0 and by[good[1]]["stats"]["cached_n"] > 10


def test_bad_input_one_line_exit_2(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    (empty / "readme.md").write_text("x")
    assert_clean_error(run_cli(*cap_args(pair, str(empty))), "no images found", "1 file(s) are not images")
    assert_clean_error(run_cli(*cap_args(pair, str(tmp_path / "nope"))), "no such file or directory")
    assert_clean_error(run_cli(*cap_args(pair, str(folder["dir"]), "--shard", "3/2")), "--shard")
    assert_clean_error(run_cli(*cap_args(pair, str(folder["dir"]), "--prompt", "Hi {nme}")), "{nme}")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    assert_clean_error(run_cli(*cap_args(pair, str(folder["dir"]), "--out", str(notes))), "not a caption")


def test_caption_images_python_api(model_pair, folder):
    import edgevlm
    from edgevlm.caption import caption_images

    pair = model_pair("qwen2vl")
    with edgevlm.load(pair.model, pair.mmproj) as vlm:
        recs = list(
            caption_images(
                vlm,
                [str(p) for p in folder["good"]] + [str(folder["bad"]["corrupt"])],
                max_tokens=4,
                prompt="Describe {name}.",
            )
        )
    assert [r.ok for r in recs] == [True, True, True, True, False]
    assert recs[0].prompt == "Describe a." and recs[1].stats["cached_n"] > 0
    proj = edgevlm.load_projector(pair.mmproj)
    assert recs[0].image_tokens == edgevlm.image_tokens(proj, 64, 48).n_tokens  # as mtmd counts


def test_caption_images_leaves_the_engine_as_it_found_it(model_pair, folder):
    """Captioning borrows the model's scheduler; its options and a conversation over it stay the same."""
    import edgevlm
    from edgevlm.caption import caption_images

    pair = model_pair("llava15")
    with edgevlm.load(
        pair.model, pair.mmproj, options=edgevlm.EngineOptions(system="You are terse."), n_seq_max=2, n_threads=2
    ) as vlm:
        conv = vlm.conversation()
        first = conv.chat("Describe it.", [folder["good"][0]], max_tokens=3, temperature=0.0)
        options, history = vlm.options, [(m.role, m.text) for m in conv.messages]
        recs = list(
            caption_images(
                vlm,
                [str(p) for p in folder["good"]],
                max_tokens=3,
                system="Captions only.",
                image_tokens=576,
                tiles="off",
            )
        )
        assert all(r.ok for r in recs) and len(recs) == len(folder["good"])
        assert vlm.options is options and vlm.options.system == "You are terse."
        assert [(m.role, m.text) for m in conv.messages] == history
        follow = conv.chat("And?", max_tokens=2, temperature=0.0)  # the conversation goes on
        assert follow.stats.images_encoded == 0 and first.stats.image_tokens == 576
        assert len(conv.messages) == 4


def test_changed_or_retried_images_keep_one_record_each(model_pair, tmp_path):
    pair = model_pair("llava15")
    d = tmp_path / "ds"
    d.mkdir()
    picture(d / "a.png", 1)
    (d / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # broken
    (d / "c.jpg").write_text("text")
    out = tmp_path / "c.jsonl"
    listed = run_cli(*cap_args(pair, str(d), "--out", str(out), "--dry-run"))
    assert listed.returncode == 0 and listed.stdout.split() == [str(d / n) for n in ("a.png", "b.png", "c.jpg")]
    assert not out.exists()
    assert run_cli(*cap_args(pair, str(d), "--out", str(out))).returncode == 4
    picture(d / "b.png", 2)  # fixed: new bytes, so captioned again; its error record goes
    r = run_cli(*cap_args(pair, str(d), "--out", str(out)))
    assert r.returncode == 4 and "captioned 1" in summary_line(r.stderr)
    recs = records(out)
    assert sorted(Path(x["path"]).name for x in recs) == ["a.png", "b.png", "c.jpg"]
    assert [x["error"] is None for x in recs if x["path"].endswith("b.png")] == [True]
    r = run_cli(*cap_args(pair, str(d), "--out", str(out), "--retry-errors"))
    assert r.returncode == 4 and "retried 1 image" in r.stderr
    assert sorted(Path(x["path"]).name for x in records(out)) == ["a.png", "b.png", "c.jpg"]


def test_json_schema_puts_the_parsed_object_in_each_record(model_pair, folder, tmp_path):
    pair = model_pair("llava15")
    schema = tmp_path / "tags.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["tag"],
                "properties": {"tag": {"enum": ["cat", "dog", "car", "tree"]}},
            }
        )
    )
    out = tmp_path / "tags.jsonl"
    r = run_cli(
        *cap_args(pair, *[str(p) for p in folder["good"]], "--out", str(out), "-n", "32", "--json-schema", str(schema))
    )
    assert r.returncode == 0, r.stderr
    recs = records(out)
    assert len(recs) == len(folder["good"])
    for rec in recs:
        assert rec["json"] == json.loads(rec["caption"]) and rec["json"]["tag"] in ("cat", "dog", "car", "tree")
    # too few tokens for the object: an "output" error record, not a crash; final until retried
    short = tmp_path / "short.jsonl"
    r = run_cli(*cap_args(pair, str(folder["good"][0]), "--out", str(short), "-n", "2", "--json-schema", str(schema)))
    assert r.returncode == 4
    rec = records(short)[0]
    assert rec["error_kind"] == "output" and "not complete JSON" in rec["error"] and "json" not in rec
    again = run_cli(
        *cap_args(pair, str(folder["good"][0]), "--out", str(short), "-n", "2", "--json-schema", str(schema))
    )
    assert again.returncode == 4 and len(records(short)) == 1


def test_quiet_prints_nothing_but_errors(tmp_path):
    """``caption -q`` with the demo model: no demo note, no progress, no summary."""
    from PIL import Image

    Image.new("RGB", (64, 48), "red").save(tmp_path / "red.png")
    r = run_cli("caption", str(tmp_path / "red.png"), "--model", "demo", "-q", "-n", "4",
                "--out", str(tmp_path / "c.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and (tmp_path / "c.jsonl").read_text().strip()
    loud = run_cli(
        "caption", str(tmp_path / "red.png"), "--model", "demo", "-n", "4", "--out", str(tmp_path / "d.jsonl")
    )
    assert "note: demo" in loud.stderr  # the note is there without -q


def test_an_output_that_cannot_be_written_is_said_before_the_model_is_loaded(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 48), "red").save(tmp_path / "red.png")
    (tmp_path / "afile").write_text("x")
    r = run_cli("caption", str(tmp_path / "red.png"), "--model", "demo", "--out", str(tmp_path / "afile" / "c.jsonl"))
    assert r.returncode == 2 and "afile is a file, not a folder" in r.stderr and "Traceback" not in r.stderr
    assert "note: demo" not in r.stderr  # (the model was not even resolved)
    r = run_cli("caption", str(tmp_path / "red.png"), "--model", "demo", "--out", str(tmp_path))
    assert r.returncode == 2 and "is a folder, not a file" in r.stderr


def test_a_dry_run_by_model_name_counts_the_records_or_says_it_cannot(tmp_path):
    """``caption -m demo DIR --dry-run`` (a name, not paths) resolves the model's files that are
    here, without a download, and counts the records a real run left; with no model named it
    lists the images and says the records were not checked. Before, both were a traceback
    (the records' key was made from a projector path that was None)."""
    d = tmp_path / "ds"
    d.mkdir()
    picture(d / "a.png", 1)
    picture(d / "b.png", 2)
    out = tmp_path / "c.jsonl"
    base = ("caption", str(d), "--out", str(out), "-n", "2")
    assert run_cli(*base, "-m", "demo", "--ctx", "2048").returncode == 0
    picture(d / "c.png", 3)
    listed = run_cli(*base, "-m", "demo", "--ctx", "2048", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == [str(d / n) for n in ("a.png", "b.png", "c.png")]
    assert "3 image(s), 2 with a record" in listed.stderr
    unnamed = run_cli(*base, "--dry-run")
    assert unnamed.returncode == 0, unnamed.stderr
    assert "Traceback" not in unnamed.stderr
    assert "3 image(s); records in" in unnamed.stderr and "not checked" in unnamed.stderr
