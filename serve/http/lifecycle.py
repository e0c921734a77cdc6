"""Running the HTTP server and stopping it: uvicorn on a socket bound before the model loaded (a busy
port fails at once), with the client limits of `http_gate`, and the shutdown.

Shutdown (the first SIGTERM or Ctrl-C, or `HttpServer.shutdown`): the gate answers new requests with
503 (`/health` too, so that a load balancer stops sending), the requests in flight get up to
`shutdown_timeout` seconds to finish, then the rest are aborted — a stream gets an error event and
ends, a request still waiting for its response gets a 503 — and uvicorn closes the connections. One
`shutdown` log line gives the counts; the process then exits with status 0. A second signal exits at
once (status 128 + the signal's number).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from hy3c.logs import log_event
from hy3c.serve.engine.core import Engine
from hy3c.serve.http.http_gate import HttpLimits, RequestGate, limited_http_protocol

log = logging.getLogger("hy3c.serve")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ABORTED_GRACE_S = 5.0  # for aborted requests to send their last event after the engine dropped them
_CLOSE_GRACE_S = 5  # for uvicorn to close the connections before it cancels what still runs
SHUTDOWN_ERROR = "server is shutting down"


class HttpServer:
    """uvicorn serving `gate` on `sock` until shut down (see the module docstring)."""

    def __init__(
        self,
        gate: RequestGate,
        engine: Engine,
        sock: socket.socket,
        limits: HttpLimits,
        shutdown_timeout: float,
        model: str,
    ) -> None:
        self.gate, self.engine, self.sock, self.model = gate, engine, sock, model
        self.shutdown_timeout = shutdown_timeout
        config = uvicorn.Config(
            gate,
            http=limited_http_protocol(limits),
            timeout_keep_alive=limits.timeout_keep_alive,
            timeout_graceful_shutdown=_CLOSE_GRACE_S,
            log_level="warning",
            access_log=False,
        )
        self.server = _Uvicorn(config, self)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._counts: dict | None = None
        self._drain_started = 0.0

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def run(self) -> None:
        """Serve until shut down (blocking). On the main thread, SIGTERM and SIGINT start the shutdown."""
        self.server.run(sockets=[self.sock])
        if self._counts is not None:  # seconds: from the signal to the connections closed
            # refused: read now, for requests keep being refused until the listener closes
            log_event(
                log,
                "shutdown",
                **self._counts,
                refused=self.gate.refused,
                seconds=round(time.monotonic() - self._drain_started, 2),
            )

    def shutdown(self, reason: str = "request") -> None:
        """Start the shutdown from any thread (what the first signal does)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._begin, reason)

    # ---- on the server's event loop ---------------------------------------------------------------
    def _started(self) -> None:
        self.loop = asyncio.get_running_loop()
        log_event(log, "serving", url=f"{self.url}/v1", model=self.model)

    def _signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._drain is None:
            self._begin(name)
            return
        log_event(log, "shutdown_forced", logging.WARNING, signal=name)
        sys.stderr.flush()
        os._exit(128 + signum)

    def _begin(self, reason: str) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._shut_down(reason))

    async def _shut_down(self, reason: str) -> None:
        self._drain_started = time.monotonic()
        in_flight = self.gate.begin_drain()
        log_event(log, "draining", signal=reason, in_flight=in_flight, timeout_s=self.shutdown_timeout)
        await self._wait_for_flights(self._drain_started + self.shutdown_timeout)
        aborted = await self.gate.abort_in_flight(SHUTDOWN_ERROR)
        if aborted:
            self.engine.abort_all(SHUTDOWN_ERROR)
            await self._wait_for_flights(time.monotonic() + _ABORTED_GRACE_S)
        self._counts = {
            "signal": reason,
            "in_flight": in_flight,
            "finished": in_flight - aborted,
            "aborted": aborted,
        }
        self.server.should_exit = True

    async def _wait_for_flights(self, deadline: float) -> None:
        while self.gate.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server whose signals start `HttpServer`'s shutdown (uvicorn's own handlers would wait for
    every connection without a limit) and that reports when it serves."""

    def __init__(self, config: uvicorn.Config, owner: HttpServer) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self.owner._signal, sig)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.owner._started()
