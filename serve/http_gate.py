"""The ASGI gate in front of the HTTP API: the API key and the request size limit, answered with
OpenAI-style error JSON before a route sees the request."""

from __future__ import annotations

import hmac
import json

from hy3c.serve.protocol import error_body

OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key


class RequestGate:
    """ASGI middleware in front of the app: 401 without the API key (when one is set; every path but
    OPEN_PATHS) and 413 for request bodies over the limit (by Content-Length, or counted while a
    streamed body is read). Plain ASGI, so the app still sees the client's disconnect."""

    def __init__(self, app, limit: int, api_key: str | None) -> None:
        self.app, self.limit = app, limit
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        if (
            self.expected is not None
            and scope["path"] not in OPEN_PATHS
            and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        ):
            return await _send_error(send, 401, "invalid API key", "authentication_error")
        too_big = f"request body exceeds {self.limit} bytes"
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _send_error(send, 413, too_big)
        if length is not None:  # the server reads exactly Content-Length bytes
            return await self.app(scope, receive, send)
        parts, seen, more = [], 0, True  # streamed body: read it (up to the limit) before the app does
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            parts.append(message.get("body", b""))
            seen += len(parts[-1])
            if seen > self.limit:
                return await _send_error(send, 413, too_big)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    """An error response in OpenAI's JSON shape, sent straight through ASGI."""
    body = json.dumps(error_body(message, kind, code=status)).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})
