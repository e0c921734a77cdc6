"""The HTTP gate in front of the API: what is checked and answered before a route sees a request.

`RequestGate` (ASGI middleware): the API key, the request size limit, the body read timeout, 503s while
the server shuts down, the in-flight requests a shutdown waits for (and answers with 503 when it aborts
them), and the access log — one `request` line per request (method, path, status, latency, the tokens
of its generations, the error message of a 4xx/5xx) on the `hy3c.access` logger, at INFO (DEBUG for
`/health`, `/metrics`, `/version`, which scrapers poll). Errors use OpenAI's JSON shape.

`limited_http_protocol`: uvicorn's httptools protocol with the limits uvicorn lacks — a time limit on
the request line and headers (uvicorn and its parsers have none: a client sending half its headers
would hold the connection forever), a cap on their size (httptools buffers a header of any length: a
client sending one endless header grows the server's memory until the time limit) and a cap on open
connections (uvicorn's `limit_concurrency` answers only once the headers are in, in plain text, and
counts tasks too) — and OpenAI's error JSON where uvicorn answers a malformed request in plain text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
from dataclasses import dataclass

from hy3c.logs import log_event
from hy3c.serve.engine.metrics import CURRENT_USAGE, RequestUsage
from hy3c.serve.http.protocol import error_body

OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key
# httptools' reasons for a malformed request, where a plainer one helps (the rest are clear as they are)
_PARSER_REASONS = {"Pause on PRI/Upgrade": "HTTP/2 is not supported; send HTTP/1.1"}
_ERROR_CAPTURE_BYTES = 4096  # of an error response's body, for the access log's message

log = logging.getLogger("hy3c.serve")
access_log = logging.getLogger("hy3c.access")


@dataclass
class HttpLimits:
    """How long and how many clients may hold the server (`hy3c serve` flags; README)."""

    header_timeout: float = 10.0  # s from connecting (or a keep-alive request's first byte) to the headers
    body_timeout: float = 30.0  # s from the headers to the whole body
    timeout_keep_alive: float = 5.0  # s an idle keep-alive connection stays open
    max_connections: int = 2048  # open connections; more are answered 503 and closed
    max_header_bytes: int = 64 * 1024  # request line and headers; more are answered 431 and closed


class RequestGate:
    """ASGI middleware in front of the app: 401 without the API key (when one is set; every path but
    OPEN_PATHS), 413 for request bodies over the limit (by Content-Length, or counted while a streamed
    body is read), 408 for a body not received within `body_timeout` seconds, 503 while draining.
    The body is read here (it is at most `limit` bytes) and replayed to the app; later `receive` calls
    go to the server, so the app still sees the client's disconnect."""

    def __init__(self, app, limit: int, api_key: str | None, body_timeout: float = 30.0) -> None:
        self.app, self.limit, self.body_timeout = app, limit, body_timeout
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.draining = False
        self.refused = 0  # requests answered 503 while draining
        self.flights: set[_Flight] = set()  # requests the app is serving (OPEN_PATHS aside)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        flight = _Flight(scope, send)
        try:
            await self._serve(flight, scope, receive)
        except Exception:
            flight.status = flight.status or 500  # uvicorn answers 500 for an app that raised
            raise
        finally:
            flight.log()

    async def _serve(self, flight: _Flight, scope, receive) -> None:
        path = scope["path"]
        if self.draining and path != "/metrics":
            self.refused += 1
            message = (
                "the server is draining (shutting down)" if path == "/health" else "server is shutting down"
            )
            return await flight.answer(503, message, "service_unavailable", close=True)
        headers = dict(scope.get("headers", []))
        if (
            self.expected is not None
            and path not in OPEN_PATHS
            and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        ):
            return await flight.answer(401, "invalid API key", "authentication_error")
        too_big = f"request body exceeds {self.limit} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await flight.answer(413, too_big, close=True)
        if path not in OPEN_PATHS:  # in flight from here: a shutdown waits for it (or answers it)
            self.flights.add(flight)
        try:
            body = await self._read_body(flight, receive, too_big)
            if body is None or flight.answered:  # the gate answered (a shutdown may have meanwhile)
                return None
            pending = [{"type": "http.request", "body": body, "more_body": False}]

            async def replay():
                return pending.pop() if pending else await receive()

            token = CURRENT_USAGE.set(flight.usage)
            try:
                await self.app(scope, replay, flight.send)
            finally:
                CURRENT_USAGE.reset(token)
        finally:
            self.flights.discard(flight)

    async def _read_body(self, flight: _Flight, receive, too_big: str) -> bytes | None:
        """The whole body, or None once the gate has answered (408, 413) or the client went away."""
        parts, seen, more = [], 0, True
        deadline = flight.started + self.body_timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await flight.answer(
                    408, f"request body not received within {self.body_timeout:g} s", close=True
                )
                return None
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                await flight.answer(413, too_big, close=True)
                return None
            more = message.get("more_body", False)
        return b"".join(parts)

    # ---- shutdown ----------------------------------------------------------------------------------
    def begin_drain(self) -> int:
        """Refuse new requests from now on; returns how many are in flight."""
        self.draining = True
        return len(self.flights)

    async def abort_in_flight(self, message: str) -> int:
        """Answer 503 to every request in flight whose response has not started (the app's own answer
        is dropped when it comes); returns how many were in flight. Started responses (streams) are
        ended by aborting their engine requests."""
        flights = list(self.flights)
        for flight in flights:
            await flight.answer(503, message, "service_unavailable", close=True)
        return len(flights)


