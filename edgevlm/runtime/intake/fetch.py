"""Where a turn's pictures come from when they are named by a string: ``data:`` URIs (base64),
http(s) URLs fetched with size, time and redirect limits, and local paths (``FetchRules``: on a
caller's own machine any file; in a server only under ``--allow-path``). URLs whose host
resolves to a loopback, private, link-local or otherwise non-public address are refused (every
redirect is checked again) unless ``allow_private_urls``, and the connection goes to the address
that was checked (the host is resolved once: a DNS answer that changes in between cannot point
the fetch elsewhere); ``file:`` URLs never work. Every refusal is a ``MediaRefused`` (a 400 in
the server) with one line saying why. This is the one module that fetches a URL: chat, the
library, captioning, batch files and the server all come here through the intake.

A source's scheme is read from its first characters (``url_scheme``), never by parsing the
whole string: ``urllib.parse.urlsplit`` keeps its last 128 inputs (Python 3.11+), and a
``data:`` URI is the picture itself. Only http(s) URLs of at most ``URL_MAX_CHARS`` are parsed.

A fetch ends by its deadline (``url_deadline_s``, redirects included: "took longer"), and its
body must come at ``url_min_rate`` bytes/s or faster once ``RATE_GRACE_S`` have passed ("too
slow"); each wait for bytes is at most ``url_timeout_s``. URLs are fetched on threads of their
own (``Fetcher``: ``url_fetches`` at once), so slow URLs cannot hold the threads that decode
pictures and build grammars for everyone else."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes, urljoin, urlsplit, urlunsplit

from ...errors import InputError, MediaRefused, MediaTimedOut, shown
from ...plan.host import Lease, LeaseReleased

__all__ = ["RATE_GRACE_S", "URL_MAX_CHARS", "FetchRules", "Fetcher", "fetch_bytes", "read_data_uri", "url_scheme"]

URL_MAX_CHARS = 8192  # a longer http(s) image URL (or redirect) is refused before it is parsed
RATE_GRACE_S = 2.0  # a fetch's body is held to url_min_rate from this long after its headers on
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-.")


@dataclass(frozen=True)
class FetchRules:
    """What a caller's picture sources may be, and the limits of a fetch (the server's flags:
    docs/serve.md). ``allow_paths`` None: any local file (a caller on its own machine: chat,
    the library, captioning); a tuple: only files under those folders (a server: ``()``, none,
    unless ``--allow-path``)."""

    allow_private_urls: bool = False  # image URLs resolving to loopback / private / link-local
    allow_paths: tuple[str, ...] | None = None  # folders whose files may be named (None: any file)
    path_base: str | None = None  # relative image paths are read from here (None: the current folder)
    url_max_bytes: int = 32 * 2**20  # an image URL's body is cut off (and refused) past this
    url_timeout_s: float = 15.0  # connecting to an image URL, and each wait for its next bytes
    url_deadline_s: float = 30.0  # a whole fetch (redirects included) ends by then: 400 "took longer"
    # an image URL's body comes at least this fast (bytes/s, on average from RATE_GRACE_S after its
    # headers on), or the fetch ends: 400 "too slow"; 0: no floor
    url_min_rate: int = 32 * 1024
    url_fetches: int = 16  # image URLs fetched at once, on threads of their own; more wait their turn
    # one request's URLs fetched at once (the rest of its URLs wait for these): a request with many
    # slow URLs leaves the other url_fetches - this threads to everyone else
    url_fetches_per_request: int = 4
    url_max_redirects: int = 3
    timeout_s: float = 0.0  # the request's own time (the server's --timeout), named when it ends a fetch
    host_wait_s: float = 30.0  # a fetch waits this long for host allowance for its bytes (then 503)


def _refuse(message: str, param: str = "messages") -> MediaRefused:
    return MediaRefused(message, param)


def url_scheme(url: str) -> str:
    """``url``'s scheme, lower-cased, as ``urlsplit`` reads it ("" for none: a path), from its
    first 16 characters alone."""
    head, sep, _ = url[:16].partition(":")
    head = head.replace("\t", "").replace("\r", "").replace("\n", "")  # (urlsplit drops them)
    if not sep or not head or not head[0].isalpha() or not _SCHEME_CHARS.issuperset(head):
        return ""
    return head.lower()


def read_data_uri(uri: str, limit: int) -> bytes:
    """The bytes of a ``data:[type][;base64],payload`` URI."""
    head, sep, payload = uri.partition(",")
    if not sep:
        raise _refuse("a data: URI needs a comma before its payload")
    if len(payload) > limit * 4 // 3 + 4:
        raise _refuse(f"the data: URI holds more than {limit:,} bytes")
    if head.endswith(";base64"):
        try:
            return base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise _refuse("the data: URI is not valid base64") from None
    return unquote_to_bytes(payload)


def _resolve(host: str, port: int, allow_private: bool) -> str:
    """The one address the fetch connects to: every address ``host`` resolves to must pass."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _refuse(f"cannot resolve {host} ({exc.strerror or exc})") from None
    if not infos:
        raise _refuse(f"cannot resolve {host} (no address)")
    # (an AF_INET/AF_INET6 sockaddr starts with the host string; typeshed also allows AF_PACKET's int)
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not allow_private and not ip.is_global:
            raise _refuse(
                f"{host} resolves to {ip}, a non-public address (start the server with "
                f"--allow-private-urls to fetch from it)"
            )
    return str(infos[0][4][0])


