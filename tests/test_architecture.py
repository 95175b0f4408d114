"""The package's shape, checked: layers without import cycles, every module importable first in a
fresh interpreter, no private name used across modules, ``llama_cpp`` only in the backend,
nothing POSIX-only at import time, modules of a few hundred lines, public modules with
``__all__``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "edgevlm"
MAX_LINES = 600
# Lower layers never import higher ones; peers in one tuple are independent (neither imports the
# other) unless the pair is in PEERS_ALLOWED, importer first: cluster runs edgevlm.load (api) in
# its actors. What caption and serve's batch files share (the record log, the stop token) is in
# jobs, below both. Outside the layers: errors and the package root. The test kit (generated
# GGUF pairs, measuring harnesses, a stand-in hub) is another distribution, testkit/, that
# edgevlm never imports: ``demo:FAMILY`` finds it by entry point.
LAYERS = [
    "model",
    "backend",
    ("vision", "audio"),
    "plan",
    "runtime",
    "jobs",
    ("caption", "hub", "serve"),
    ("api", "cluster"),
    "cli",
]
PEERS_ALLOWED = {("cluster", "api")}


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (at module level or inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module != "__future__":
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names}
    return {d for d in out if d in mods and d != name and not name.startswith(d + ".")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_the_import_graph_has_no_cycle():
    mods = modules()
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    assert sum(len(v) for v in graph.values()) > 100  # the scan does see the imports


def test_the_find_cycle_check_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) < 2:
        return None
    for i, layer in enumerate(LAYERS):
        if parts[1] in (layer if isinstance(layer, tuple) else (layer,)):
            return i
    return None


def test_lower_layers_never_import_higher_ones():
    mods = modules()
    bad = []
    for m, p in mods.items():
        mine = _layer(m)
        for d in imports_of(m, p, mods):
            theirs = _layer(d)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{m} imports {d}")
    assert not bad, bad


def test_peers_in_a_layer_do_not_import_each_other():
    """caption, hub and serve are independent (serve's batch files take the record log and the
    stop token from jobs, not from captioning); only the pairs in PEERS_ALLOWED may."""
    mods = modules()
    bad = []
    for m, p in mods.items():
        mine = _layer(m)
        for d in imports_of(m, p, mods):
            if mine is None or _layer(d) != mine:
                continue
            pair = (m.split(".")[1], d.split(".")[1])
            if pair[0] != pair[1] and pair not in PEERS_ALLOWED:
                bad.append(f"{m} imports {d}")
    assert not bad, bad
    assert _layer("edgevlm.jobs.records") == LAYERS.index("jobs") < _layer("edgevlm.serve.batchfile")


@pytest.mark.slow
@pytest.mark.timeout(360)  # 120 s measured on 2 cores shared with 3 other suites
def test_every_module_imports_first_in_a_fresh_interpreter():
    names = [m for m in modules() if not m.endswith("__main__")]

    def one(m: str) -> tuple[str, int, str]:
        r = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True, timeout=120)
        return m, r.returncode, r.stderr.strip().splitlines()[-1:] and r.stderr.strip().splitlines()[-1]

    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [f"{m}: {err}" for m, rc, err in pool.map(one, names) if rc != 0]
    assert not failed, failed


def test_no_private_name_is_used_across_modules():
    """``from x import _y`` inside the package, or ``obj._y`` where ``_y`` is not defined in the
    module that uses it, would reach into another module's internals."""
    allowed = {"_exit"}  # os._exit: the stdlib's documented way out
    bad = []
    for m, p in modules().items():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        defined = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("edgevlm")):
                bad += [
                    f"{m}:{n.lineno} imports {a.name}"
                    for a in n.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                if n.attr not in defined and n.attr not in allowed:
                    bad.append(f"{m}:{n.lineno} uses {ast.unparse(n)}")
    assert not bad, bad


def test_the_package_never_imports_the_test_kit():
    """edgevlm_testkit (testkit/) imports edgevlm's public names, never the other way: the kit is
    not installed with edgevlm, and ``demo:FAMILY`` reaches it through the
    ``edgevlm.generated_pairs`` entry point group (hub.demo), not an import."""
    bad = []
    for m, p in modules().items():
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module or ""]
                if isinstance(n, ast.ImportFrom) and not n.level
                else []
            )
            bad += [f"{m}:{n.lineno} imports {x}" for x in names if x.split(".")[0] == "edgevlm_testkit"]
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.split(".")[0] == "edgevlm_testkit":
                bad.append(f"{m}:{n.lineno} names {n.value!r}")  # importlib.import_module("edgevlm_testkit")
    assert not list((PKG / "testing").glob("*.py")), "edgevlm/testing moved to testkit/edgevlm_testkit"
    assert not bad, bad


