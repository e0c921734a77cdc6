"""The server's lifecycle and its limits on clients: SIGTERM drains then aborts and exits (a second
signal exits at once), a busy port fails before the model loads, slow or idle clients are closed,
oversized headers are refused at once, malformed HTTP gets OpenAI's error JSON, open connections are
capped, and nothing listens beyond loopback unless asked."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hy3c.cli import build_parser
from hy3c.serve.http.bench_client import BenchConfig
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.server import ServeOptions, bind_socket

LOOPBACK = ("127.0.0.1", "::1", "localhost")
LONG = {"prompt": "a long generation", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


class ServeProcess:
    """`python -m hy3c serve` of the tiny artifact, its log in a file."""

    def __init__(self, artifact: Path, log: Path, *flags: str) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "hy3c", "serve", str(artifact), "--port", str(self.port)]
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*command, "--kv-memory", "0.02", *flags], stdout=subprocess.DEVNULL, stderr=out
            )
        self.wait_for_log("event=serving", timeout=180)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} in the log:\n{self.text()}")
            time.sleep(0.05)

    def running(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "hy3c:num_requests_running"]
        return family.samples[0].value

    def wait_running(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.running() < count:
            assert time.monotonic() < deadline, f"{count} requests did not start running"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def in_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def sse_lines(url: str, body: dict, into: list) -> None:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as response:
        into.extend(line for line in response.iter_lines() if line)


def test_sigterm_drains_in_flight_requests_then_aborts_the_rest_and_exits(tiny_artifact, tmp_path):
    server = ServeProcess(tiny_artifact, tmp_path / "serve.log", "--shutdown-timeout", "6")
    try:
        long_stream, short_stream, plain = [], [], []
        threads = [
            in_thread(sse_lines, server.url, LONG, long_stream),
            in_thread(
                lambda: plain.append(httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=120))
            ),
        ]
        server.wait_running(2)
        short = {"prompt": "short", "max_tokens": 50, "temperature": 0, "ignore_eos": True}
        threads.append(in_thread(sse_lines, server.url, short, short_stream))
        server.wait_running(3)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        server.wait_for_log("event=draining", timeout=10)
        refused = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10
        )
        assert refused.status_code == 503
        assert refused.json()["error"] == {
            "message": "server is shutting down",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
        assert server.proc.wait(timeout=6 + 30) == 0
        took = time.monotonic() - signalled
        for thread in threads:
            thread.join(30)
    finally:
        server.kill()
    log = server.text()
    print(f"exited {took:.1f} s after SIGTERM (--shutdown-timeout 6)")
    assert 5 < took < 6 + 30  # the drain waited for the long requests, then aborted them
    # the short stream finished during the drain; the long one got an error event, then the end
    assert json.loads(short_stream[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not any('"error"' in line for line in short_stream)
    events = [json.loads(line[6:]) for line in long_stream[:-1]]
    assert long_stream[-1] == "data: [DONE]" and events[-1]["error"] == {
        "message": "server is shutting down",
        "type": "service_unavailable",  # as every 503: retry elsewhere, not a server bug
        "param": None,
        "code": 503,
    }
    assert len(events) > 2  # tokens streamed before the abort
    (response,) = plain  # the non-streaming one waited for its answer: 503
    assert response.status_code == 503 and response.json()["error"]["message"] == "server is shutting down"
    (line,) = [line for line in log.splitlines() if "event=shutdown " in line]
    assert "signal=SIGTERM in_flight=3 finished=1 aborted=2 refused=2" in line
    assert "Traceback" not in log


def test_a_second_sigterm_exits_at_once(tiny_artifact, tmp_path):
    server = ServeProcess(tiny_artifact, tmp_path / "serve.log", "--shutdown-timeout", "120")
    try:

        def doomed_stream() -> None:  # the forced exit cuts it off
            with contextlib.suppress(httpx.HTTPError):
                sse_lines(server.url, LONG, [])

        in_thread(doomed_stream)
        server.wait_running(1)
        server.proc.send_signal(signal.SIGTERM)
        server.wait_for_log("event=draining", timeout=10)
        time.sleep(0.5)
        assert server.proc.poll() is None  # draining: waits for the stream
        server.proc.send_signal(signal.SIGTERM)
        forced = time.monotonic()
        status = server.proc.wait(timeout=30)
        took = time.monotonic() - forced
    finally:
        server.kill()
    print(f"second SIGTERM: exited in {took:.2f} s")
    assert status == 128 + signal.SIGTERM and took < 5
    assert "event=shutdown_forced signal=SIGTERM" in server.text()


def test_a_busy_port_fails_before_the_model_loads(tiny_artifact):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-m",
                "hy3c",
                "serve",
                str(tiny_artifact),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - started
    print(f"busy port: answered in {took:.2f} s")
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == 2
    assert lines == [f"error: --port {port}: 127.0.0.1:{port} is already in use (pick another --port)"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    heavy = (
        "hy3c.program.artifact",
        "hy3c.compiler",
        "hy3c.passes",
        "hy3c.serve.engine.core",
        "torch._inductor",
    )
    assert "hy3c.serve.http.server" in imported and not [m for m in imported if m.startswith(heavy)]
    assert took < 5  # a process start and the CLI's imports; the model would take longer still


def _raw(port: int, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:  # the server may refuse and close before it has read all of it
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection (a reset after the response counts as the
    close: the server drops unread bytes of a client it refused)."""
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


