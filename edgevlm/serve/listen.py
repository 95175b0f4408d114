"""``edgevlm serve``'s uvicorn server, and a second listener beside it in the same process and
event loop (``--ollama-port``: Ollama's API on a port of its own): one set of signal handlers
(the main server's), and the two stop together."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

__all__ = ["Beside", "Listener"]


class Beside(uvicorn.Server):
    """A second listener in the main server's event loop: no signal handlers of its own (the
    main server's end both), it stops when the main one stops, and a port it cannot listen on
    stops the main one (``failed``)."""

    def __init__(self, config: uvicorn.Config, main: uvicorn.Server):
        super().__init__(config)
        self.main = main
        self.failed = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def on_tick(self, counter: int) -> bool:
        return self.main.should_exit or await super().on_tick(counter)

    async def serve_beside(self) -> None:
        try:
            await self.serve()
        except SystemExit:  # (uvicorn exits when it cannot listen: the port is taken)
            self.failed = True
            self.main.should_exit = True


class Listener(uvicorn.Server):
    """uvicorn's server, and ``beside`` (a config: its app, host and port) with it."""

    def __init__(self, config: uvicorn.Config, beside: uvicorn.Config | None = None):
        super().__init__(config)
        self.beside = Beside(beside, self) if beside is not None else None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if self.beside is None:
            return await super().serve(sockets)
        other = asyncio.ensure_future(self.beside.serve_beside())
        try:
            await super().serve(sockets)
        finally:
            self.beside.should_exit = True
            await other