class _Flight:
    """One request through the gate: its response status, whether the gate answered it (then the
    app's messages are dropped), and what the access log says about it."""

    def __init__(self, scope, send) -> None:
        self.scope, self._send = scope, send
        self.started = time.monotonic()
        self.status: int | None = None
        self.answered = False
        self.error: str | None = None
        self.captured = bytearray()  # the start of an error response's body
        self.usage = RequestUsage()

    async def send(self, message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif self.status is not None and self.status >= 400 and len(self.captured) < _ERROR_CAPTURE_BYTES:
            self.captured += message.get("body", b"")
        await self._send(message)

    async def answer(
        self, status: int, message: str, kind: str = "invalid_request_error", close: bool = False
    ):
        """Send an error response from the gate, unless the app's response has started."""
        if self.status is not None:
            return
        self.status, self.error, self.answered = status, message, True
        headers = [(b"content-type", b"application/json")]
        if close:  # the rest of the request may still be on its way: do not read it as the next one
            headers.append((b"connection", b"close"))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        body = json.dumps(error_body(message, kind, code=status)).encode()
        await self._send({"type": "http.response.body", "body": body})

    def log(self) -> None:
        path = self.scope["path"]
        level = logging.DEBUG if path in OPEN_PATHS else logging.INFO
        if not access_log.isEnabledFor(level):
            return
        fields: dict = {
            "method": self.scope["method"],
            "path": path,
            "status": self.status if self.status is not None else "-",  # "-": the client left first
            "ms": round((time.monotonic() - self.started) * 1e3, 1),
        }
        usage = self.usage
        if usage.prompt_tokens or usage.completion_tokens:
            fields.update(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
            )
        client = self.scope.get("client")
        if client:
            fields["client"] = f"{client[0]}:{client[1]}"
        if self.status is not None and self.status >= 400:
            fields["error"] = self.error or _error_message(bytes(self.captured))
        log_event(access_log, "request", level, **fields)


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (or the start of the body as text)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def raw_error_response(status: int, reason: str, message: str, kind: str = "invalid_request_error") -> bytes:
    """A whole HTTP/1.1 error response with OpenAI's error JSON that closes the connection (for the
    protocol layer, where no ASGI app runs)."""
    body = json.dumps(error_body(message, kind, code=status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def limited_http_protocol(limits: HttpLimits) -> type:
    """uvicorn's httptools protocol, closing a connection whose request line and headers are not in
    within `limits.header_timeout` seconds (of connecting, or of a keep-alive request's first byte;
    answered 408) or exceed `limits.max_header_bytes` (answered 431 as soon as they do), answering
    connections beyond `limits.max_connections` with 503 before closing them, and a request httptools
    cannot parse with a 400 in OpenAI's error JSON."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    header_timeout, max_connections = limits.header_timeout, limits.max_connections
    max_header_bytes = limits.max_header_bytes

    class LimitedHttpProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        # bytes received of the current request's line and headers; None from the end of its headers
        # to the end of its body (a pipelined request's bytes that arrive with the previous one's end
        # are not counted: at most one read's worth)
        _head_bytes: int | None = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log_event(
                    log, "connection_refused", logging.WARNING, limit=max_connections, client=self._peer()
                )
                message = f"too many open connections (the limit is {max_connections})"
                transport.write(
                    raw_error_response(503, "Service Unavailable", message, "service_unavailable")
                )
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            """Parse `data`, but no more of a request's line and headers than `max_header_bytes`: the
            first byte beyond them gets 431 and the connection closed, before httptools buffers it."""
            if self._head_bytes is not None and self._head_bytes + len(data) > max_header_bytes:
                room = max_header_bytes - self._head_bytes
                self._feed(data[:room])
                if self.transport.is_closing():  # e.g. answered 400: the bytes before the cap were bad
                    return
                if self._head_bytes is not None:  # the headers did not end within the cap
                    self._headers_too_large()
                    return
                data = data[room:]
            self._feed(data)

        def _feed(self, data: bytes) -> None:
            if not data or self.transport.is_closing():
                return
            if self._head_bytes is not None:
                self._head_bytes += len(data)
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            """A request httptools cannot parse: 400 in OpenAI's error JSON (uvicorn's is plain text),
            naming the parser's reason; uvicorn calls this inside its `except HttpParserError`."""
            reason = str(sys.exc_info()[1] or msg)
            message = f"invalid HTTP request: {_PARSER_REASONS.get(reason, reason)}"
            self.transport.write(raw_error_response(400, "Bad Request", message))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:  # a keep-alive connection's next request
                self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._cancel_header_timer()
            self._head_bytes = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._head_bytes = 0  # what comes next is the next request's
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._headers_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            log_event(log, "header_timeout", seconds=header_timeout, client=self._peer())
            message = f"request headers not received within {header_timeout:g} s"
            self._refuse(408, "Request Timeout", message)

        def _headers_too_large(self) -> None:
            self._cancel_header_timer()
            log_event(log, "header_too_large", limit=max_header_bytes, client=self._peer())
            message = f"request line and headers exceed {max_header_bytes} bytes"
            self._refuse(431, "Request Header Fields Too Large", message)

        def _refuse(self, status: int, reason: str, message: str) -> None:
            """Answer `status` (unless a response of ours is underway: a pipelined request) and close."""
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(raw_error_response(status, reason, message))
            self.transport.close()

        def _peer(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "-"

    return LimitedHttpProtocol