def test_the_test_kit_imports_only_public_names_of_edgevlm():
    """What testkit/edgevlm_testkit takes from edgevlm is in the ``__all__`` of the module it comes
    from (or is a public module): the kit is a client of the package, not a part of it."""
    import importlib

    def is_module(name: str) -> bool:
        try:
            importlib.import_module(name)
        except ImportError:
            return False
        return True

    kit = PKG.parent / "testkit" / "edgevlm_testkit"
    files = sorted(kit.rglob("*.py"))
    assert len(files) > 10, kit
    bad = []
    for p in files:
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Import):
                bad += [
                    f"{p.name}:{n.lineno} imports {a.name}"
                    for a in n.names
                    if a.name.split(".")[0] == "edgevlm" and any(x.startswith("_") for x in a.name.split("."))
                ]
            elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "edgevlm":
                if any(x.startswith("_") for x in n.module.split(".")):
                    bad.append(f"{p.name}:{n.lineno} imports from {n.module}")
                    continue
                mod = importlib.import_module(n.module)
                public = set(getattr(mod, "__all__", ()))
                for a in n.names:
                    if a.name.startswith("_") or (a.name not in public and not is_module(f"{n.module}.{a.name}")):
                        bad.append(f"{p.name}:{n.lineno} imports {a.name} from {n.module} (not in its __all__)")
    assert not bad, bad


def test_llama_cpp_is_imported_only_by_the_backend():
    bad = []
    for m, p in modules().items():
        if m.startswith("edgevlm.backend"):
            continue
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module or ""]
                if isinstance(n, ast.ImportFrom) and not n.level
                else []
            )
            bad += [f"{m}:{n.lineno}" for x in names if x.split(".")[0] == "llama_cpp"]
    assert not bad, bad


def test_modules_stay_small_and_public_ones_say_what_they_export():
    too_long, no_all = [], []
    for m, p in modules().items():
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            too_long.append(f"{m}: {n} lines")
        leaf = m.rsplit(".", 1)[-1]
        if p.name != "__init__.py" and not leaf.startswith("_"):
            tree = ast.parse(p.read_text(encoding="utf-8"))
            if not any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for n in tree.body
                if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            ):
                no_all.append(m)
    assert not too_long, too_long
    assert not no_all, no_all


SERVE_MAX_LINES = 450


def test_serve_modules_stay_under_450_lines():
    """Each API module is split along what it owns (requests apart from replies), so none of
    edgevlm/serve/ grows past SERVE_MAX_LINES."""
    too_long = []
    for p in sorted((PKG / "serve").rglob("*.py")):
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > SERVE_MAX_LINES:
            too_long.append(f"{p.name}: {n} lines")
    assert not too_long, too_long


