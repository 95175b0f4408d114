"""Every command README.md and docs/*.md show runs as written on a fresh clone (issue #59, case 12).

The commands are read out of the pages' code blocks (``$ COMMAND`` lines, and the plain command
lines of ``sh`` blocks) and run as real subprocesses (``bash -c``), page by page, in order, in a
temporary folder that holds what a clone holds (``examples/``, ``models/``, ``scripts/``) and the
generated pairs the page says ``scripts/make_tiny_vlm.py`` makes. Each must exit 0, or the code
its ``$`` line's comment names (``# exit code 4: ...``), and print every output line the page
shows under it, where those lines are reproducible:

- ``...`` and ``…`` in a shown line stand for anything, a line that is only an elision is skipped,
  and an annotation after two spaces and ``#`` is the page's, not the program's;
- measured figures (a number with decimals, or one in s, ms, tok/s, images/s, requests/s,
  tok/image) match any number;
- the text a random-weight pair generates (``demo:FAMILY``, a generated ``X/model.gguf``) and
  what a chat samples without ``--temp 0`` are not compared, only the exit code.

Servers: ``edgevlm serve`` runs in the background on free ports (``--port``/``--ollama-port``
replaced, and those ports in the page's later commands), the page's ``ready:`` line is compared
once it is printed, and the page's ``curl`` commands are sent to it (``IMG=$(...)`` lines set
what they name); the ``"text"``/``"content"`` strings a shown reply holds must be in the real
one. The stand-in hub
starts by its documented line (``--port 0 --home TMP`` added), and the ``export`` line the page
shows must be the one it prints (port and folder aside); ``pull``/``models``/``rm`` then run
against it.

What cannot run here is listed in ``EXCEPTIONS``, each with its reason; a test holds that list
to the pages (no entry that matches nothing, no command that is neither run nor listed).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgevlm_testkit import cached_model_pair

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLONE = ("examples", "models", "scripts")  # what the commands read from a fresh clone

# (page, the start of the command) → why it does not run here. Reviewed: keep it short.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("README.md", "python3 -m venv .venv"): "installs the package into a new venv (what .ci/run does)",
    ("README.md", "ruff check ."): "the linters (.ci/run, and every helper before a commit)",
    ("README.md", "edgevlm chat --model llava-1.5-7b"): "downloads LLaVA-1.5-7B (4.6 GB) from the Hugging Face hub",
    ("docs/install.md", "git clone"): "the clone itself",
    ("docs/chat.md", "edgevlm chat -m model.gguf --mmproj mmproj.gguf --ctx 4096"): "the session file and the "
    "LLaVA-1.5-7B-shaped pair scripts/bench_restore.py made: the block is rendered from that run",
    ("docs/install.md", "python3 -m venv .venv"): "installs the package into a new venv (what .ci/run does)",
    ("docs/install.md", "pip install"): "installs packages",
    ("docs/install.md", "ruff check ."): "the linters (.ci/run)",
    ("docs/install.md", "pytest -q"): "the whole suite (this test is part of it)",
    ("docs/install.md", "GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/edgevlm doctor"): "needs the Vulkan build's venv",
    ("docs/gpu.md", "pip install -e ./testkit"): "installs packages",
    ("docs/gpu.md", "python -m edgevlm_testkit.vulkan_build"): "builds llama.cpp with Vulkan (minutes)",
    ("docs/caption.md", "pip install -e '.[ray]'"): "installs packages",
    ("docs/demo-model.md", "pip install -e '.[train]'"): "installs packages",
    ("docs/install.md", "CMAKE_ARGS="): "rebuilds llama-cpp-python for a GPU backend",
    ("docs/gpu.md", "sudo apt-get install"): "installs system packages",
    ("docs/gpu.md", "CMAKE_ARGS="): "rebuilds llama-cpp-python for Vulkan",
    ("docs/gpu.md", "vulkaninfo"): "needs a Vulkan loader and device",
    ("docs/gpu.md", "GGML_VK_VISIBLE_DEVICES=0 edgevlm plan"): "needs the Vulkan build and its device",
    ("docs/gpu.md", ".venv-vulkan/bin/python scripts/bench_gpu_speed.py"): "needs the Vulkan build's venv and "
    "its llama-server (minutes)",
    ("docs/demo-model.md", "python scripts/train_demo.py"): "trains the demo model for hours (JAX)",
    ("docs/demo-model.md", "cp test-artifacts/run12/"): "copies what the training above wrote",
    ("docs/plan.md", "python scripts/make_tiny_vlm.py real7b"): "writes 450 MB; the test links the test kit's cached "
    "copy of the same bytes (make_tiny_vlm.py: same arguments, byte-identical files)",
}
# commands whose output is this machine's own (its Python, its devices): only the exit code counts
MACHINE_OUTPUT = ("edgevlm doctor",)
GENERATED = re.compile(r"make_tiny_vlm\.py ([\w.-]+)((?: --\w+ [\w.-]+)*)")
MEASURED = re.compile(r"\d[\d,]*\.\d+|\d[\d,]*(?= ?(?:s|ms|tok/s|images/s|requests/s|tok/image)\b)")
ELISION = re.compile(r"\.\.\.|…")
ANNOTATION = re.compile(r"\s{2,}# .*$")
REPLY_TEXT = re.compile(r'"(text|content)"\s*:\s*"((?:[^"\\]|\\.)*)"')


# --- reading the pages --------------------------------------------------------------------------


@dataclass
class Shown:
    page: str  # relative to the repository
    line: int
    command: str
    output: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def comment(self) -> str:
        """The comment of the command's first line (``# exit code 4: ...``)."""
        first = self.command.splitlines()[0]
        try:
            lex = shlex.shlex(first, posix=True, punctuation_chars=False)
            lex.whitespace_split, lex.commenters = True, ""
            toks = list(lex)
        except ValueError:  # a quote the next lines close
            return ""
        return " ".join(toks[toks.index("#") + 1 :]) if "#" in toks else ""

    @property
    def exit_code(self) -> int:
        m = re.search(r"exit code (\d+)", self.comment)
        return int(m.group(1)) if m else 0


