"""The engine in a process of its own — `hy3c serve`'s default (`--no-engine-process` keeps it on a
thread of the HTTP process). The HTTP event loop and the engine loop then hold different GILs: in one
process the loop's Python (~70 µs a streamed chunk, ~2.2 ms a step at 32 streams) took the GIL each
time the engine let it go, and a constrained step's grammar masks waited for it (BENCHMARKS.md,
structured outputs: TPOT 3.5× the free-text one over HTTP against 1.4–1.5× in the engine alone).

The child (`_engine_main`) builds the engine as the in-process server does (`build_engine`) and serves
it over one duplex pipe; `EngineClient`, in the HTTP process, offers the part of `Engine` the HTTP layer
uses. Messages are JSON lists (a kind, then its fields; a prompt's ids as base64 of int32), never
pickles:

    HTTP → engine   ["submit", request] ["abort", id] ["abort_all", error] ["metrics", model, nonce] ["stop"]
    engine → HTTP   ["ready", facts] or ["failed", exception type, message], once, at the start;
                    ["outputs", [output, ...]] a step; ["metrics", nonce, text]; ["dead", why]

A request's grammar crosses as its source (llguidance's format, compiled and checked by the HTTP
process) and is compiled again, from a cache, in the engine's. The engine's request counts (running,
waiting, queued) sit in shared memory the child refreshes every `COUNTS_EVERY_S`, so a request's
capacity check costs no round trip. The usage of each HTTP request (its access-log line) is summed here
from its generations' last outputs.

If the engine process ends (a crash, the OOM killer), every request in flight ends with an error and
`alive` turns false (/health answers 503); if the HTTP process ends, the child sees its pipe close and
exits. Ctrl-C and a SIGTERM to the whole process group reach both: the child ignores them, the HTTP
process drains and then stops it. Messages to the child leave from a sender thread, so a full pipe
never blocks the HTTP event loop; if the engine loop ends while its process lives on, every request
not yet finished ends with the loop's error.
"""

from __future__ import annotations

import array
import base64
import itertools
import json
import logging
import multiprocessing
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hy3c.logs import log_event, setup_logging
from hy3c.serve.engine.core import GenerationRequest, StepOutput, hand_over
from hy3c.serve.engine.metrics import CURRENT_USAGE, RequestUsage
from hy3c.serve.engine.sampler import SamplingParams

if TYPE_CHECKING:
    from hy3c.serve.agent.structured import Grammars
    from hy3c.serve.engine.core import Engine
    from hy3c.serve.http.server import ServeOptions

log = logging.getLogger("hy3c.serve")

COUNTS_EVERY_S = 0.005  # the child refreshes the shared request counts this often
METRICS_TIMEOUT_S = 10.0  # a /metrics scrape waits this long for the engine's text
STOP_TIMEOUT_S = 15.0  # `stop` waits this long for the child to end, then kills it
RUNNING, WAITING, QUEUED, RECEIVED = range(4)  # the shared counts


# ---- the wire format ---------------------------------------------------------------------------------
def request_to_wire(request: GenerationRequest) -> dict[str, Any]:
    grammar = request.grammar
    return {
        "request_id": request.request_id,
        "prompt_ids": _ids_to_wire(request.prompt_ids),
        "params": {**vars(request.params), "logit_bias": [list(p) for p in request.params.logit_bias]},
        "max_tokens": request.max_tokens,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "num_logprobs": request.num_logprobs,
        "prompt_logprobs": request.prompt_logprobs,
        "arrival": request.arrival,  # time.monotonic: one clock for every process of the host
        "grammar": None if grammar is None else [grammar.source, grammar.param],
    }


