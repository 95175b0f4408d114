"""Where a request's pictures come from: ``data:`` URIs (base64), http(s) URLs fetched with size,
time and redirect limits, and local paths only under ``--allow-path``. URLs whose host resolves
to a loopback, private, link-local or otherwise non-public address are refused (every redirect
is checked again) unless ``--allow-private-urls``, and the connection goes to the address that
was checked (the host is resolved once: a DNS answer that changes in between cannot point the
fetch elsewhere); ``file:`` URLs never work. Every refusal is an ``APIError`` with one line
saying why."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
from urllib.parse import unquote_to_bytes, urljoin, urlsplit, urlunsplit

from ..vision.images import LoadedImage, load_image
from .api_errors import APIError
from .options import ServeOptions
from .request import ImageRef

__all__ = ["fetch_bytes", "fetch_image", "read_data_uri"]


def _refuse(message: str, param: str = "messages") -> APIError:
    return APIError(message, param, "invalid_image_url")


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


def _fetch_url(url: str, opts: ServeOptions) -> bytes:
    import httpx

    for _ in range(opts.url_max_redirects + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _refuse(f"image URL scheme {parts.scheme or '(none)'!r} is not allowed (data:, http, https)")
        address = _resolve(
            parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), opts.allow_private_urls
        )
        target, headers, ext = _pinned(url, address)
        try:
            # no proxy from the environment: the connection goes to the address checked above
            with (
                httpx.Client(timeout=opts.url_timeout_s, follow_redirects=False, trust_env=False) as client,
                client.stream("GET", target, headers={"User-Agent": "edgevlm", **headers}, extensions=ext) as resp,
            ):
                if resp.is_redirect:
                    url = urljoin(url, resp.headers.get("location", ""))
                    continue
                if resp.status_code != 200:
                    raise _refuse(f"fetching the image URL got HTTP {resp.status_code}")
                size = int(resp.headers.get("content-length") or 0)
                if size > opts.url_max_bytes:
                    raise _refuse(f"the image URL holds {size:,} bytes, over the limit of {opts.url_max_bytes:,}")
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > opts.url_max_bytes:
                        raise _refuse(f"the image URL holds more than {opts.url_max_bytes:,} bytes")
                return bytes(data)
        except httpx.HTTPError as exc:
            raise _refuse(f"cannot fetch the image URL ({type(exc).__name__})") from None
    raise _refuse(f"the image URL redirects more than {opts.url_max_redirects} times")


def _read_path(path: str, opts: ServeOptions) -> bytes:
    if opts.path_base and not os.path.isabs(path):
        path = os.path.join(opts.path_base, path)
    real = os.path.realpath(path)
    roots = [os.path.realpath(r) for r in opts.allow_paths]
    if not any(_under(real, r) for r in roots):
        raise _refuse("local paths are only read under --allow-path folders" + ("" if roots else " (none given)"))
    try:
        with open(real, "rb") as fh:
            return fh.read(opts.url_max_bytes + 1)
    except OSError as exc:
        raise _refuse(f"cannot read {path} ({exc.strerror or exc})") from None


def _under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # on Windows: paths on two drives (or one relative) have no common path
        return False


def fetch_bytes(ref: ImageRef, opts: ServeOptions, label: str) -> bytes:
    """A request's picture as the bytes it was sent as (``label`` names it in errors:
    ``messages[1] image 1``)."""
    url = ref.url.strip()
    scheme = urlsplit(url).scheme.lower() if ":" in url[:12] else ""
    if scheme == "data":
        data = read_data_uri(url, opts.url_max_bytes)
    elif scheme in ("http", "https"):
        data = _fetch_url(url, opts)
    elif scheme == "file":
        raise _refuse("file: URLs are not allowed (name a path under --allow-path)")
    elif scheme == "" or len(scheme) == 1:  # a path (C:\\ on Windows)
        data = _read_path(url, opts)
    else:
        raise _refuse(f"image URL scheme {scheme!r} is not allowed (data:, http, https)")
    if len(data) > opts.url_max_bytes:
        raise _refuse(f"{label}: more than {opts.url_max_bytes:,} bytes")
    return data


def fetch_image(ref: ImageRef, opts: ServeOptions, max_pixels: int, label: str) -> LoadedImage:
    """A request's picture, decoded."""
    return load_image(fetch_bytes(ref, opts, label), max_pixels, name=label)
