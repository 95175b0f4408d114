"""``edgevlm serve``'s uvicorn server, and a second listener beside it in the same process and
event loop (``--ollama-port``: Ollama's API on a port of its own): one set of signal handlers
(the main server's), and the two stop together. Their ports are bound first (``bind``), before
the model is planned or loaded: a port in use is one line at once, not uvicorn's error after
the load.

Stopping (SIGTERM, Ctrl-C; SIGBREAK on Windows — uvicorn's signals): the first signal is
uvicorn's graceful shutdown — the listening sockets close, idle connections end — and
``on_stop`` hears the signal's time first (the app stops admitting and gives replies in
progress their grace; uvicorn's ``timeout_graceful_shutdown`` is the backstop). Once it has
stopped the command's own exit code stands: the signal is not raised again (uvicorn would,
and die by it). A signal while stopping ends the process at once: exit 128 + its number (130
for Ctrl-C, 143 for SIGTERM), one line on stderr, streams cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import HANDLED_SIGNALS

from ..errors import InputError

__all__ = ["Beside", "Listener", "bind", "header_deadline"]


def header_deadline(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on a request's head: a connection must
    send its request line and headers within ``seconds`` of opening (or of its last response),
    else it is closed. uvicorn bounds only an idle kept-alive connection, and any byte that
    arrives cancels that timer: a socket trickling its headers a line at a time held its
    connection for as long as it liked. (Bodies have their own pace: ``http.BodyPace``.)"""

    class HeadInTime(H11Protocol):
        head_timer: asyncio.TimerHandle | None = None

        def arm(self) -> None:
            self.disarm()
            self.head_timer = self.loop.call_later(seconds, self.head_late)

        def disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_late(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # (no request began: nobody waits for an answer)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # (its head is in: the body has its own pace)
                self.disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.arm()  # the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

    return HeadInTime


def bind(host: str, port: int, what: str = "--port") -> list[socket.socket]:
    """Sockets bound to ``host``:``port`` as uvicorn (asyncio's ``create_server``) binds them —
    every address the host resolves to, ``SO_REUSEADDR`` on POSIX, IPv6 sockets IPv6 only — for
    the listener to serve on (``Listener.run(sockets)``). A port in use, an address that is not
    this machine's or a host that does not resolve is an ``InputError`` naming ``host:port``."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError(f"{what} {port}: cannot listen on {where}: {exc.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError as exc:
        for sock in socks:
            sock.close()
        reason = {
            errno.EADDRINUSE: "the port is in use (another server?); give another",
            errno.EADDRNOTAVAIL: "the address is not this machine's",
            errno.EACCES: "permission denied (a port below 1024 needs privileges)",
        }.get(exc.errno or 0, exc.strerror or str(exc))
        raise InputError(f"{what} {port}: cannot listen on {where}: {reason}") from None
    return socks


class Beside(uvicorn.Server):
    """A second listener in the main server's event loop: no signal handlers of its own (the
    main server's end both), it stops when the main one stops, and a port it cannot listen on
    stops the main one (``failed``)."""

    def __init__(self, config: uvicorn.Config, main: uvicorn.Server, sockets: list[socket.socket] | None = None):
        super().__init__(config)
        self.main = main
        self.sockets = sockets  # bound already (``bind``), else uvicorn binds them
        self.failed = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def on_tick(self, counter: int) -> bool:
        return self.main.should_exit or await super().on_tick(counter)

    async def serve_beside(self) -> None:
        try:
            await self.serve(self.sockets)
        except SystemExit:  # (uvicorn exits when it cannot listen: the port is taken)
            self.failed = True
            self.main.should_exit = True


class Listener(uvicorn.Server):
    """uvicorn's server, and ``beside`` (a config: its app, host and port; ``beside_sockets``:
    bound for it already) with it."""

    def __init__(
        self,
        config: uvicorn.Config,
        beside: uvicorn.Config | None = None,
        beside_sockets: list[socket.socket] | None = None,
        on_stop: Callable[[float], None] | None = None,
    ):
        super().__init__(config)
        self.beside = Beside(beside, self, beside_sockets) if beside is not None else None
        self.on_stop = on_stop  # hears when the first signal came (monotonic), as stopping begins
        self.signalled_at: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signals to ``handle_exit``, which stay (the process is ending): a late one
        must not become a traceback."""
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                signal.signal(sig, self.handle_exit)
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a second signal (or one while stopping anyway): at once
            os.write(2, b"edgevlm serve: stopped at once; replies in progress are cut\n")
            os._exit(128 + sig)
        self.signalled_at = time.monotonic()
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_stop is not None:
            self.on_stop(self.signalled_at or time.monotonic())
        await super().shutdown(sockets)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self.beside is None:
            return await super().serve(sockets)
        other = asyncio.ensure_future(self.beside.serve_beside())
        try:
            await super().serve(sockets)
        finally:
            self.beside.should_exit = True
            await other
