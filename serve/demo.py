"""The demo's last leg: serve an artifact on a free loopback port and send it one chat completion."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

from hy3c.serve.api import build_app
from hy3c.serve.server import ServeOptions, build_engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn serving an artifact in a thread (demo and tests)."""

    def __init__(self, options: ServeOptions) -> None:
        import uvicorn

        self.engine, tokenizer, server = build_engine(options)
        self.engine.start()
        self.base_url = f"http://{options.host}:{options.port}"
        config = uvicorn.Config(
            build_app(self.engine, tokenizer, server),
            host=options.host,
            port=options.port,
            log_level="warning",
            timeout_keep_alive=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.stop()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_demo(artifact: Path, prompt: str) -> str:
    with BackgroundServer(ServeOptions(artifact, port=free_port(), kv_memory_gib=0.05)) as server:
        body = json.dumps(
            {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
        ).encode()
        request = urllib.request.Request(
            f"{server.base_url}/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
    return json.dumps(reply, indent=2, ensure_ascii=False)
