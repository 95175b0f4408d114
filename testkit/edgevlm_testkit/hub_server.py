"""A local stand-in for the Hugging Face hub (tests and offline demos; no internet needed).

It answers what ``huggingface_hub`` asks, in the hub's URL layout:

* ``HEAD/GET /{repo}/resolve/{revision}/{file}`` → for LFS-like files (all ``.gguf``) a 302 to a
  "CDN" URL on *another host name* (``localhost`` instead of ``127.0.0.1``, like the real hub's
  signed CDN links, so the client drops its token there) carrying ``X-Repo-Commit``,
  ``X-Linked-Etag`` (the sha256), ``X-Linked-Size``; with ``redirect=False`` the bytes are served
  directly. Range requests get 206 with ``Content-Range``.
* ``GET /api/models/{repo}[/revision/{rev}]`` (model_info), ``GET /api/models/{repo}/tree/{rev}``
  (list_repo_files), ``POST /api/models/{repo}/paths-info/{rev}`` (get_paths_info): JSON with
  ``oid``, ``size`` and ``lfs: {oid: sha256, size, pointerSize}``.
* Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) as
  the hub's do, so the client raises its usual exceptions.

Fault injection for tests: ``drop_once(repo, file)`` cuts the connection halfway through the
next full download of that file; ``corrupt(repo, file)`` serves different bytes than the sha256
it announces. Every request is logged in ``requests`` (method, path, Range, Authorization,
Host). Start with ``FakeHub().start()``; point ``HF_ENDPOINT`` at ``hub.endpoint``.

``python -m edgevlm_testkit.hub_server`` serves generated pairs under the real registry's repo
and file names, for trying ``pull``/``plan``/``models``/``rm`` without a network: it prints the
``export HF_ENDPOINT=... HF_HOME=... EDGEVLM_CACHE=...`` line a shell runs to use it
(docs/models.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


@dataclass
class _File:
    source: Path | bytes
    size: int
    sha256: str
    git_sha1: str

    def read(self, start: int, end: int) -> bytes:  # inclusive end
        if isinstance(self.source, bytes):
            return self.source[start : end + 1]
        with open(self.source, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start + 1)


@dataclass
class _Repo:
    commit: str
    files: dict[str, _File] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None
    host: str


class FakeHub:
    def __init__(self, redirect: bool = True):
        self.redirect = redirect
        self.repos: dict[str, _Repo] = {}
        self.requests: list[Request] = []
        self._drop: set[tuple[str, str]] = set()
        self._corrupt: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- content ----------------------------------------------------------------------
    def add_file(self, repo: str, path: str, source: str | os.PathLike[str] | bytes) -> None:
        if isinstance(source, bytes):
            data: Path | bytes = source
            sha, size = hashlib.sha256(source).hexdigest(), len(source)
            git = hashlib.sha1(f"blob {size}\0".encode() + source).hexdigest()
        else:
            data = Path(source)
            size = data.stat().st_size
            h, g = hashlib.sha256(), hashlib.sha1(f"blob {size}\0".encode())
            with open(data, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
                    g.update(chunk)
            sha, git = h.hexdigest(), g.hexdigest()
        r = self.repos.setdefault(repo, _Repo(hashlib.sha1(repo.encode()).hexdigest()))
        r.files[path] = _File(data, size, sha, git)

    def drop_once(self, repo: str, path: str) -> None:
        self._drop.add((repo, path))

    def corrupt(self, repo: str, path: str) -> None:
        self._corrupt.add((repo, path))

    def sha256(self, repo: str, path: str) -> str:
        return self.repos[repo].files[path].sha256

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()

    # --- server -----------------------------------------------------------------------
    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.server_address[1]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self, port: int = 0) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # --- plumbing ---------------------------------------------------------------------
    def _log(self) -> None:
        with self.hub._lock:
            self.hub.requests.append(
                Request(
                    self.command,
                    urlsplit(self.path).path,
                    self.headers.get("Range"),
                    self.headers.get("Authorization"),
                    self.headers.get("Host", ""),
                )
            )

    def _send(
        self, code: int, body: bytes = b"", headers: dict[str, str] | None = None, ctype: str = "application/json"
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), headers)

    def _error(self, code: int, err: str, msg: str, headers: dict[str, str] | None = None) -> None:
        h = {"X-Error-Code": err, "X-Error-Message": msg, **(headers or {})}
        self._send(code, json.dumps({"error": msg}).encode(), h)

    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    # --- routes -----------------------------------------------------------------------
    def _route(self) -> None:
        self._log()
        path = unquote(urlsplit(self.path).path)
        parts = path.strip("/").split("/")
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api("/".join(parts[2:4]), parts[4:])
            if parts[0] == "cdn" and len(parts) == 4:
                return self._cdn("/".join(parts[1:3]), parts[3])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            self._error(404, "NotFound", f"no route for {path}")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _repo(self, repo: str, rev: str) -> _Repo | None:
        r = self.hub.repos.get(repo)
        if r is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if rev not in ("main", r.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return r

    @staticmethod
    def _entry(path: str, f: _File) -> dict:
        d = {"type": "file", "path": path, "size": f.size, "oid": f.git_sha1}
        if _is_lfs(path):
            d["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        return d

    def _api(self, repo: str, rest: list[str]) -> None:
        rev = "main"
        if rest[:1] == ["revision"] and len(rest) >= 2:
            rev, rest = rest[1], []
        elif rest[:1] in (["tree"], ["paths-info"]) and len(rest) >= 2:
            rev = rest[1]
        r = self._repo(repo, rev)
        if r is None:
            return
        if not rest:
            sib = []
            for p, f in sorted(r.files.items()):
                e = {"rfilename": p, "size": f.size, "blobId": f.git_sha1}
                if _is_lfs(p):
                    e["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
                sib.append(e)
            return self._json({"id": repo, "modelId": repo, "sha": r.commit, "private": False, "siblings": sib})
        if rest[0] == "tree":
            prefix = "/".join(rest[2:])
            return self._json(
                [
                    self._entry(p, f)
                    for p, f in sorted(r.files.items())
                    if not prefix or p.startswith(prefix.rstrip("/") + "/")
                ]
            )
        if rest[0] == "paths-info" and self.command == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            if self.headers.get("Content-Type", "").startswith("application/json"):
                paths = json.loads(raw or "{}").get("paths", [])
            else:
                paths = parse_qs(raw).get("paths", [])
            return self._json([self._entry(p, r.files[p]) for p in paths if p in r.files])
        self._error(404, "NotFound", "unknown api route")

    def _resolve(self, repo: str, rev: str, file: str) -> None:
        r = self._repo(repo, rev)
        if r is None:
            return
        f = r.files.get(file)
        if f is None:
            return self._error(404, "EntryNotFound", f"{file} does not exist on {rev}", {"X-Repo-Commit": r.commit})
        if _is_lfs(file):  # LFS: the etag is the content's sha256, announced on the redirect
            meta = {
                "X-Repo-Commit": r.commit,
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(f.size),
                "ETag": f'"{f.sha256}"',
                "Accept-Ranges": "bytes",
            }
        else:  # a file stored in git: its etag is the git blob sha1, served in place
            meta = {"X-Repo-Commit": r.commit, "ETag": f'"{f.git_sha1}"', "Accept-Ranges": "bytes"}
        if self.hub.redirect and _is_lfs(file):
            loc = f"{self.hub.cdn}/cdn/{quote(repo)}/{f.sha256}"
            return self._send(302, b"", {**meta, "Location": loc})
        self._content(repo, file, f, meta)

    def _cdn(self, repo: str, sha: str) -> None:
        r = self.hub.repos.get(repo)
        hit = next(((p, f) for p, f in (r.files.items() if r else ()) if f.sha256 == sha), None)
        if hit is None:
            return self._send(404, b"no such object", ctype="text/plain")
        name = os.path.basename(hit[0])
        self._content(
            repo,
            hit[0],
            hit[1],
            {
                "ETag": f'"{sha}"',
                "Accept-Ranges": "bytes",
                # as the hub's CDN does: the client shows this name on its progress bar
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{name}\";",
            },
        )

    def _content(self, repo: str, file: str, f: _File, meta: dict[str, str]) -> None:
        start, end, code = 0, f.size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._send(416, b"", {"Content-Range": f"bytes */{f.size}"})
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), f.size - 1) if m.group(2) else f.size - 1
            else:  # suffix range: the last N bytes
                start = max(0, f.size - int(m.group(2)))
            if start >= f.size or start > end:
                return self._send(416, b"", {"Content-Range": f"bytes */{f.size}"})
            code = 206
            meta = {**meta, "Content-Range": f"bytes {start}-{end}/{f.size}"}
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        for k, v in meta.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        data = f.read(start, end)
        key = (repo, file)
        if key in self.hub._corrupt:
            data = bytes(b ^ 0xFF if i % 4096 == 7 else b for i, b in enumerate(data))
        drop = False
        with self.hub._lock:
            if key in self.hub._drop and start == 0 and len(data) > 1:
                self.hub._drop.discard(key)
                drop = True
        if drop:  # half the body, then the connection goes away
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(data)


def _is_lfs(path: str) -> bool:
    """Which files the fake repo stores in LFS (as the hub does for large binaries)."""
    return path.endswith((".gguf", ".bin", ".safetensors"))


# --- generated pairs under registry names --------------------------------------------------


def serve_registry_names(
    hub: FakeHub, names: list[str] | None = None, preset: str = "tiny", registry=None
) -> dict[str, tuple[str, str, str]]:
    """Serve a generated pair under each registry entry's repo and file names (default quant).

    Only entries whose family edgevlm can generate are served (by name for LLaVA, else by
    projector type); returns {name: (repo, model file, mmproj file)}.
    """
    from edgevlm.hub.registry import load_registry

    from . import cached_model_pair

    reg = registry or load_registry()
    by_name = {"llava-1.5-7b": "llava15", "llava-1.6-mistral-7b": "llava16"}
    by_type = {
        "qwen2.5vl_merger": "qwen25vl",
        "qwen3vl_merger": "qwen3vl",
        "gemma3": "gemma3",
        "idefics3": "idefics3",
        "internvl": "internvl",
        "pixtral": "pixtral",
    }
    out = {}
    for e in reg.entries:
        fam = by_name.get(e.name) or by_type.get(e.projector_type)
        if fam is None or (names is not None and e.name not in names):
            continue
        pair = cached_model_pair(fam, preset)
        f = e.files[e.default_quant]
        hub.add_file(f.repo or e.repo, f.file, pair.model)
        hub.add_file(e.mmproj.repo or e.repo, e.mmproj.file, pair.mmproj)
        out[e.name] = (e.repo, f.file, e.mmproj.file)
    return out


DEFAULT_PORT = 8765
DEFAULT_HOME = Path(tempfile.gettempdir()) / "edgevlm-stand-in-hub"


def environment(endpoint: str, home: Path) -> dict[str, str]:
    """What a shell exports to use the stand-in hub: its address, and a hub cache and an edgevlm
    cache of their own, so its generated files never mix with real downloads."""
    return {"HF_ENDPOINT": endpoint, "HF_HOME": str(home / "hf"), "EDGEVLM_CACHE": str(home / "edgevlm")}


def main(argv: list[str] | None = None) -> int:
    """``python -m edgevlm_testkit.hub_server [NAME ...]``: serve generated pairs under the
    registry's names on 127.0.0.1 until stopped (Ctrl-C, SIGTERM); prints the line to export."""
    import argparse
    import signal
    import sys

    ap = argparse.ArgumentParser(
        prog="python -m edgevlm_testkit.hub_server",
        description="A local stand-in for the Hugging Face hub: generated pairs (random weights) under the "
        "registry's repo and file names, for edgevlm pull/models/rm/plan without a network.",
    )
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT}; 0: any free one)")
    ap.add_argument(
        "--home", type=Path, default=DEFAULT_HOME, help=f"where the exported caches live (default {DEFAULT_HOME})"
    )
    ap.add_argument("--preset", default="tiny", choices=["tiny", "real"])
    ap.add_argument("--no-redirect", action="store_true")
    ap.add_argument("names", nargs="*", help="registry names to serve (default: all it can generate)")
    args = ap.parse_args(argv)
    hub = FakeHub(redirect=not args.no_redirect)
    served = serve_registry_names(hub, args.names or None, preset=args.preset)
    if args.names and (missing := sorted(set(args.names) - set(served))):
        print(f"Error: no generated family for {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        hub.start(args.port)
    except OSError as e:
        print(f"Error: --port {args.port}: cannot listen on 127.0.0.1:{args.port} ({e.strerror}); give another",
              file=sys.stderr)  # fmt: skip
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    env = environment(hub.endpoint, args.home)
    what = f"generated {args.preset} pairs, random weights"
    print(f"serving {', '.join(served)} on {hub.endpoint} until stopped ({what})")
    print("export " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
