"""The engine in a process of its own (`hy3c serve`'s default): the same answers as the engine on a
thread of the HTTP process, its wire format, and what the HTTP side does when the child goes away."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.agent.structured import Grammars, GrammarSpec
from hy3c.serve.engine.core import GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.engine_process import (
    EngineClient,
    output_from_wire,
    request_from_wire,
    request_to_wire,
)
from hy3c.serve.http.server import ServeOptions
from tests.serve.http.test_lifecycle import ServeProcess

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def _options(artifact, **overrides) -> ServeOptions:
    settings = {"kv_memory_gib": 0.02, "max_num_seqs": 16, **overrides}
    return ServeOptions(artifact, port=free_port(), **settings)


@pytest.fixture(scope="module")
def servers(tiny_artifact):
    """The same artifact served twice: engine on a thread here, engine in a child process."""
    with (
        BackgroundServer(_options(tiny_artifact)) as here,
        BackgroundServer(_options(tiny_artifact, engine_process=True)) as child,
    ):
        assert isinstance(child.engine, EngineClient) and not isinstance(here.engine, EngineClient)
        yield here, child


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def _without_ids(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


def _streamed(server, body: dict) -> tuple[list[dict], str]:
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks, text


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 2},
        {"prompt": "abc abc", "max_tokens": 8, "temperature": 0, "prompt_logprobs": 1, "ignore_eos": True},
        {"prompt": "Once", "max_tokens": 10, "temperature": 0.9, "seed": 7, "logit_bias": {"17": 5}, "n": 2},
    ],
    ids=["logprobs", "prompt_logprobs", "seeded_n2_bias"],
)
def test_completions_equal_the_in_process_engine(servers, body):
    here, child = servers
    a, b = _post(here, "/v1/completions", body), _post(child, "/v1/completions", body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert _without_ids(b.json()) == _without_ids(a.json())
    assert b.json()["usage"]["completion_tokens"] > 0


def test_streamed_and_json_schema_chat_equal_the_in_process_engine(servers):
    here, child = servers
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 12, "temperature": 0}
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    (chunks_a, text_a), (chunks_b, text_b) = _streamed(here, streamed), _streamed(child, streamed)
    assert text_b == text_a and chunks_b[-1]["usage"] == chunks_a[-1]["usage"]
    schema = {
        **chat,
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    a, b = _post(here, "/v1/chat/completions", schema), _post(child, "/v1/chat/completions", schema)
    assert a.status_code == b.status_code == 200
    assert _without_ids(b.json()) == _without_ids(a.json())
    if b.json()["choices"][0]["finish_reason"] == "stop":  # (64 tokens may cut it short)
        assert set(json.loads(b.json()["choices"][0]["message"]["content"])) == {"name", "n"}


def test_a_grammar_the_library_rejects_is_a_400_from_the_http_process(servers):
    _, child = servers
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}}
    reply = _post(child, "/v1/completions", body)
    assert reply.status_code == 400 and "regex" in reply.json()["error"]["message"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_access_log_usage_and_metrics_come_through_the_pipe(servers):
    _, child = servers
    logger, lines = logging.getLogger("hy3c.access"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
        ok = _post(child, "/v1/completions", body)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    prompt = ok.json()["usage"]["prompt_tokens"]
    assert len(lines.lines) == 1
    assert f"prompt_tokens={2 * prompt} completion_tokens=6 cached_tokens=" in lines.lines[0]
    metrics = httpx.get(f"{child.base_url}/metrics", timeout=30).text
    finished = [line for line in metrics.splitlines() if line.startswith("hy3c:request_success_total{")]
    assert finished and sum(float(line.rsplit(" ", 1)[1]) for line in finished) >= 2


def test_a_client_that_goes_away_aborts_its_request_in_the_child(servers):
    _, child = servers
    body = {"prompt": "a", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{child.base_url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert child.engine.num_requests()[0] == 1
    deadline = time.monotonic() + 10
    while child.engine.num_requests() != (0, 0) or child.engine.num_submitted():
        assert time.monotonic() < deadline, (child.engine.num_requests(), child.engine.num_submitted())
        time.sleep(0.02)


def test_the_engine_process_ignores_a_sigterm_meant_for_the_http_process(servers):
    _, child = servers
    os.kill(child.engine._process.pid, signal.SIGTERM)  # as a SIGTERM to the whole group delivers it
    time.sleep(0.3)
    assert child.engine.alive
    reply = _post(child, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text


class _FakeWire:
    """The child's messages, then (the child still up, its pipe open) a look at what had ended by then."""

    def __init__(self, messages: list, then: Callable[[], None]) -> None:
        self.messages, self.then = messages, then

    def receive(self) -> list:
        if not self.messages:
            self.then()
            raise EOFError  # (only so that the test's reader returns)
        return self.messages.pop(0)


class _LiveProcess:
    exitcode = None
    pid = 0

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        return None


def test_when_the_engine_loop_dies_in_a_live_child_every_request_it_holds_ends():
    client = EngineClient.__new__(EngineClient)  # the reader's logic alone, without a child
    client._lock, client._usage, client._dead, client._stopping = threading.Lock(), {}, None, False
    client._process, client._reaping = _LiveProcess(), threading.Lock()
    seen: dict[str, list[StepOutput]] = {"a": [], "b": []}
    client._emits = {name: outs.append for name, outs in seen.items()}
    partial = vars(StepOutput("a", "x", [5]))
    ended_before_eof: list[bool] = []
    client._wire = _FakeWire(
        [["outputs", [partial]], ["dead", "engine loop: boom"]],
        lambda: ended_before_eof.append(client._emits == {}),
    )
    client._read()
    assert ended_before_eof == [True]
    assert [out.text for out in seen["a"]] == ["x", ""]
    for outs in seen.values():
        assert (
            outs[-1].finished and outs[-1].finish_reason == "error" and outs[-1].error == "engine loop: boom"
        )
    assert client.dead == "engine loop: boom"