def _ids_to_wire(ids: list[int]) -> str:
    """A prompt's token ids (checked against the vocabulary: they fit 32 bits) as base64 of little-endian
    int32. As a JSON list, 32K ids took ~4 ms to write and ~3 ms to read, each holding its process's
    GIL (the HTTP event loop's, the engine loop's); this way about a third of that."""
    packed = array.array("i", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _ids_from_wire(text: str) -> list[int]:
    packed = array.array("i")
    packed.frombytes(base64.b64decode(text))
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def request_from_wire(wire: dict[str, Any], grammars: Grammars) -> GenerationRequest:
    params = dict(wire["params"])
    params["logit_bias"] = tuple((int(t), float(b)) for t, b in params["logit_bias"])
    grammar = wire["grammar"]
    return GenerationRequest(
        wire["request_id"],
        _ids_from_wire(wire["prompt_ids"]),
        SamplingParams(**params),
        wire["max_tokens"],
        wire["stop"],
        wire["stop_token_ids"],
        wire["ignore_eos"],
        wire["num_logprobs"],
        wire["prompt_logprobs"],
        wire["arrival"],
        None if grammar is None else grammars.compile_source(*grammar),
    )


def output_from_wire(wire: dict[str, Any]) -> StepOutput:
    out = StepOutput(**wire)
    if out.logprobs:
        out.logprobs = [(t, lp, [(a, b) for a, b in top]) for t, lp, top in out.logprobs]
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = [(t, lp, r, [(a, b) for a, b in top]) for t, lp, r, top in out.prompt_logprobs]
    return out


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP layer reads of the engine once: `Engine`'s properties of the same names."""

    max_model_len: int
    vocab_size: int
    model_path: str | None
    forced_acceptance: bool


class _Wire:
    """One end of the pipe: JSON messages, sent under a lock (several threads send)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: list) -> None:
        data = json.dumps(message).encode()
        with self._lock:
            self.conn.send_bytes(data)

    def receive(self) -> list:
        return json.loads(self.conn.recv_bytes())


# ---- the engine's process ------------------------------------------------------------------------------
class _PipeEmit:
    """Every request's `emit` in the child: a step's outputs leave in one message (`batch_sink`)."""

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire
        self.batch_sink = self._send_step  # one object: `hand_over` groups emits by their sink

    def _send_step(self, items: list[tuple[Callable, StepOutput]]) -> None:
        self.wire.send(["outputs", [vars(out) for _, out in items]])

    def __call__(self, out: StepOutput) -> None:
        self.wire.send(["outputs", [vars(out)]])


def _engine_main(conn: Connection, counts, options: ServeOptions, log_level: int) -> None:
    """The child: build the engine, say it is ready, then serve the pipe's commands until told to stop
    or the pipe closes."""
    from hy3c.serve.agent.structured import GrammarError, Grammars
    from hy3c.serve.http.server import build_engine, stop_engine

    # Ctrl-C or a SIGTERM to the whole group (systemd, a terminal): the HTTP process drains, then stops
    # this one; a killed HTTP process closes the pipe, which ends it too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(log_level)
    wire = _Wire(conn)
    try:
        engine, tokenizer, _ = build_engine(options)
    except BaseException as exc:  # one line for the HTTP process to raise as its own
        wire.send(["failed", type(exc).__name__, str(exc)])
        return
    grammars = Grammars(tokenizer, engine.vocab_size)
    threading.Thread(target=grammars.warm, name="hy3c-grammar-table", daemon=True).start()
    emit = _PipeEmit(wire)
    stopping = threading.Event()
    try:
        engine.start()
        path = engine.model_path
        facts = EngineFacts(
            engine.max_model_len,
            engine.vocab_size,
            None if path is None else str(path),
            engine.forced_acceptance,
        )
        wire.send(["ready", vars(facts)])
        threading.Thread(
            target=_refresh_counts,
            args=(engine, counts, wire, stopping),
            name="hy3c-engine-counts",
            daemon=True,
        ).start()
        while True:
            try:
                kind, *fields = wire.receive()
            except (EOFError, OSError):
                break
            if kind == "submit":
                try:
                    request = request_from_wire(fields[0], grammars)
                except (GrammarError, ValueError, RuntimeError, TypeError, KeyError) as exc:
                    request_id = str(fields[0].get("request_id", ""))
                    emit(StepOutput(request_id, finished=True, finish_reason="error", error=str(exc)))
                else:
                    engine.submit(request, emit)
                    counts[QUEUED] = engine.num_submitted()  # counted there before it leaves the pipe's
                counts[RECEIVED] += 1
            elif kind == "abort":
                engine.abort(fields[0])
            elif kind == "abort_all":
                engine.abort_all(fields[0])
            elif kind == "metrics":
                wire.send(["metrics", fields[1], engine.metrics.render(fields[0])])
            elif kind == "stop":
                break
    finally:
        stopping.set()
        stop_engine(engine)  # (and a sharded artifact's workers)
        conn.close()


def _refresh_counts(engine: Engine, counts, wire: _Wire, stopping: threading.Event) -> None:
    """Keep the shared counts current; report once that the engine can no longer serve."""
    reported = False
    while not stopping.wait(COUNTS_EVERY_S):
        counts[RUNNING], counts[WAITING] = engine.num_requests()
        counts[QUEUED] = engine.num_submitted()
        if not reported and not engine.alive:
            reported = True
            try:
                wire.send(["dead", engine.dead or "the engine loop stopped"])
            except OSError:
                return


# ---- the HTTP process's side ---------------------------------------------------------------------------
class _RemoteMetrics:
    """`EngineMetrics.render` of the engine in the child (a round trip over the pipe)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._nonces = itertools.count()

    def render(self, model: str) -> str:
        client = self.client
        if not client.alive:
            return ""
        with self._lock:
            nonce = next(self._nonces)
            client.send(["metrics", model, nonce])
            deadline = time.monotonic() + METRICS_TIMEOUT_S
            while True:
                try:
                    answered, text = client.metrics_replies.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(
                        f"the engine process did not answer /metrics in {METRICS_TIMEOUT_S} s"
                    ) from None
                if answered == nonce:  # (an answer to an earlier scrape that timed out is dropped)
                    return text


class EngineClient:
    """The engine of `options` in a child process, behind the `Engine` surface the HTTP layer uses:
    `submit` / `abort` / `abort_all`, `alive` / `dead`, `num_requests` / `num_submitted`,
    `metrics.render`, `max_model_len` / `vocab_size` / `model_path` / `forced_acceptance`, `stop`.
    Starting it waits until the child's engine is built (CUDA graphs, warm-up) and raises what
    building it raised, as one line."""

    def __init__(self, options: ServeOptions) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA is never forked
        self._conn, child_end = context.Pipe(duplex=True)
        self._counts = context.Array("q", 4, lock=False)  # one writer per slot: the child, or here
        level = logging.getLogger("hy3c").getEffectiveLevel()
        self._process = context.Process(
            target=_engine_main, args=(child_end, self._counts, options, level), name="hy3c-engine"
        )
        self._wire = _Wire(self._conn)
        # messages to the child leave from a thread of their own: a full pipe (a long prompt while the
        # child compiles a grammar) never blocks the HTTP event loop
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._emits: dict[str, Callable[[StepOutput], None]] = {}
        self._usage: dict[str, RequestUsage] = {}
        self._lock = threading.Lock()
        self._reaping = threading.Lock()  # `_reap`
        self._sent = 0
        self._dead: str | None = None
        self._stopping = False
        self.metrics_replies: queue.SimpleQueue = queue.SimpleQueue()
        self.metrics = _RemoteMetrics(self)
        self._process.start()
        child_end.close()
        try:
            self.facts = self._wait_until_ready()
        except BaseException:
            self._process.kill()
            self._process.join()
            raise
        self._reader = threading.Thread(target=self._read, name="hy3c-engine-outputs", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_all, name="hy3c-engine-inputs", daemon=True)
        self._sender.start()
        log_event(log, "engine_process", pid=self._process.pid)

    def _wait_until_ready(self) -> EngineFacts:
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the engine process exited with code {self._process.exitcode} while starting"
                )
        try:
            kind, *fields = self._wire.receive()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(
                f"the engine process exited with code {self._process.exitcode} while starting"
            ) from None
        if kind == "failed":
            name, message = fields
            raised = {e.__name__: e for e in (ValueError, FileNotFoundError, FileExistsError, OSError)}
            raise raised.get(name, RuntimeError)(message)
        return EngineFacts(**fields[0])

    # ---- what the HTTP layer reads ----
    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def model_path(self) -> Path | None:
        return None if self.facts.model_path is None else Path(self.facts.model_path)

    @property
    def forced_acceptance(self) -> bool:
        return self.facts.forced_acceptance

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    @property
    def dead(self) -> str | None:
        if self._dead is None and not self._process.is_alive() and not self._stopping:
            return f"the engine process exited with code {self._process.exitcode}"
        return self._dead

    def num_requests(self) -> tuple[int, int]:
        return self._counts[RUNNING], self._counts[WAITING]

    def num_submitted(self) -> int:
        """Requests and aborts on their way to the engine loop: in the pipe, then in its inbox."""
        return self._counts[QUEUED] + self._sent - self._counts[RECEIVED]

    # ---- what it does ----
    def start(self) -> None:
        """Nothing: the child's engine loop runs once it is ready (`Engine.start`'s place in `serve`)."""

    def submit(self, request: GenerationRequest, emit: Callable[[StepOutput], None]) -> None:
        usage = CURRENT_USAGE.get()
        with self._lock:
            self._emits[request.request_id] = emit
            if usage is not None:
                self._usage[request.request_id] = usage
            self._sent += 1
        if self._dead is not None:
            self._end([request.request_id])
            return
        self._outbox.put((["submit", request_to_wire(request)], request.request_id))

    def abort(self, request_id: str) -> None:
        self.send(["abort", request_id])

    def abort_all(self, error: str) -> None:
        self.send(["abort_all", error])

    def send(self, message: list) -> None:
        """One message to the child, in order, from the sender thread (nothing once it has gone)."""
        self._outbox.put((message, None))

    def _send_all(self) -> None:
        """The sender thread: the outbox's messages to the child; a submit that cannot leave ends."""
        while True:
            message, request_id = self._outbox.get()
            if message is None:
                return
            try:
                self._wire.send(message)
            except OSError:
                if request_id is not None:
                    self._end([request_id])

    def _reap(self, timeout: float) -> None:
        """Wait up to `timeout` for the child to end, one thread at a time: the reader (at the pipe's end)
        and `stop` both wait for it, and two threads reaping one child race — the loser's `waitpid`
        finds no child and multiprocessing takes it for one still running."""
        with self._reaping:
            self._process.join(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the child's engine (requests still in it are dropped) and wait for the process."""
        self._stopping = True
        self.send(["stop"])
        self._outbox.put((None, None))
        self._sender.join(timeout)
        self._reap(timeout)
        if self._process.is_alive():
            log_event(log, "engine_process_killed", logging.WARNING, after_s=timeout)
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._reader.join(5)

    # ---- the reader thread ----
    def _read(self) -> None:
        while True:
            try:
                kind, *fields = self._wire.receive()
            except (EOFError, OSError):
                break
            if kind == "outputs":
                self._deliver([output_from_wire(w) for w in fields[0]])
            elif kind == "metrics":
                self.metrics_replies.put((fields[0], fields[1]))
            elif kind == "dead":  # the engine loop ended: what it had not yet taken in never will be
                self._dead = fields[0]
                log_event(log, "engine_dead", logging.ERROR, reason=fields[0])
                with self._lock:
                    unfinished = list(self._emits)
                self._end(unfinished)
        self._reap(5)
        if not self._stopping:
            self._dead = self._dead or f"the engine process exited with code {self._process.exitcode}"
            log_event(log, "engine_process_exited", logging.ERROR, code=self._process.exitcode)
        with self._lock:
            unfinished = list(self._emits)
        self._end(unfinished)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        emissions = []
        with self._lock:
            for out in outputs:
                emit = self._emits.pop(out.request_id) if out.finished else self._emits.get(out.request_id)
                if emit is None:
                    continue
                if out.finished:
                    usage = self._usage.pop(out.request_id, None)
                    if usage is not None:  # counted before the output reaches the handler
                        usage.prompt_tokens += out.prompt_tokens
                        usage.completion_tokens += out.completion_tokens
                        usage.cached_tokens += out.cached_tokens
                emissions.append((emit, out))
        try:
            hand_over(emissions)
        except Exception as exc:  # e.g. a consumer's event loop closed: the others got theirs
            log_event(log, "delivery_failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")

    def _end(self, request_ids: list[str]) -> None:
        """End these requests with an error: the engine process has gone (or is stopping)."""
        if self._stopping:
            error, reason = "the engine process stopped", "abort"
        else:
            error, reason = self.dead or "the engine process is not running", "error"
        self._deliver([StepOutput(r, finished=True, finish_reason=reason, error=error) for r in request_ids])