def _pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``url`` with its host replaced by the checked ``address``, the Host header and the TLS
    name the server expects (certificates are still checked against the host's name)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    ip = address.split("%")[0]
    netloc = f"[{ip}]" if ":" in ip else ip
    if parts.port:
        netloc += f":{parts.port}"
    shown = f"[{host}]" if ":" in host else host
    headers = {"Host": shown + (f":{parts.port}" if parts.port else "")}
    target = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return target, headers, {"sni_hostname": host}


class _Cut(Exception):
    """A fetch's time is up: ``slow`` (under url_min_rate) or too long (past its deadline)."""

    def __init__(self, slow: bool, got: int):
        self.slow, self.got = slow, got


def _fetch_url(
    url: str, opts: FetchRules, label: str, deadline: float | None = None, lease: Lease | None = None
) -> bytes:
    start = time.monotonic()
    end = start + opts.url_deadline_s if deadline is None else min(deadline, start + opts.url_deadline_s)
    try:
        return asyncio.run(_fetch_async(url, opts, end, lease))
    except _Cut as cut:
        shown = url if len(url) <= 120 else url[:117] + "..."
        took = time.monotonic() - start
        if cut.slow:
            raise _refuse(
                f"{label}: the image URL {shown} is too slow: {cut.got:,} bytes in {took:.1f} s, under the "
                f"{opts.url_min_rate:,} bytes/s the server asks for"
            ) from None
        if deadline is not None and deadline < start + opts.url_deadline_s:  # the request's own time ran out
            raise MediaTimedOut(  # (the words serve.prep uses when the same deadline ends the wait)
                f"the request was not prepared within its {opts.timeout_s:g} s (the server's --timeout): "
                f"{label}'s image URL {shown} gave {cut.got:,} bytes in {took:.1f} s"
            ) from None
        raise _refuse(
            f"{label}: the image URL {shown} took longer than {end - start:.3g} s (the server's limit)"
        ) from None


async def _fetch_async(url: str, opts: FetchRules, end: float, lease: Lease | None = None) -> bytes:
    import httpx

    for _ in range(opts.url_max_redirects + 1):
        if len(url) > URL_MAX_CHARS:
            raise _refuse(f"the image URL is longer than {URL_MAX_CHARS:,} characters")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _refuse(f"image URL scheme {shown(parts.scheme or '(none)')} is not allowed (data:, http, https)")
        address = _resolve(
            parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), opts.allow_private_urls
        )
        target, headers, ext = _pinned(url, address)
        try:
            # no proxy from the environment: the connection goes to the address checked above
            async with httpx.AsyncClient(timeout=opts.url_timeout_s, follow_redirects=False, trust_env=False) as client:
                request = client.build_request(
                    "GET", target, headers={"User-Agent": "edgevlm", **headers}, extensions=ext
                )
                resp = await _by(client.send(request, stream=True), end, 0)
                try:
                    if resp.is_redirect:
                        location = resp.headers.get("location", "")
                        if len(location) > URL_MAX_CHARS:
                            raise _refuse(f"the image URL redirects to more than {URL_MAX_CHARS:,} characters")
                        url = urljoin(url, location)
                        continue
                    if resp.status_code != 200:
                        raise _refuse(f"fetching the image URL got HTTP {resp.status_code}")
                    size = int(resp.headers.get("content-length") or 0)
                    if size > opts.url_max_bytes:
                        raise _refuse(f"the image URL holds {size:,} bytes, over the limit of {opts.url_max_bytes:,}")
                    return await _body(resp, opts, end, size, lease)
                finally:
                    await resp.aclose()
        except httpx.HTTPError as exc:
            raise _refuse(f"cannot fetch the image URL ({type(exc).__name__})") from None
    raise _refuse(f"the image URL redirects more than {opts.url_max_redirects} times")