class _ClosedConn:
    def close(self) -> None:
        return None


class _JoinedProcess:
    """A child that ends as soon as it is waited for, counting how many threads wait at once."""

    pid, exitcode = 0, None

    def __init__(self) -> None:
        self.waiting = self.most = 0
        self.count_lock = threading.Lock()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout=None) -> None:
        with self.count_lock:
            self.waiting += 1
            self.most = max(self.most, self.waiting)
        time.sleep(0.2)
        with self.count_lock:
            self.waiting -= 1
        self.exitcode = 0


def test_stop_and_the_reader_never_wait_for_the_child_at_once(hy3c_log):
    """At the pipe's end the reader waits for the child while `stop` does too; two threads reaping one
    child race (the loser's waitpid finds none, and multiprocessing calls the child alive: a kill and
    a warning after a clean exit, seen after Ctrl-C). They take turns, and a clean exit warns nothing."""
    client = EngineClient.__new__(EngineClient)
    client._lock, client._usage, client._dead, client._stopping = threading.Lock(), {}, None, True
    client._process, client._reaping, client._emits = _JoinedProcess(), threading.Lock(), {}
    client._wire = _FakeWire([], lambda: None)
    client._outbox, client._conn = queue.SimpleQueue(), _ClosedConn()
    client._sender = threading.Thread(target=lambda: None)
    client._sender.start()
    client._reader = threading.Thread(target=client._read)
    client._reader.start()
    client.stop(timeout=5)
    assert client._process.most == 1
    assert "engine_process_killed" not in hy3c_log.text


def test_requests_round_trip_the_wire(tiny_ckpt):
    tokenizer = Hy3Tokenizer.from_dir(tiny_ckpt)
    here, there = Grammars(tokenizer, tokenizer.vocab_size), Grammars(tokenizer, tokenizer.vocab_size)
    grammar = here.compile(GrammarSpec("json", SCHEMA, "response_format"))
    params = SamplingParams(0.7, 0.9, 5, 0.05, 0.1, 0.2, 1.1, 42, ((3, 1.5), (9, -100.0)))
    request = GenerationRequest("r-1", [1, 2, 3], params, 9, ["\n"], [5], True, 2, 1, 123.5, grammar)
    back = request_from_wire(json.loads(json.dumps(request_to_wire(request))), there)
    assert back.params == params and back.grammar.source == grammar.source
    assert back.grammar.param == "response_format" and back.grammar is not grammar
    assert {**vars(back), "grammar": None} == {**vars(request), "grammar": None}
    free = GenerationRequest("r-2", [4], SamplingParams(), 1)
    assert request_from_wire(json.loads(json.dumps(request_to_wire(free))), there) == free
    long = GenerationRequest("r-3", [i * 7919 % (2**31 - 1) for i in range(40_000)], SamplingParams(), 1)
    wire = request_to_wire(long)
    assert isinstance(wire["prompt_ids"], str)  # packed, not a JSON list of 40,000 numbers
    assert request_from_wire(json.loads(json.dumps(wire)), there) == long
    assert (
        request_from_wire(
            json.loads(json.dumps(request_to_wire(GenerationRequest("r-4", [], params, 1)))), there
        ).prompt_ids
        == []
    )
    out = StepOutput(
        "r-1", "ab", [4, 5], [(4, -0.5, [(4, -0.5), (6, -1.0)])], True, "stop", 5, None, 3, 2, 1,
        [(2, -1.25, 3, [(7, -0.25)])],
    )  # fmt: skip
    assert output_from_wire(json.loads(json.dumps(vars(out)))) == out


def test_an_option_the_child_refuses_is_raised_here_as_one_line(tiny_artifact):
    with pytest.raises(ValueError, match=r"^--kv-memory: \d+ bytes hold fewer than 2 KV pages"):
        EngineClient(_options(tiny_artifact, kv_memory_gib=1e-9, engine_process=True))


def test_a_killed_engine_process_fails_its_requests_and_health(tiny_artifact):
    server = BackgroundServer(_options(tiny_artifact, engine_process=True))
    try:
        body = {"prompt": "a", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
        seen: list[str] = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                seen.append(line)
                if len(seen) == 3:
                    os.kill(server.engine._process.pid, signal.SIGKILL)
        events = [json.loads(line[6:]) for line in seen if line.startswith("data: {")]
        assert "error" in events[-1] and "exited with code -9" in events[-1]["error"]["message"]
        assert seen[-1] != "data: [DONE]" or "error" in events[-1]
        assert not server.engine.alive
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503
        again = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert again.status_code == 503, again.text
    finally:
        server.stop()


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its parent was killed)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:\tZ") for line in status)
    except FileNotFoundError:
        return True


def test_the_engine_process_exits_when_the_http_process_is_killed(tiny_artifact, tmp_path):
    serving = ServeProcess(tiny_artifact, tmp_path / "serve.log")
    try:
        (pid,) = re.findall(r"event=engine_process pid=(\d+)", serving.text())
        assert not _exited(int(pid))
        serving.kill()  # SIGKILL: no shutdown runs, the child only sees its pipe close
        deadline = time.monotonic() + 30
        while not _exited(int(pid)):
            assert time.monotonic() < deadline, "the engine process outlived the HTTP process"
            time.sleep(0.05)
    finally:
        serving.kill()