def bare(cmd: str) -> str:
    """A one-line command without the comment the page adds after it."""
    return re.sub(r"\s{2,}#.*$", "", cmd).strip()


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
        return True
    except ValueError:
        return False


def shown_commands(page: Path) -> list[Shown]:
    """Every command a page's code blocks show, with the output lines shown under it."""
    rel = str(page.relative_to(ROOT))
    out: list[Shown] = []
    lang, cur = None, None
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        i += 1
        if ln.startswith("```"):
            lang = None if lang is not None else (ln[3:].strip() or "text")
            cur = None
            continue
        if lang is None or lang == "python":
            continue
        plain = lang == "sh" and not ln.startswith(("#", " ")) and ln.strip()
        if ln.startswith("$ ") or plain:
            text, start = (ln[2:] if ln.startswith("$ ") else ln), i
            while not _complete(text) and i < len(lines) and not lines[i].startswith("```"):
                text += "\n" + lines[i]
                i += 1
            cur = Shown(rel, start, text)
            out.append(cur)
        elif cur is not None and lang != "sh":
            cur.output.append(ln)
    return out


def all_commands() -> list[Shown]:
    return [c for p in PAGES for c in shown_commands(p)]


def exception(c: Shown) -> str | None:
    for (page, start), why in EXCEPTIONS.items():
        if c.page == page and c.command.startswith(start):
            return why
    return None


# --- comparing what is shown with what is printed -----------------------------------------------


def _norm(s: str) -> str:
    return " ".join(s.split())


def pattern(shown: str) -> re.Pattern[str] | None:
    """A shown output line as a pattern over a printed one (None: nothing to compare)."""
    line = _norm(ANNOTATION.sub("", shown))
    if not line or not ELISION.sub("", line).strip():
        return None
    parts = []
    for piece in ELISION.split(line):
        out, last = [], 0
        for m in MEASURED.finditer(piece):
            out += [re.escape(piece[last : m.start()]), r"[\d,]+(?:\.\d+)?"]
            last = m.end()
        parts.append("".join(out) + re.escape(piece[last:]))
    return re.compile(".*".join(parts))