async def _by(step: Any, end: float, got: int, slow_at: float = math.inf) -> Any:
    """``step`` awaited until ``end`` (then: too long) or ``slow_at`` (then: too slow)."""
    try:
        return await asyncio.wait_for(step, max(0.0, min(end, slow_at) - time.monotonic()))
    except asyncio.TimeoutError:
        raise _Cut(slow_at < end, got) from None


FETCH_COPIES = 2  # a URL's body while fetched: what came so far, and its copy when it is done


async def _body(resp: Any, opts: FetchRules, end: float, size: int = 0, lease: Lease | None = None) -> bytes:
    """The response's body, at most ``url_max_bytes``, by ``end`` and at ``url_min_rate``. With
    ``lease``, its memory is held before it arrives — ``FETCH_COPIES`` × its ``Content-Length``
    up front, else × each chunk as it comes — and the one copy that is returned stays held (the
    caller gives it back once the picture is decoded). Once the lease is released — its request
    gave way, failed elsewhere or lost its client, and gave all it held back — the fetch stops
    at the next chunk (``LeaseReleased``): the bytes it would go on reading are no longer
    planned. (Before, such a fetch read its whole URL and copied it, outside the allowance.)"""
    begun = time.monotonic()
    held = 0

    def take(n: int) -> None:
        nonlocal held
        if lease is not None and n > 0:
            lease.grow(n, time.monotonic() + opts.host_wait_s)  # (a fetch thread of its own: it may wait)
            held += n

    data = bytearray()
    try:
        take(size * FETCH_COPIES)
        chunks = resp.aiter_bytes()
        while True:
            slow_at = begun + RATE_GRACE_S + len(data) / opts.url_min_rate if opts.url_min_rate > 0 else math.inf
            try:
                chunk = await _by(chunks.__anext__(), end, len(data), slow_at)
            except StopAsyncIteration:
                break
            if len(data) + len(chunk) > opts.url_max_bytes:
                raise _refuse(f"the image URL holds more than {opts.url_max_bytes:,} bytes")
            if lease is not None and lease.released:  # its request has ended and given its bytes back
                raise LeaseReleased(f"{lease.what} has ended; its image URL is no longer read")
            take((len(data) + len(chunk)) * FETCH_COPIES - held)  # (nothing while a Content-Length covers it)
            data += chunk
        if lease is not None and lease.released:  # (not even the copy: nobody will take it)
            raise LeaseReleased(f"{lease.what} has ended; its image URL is no longer read")
    except BaseException:
        data.clear()  # (the error's traceback keeps this frame: not the bytes that came)
        if lease is not None:
            lease.shrink(held)
        raise
    out = bytes(data)
    data.clear()
    if lease is not None:
        lease.shrink(held - len(out))  # the copy that is returned stays held
    return out


