"""The demo's last leg: serve an artifact on a free loopback port and send it one chat completion."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

from hy3c.serve.http.api import build_app
from hy3c.serve.http.lifecycle import HttpServer
from hy3c.serve.http.server import ServeOptions, bind_socket, start_engine, stop_engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """The server of `hy3c serve` (same gate, limits and shutdown) in a thread (demo and tests); port 0
    picks a free one. Signals stay with the main thread: `drain` runs the SIGTERM shutdown."""

    def __init__(self, options: ServeOptions) -> None:
        sock = bind_socket(options.host, options.port)
        self.engine, tokenizer, server = start_engine(options)
        limits = options.limits()
        gate = build_app(self.engine, tokenizer, server, limits)
        self.engine.start()
        self.http = HttpServer(gate, self.engine, sock, limits, options.shutdown_timeout, server.model_name)
        self.gate, self.server, self.base_url = gate, self.http.server, self.http.url
        self.thread = threading.Thread(target=self.http.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop at once (no drain)."""
        self.server.should_exit = True
        self.thread.join(10)
        stop_engine(self.engine)

    def drain(self, timeout: float = 60.0) -> None:
        """The SIGTERM shutdown (drain, abort, close), waiting up to `timeout` seconds for it."""
        self.http.shutdown()
        self.thread.join(timeout)
        stop_engine(self.engine)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_demo(artifact: Path, prompt: str) -> str:
    options = ServeOptions(
        artifact, port=free_port(), kv_memory_gib=0.05, engine_process=True
    )  # as `hy3c serve`
    with BackgroundServer(options) as server:
        body = json.dumps(
            {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{server.base_url}/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
    return json.dumps(reply, indent=2, ensure_ascii=False)
