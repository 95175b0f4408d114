"""One turn for every caller (#57): the turn's shape is made only by the intake
(``runtime/intake/``), no module outside it fetches a URL or makes an image budget, nothing
outside it changes a turn once made, and a turn built by the intake is frozen and hands out
copies.
The first three read the package's source (``ast``); the last builds a real turn."""

from __future__ import annotations

import ast
import dataclasses
import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

import edgevlm
from edgevlm.runtime.intake import Asked, MediaRef, ReplySpec

from .conftest import make_image, run_cli

PKG = Path(edgevlm.__file__).parent
INTAKE = "runtime/intake/"
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "sort", "reverse"}


def modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PKG)), ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(PKG.rglob("*.py"))]


def called(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def test_the_turn_and_the_schedulers_request_are_made_only_by_the_intake():
    """``Turn(``, ``Asked`` made into a turn, and the scheduler's ``Request(`` are constructed in
    ``runtime/intake/`` alone: every caller reaches the runtime through the intake's turn and
    ``ReplySpec.request``."""
    outside = [
        f"{rel}:{n.lineno} {ast.unparse(n)[:70]}"
        for rel, tree in modules()
        if not rel.startswith(INTAKE)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and called(n) in ("Turn", "Request", "make_turn")
    ]
    assert outside == []


def test_no_module_outside_the_intake_fetches_a_url_or_makes_an_image_budget():
    """URL fetching (httpx, urllib.request, http.client, raw sockets to a host) lives in
    ``runtime/intake/fetch.py``; model downloads (``hub/``, huggingface_hub) are not a turn's
    pictures. ``ImageBudget(`` and ``plan_video(`` are called in the intake (and defined in
    ``vision/``) alone."""
    fetchers = {"httpx", "urllib.request", "http.client", "requests", "aiohttp"}
    bad = []
    for rel, tree in modules():
        if rel.startswith((INTAKE, "vision/")):
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not rel.startswith("hub/"):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else [] if n.level else [n.module or ""]
                bad += [f"{rel}:{n.lineno} imports {m}" for m in names if m in fetchers]
            if isinstance(n, ast.Call) and called(n) in ("ImageBudget", "plan_video", "create_connection"):
                bad.append(f"{rel}:{n.lineno} {ast.unparse(n)[:70]}")
    assert bad == []


def _rooted_at_turn(node: ast.AST) -> bool:
    """Whether an expression reaches into a turn: ``turn.x``, ``job.turn.x[...]``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        inner = node.value
        if isinstance(inner, ast.Attribute) and inner.attr == "turn":
            return True
        if isinstance(inner, ast.Name) and inner.id == "turn":
            return True
        node = inner
    return False


def test_nothing_outside_the_intake_assigns_into_a_turn_or_changes_what_it_holds():
    """No assignment into ``….turn.<field>`` (or an item of one) and no mutating call on what a
    turn holds, outside the intake: the worker keeps what it changes per request in the job's
    ``progress`` and its own copy of the conversation (``Turn.conversation``). (Rebinding
    ``job.turn`` to ``turn.without_views()`` is the job's own field.)"""
    bad = []
    for rel, tree in modules():
        if rel.startswith(INTAKE):
            continue
        for n in ast.walk(tree):
            targets: list[ast.AST] = []
            if isinstance(n, ast.Assign):
                targets = list(n.targets)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            elif isinstance(n, ast.Delete):
                targets = list(n.targets)
            bad += [f"{rel}:{n.lineno} {ast.unparse(n)[:70]}" for t in targets if _rooted_at_turn(t)]
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS
                and _rooted_at_turn(n.func)
            ):
                bad.append(f"{rel}:{n.lineno} {ast.unparse(n)[:70]}")
    assert bad == []


def test_a_turn_the_intake_builds_is_frozen_and_its_conversation_is_a_copy_of_its_own(model_pair, tmp_path):
    """A turn built by a real model's intake: its fields are tuples, frozensets or frozen values;
    assigning raises; ``conversation()`` is a copy (changing it leaves the turn as it was)."""
    pair = model_pair("llava15")
    pic = make_image(tmp_path / "p.png", 300, 200, seed=4)
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        intake = vlm.intake()
        turn = intake.turn(
            [Asked("user", "first", (MediaRef(str(pic)),)), Asked("assistant", "ok"), Asked("user", "again")],
            ReplySpec(8),
            vlm.scheduler.budget.image_room(8),
        )
        for f in dataclasses.fields(turn):
            value = getattr(turn, f.name)
            assert not isinstance(value, (list, dict, set)), f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            turn.evict = True  # type: ignore[misc]
        assert [m.role for m in turn.messages] == ["user", "assistant", "user"]
        assert len(turn.pictures) == turn.added == 1
        assert turn.messages[0].pictures == [1] * len(turn.messages[0].images)
        conv = turn.conversation()
        conv.messages[0].images.clear()
        conv.messages[0].notes.append("replaced by its summary")
        conv.pictures[0].summary = "a summary"
        conv.messages.pop()
        assert len(turn.messages) == 3
        assert turn.messages[0].images
        assert not turn.messages[0].notes
        assert turn.pictures[0].summary is None
        assert turn.without_views().messages == ()
        assert turn.without_views().reply == turn.reply


class Pictures:
    """A folder served over HTTP on 127.0.0.1 (stopped by ``close``)."""

    def __init__(self, folder: Path):
        handler = functools.partial(QuietHandler, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass


def test_chat_fetches_an_http_picture_through_the_intake_as_the_server_does(model_pair, tmp_path):
    """``edgevlm chat -i URL`` (one-shot, greedy) fetches the picture through the intake's
    fetcher and answers as for the same file: the same image tokens, the same text. A URL that
    is not there is one line naming it, exit 2. Before, chat read every ``-i`` as a path."""
    pair = model_pair("llava15")
    folder = tmp_path / "pics"
    folder.mkdir()
    make_image(folder / "p.png", 320, 240, seed=9)
    pictures = Pictures(folder)
    try:
        base = ["chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--temp", "0", "-n", "6", "--json"]
        by_file = run_cli(*base, "-i", str(folder / "p.png"), "What is it?")
        by_url = run_cli(*base, "-i", pictures.url + "/p.png", "What is it?")
        assert by_file.returncode == 0, by_file.stderr
        assert by_url.returncode == 0, by_url.stderr
        f, u = json.loads(by_file.stdout), json.loads(by_url.stdout)
        assert u["stats"]["images_encoded"] == 1
        assert u["stats"]["image_tokens"] == f["stats"]["image_tokens"]
        assert u["text"] == f["text"]
        missing = run_cli(*base, "-i", pictures.url + "/gone.png", "What is it?")
        assert missing.returncode == 2
        assert "Traceback" not in missing.stderr
        assert "HTTP 404" in missing.stderr
    finally:
        pictures.close()