def _error_reply(reply: bytes, status: int) -> dict:
    """The `error` object of a whole HTTP response of `status` that closes the connection."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), reply
    assert "content-type: application/json" in lines and "connection: close" in lines, reply
    return json.loads(body)["error"]


@pytest.fixture(scope="module")
def strict_server(tiny_artifact):
    options = ServeOptions(
        tiny_artifact,
        port=0,
        kv_memory_gib=0.02,
        header_timeout=1.0,
        body_timeout=1.0,
        timeout_keep_alive=1.0,
        max_connections=6,
        max_header_bytes=16384,
    )
    with BackgroundServer(options) as srv:
        yield srv


def _wait_no_connections(srv, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.server.server_state.connections:
        assert time.monotonic() < deadline, "connections did not close"
        time.sleep(0.05)


def test_half_sent_requests_are_closed_and_others_still_served(strict_server):
    port = int(strict_server.base_url.rsplit(":", 1)[1])
    started = time.monotonic()
    silent = _raw(port)
    half_headers = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    body = b'{"prompt": "hello", "max_tokens": 1}'
    half_body = _raw(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:10],
    )
    ok = httpx.post(
        f"{strict_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200  # served while the slow ones hang
    for sock, message in (
        (silent, b"request headers not received within 1 s"),
        (half_headers, b"request headers not received within 1 s"),
        (half_body, b"request body not received within 1 s"),
    ):
        reply = _read_until_closed(sock)
        took = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408 ") and message in reply, reply
        assert 0.9 < took < 6, took
    keep_alive = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answered = time.monotonic()
    reply = _read_until_closed(keep_alive)  # the response, then the idle connection closes
    assert reply.startswith(b"HTTP/1.1 200 ") and 0.9 < time.monotonic() - answered < 6
    assert httpx.get(f"{strict_server.base_url}/health", timeout=10).status_code == 200


def test_connections_beyond_the_cap_are_answered_503(strict_server):
    port = int(strict_server.base_url.rsplit(":", 1)[1])
    _wait_no_connections(strict_server)
    held = [_raw(port) for _ in range(6)]
    deadline = time.monotonic() + 10
    while len(strict_server.server.server_state.connections) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    reply = _read_until_closed(_raw(port))
    assert _error_reply(reply, 503) == {
        "message": "too many open connections (the limit is 6)",
        "type": "service_unavailable",
        "param": None,
        "code": 503,
    }
    assert time.monotonic() - started < 0.9  # at once, not at the header timeout
    for sock in held:
        sock.close()
    _wait_no_connections(strict_server)
    assert httpx.get(f"{strict_server.base_url}/health", timeout=10).status_code == 200


def test_headers_over_the_cap_get_431_at_once_and_others_are_still_served(strict_server):
    port = int(strict_server.base_url.rsplit(":", 1)[1])
    big = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    started, sent = time.monotonic(), 0
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # an endless header: the server closes
        while time.monotonic() - started < 10:
            sent += big.send(b"a" * 65536)
    closed = time.monotonic() - started
    reply = _read_until_closed(big)
    print(f"endless header: closed after {sent} bytes sent, {closed:.3f} s")
    assert closed < 0.9  # refused at the cap, before the 1 s header timeout
    assert _error_reply(reply, 431) == {
        "message": "request line and headers exceed 16384 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": 431,
    }
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    one_mib = _read_until_closed(_raw(port, head + b"X-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"))
    assert one_mib.startswith(b"HTTP/1.1 431 ")
    under = _read_until_closed(_raw(port, head + b"X-Big: " + b"a" * 16000 + b"\r\n\r\n"))
    assert under.startswith(b"HTTP/1.1 200 ")  # 16,000 bytes of header fit the 16,384 bytes
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    big_body = (  # a body does not count: only the line and headers do
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body) + 20000}\r\nConnection: close\r\n\r\n".encode()
        + body
        + b" " * 20000
    )
    assert _read_until_closed(_raw(port, big_body)).startswith(b"HTTP/1.1 200 ")
    assert httpx.get(f"{strict_server.base_url}/health", timeout=10).status_code == 200


MALFORMED = {
    "content-length not a number": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "negative content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "two content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
    b"Content-Length: 2\r\n\r\nab",
    "content-length and chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "garbage request line": b"HELLO THERE\r\n\r\n",
    "TLS ClientHello": bytes.fromhex("16030100a5010000a10303") + bytes(32),
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "control bytes in a header": b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Type: \x01\x02\r\n\r\n",
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_http_gets_openai_error_json_and_the_connection_closes(strict_server, request_bytes):
    port = int(strict_server.base_url.rsplit(":", 1)[1])
    started = time.monotonic()
    error = _error_reply(_read_until_closed(_raw(port, request_bytes)), 400)
    assert time.monotonic() - started < 0.9  # answered at once, not at the header timeout
    assert error["message"].startswith("invalid HTTP request: "), error
    assert error.keys() == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, 400)
    if request_bytes.startswith(b"PRI "):
        assert error["message"] == "invalid HTTP request: HTTP/2 is not supported; send HTTP/1.1"


def _option_defaults(parser: argparse.ArgumentParser, dest: str) -> list:
    """The defaults of every option named `dest` in the parser and its subcommands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_defaults(sub, dest)
        elif action.dest == dest:
            found.append(action.default)
    return found


def test_every_service_listens_on_loopback_unless_asked():
    hosts = _option_defaults(build_parser(), "host")
    assert hosts and all(host in LOOPBACK for host in hosts), hosts  # `serve` and any later service
    options = ServeOptions(Path("art"))
    assert options.host == "127.0.0.1"
    with bind_socket(options.host, 0) as sock:  # what `hy3c serve` and BackgroundServer bind
        assert sock.getsockname()[0] == "127.0.0.1"
    assert httpx.URL(BenchConfig().base_url).host == "127.0.0.1"