def _read_path(path: str, opts: FetchRules) -> bytes:
    if opts.path_base and not os.path.isabs(path):
        path = os.path.join(opts.path_base, path)  # (what errors name)
    real = local_path(path, opts)
    own = opts.allow_paths is None  # (a caller's own file: named by its path, read whole)
    try:
        with open(real, "rb") as fh:
            return fh.read(-1 if own else opts.url_max_bytes + 1)
    except OSError as exc:
        why = exc.strerror or exc
        raise InputError(f"{path}: cannot read ({why})") if own else _refuse(f"cannot read {path} ({why})") from None


def local_path(path: str, opts: FetchRules) -> str:
    """The file a path names, checked against ``opts.allow_paths`` (``MediaRefused`` outside)."""
    if opts.path_base and not os.path.isabs(path):
        path = os.path.join(opts.path_base, path)
    if opts.allow_paths is None:
        return path
    real = os.path.realpath(path)
    roots = [os.path.realpath(r) for r in opts.allow_paths]
    if not any(_under(real, r) for r in roots):
        raise _refuse("local paths are only read under --allow-path folders" + ("" if roots else " (none given)"))
    return real


def _under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # on Windows: paths on two drives (or one relative) have no common path
        return False


def fetch_bytes(
    source: str, opts: FetchRules, label: str, deadline: float | None = None, lease: Lease | None = None
) -> bytes:
    """A request's picture as the bytes it was sent as (``label`` names it in errors:
    ``messages[1] image 1``); a URL's fetch ends by ``deadline`` (a ``time.monotonic()`` value)
    too, when that comes before its own. With ``lease``, a URL's body is held on it as it is
    fetched (``_body``), and what is returned stays held: the caller shrinks the lease by its
    length once it is done with it."""
    url = source.strip()
    scheme = url_scheme(url)
    if scheme == "data":
        data = read_data_uri(url, opts.url_max_bytes)
    elif scheme in ("http", "https"):
        data = _fetch_url(url, opts, label, deadline, lease)
    elif scheme == "file":
        raise _refuse("file: URLs are not allowed (name a path under --allow-path)")
    elif scheme == "" or len(scheme) == 1:  # a path (C:\\ on Windows)
        data = _read_path(url, opts)
    else:
        raise _refuse(f"image URL scheme {shown(scheme)} is not allowed (data:, http, https)")
    if len(data) > opts.url_max_bytes:
        raise _refuse(f"{label}: more than {opts.url_max_bytes:,} bytes")
    return data


class Fetcher:
    """A caller's fetches by its ``rules``: http(s) URLs on ``url_fetches`` threads of their own
    (more wait their turn; the threads start with the first URL), anything else (``data:``,
    paths) read in the caller's thread."""

    def __init__(self, rules: FetchRules = FetchRules()):
        self.rules = rules
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, self.rules.url_fetches), thread_name_prefix="edgevlm-fetch")
            return self._pool

    @staticmethod
    def remote(source: str) -> bool:
        return url_scheme(source.strip()) in ("http", "https")

    def fetch(self, source: str, label: str, deadline: float | None = None, lease: Lease | None = None) -> bytes:
        """``fetch_bytes`` by the rules, a URL's on the fetch threads (blocking)."""
        if not self.remote(source):
            return fetch_bytes(source, self.rules, label, deadline, lease)
        return self.pool.submit(fetch_bytes, source, self.rules, label, deadline, lease).result()

    def calls(self, urls: dict[str, str], deadline: float | None, lease: Lease | None) -> list[tuple[Any, ...]]:
        """The fetches of ``urls`` (URL → the label its errors name) as calls for the pool: a
        server runs them a few at a time (``url_fetches_per_request``, ``serve.prep.run_all``)."""
        return [(fetch_bytes, url, self.rules, label, deadline, lease) for url, label in urls.items()]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
