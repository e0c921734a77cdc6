"""`hy3c serve` of an artifact compiled for two ranks (tp 2), its worker started by the server: greedy
completions carry the single-rank artifact's tokens; when rank 0 is killed its worker exits; when the
worker is killed, /health answers 503 within a bounded time naming the rank, requests get that error,
one log line says which rank died, and SIGTERM still shuts the server down cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.runtime.artifact import load
from hy3c.serve.engine.core import GenerationRequest
from hy3c.serve.engine.offline import generate
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.http.demo import free_port

PROMPTS = ["The quick brown fox jumps", "Once upon a time"]
START_TIMEOUT_S = 120
DEAD_WITHIN_S = 5.0  # from a worker's death to /health 503 (the watch looks every 0.1 s)


@pytest.fixture(scope="module")
def tp2_artifact(tiny_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "art-tp2"
    return compile_artifact(load_recipe("cpu-reference", ["parallel.tp=2"]), out, checkpoint=tiny_ckpt).out


class ShardedServer:
    """`python -m hy3c serve ART` (it starts its worker), its log in a file; the worker's pid from it."""

    def __init__(self, artifact: Path, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "hy3c", "serve", str(artifact), "--port", str(self.port)]
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [*command, "--kv-memory", "0.02", "--collective-timeout", "30"],
                stdout=subprocess.DEVNULL,
                stderr=out,
            )
        self.wait_for_log("event=serving", START_TIMEOUT_S)
        (pid,) = re.findall(r"event=ranks_started world_size=2 pids=(\d+)", self.text())
        self.worker = int(pid)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} in the log:\n{self.text()}")
            time.sleep(0.05)

    def complete(self, prompt: str) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)

    def stop(self) -> None:
        for pid in (self.proc.pid, self.worker):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie awaiting its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(condition, seconds: float) -> float | None:
    """Seconds until condition() held, None if it did not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if condition():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def single_rank_texts(artifact: Path) -> list[str]:
    """The greedy completions of PROMPTS by the one-rank artifact (offline, in this process)."""
    runner = load(artifact, "cpu", compile=False)
    tokenizer = Hy3Tokenizer.from_dir(artifact)
    requests = [
        GenerationRequest(str(i), tokenizer.encode(p), SamplingParams(temperature=0.0), 12, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    results = generate(runner, tokenizer, requests, runner.recipe.serving)
    assert len({tuple(r.token_ids) for r in results}) == len(PROMPTS)  # distinct: the check means something
    return [r.text for r in results]


def test_two_ranks_answer_like_one_and_the_worker_exits_when_rank_0_dies(
    tiny_artifact, tp2_artifact, tmp_path
):
    expected = single_rank_texts(tiny_artifact)
    server = ShardedServer(tp2_artifact, tmp_path / "serve.log")
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        for prompt, text in zip(PROMPTS, expected):
            response = server.complete(prompt)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (text, "length")
        assert "ranks=2" in server.text()
        os.kill(server.proc.pid, signal.SIGKILL)  # rank 0 goes away without a word
        assert _wait_until(lambda: not _running(server.worker), 10) is not None, server.text()
    finally:
        server.stop()


def test_a_dead_worker_makes_the_server_unhealthy_at_once_and_sigterm_still_stops_it(tp2_artifact, tmp_path):
    server = ShardedServer(tp2_artifact, tmp_path / "serve.log")
    try:
        assert server.complete("warm").status_code == 200
        os.kill(server.worker, signal.SIGKILL)
        took = _wait_until(
            lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503, DEAD_WITHIN_S
        )
        assert took is not None, server.text()
        reason = f"rank 1 (pid {server.worker}) died: killed by SIGKILL"
        health = httpx.get(f"{server.url}/health", timeout=10).json()["error"]
        assert health["message"] == f"engine is not running ({reason})" and health["code"] == 503
        response = server.complete("after")  # refused at once, with the reason: nothing hangs
        assert response.status_code == 503 and reason in response.json()["error"]["message"]
        failures = [line for line in server.text().splitlines() if "event=rank_failed" in line]
        assert failures == [failures[0]] and f'rank=1 reason="{reason}"' in failures[0]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert "event=ranks_stopped" in server.text()
    finally:
        server.stop()