NO_POSIX = textwrap.dedent("""
    import sys

    class Block:
        \"\"\"fcntl is gone for everyone (filelock then takes its portable path); resource and
        termios are refused to edgevlm's own code (psutil's Linux half needs resource, as its
        Windows half does not).\"\"\"
        def find_spec(self, name, path=None, target=None):
            if name == "fcntl" or (name in ("resource", "termios") and self.from_edgevlm()):
                raise ImportError(f"{name} is not available here (as on Windows)")
            return None

        @staticmethod
        def from_edgevlm():
            f = sys._getframe(2)
            while f is not None and f.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                f = f.f_back
            return f is not None and f.f_globals.get("__name__", "").startswith("edgevlm")

    POSIX = ("fcntl", "resource", "termios")
    sys.meta_path.insert(0, Block())
    for name in ("fcntl", "resource", "termios"):
        sys.modules.pop(name, None)

    import edgevlm, edgevlm.cli, edgevlm.caption, edgevlm.cluster, edgevlm.serve.batchfile
    from edgevlm.caption.outputs import CAPTION_RECORDS, CaptionRecord
    from edgevlm.jobs.records import RecordLog
    from edgevlm.caption.prepare import ResumeIndex
    from edgevlm.caption.sidecars import Metadata
    from edgevlm.errors import InputError
    from edgevlm.runtime.stats import peak_rss_bytes

    out = sys.argv[1]
    rec = CaptionRecord(custom_id="img-1", path="a.png", sha256="ab", caption="a house", model="m",
                        prompt="p", settings="d1", bytes=3, mtime_ns=1)
    log = RecordLog(out, CAPTION_RECORDS).open()
    try:
        RecordLog(out, CAPTION_RECORDS).open()
        raise SystemExit("a second writer was let in")
    except InputError as exc:
        assert "another edgevlm caption run" in str(exc), exc
    log.append(rec)
    log.close()
    again = RecordLog(out, CAPTION_RECORDS).open()  # resume: the record is found, the lock taken again
    index = ResumeIndex(again.entries, "d1")
    assert index.get("a.png").data["caption"] == "a house"
    again.append(CaptionRecord(custom_id="img-2", path="b.png", sha256="cd", caption="a tree",
                               model="m", prompt="p", settings="d1"))
    again.remove([e for e in again.entries if e.data["path"] == "a.png"])
    again.close()
    meta = Metadata(sys.argv[2], "skip", " ", ".txt")
    meta.updates["a.png"] = "a house"
    meta.flush()
    assert peak_rss_bytes() > 0
    assert "fcntl" not in sys.modules
    for name, mod in list(sys.modules.items()):
        if name.startswith("edgevlm"):
            held = [k for k, v in vars(mod).items() if getattr(v, "__name__", None) in POSIX]
            assert not held, (name, held)
    print("ok")
""")


def test_no_module_imports_a_posix_only_module_at_import_time():
    posix = {"fcntl", "resource", "termios", "pwd", "grp", "msvcrt", "winreg"}
    bad = []
    for m, p in modules().items():
        for n in ast.parse(p.read_text(encoding="utf-8")).body:  # module level only
            names = (
                [a.name for a in n.names]
                if isinstance(n, ast.Import)
                else [n.module or ""]
                if isinstance(n, ast.ImportFrom)
                else []
            )
            bad += [f"{m}:{n.lineno} imports {x}" for x in names if x.split(".")[0] in posix]
    assert not bad, bad


def test_the_package_and_the_caption_log_work_without_posix_modules(tmp_path):
    out = tmp_path / "captions.jsonl"
    r = subprocess.run(
        [sys.executable, "-c", NO_POSIX, str(out), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and '"b.png"' in lines[0]
    assert (tmp_path / "metadata.jsonl").read_text().count("a house") == 1


@pytest.mark.parametrize("module", ["edgevlm", "edgevlm.errors"])
def test_public_errors_are_exported(module):
    import importlib

    import edgevlm.errors as errors

    mod = importlib.import_module(module)
    for name in errors.__all__:
        assert issubclass(getattr(mod, name), errors.EdgeVLMError), name
    assert os.path.basename(errors.__file__) == "errors.py"