def missing_lines(shown: list[str], printed: str) -> list[str]:
    got = [_norm(x) for x in printed.splitlines()]
    bad = []
    for s in shown:
        p = pattern(s)
        if p is not None and not any(p.fullmatch(g) for g in got):
            bad.append(s)
    return bad


def missing_replies(shown: list[str], printed: str) -> list[str]:
    """The reply strings a shown JSON answer holds that the printed one does not."""
    want = set(REPLY_TEXT.findall("".join(shown)))
    have = set(REPLY_TEXT.findall(printed))
    return [f'"{k}": "{v}"' for k, v in sorted(want - have) if not ELISION.search(v)]


def generates_at_random(cmd: str) -> bool:
    """Text a random-weight pair makes, or a chat sampled without --temp 0: not reproducible."""
    if not re.search(r"\bedgevlm (chat|caption|batch|serve)\b", cmd) or "| jq .stats" in cmd:
        return False
    random_pair = re.search(r"--model demo:|-m demo:|/model\.gguf", cmd) is not None
    sampled = " chat " in f" {cmd} " and "--temp 0" not in cmd and re.search(r"\bchat\b", cmd) is not None
    return random_pair or sampled


# --- running a page ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Background:
    """A command that runs until stopped (a server), its output lines collected as they come."""

    def __init__(self, argv: str, cwd: Path, env: dict[str, str]):
        self.proc = subprocess.Popen(["bash", "-c", f"exec {argv}"], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in
                        (self.proc.stdout, self.proc.stderr)]  # fmt: skip
        for t in self.readers:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} line: {self.seen[-20:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for t in self.readers:
            t.join(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


def fresh_clone(dest: Path, page: Path) -> None:
    """What a clone holds that the commands read, and the generated pairs the page names
    (``make_tiny_vlm.py DIR [--family F] [--preset P]``: the test kit's cached copy of the same
    bytes, linked)."""
    for name in CLONE:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*_output.jsonl"))
    for d, opts in GENERATED.findall(page.read_text(encoding="utf-8")):
        o = dict(re.findall(r"--(\w+) ([\w.-]+)", opts))
        pair = cached_model_pair(o.get("family", "llava15"), o.get("preset", "tiny"), int(o.get("seed", 0)))
        if not (dest / d).exists():
            (dest / d).mkdir()
            (dest / d / "model.gguf").symlink_to(pair.model)
            (dest / d / "mmproj.gguf").symlink_to(pair.mmproj)


def base_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "EDGEVLM_MODEL", "HF_ENDPOINT")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONWARNINGS": "ignore",
        "HF_HOME": str(tmp / "hf"),  # nothing from the user's own hub cache, nothing downloaded
        "HF_HUB_OFFLINE": "1",
    }
    return env


def run_page(page: Path, tmp: Path) -> tuple[list[str], int, float]:
    """Run a page's commands in order; (what went wrong, commands run, seconds)."""
    work = tmp / "clone"
    work.mkdir()
    fresh_clone(work, page)
    env = base_env(tmp)
    ports: dict[str, str] = {}
    background: list[Background] = []
    problems: list[str] = []
    ran, t0 = 0, time.perf_counter()

    def local(cmd: str) -> str:
        for old, new in ports.items():
            cmd = re.sub(rf"(?<=[:= ]){old}\b", new, cmd)
        return cmd

    try:
        for c in shown_commands(page):
            if exception(c) is not None:
                continue
            ran += 1
            cmd = c.command
            if cmd.startswith("export "):
                problems += check_export(c, env)
                continue
            if m := re.fullmatch(r"(\w+)=(\$\(.*\))", bare(cmd)):  # IMG=$(base64 -w0 examples/shapes2.png)
                r = subprocess.run(["bash", "-c", f'printf %s "{m.group(2)}"'], cwd=work, env=env, capture_output=True,
                                   text=True, timeout=60)  # fmt: skip
                if r.returncode != 0 or not r.stdout:
                    problems.append(f"{c.id}: {cmd}: exit {r.returncode} {r.stderr}")
                env[m.group(1)] = r.stdout
                continue
            if re.match(r"edgevlm serve\b", cmd):
                for opt in ("--port", "--ollama-port"):
                    if m := re.search(rf"{opt} (\d+)", cmd):
                        ports[m.group(1)] = str(free_port())
                bg = Background(local(bare(cmd).removesuffix("&")), work, env)
                background.append(bg)
                ready = bg.wait_for("ready:")
                problems += [f"{c.id}: {cmd}\n  shown {s!r}\n  not in {ready!r}" for s in
                             missing_lines([local(x) for x in c.output if x.startswith("ready:")], ready)]  # fmt: skip
                continue
            if bare(cmd).endswith("&"):  # the stand-in hub: its line to export
                home = tmp / "hub"
                bg = Background(bare(cmd)[:-1] + f" --port 0 --home {home}", work, env)
                background.append(bg)
                line = bg.wait_for("export ")
                env |= dict(kv.split("=", 1) for kv in line.removeprefix("export ").split())
                env.pop("HF_HUB_OFFLINE", None)
                env["HUB_PRINTED"] = line
                env["HUB_HOME"] = str(home)
                continue
            if cmd.startswith("curl") and not ports:
                problems.append(f"{c.id}: {cmd.splitlines()[0]}: no edgevlm serve started on the page before it")
                continue
            r = subprocess.run(["bash", "-c", local(cmd)], cwd=work, env=env, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
            printed = r.stdout + r.stderr
            head = f"{c.id}: {cmd.splitlines()[0]}"
            if r.returncode != c.exit_code:
                problems.append(f"{head}\n  exit {r.returncode}, the page says {c.exit_code}\n{printed[-2000:]}")
                continue
            if generates_at_random(cmd) or cmd.startswith(MACHINE_OUTPUT):
                continue
            shown = [local(x) for x in c.output]
            bad = missing_replies(shown, printed) if cmd.startswith("curl") else missing_lines(shown, printed)
            if bad:
                problems.append(f"{head}\n  shown but not printed: {bad}\n  printed:\n{printed[-3000:]}")
    finally:
        for bg in background:
            bg.stop()
    return problems, ran, time.perf_counter() - t0


def check_export(c: Shown, env: dict[str, str]) -> list[str]:
    """The page's ``export`` line is the one the stand-in hub printed, but for its port and the
    folder its caches are in (the test gives it ``--port 0 --home TMP``)."""
    printed = env.get("HUB_PRINTED")
    if printed is None:
        return [f"{c.id}: {c.command}: no stand-in hub started before it"]

    def shape(line: str, home: str) -> str:
        return re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line.replace(home, "HOME"))

    shown = bare(c.command)
    m = re.search(r"HF_HOME=(\S+)/hf\b", shown)
    same = m is not None and shape(shown, m.group(1)) == shape(printed, env["HUB_HOME"])
    return [] if same else [f"{c.id}: shows {shown!r}, the hub printed {printed!r}"]


# --- the tests ----------------------------------------------------------------------------------

RUNNABLE = [p for p in PAGES if any(exception(c) is None for c in shown_commands(p))]


def test_the_pages_commands_are_found():
    """The reader finds what the pages show: commands, their output, the exit code a comment names."""
    cmds = {c.id: c for c in all_commands()}
    readme = [c for c in cmds.values() if c.page == "README.md"]
    assert any(c.command.startswith("edgevlm chat --model demo --image examples/shapes.png") for c in readme)
    batch = next(c for c in readme if c.command.startswith("edgevlm batch"))
    assert batch.exit_code == 4
    assert batch.output
    curl = next(c for c in readme if c.command.startswith("curl") and "/v1/messages" in c.command)
    assert "'$IMG'" in curl.command
    assert "\n" in curl.command  # a command over several lines
    assert len(cmds) > 50


def test_every_command_runs_or_is_a_reviewed_exception():
    """No exception matches nothing (a stale entry), and each has its reason."""
    cmds = all_commands()
    for (page, start), why in EXCEPTIONS.items():
        assert why, (page, start)
        assert any(c.page == page and c.command.startswith(start) for c in cmds), f"stale: {page}: {start}"


def test_a_shown_line_matches_what_is_printed_not_something_else():
    assert not missing_lines(["captioned 4 · failed 0 · 4 image(s) in 0.2 s · 18.51 images/s"],
                             "captioned 4 · failed 0 · 4 image(s) in 1.9 s · 2.07 images/s")  # fmt: skip
    assert missing_lines(["captioned 4 · failed 0"], "captioned 3 · failed 1")
    assert not missing_lines(["note: demo: a toy VLM (...)", " ...", "records: x.jsonl    # a note"],
                             "note: demo: a toy VLM (it knows shapes)\nrecords: x.jsonl")  # fmt: skip
    assert missing_lines(["square"], "circle")
    assert missing_replies(['{"content":"green"}'], '{"content": "red"}')
    assert not missing_replies(['{"content": "green", …}'], '{"x": 1, "content":"green"}')
    hub = {"HUB_PRINTED": "export HF_ENDPOINT=http://127.0.0.1:41234 HF_HOME=/t/x/hf EDGEVLM_CACHE=/t/x/edgevlm",
           "HUB_HOME": "/t/x"}  # fmt: skip
    shown = "export HF_ENDPOINT=http://127.0.0.1:8765 HF_HOME=/tmp/h/hf EDGEVLM_CACHE=/tmp/h/edgevlm"
    assert check_export(Shown("p", 1, shown), hub) == []
    assert check_export(Shown("p", 1, "export HF_ENDPOINT=http://127.0.0.1:8765 HF_HOME=/tmp/h/hf"), hub)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_the_pages_commands_run_as_written(page, tmp_path):
    problems, ran, took = run_page(page, tmp_path)
    print(f"{page.name}: {ran} command(s) in {took:.1f} s")
    assert not problems, "\n\n".join(problems)


def test_serves_ready_line_names_the_page_and_the_api(tmp_path):
    """``edgevlm serve``'s ``ready:`` line names the address a person opens (the page, ``/``)
    beside the API's base URL, with the port it really listens on (``--port 0``: any free one);
    the page answers there and the API under the other."""
    import httpx

    bg = Background("edgevlm serve --model demo --port 0 --threads 1", tmp_path, base_env(tmp_path))
    try:
        ready = bg.wait_for("ready:")
        m = re.match(r"ready: the page (http://127\.0\.0\.1:(\d+)/) · API (http://127\.0\.0\.1:(\d+)/v1) · ", ready)
        assert m, ready
        assert m.group(2) == m.group(4) != "0"
        page = httpx.get(m.group(1), timeout=30)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "<html" in page.text.lower()
        models = httpx.get(m.group(3) + "/models", timeout=30).json()
        assert [x["id"] for x in models["data"]] == ["demo"]
    finally:
        bg.stop()


def inline_commands() -> list[tuple[str, str]]:
    """(page, span) for every ``edgevlm COMMAND ...`` code span in the pages' prose."""
    out = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for m in re.finditer(r"`(edgevlm [a-z]+(?: [^`]*)?)`", text):
            if not re.search(r"\[|\.\.\.|…|\|", m.group(1)):  # a synopsis or an elided one is prose
                out.append((str(page.relative_to(ROOT)), m.group(1)))
    return out


def test_every_command_the_prose_names_parses():
    """A command written inline (``Start `edgevlm serve --model MODEL --ollama-port 11434```) has
    options the command has and no argument it does not take: the values may be placeholders,
    the shape may not."""
    import click

    from edgevlm.cli import main

    spans = inline_commands()
    assert ("docs/apis.md", "edgevlm serve --model MODEL --ollama-port 11434") in spans
    bad = []
    for page, span in spans:
        argv = shlex.split(span)
        cmd = main.commands.get(argv[1])
        if cmd is None:
            bad.append(f"{page}: {span}: no command {argv[1]!r}")
            continue
        try:
            cmd.make_context(argv[1], argv[2:])
        except click.exceptions.Exit:
            pass
        except click.NoSuchOption as e:
            bad.append(f"{page}: {span}: {e.format_message()}")
        except click.UsageError as e:  # missing arguments and placeholder values are the prose's own
            if "unexpected extra argument" in e.format_message():
                bad.append(f"{page}: {span}: {e.format_message()}")
    assert not bad, bad
