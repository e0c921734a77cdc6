"""The serving engine: one loop owns the model and the KV cache. `hy3c serve` runs it on an engine
thread that the API talks to through queues; `hy3c generate` drives the same loop on its own thread
(`run_until_done`, through `hy3c.serve.engine.offline`).

    engine = Engine(runner, tokenizer, EngineConfig(...)); engine.start()
    engine.submit(GenerationRequest(...), emit)      # emit(StepOutput) is called from the engine thread
    engine.abort(request_id)

An `emit` with a `batch_sink` attribute gets a step's outputs through that sink, together with every
other request's that shares it: `batch_sink([(emit, output), ...])`, once per step (the HTTP server uses
it to wake its event loop once per step rather than once per request).

Each loop iteration takes new requests and aborts from the inbox, asks the scheduler for a step, runs it
(`runner.step`: a captured CUDA graph for decode batches on GPU), samples the rows that need a next
token, detokenizes incrementally, checks stop conditions and emits one `StepOutput` per request. What a
step did to the sequences it reports to the scheduler, which owns their state and their pages in the
prefix cache. A failing step fails the requests in it (their pages are freed) and the engine keeps
serving — unless the runner reports a `failure` (a runner over several ranks that lost one): then
every request fails with it and the engine is dead (`alive` false, `dead` says why). When it has
nothing to do, the loop calls the runner's `idle` if it has one (the ranks' heartbeat).

Attention data parallelism (a runner with `data_parallel` = D > 1: the `ShardedRunner` of a
`parallel.dp_attention` artifact): a page pool per DP rank and a `DataParallelScheduler` that places
each request on one rank; a step builds one batch per rank from its requests' work and runs them all
at once (`runner.step_data_parallel`), which returns their logits rows in rank order — the order of
the scheduler's work — so sampling, detokenizing and emitting are the same as on one rank.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.config import Hy3Config
from hy3c.logs import log_event
from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
from hy3c.serve.agent.structured import (
    STRUCTURED_ERROR,
    Constraint,
    GrammarError,
    Grammars,
    GrammarSpec,
    allow_other_rows,
    fill_masks,
    new_constraint,
)
from hy3c.serve.engine.detokenizer import IncrementalDetokenizer
from hy3c.serve.engine.kv_pages import OutOfPages, PagePool
from hy3c.serve.engine.kv_tiers import KVTiers, TierConfig
from hy3c.serve.engine.metrics import EngineMetrics
from hy3c.serve.engine.sampler import (
    History,
    HostStaging,
    MaskStaging,
    PendingSample,
    SampleResult,
    SamplingParams,
    TrackedPenalties,
    fused_on,
    has_penalties,
    sample_async,
    sampling_block,
    staged_draws,
    upload,
    upload_block,
    wait_event,
)
from hy3c.serve.engine.scheduler import DataParallelScheduler, Scheduler, Sequence, Work
from hy3c.serve.engine.spec_decode import SpeculativeConfig, Verified, draw_seeds
from hy3c.serve.engine.speculation import Drafted, Drafting, DraftProbs, Speculator
from hy3c.serve.engine.step_inputs import StepInputs

log = logging.getLogger("hy3c.engine")


class StepModel(Protocol):
    """What the engine steps: a compiled artifact's `Runner` (`hy3c serve`, `hy3c generate --artifact`)
    or the eager `Hy3ForCausalLM` (`hy3c generate --model`)."""

    config: Hy3Config

    @property
    def device(self) -> torch.device: ...

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor: ...

    def step(self, batch: StepBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class EngineConfig:
    num_pages: int
    page_size: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    async_scheduling: bool = True  # plan and launch step N+1 before reading step N's tokens
    speculative: SpeculativeConfig | None = None  # MTP speculative decoding (its steps are read at once)
    long_prefill_token_threshold: int = 0  # a prefill chunk's tokens per step at most (0: the budget)
    max_num_partial_prefills: int = 0  # requests prefilling in one step at most (0: any number)
    kv_tiers: TierConfig | None = None  # L2 pinned host memory and an L3 store below the page pool
    # a step's grammar masks after the first filled on the engine's thread at most, the rest on
    # llguidance's pool (None: only their time decides; `hy3c.serve.agent.structured.fill_masks`)
    masks_in_turn_at_most: int | None = None


WARM_UP_TOKENS = (1, 15, 16, 127, 128, 1023, 1024)  # prefill lengths `Engine.warm_up` runs
SCORE_ROWS = 128  # prompt rows per log_softmax when scoring a prompt (bounds its temporary memory)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only
    # None: none; k: each prompt token's logprob and rank under the raw logits, and the top k there
    prompt_logprobs: int | None = None
    arrival: float = field(default_factory=time.monotonic)
    # a compiled grammar (`hy3c.serve.agent.structured.Grammars.compile`) the output must follow
    grammar: object | None = None


@dataclass
class StepOutput:
    """What a request produced in one engine step (text and ids are the new part)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # in a request's first output, if it asked: (token, logprob, rank, top k) of prompt tokens 1, 2, …
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None


@dataclass
class _Live:
    request: GenerationRequest
    seq: Sequence
    emit: Callable[[StepOutput], None]
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    scored: list[tuple[int, float, int, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_sent: bool = False  # the prompt logprobs went out (with the first output)
    admitted_at: float | None = None  # first scheduled
    first_token_at: float | None = None
    last_token_at: float | None = None
    constraint: Constraint | None = None  # the request's grammar state (structured outputs)


@dataclass
class _InFlight:
    """A launched step the engine has not collected: its work, the requests of its sampled rows (in row
    order) and their draws on the device."""

    work: list[Work]
    lives: list[_Live]
    pending: PendingSample
    row_of: dict[Sequence, int]  # a sampled sequence → its row in pending.tokens
    scored_only: list[_Live]
    preempted: int
    started: float
    host_seconds: float  # planning and building it, before the runner was called
    collected: bool = False


@dataclass
class _SpecStep:
    """A launched speculative step the engine has not read: its work, the requests it verified (in
    row order) and their work items, the verification and the next drafts on the device."""

    work: list[Work]
    lives: list[_Live]
    sampled: list[Work]
    verified: Verified
    drafted: Drafted
    asked: bool  # some request wants logprobs
    scored_only: list[_Live]
    started: float
    host_seconds: float
    preempted: int
    fed: int  # tokens fed (before the rejected drafts were rolled back)
    # [R, 1 + width + passes]: accepted counts, emitted tokens, next drafts — on the host (pinned, copied
    # without blocking right behind the step; `ready` is recorded after the copy) or, off CUDA, as is
    readout: Tensor
    ready: torch.cuda.Event | None
    packed: Tensor  # the same outputs on the device: a chained step's inputs


def hand_over(emissions: list[tuple[Callable[[StepOutput], None], StepOutput]]) -> None:
    """Call each output's `emit`; emits that share a `batch_sink` get theirs in one call of it. A
    consumer that raises does not keep the others from theirs; the first error is raised after every
    delivery was tried."""
    batches: dict[int, tuple[Callable, list]] = {}
    calls: list[tuple[Callable, object]] = []
    for emit, out in emissions:
        sink = getattr(emit, "batch_sink", None)
        if sink is None:
            calls.append((emit, out))
        else:
            batches.setdefault(id(sink), (sink, []))[1].append((emit, out))
    calls.extend(batches.values())
    error: Exception | None = None
    for consumer, payload in calls:
        try:
            consumer(payload)
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


def _draw_only(live: _Live) -> bool:
    """Whether the request's row needs nothing but the draw (no penalties or logit bias, no top
    logprobs, no grammar): a decode graph that samples can draw it."""
    request = live.request
    return not has_penalties(request.params) and not request.num_logprobs and live.constraint is None


def _feed_pairs(work: list[Work], previous: _InFlight | None) -> list[tuple[int, int]]:
    """(token index, draw row of `previous`) of each item fed from the device: its last token, which
    its chunk holds as a placeholder, is `previous`'s draw for the request."""
    pairs = []
    row = 0
    for w in work:
        row += w.count
        if w.from_device:
            assert previous is not None, "a token in flight without a step in flight"
            pairs.append((row - 1, previous.row_of[w.seq]))
    return pairs


def _feed_from_device(batch: StepBatch, pairs: list[tuple[int, int]], previous: _InFlight | None) -> None:
    """Put the in-flight tokens of `previous` into the batch's token ids, on the device (`pairs`:
    `_feed_pairs`; uploaded here unless the batch carries them as its `feed_index`)."""
    if not pairs:
        return
    assert previous is not None
    index = batch.feed_index
    if index is None:
        index = upload(torch.tensor(pairs, dtype=torch.long).T.contiguous(), batch.input_ids.device)
    batch.input_ids.index_copy_(0, index[0], previous.pending.tokens.index_select(0, index[1]))


class Engine:
    def __init__(
        self,
        runner: StepModel,
        tokenizer: Hy3Tokenizer,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or EngineMetrics(config.max_model_len)
        # attention data parallelism (a ShardedRunner over a dp_attention artifact): a page pool and a
        # scheduler per DP rank, each rank's step its own batch
        self.data_parallel: int = getattr(runner, "data_parallel", 1)
        self.pools = [PagePool(config.num_pages, config.page_size) for _ in range(self.data_parallel)]
        self.pool = self.pools[0]
        self.scheduler: Scheduler | DataParallelScheduler
        if self.data_parallel > 1:
            self.scheduler = DataParallelScheduler(
                self.pools, config.max_num_seqs, config.max_num_batched_tokens
            )
            usage = self.scheduler.usage
        else:
            speculative = config.speculative is not None
            self.scheduler = Scheduler(
                self.pool,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                speculative,
                config.long_prefill_token_threshold,
                config.max_num_partial_prefills,
            )
            usage = self.pool.usage
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            if self.data_parallel > 1:
                raise ValueError("--speculative-config: not supported with attention data parallelism yet")
            self.speculator = Speculator(config.speculative, config.page_size)
            # a preempted request's drafts are spent: their distributions' slot goes
            self.scheduler.on_preempt = self.speculator.forget
        self.metrics.watch(lambda: len(self.scheduler.running), lambda: len(self.scheduler.waiting), usage)
        self.kv_cache = runner.allocate_kv_cache(config.num_pages, config.page_size)
        self.tiers: KVTiers | None = None
        if config.kv_tiers is not None and config.kv_tiers.host_gib > 0:
            if self.data_parallel > 1 or getattr(runner, "world_size", 1) > 1:
                # each rank holds its own KV shard; the tiers copy this process's cache only
                raise ValueError("--kv-host-gib: not supported with several ranks (TP / EP / DP) yet")
            self.tiers = KVTiers(self.kv_cache, config.kv_tiers)
            self.pool.on_publish, self.pool.on_allocate = self.tiers.published, self.tiers.reusing
            self.scheduler.tiers = self.tiers
            self.metrics.watch_tiers(self.tiers)
        self.eos_ids = set(runner.config.eos_token_ids)
        self._live: dict[str, _Live] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hy3c-engine", daemon=True)
        self._dead: str | None = None
        self._idle = getattr(runner, "idle", None)  # a runner over several ranks: its heartbeat
        self._in_flight: _InFlight | _SpecStep | None = None  # the step launched and not collected yet
        # the page table kept on the device, a row per running request (host work per step does not
        # grow with the context); attention-DP builds each rank's batch with build_step_batch
        rows, pages = config.max_num_seqs, -(-config.max_model_len // config.page_size)
        self._inputs = StepInputs(config.page_size, runner.device, rows, pages)
        self._staging = HostStaging()  # pinned buffers the draws reach the host through
        self._mask_staging = MaskStaging()  # pinned buffers of the grammar masks (structured outputs)
        self._held: list[tuple[Callable[[StepOutput], None], StepOutput]] | None = None  # _holding_outputs
        self._penalties: TrackedPenalties | None = None  # penalised requests' counts, on the device
        self._last_collected = 0.0
        self._steps_finished = 0  # steps collected (the loop tells a turn that ran none: `metrics.held`)

    def warm_up(self) -> None:
        """Run throw-away requests through the engine before it serves (call before `start`).

        The first use of each Triton kernel specialization compiles it — seconds that would otherwise
        land on the first users' TTFT. Kernels specialize on the step's token count (a multiple of 16
        or not; integer arguments that follow the batch — request and token counts — are marked not
        to specialize) and pick launch configs by token-count bucket (FusedMoE: 16 / 128 / 1024 /
        more; moe_align: 64 / 512 / 1024 pairs, i.e. 8 / 64 / 128 tokens at top-8), so single
        prefills of WARM_UP_TOKENS (and of the token budget, and one less) run first; then one step samples the greedy, filtered, unfiltered and fallback paths of the sampler,
        then (when llguidance is installed, and not in the forced-acceptance benchmark mode) a greedy
        and a sampled request under a grammar, whose draws read a mask: the masked sampler's kernel
        variants (built on live traffic, they stalled the first structured-output requests for
        seconds). Decode batch sizes are covered by the CUDA-graph capture. Leaves no trace: the
        metrics are kept aside and the prefix cache is emptied.
        """
        metrics, self.metrics = self.metrics, EngineMetrics()
        vocab = self.runner.config.vocab_size
        budget = self.config.max_num_batched_tokens
        longest = max(1, self.config.max_model_len - 3)
        sizes = sorted({min(n, budget, longest) for n in (*WARM_UP_TOKENS, budget - 1, budget) if n > 0})
        kinds = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=1.0, top_p=0.999),
        ]
        requests: list[str] = []

        def admit(name: str, length: int, params: SamplingParams, grammar: object | None = None) -> None:
            salt = 7919 * len(requests)  # distinct prompts: no prefix-cache hits
            requests.append(name)
            prompt = [(salt + 31 * j) % vocab for j in range(length)]
            request = GenerationRequest(name, prompt, params, max_tokens=2, ignore_eos=True, grammar=grammar)
            self._admit(request, lambda _: None)

        def drain() -> None:
            while self._iterate():
                pass

        hooks = self.pool.on_publish, self.pool.on_allocate
        self.pool.on_publish = None  # warm-up pages are not worth keeping in L2 / L3
        try:
            for size in sizes:
                admit(f"warm-up-prefill-{size}", size, kinds[0])
                drain()
            for i, params in enumerate(kinds):
                admit(f"warm-up-sampler-{i}", min(64, longest), params)
            drain()
            grammar = self._warm_up_grammar()
            if grammar is not None:
                for i, params in enumerate(kinds[:2]):
                    admit(f"warm-up-grammar-{i}", min(64, longest), params, grammar)
                drain()
        finally:
            self.scheduler.reset_prefix_cache()
            self.pool.on_publish, self.pool.on_allocate = hooks
            self.metrics = metrics

    def _warm_up_grammar(self) -> object | None:
        """A grammar that allows any text, for the warm-up's constrained requests; None without
        llguidance or in the forced-acceptance benchmark mode (which refuses grammars)."""
        if self.forced_acceptance:
            return None
        grammars = Grammars(self.tokenizer, self.runner.config.vocab_size)
        try:
            return grammars.compile(GrammarSpec("regex", "[\\s\\S]*", "warm-up"))
        except (GrammarError, ImportError):  # llguidance is not installed: no structured outputs
            return None

    # ---- API side (any thread) ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self.tiers is not None:
            self.tiers.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        """The logits' width (token ids the model can draw)."""
        return self.runner.config.vocab_size

    @property
    def model_path(self) -> Path | None:
        """The artifact the runner loaded (None: a runner built in memory)."""
        return getattr(self.runner, "path", None)

    @property
    def forced_acceptance(self) -> bool:
        """Speculative decoding in its benchmark mode that accepts drafts by a coin (no grammars)."""
        return self.speculator is not None and self.speculator.forced is not None

    @property
    def dead(self) -> str | None:
        """Why the engine cannot serve any more — its loop broke, or its runner lost a rank (a
        runner's `failure`: `hy3c.runtime.distributed.ShardedRunner`) —, None while it can."""
        return self._dead or getattr(self.runner, "failure", None)

    def submit(self, request: GenerationRequest, emit: Callable[[StepOutput], None]) -> None:
        self.metrics.submitted(request.request_id)
        self._inbox.put(("add", request, emit))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def abort_all(self, error: str) -> None:
        """Abort every request in the engine (shutdown): each ends with an output of finish_reason
        "abort" carrying `error` (a client's abort carries none), which a stream answers as a 503."""
        self._inbox.put(("abort_all", error, None))
        self._wake.set()

    def num_requests(self) -> tuple[int, int]:
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def num_submitted(self) -> int:
        """Requests and aborts handed to the engine thread and not yet taken in."""
        return self._inbox.qsize()

    def run_until_done(self) -> None:
        """Drive the engine loop on the calling thread until every submitted request has ended (offline
        generation, `hy3c.serve.engine.offline`): the same iterations the engine thread runs, without it."""
        if self._thread.is_alive():
            raise RuntimeError("the engine thread runs this engine's loop; submit to it instead")
        while self._iterate():
            pass

    # ---- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                turn_start, steps_before = time.monotonic(), self._steps_finished
                running_before = self._in_flight is not None
                if not self._iterate():  # no request in the engine: wait for one, counted as it goes
                    self.metrics.idle_from(turn_start)
                    if self._idle is not None:
                        self._idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.metrics.idle_to()
                    continue
                if self.tiers is not None and self.tiers.waiting_on_store and not self.scheduler.running:
                    self._wake.wait(0.001)  # only an admission waiting for the store: nap, do not spin
                if not running_before and self._in_flight is None and self._steps_finished == steps_before:
                    self.metrics.held(time.monotonic() - turn_start)  # requests, none of them steppable
        except BaseException as exc:  # the loop itself broke: report unhealthy, fail everything
            self._dead = f"{type(exc).__name__}: {exc}"
            log_event(log, "engine_dead", level=logging.ERROR, error=self._dead)
            for request_id in list(self._live):
                self._fail(request_id, self._dead)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, emit = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self._admit(payload, emit)
                except Exception as exc:  # a request the engine cannot take fails alone
                    self._live.pop(payload.request_id, None)
                    self.scheduler.remove(payload.request_id)
                    self.metrics.finished(
                        payload.request_id, "error", now=time.monotonic(), arrival=payload.arrival
                    )
                    emit(
                        StepOutput(
                            payload.request_id,
                            finished=True,
                            finish_reason="error",
                            error=f"request rejected: {type(exc).__name__}: {exc}",
                            prompt_tokens=len(payload.prompt_ids),
                        )
                    )
            elif kind == "abort" and payload in self._live:
                self._abort(payload)
            elif kind == "abort_all":
                for request_id in list(self._live):
                    self._abort(request_id, payload)

    def _abort(self, request_id: str, error: str | None = None) -> None:
        live = self._live.pop(request_id)
        self.scheduler.remove(request_id)
        self._forget(live.seq)
        self.metrics.aborted.inc()
        self._record_end(live, "abort")
        self._deliver([(live.emit, self._final(live, "abort", error))])

    def _admit(self, request: GenerationRequest, emit: Callable[[StepOutput], None]) -> None:
        prompt = list(request.prompt_ids)
        scoring = request.prompt_logprobs is not None and len(prompt) > 1
        limit = min(len(prompt) + request.max_tokens, self.config.max_model_len)
        seq = Sequence(request.request_id, prompt, len(prompt), score_prompt=scoring, limit=limit)
        generator = None
        if not request.params.greedy:
            generator = torch.Generator()  # on the host: drawing a step's seed needs no GPU sync
            generator.seed() if request.params.seed is None else generator.manual_seed(request.params.seed)
        live = _Live(request, seq, emit, IncrementalDetokenizer(self.tokenizer, request.stop), generator)
        if request.grammar is not None:
            if self.speculator is not None and self.speculator.forced is not None:
                raise ValueError("structured outputs: not with forced acceptance (its tokens are not drawn)")
            live.constraint = new_constraint(request.grammar)
        self._live[request.request_id] = live
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))

    def _iterate(self) -> bool:
        """One turn of the engine loop: take in what was submitted and aborted, plan and launch a step,
        then collect the step launched in the previous turn (overlapped scheduling: the GPU runs the
        new step while the host reads, detokenizes and emits the previous one). Without
        `async_scheduling` a step is collected at once. Returns whether there was work."""
        self._drain_inbox()
        if self.speculator is not None:
            return self._iterate_speculative()
        previous, self._in_flight = self._in_flight, None
        # a step whose tokens the next draws need (grammar masks, penalties) is read once the next
        # model step is running, before its draws are launched
        history = previous is not None and self._needs_history(previous)
        launched = self._launch(previous, read_previous=history) if self.scheduler.has_work else None
        if previous is not None and not previous.collected:
            self._collect(previous)
        if launched is not None and not self.config.async_scheduling:
            self._collect(launched)
            launched = None
        self._in_flight = launched
        return launched is not None or previous is not None or self.scheduler.has_work

    def _iterate_speculative(self) -> bool:
        """`_iterate` under MTP speculative decoding: when the step in flight allows it (`_can_chain`)
        the next one is planned from it and launched before it is read — MTP with overlap — else it
        is read first and the next step planned as usual."""
        previous, self._in_flight = self._in_flight, None
        launched = None
        if isinstance(previous, _SpecStep) and self._can_chain(previous):
            try:
                launched = self._spec_chain(previous)
            except Exception as exc:  # the step it followed is read as usual, then its requests fail
                self._spec_collect(previous)
                self._step_failed([w for w in previous.work if self._live.get(w.seq.request_id)], exc)
                return True
        if previous is not None and launched is None:
            self._spec_collect(previous)
            previous = None
        if launched is None and self.scheduler.has_work:
            launched = self._launch(None)
        if previous is not None:
            self._spec_collect(previous, launched)
        if launched is not None and not self.config.async_scheduling:
            self._spec_collect(launched)
            launched = None
        self._in_flight = launched
        return launched is not None or previous is not None or self.scheduler.has_work

    @staticmethod
    def _needs_history(step: _InFlight) -> bool:
        """Whether a request of the step samples with penalties over its output, or under a grammar:
        the next step's draws need this one's tokens on the host (read once that step's model runs)."""
        return any(
            live.constraint is not None  # its next mask needs this step's token
            or live.request.params.repetition_penalty != 1.0
            or live.request.params.presence_penalty
            or live.request.params.frequency_penalty
            for live in step.lives
        )

    def _launch(
        self, previous: _InFlight | None, read_previous: bool = False
    ) -> _InFlight | _SpecStep | None:
        """Plan a step and launch it on the device: the model step, then the draws (which stay on the
        device). Tokens of `previous` that are still in flight are fed from the device. With
        `read_previous` (its tokens decide this step's grammar masks or penalties) `previous` is
        collected after the model step is launched and before the draws: the host reads it, advances
        the grammars and builds the masks while the device runs the model."""
        started = time.monotonic()
        preempted = self.scheduler.num_preemptions
        try:
            work = self.scheduler.schedule()
        except OutOfPages as exc:
            self._fail(exc.request_id or self.scheduler.waiting[0].request_id, str(exc))
            return None
        if not work:
            return None
        preempted = self.scheduler.num_preemptions - preempted
        for w in work:
            if w.start < w.seq.num_prompt:  # a prefill chunk: maybe the request's first scheduling
                self._note_admission(w.seq, started)
        try:
            if self.speculator is not None and self._captures_speculation:
                self._reserve_drafting(work)
            chunks = [
                SeqChunk(
                    w.seq.tokens[w.start : w.end] + ([0] if w.from_device else []) + w.seq.drafts[: w.drafts],
                    w.start,
                    w.seq.pages,
                    "all" if w.all_logits or w.drafts else "last" if w.wants_logits else "none",
                )
                for w in work
            ]
            written = self._launch_written(work, chunks, previous, started, preempted)
            if written is not None:
                return written
            device = self.runner.device
            if self.data_parallel > 1:  # each DP rank's own batch; the logits rows come back in rank order
                ranks = [
                    [i for i, w in enumerate(work) if w.seq.dp_rank == r] for r in range(self.data_parallel)
                ]
                batches = [
                    build_step_batch([chunks[i] for i in items], self.config.page_size, device)
                    for items in ranks
                ]
                for batch, items in zip(batches, ranks):
                    _feed_from_device(batch, _feed_pairs([work[i] for i in items], previous), previous)
                num_rows = sum(len(b.logits_owner) for b in batches)
            else:
                pairs = _feed_pairs(work, previous)
                batch = self._inputs.build(chunks, [w.seq for w in work], pairs)
                _feed_from_device(batch, pairs, previous)
                num_rows = len(batch.logits_owner)
            rows, lives, scoring, scored_only = self._logit_rows(work)
            if self.speculator is not None:  # verified and drafted on the device; read in _spec_collect
                return self._spec_launch(work, batch, rows, lives, scoring, scored_only, started, preempted)
            # the logits rows to sample, when others (prompt rows to score) are among them
            pick = None
            if len(rows) < num_rows:
                pick = upload(torch.tensor(rows, dtype=torch.long), device)
            params = [lv.request.params for lv in lives]
            generators = [lv.generator for lv in lives]
            want = max((lv.request.num_logprobs or 0 for lv in lives), default=0)
            # the sampler's parameters (this step's seeds drawn) go up before the step: into the decode
            # graph that draws the tokens itself, else for the sampler's launches right behind the step
            width = getattr(self.runner, "sampling_width", None) if self.data_parallel == 1 else None
            in_graph = bool(width) and pick is None and not scoring and 0 < len(params) <= width
            in_graph = in_graph and all(_draw_only(lv) for lv in lives)
            fused = bool(params) and fused_on(device)
            block = None
            if in_graph or fused:
                block = sampling_block(params, generators, width if in_graph else 0)
            prepared = time.monotonic()
            drawn = self.runner.step_sampled(batch, self.kv_cache, block) if in_graph else None
            if drawn is not None:
                logits, _, tokens, pair = drawn
                self.scheduler.advance(work, [lv.seq for lv in lives])
                pending = staged_draws(tokens, pair, self._staging)
            else:
                inputs = upload_block(block, len(params), device) if fused and block is not None else None
                if self.data_parallel > 1:
                    logits, _ = self.runner.step_data_parallel(batches, self.kv_cache)
                else:
                    logits, _ = self.runner.step(batch, self.kv_cache)
                self.scheduler.advance(work, [lv.seq for lv in lives])
                self._score_prompts(logits, scoring)
                sampled = logits if pick is None else logits[pick]
                reading = read_previous and previous is not None
                with self._holding_outputs(previous.work if reading else None):
                    if reading:  # the device runs the model meanwhile
                        self._collect(previous)
                    pending = sample_async(
                        sampled,
                        params,
                        [self._history(lv) for lv in lives],
                        generators,
                        want,
                        prepared=inputs,
                        staging=self._staging,
                        allowed=self._grammar_masks(lives, sampled.shape[-1], device),
                    )
        except Exception as exc:  # fail the requests of this step, keep serving the others
            self._step_failed(work, exc)
            return None
        rows_of = {lv.seq: row for row, lv in enumerate(lives)}
        return _InFlight(work, lives, pending, rows_of, scored_only, preempted, started, prepared - started)

    def _launch_written(
        self,
        work: list[Work],
        chunks: list[SeqChunk],
        previous: _InFlight | None,
        started: float,
        preempted: int,
    ) -> _InFlight | None:
        """Launch a plain decode step whose every request only draws its next token (no penalties,
        bias, logprobs, grammar or prompt rows) with the fewest device operations: written into the
        sampled decode graphs' inputs with one copy, its page-table rows gathered by one kernel, and
        the graph replayed, which feeds the tokens still in flight and draws the next ones itself
        (`hy3c.runtime.cuda_graphs.DecodeInputs`). None when the step is not such a step or no
        graph takes it (the caller builds it as a batch)."""
        graphs = getattr(self.runner, "decode_graphs", None)
        if graphs is None or graphs.inputs is None or graphs.kv_cache is not self.kv_cache:
            return None
        if self.speculator is not None or self.data_parallel > 1:
            return None
        if len(work) > graphs.sizes[-1] or self._inputs.table.shape[1] < graphs.max_pages:
            return None
        if any(w.count != 1 or not w.wants_logits or w.all_logits or w.drafts for w in work):
            return None
        _, lives, scoring, scored_only = self._logit_rows(work)
        if scoring or scored_only or len(lives) != len(work) or not all(_draw_only(lv) for lv in lives):
            return None
        inputs = graphs.inputs
        pairs = _feed_pairs(work, previous)
        if pairs:  # the tokens in flight are fed from `inputs.drawn`: those drawn elsewhere are moved in
            assert previous is not None
            tokens = previous.pending.tokens
            if tokens.data_ptr() != inputs.drawn.data_ptr():
                if tokens.shape[0] > inputs.drawn.shape[0]:
                    return None
                inputs.drawn[: tokens.shape[0]].copy_(tokens)
        params = [lv.request.params for lv in lives]
        block = sampling_block(params, [lv.generator for lv in lives], graphs.sampling_width)
        prepared = time.monotonic()
        self._inputs.write_decode(chunks, [w.seq for w in work], pairs, inputs, block)
        _, _, tokens, pair = self.runner.step_written(len(work), self._inputs.table)
        self.scheduler.advance(work, [lv.seq for lv in lives])
        pending = staged_draws(tokens, pair, self._staging)
        rows_of = {lv.seq: row for row, lv in enumerate(lives)}
        return _InFlight(work, lives, pending, rows_of, [], preempted, started, prepared - started)

    def _grammar_masks(self, lives: list[_Live], vocab: int, device: torch.device) -> Tensor | None:
        """The packed masks of a step's sampled rows (`hy3c.ops.sample`; every token allowed in a row
        without a grammar, or whose request ended since the step was planned), on `device`; None when
        no row has a grammar."""
        rows = [
            (row, lv.constraint)
            for row, lv in enumerate(lives)
            if lv.constraint is not None and self._live.get(lv.request.request_id) is lv
        ]
        if not rows:
            return None
        return self._masks_of(
            [constraint for _, constraint in rows], [row for row, _ in rows], len(lives), vocab, device
        )

    def _masks_of(
        self, constraints: list[Constraint], rows: list[int], total: int, vocab: int, device: torch.device
    ) -> Tensor:
        """`total` rows of packed masks, rows[i] filled by constraints[i] and the others allowing every
        token; on CUDA built in a pinned staging buffer and copied up without blocking."""
        width = max(vocab, self.tokenizer.vocab_size)
        cuda = device.type == "cuda"
        # off CUDA a fresh buffer allowing nothing, so a row left unwritten cannot pass unseen
        masks = (
            self._mask_staging.take(total, width)
            if cuda
            else torch.zeros((total, -(-width // 32)), dtype=torch.int32)
        )
        fill_masks(constraints, masks, rows, self.config.masks_in_turn_at_most)
        allow_other_rows(masks, rows)
        return self._mask_staging.upload(masks, device) if cuda else masks

    def _verify_masks(
        self, work: list[Work], lives: list[_Live], vocab: int, device: torch.device
    ) -> Tensor | None:
        """The packed masks of a speculative step's target rows (request i's w.drafts + 1 rows, each
        masked by its grammar after the drafts before it: `Constraint.ahead`; every token allowed in
        the rows of a request without a grammar), built while the device runs the model; None when
        no request has a grammar. The drafts are on the host: a constrained step is never chained."""
        if not any(lv.constraint is not None for lv in lives):
            return None
        states, rows, start = [], [], 0
        for w, lv in zip(work, lives):
            if lv.constraint is not None and self._live.get(lv.request.request_id) is lv:
                ahead = lv.constraint.ahead(w.seq.drafts[: w.drafts])
                states += ahead
                rows += range(start, start + len(ahead))
            start += w.drafts + 1
        return self._masks_of(states, rows, start, vocab, device)

    def _collect(self, step: _InFlight) -> None:
        """Read a launched step's tokens (waiting for the device if it is still running), then
        detokenize, check stops and emit; publish the pages it completed. Rows of requests that ended
        since it was launched (a stop token read meanwhile, an abort) are dropped."""
        step.collected = True
        try:
            result = step.pending.result()
            known = time.monotonic()
            self.scheduler.settle(step.work)
            self._emit_sampled(step.lives, result, known)
            self._finish_scored(
                [lv for lv in step.scored_only if self._live.get(lv.request.request_id) is lv]
            )
        except Exception as exc:
            self._step_failed(step.work, exc)
            return
        self._finish_step(
            step.work, step.started, step.host_seconds, known, sum(w.count for w in step.work), step.preempted
        )

    def _spec_launch(
        self,
        work: list[Work],
        batch: StepBatch,
        last_rows: list[int],
        lives: list[_Live],
        scoring: list[tuple[_Live, int, int, int]],
        scored_only: list[_Live],
        started: float,
        preempted: int,
        chained: tuple[Tensor, Tensor] | None = None,
        packed_before: Tensor | None = None,
        captured_kind: str | None = None,
    ) -> _SpecStep:
        """Launch a step with MTP speculative decoding (`hy3c.serve.engine.speculation`): the target
        verifies the drafts fed and the MTP program drafts the next ones, all on the device. `chained`:
        (the drafts on the device, request-major; how far each request's positions were planned past
        the true ones) for a step planned from one still in flight (`_spec_chain`), run uncaptured.
        A uniform decode (`_captured_kind`) replays one captured step instead
        (`hy3c.runtime.spec_graphs`); `packed_before`: the outputs of the step in flight it was
        planned from, which the captured step corrects its inputs by, with `captured_kind` the kind of
        captured step that runs it."""
        assert self.speculator is not None
        prepared = time.monotonic()
        captured = None
        kind = captured_kind
        if kind is None and chained is None and packed_before is None and not scoring and not scored_only:
            kind = self._captured_kind(work, lives, batch)
        if packed_before is not None and kind is None:
            raise RuntimeError("a step planned from a captured one in flight needs a captured step")
        if kind is not None:
            params = self._captured_params(work, lives) if kind == "sampled" else None
            captured = self.runner.spec_step(batch, self.kv_cache, packed_before, params)
            if captured is None:
                raise RuntimeError("no captured speculative step covers a batch checked to fit one")
        if captured is not None:
            self.scheduler.advance(work)
            q = self.speculator.k + 1
            depth = {w.seq: (row, q - 1) for row, w in enumerate(work)}
            return self._spec_launched(
                _SpecStep(
                    work, lives, work, Verified(captured[:, 1 : 1 + q], captured[:, 0]),
                    Drafted(captured[:, 1 + q :], depth), False, [], started, prepared - started,
                    preempted, sum(w.count for w in work), captured, None, captured,
                )
            )  # fmt: skip
        logits, hidden = self.runner.step(batch, self.kv_cache)
        self.scheduler.advance(work)
        self._score_prompts(logits, scoring)
        item_of = {w.seq: w for w in work}
        sampled = [item_of[lv.seq] for lv in lives]
        asked = [lv.request.num_logprobs for lv in lives if lv.request.num_logprobs is not None]
        verified = self.speculator.verify_step(
            logits,
            last_rows,
            sampled,
            [lv.request.params for lv in lives],
            [History(lv.request.prompt_ids, lv.output) for lv in lives],
            [lv.generator for lv in lives],
            max(asked) if asked else None,
            None if chained is None else chained[0],
            self._verify_masks(sampled, lives, logits.shape[-1], logits.device),
        )
        row_of = {lv.seq: row for row, lv in enumerate(lives)}
        items = [
            Drafting(
                w,
                w.count,
                row_of.get(w.seq),
                lives[row_of[w.seq]].request.params if w.seq in row_of else None,
                lives[row_of[w.seq]].generator if w.seq in row_of else None,
            )
            for w in work
        ]
        drafted = self.speculator.draft_pass(
            self.runner,
            self.kv_cache,
            batch,
            hidden,
            items,
            verified,
            self.scheduler.reserve,
            self._inputs.build,
            None if chained is None else chained[1],
        )
        packed = torch.cat([verified.counts[:, None], verified.tokens, drafted.tokens], 1)
        return self._spec_launched(
            _SpecStep(
                work, lives, sampled, verified, drafted, bool(asked), scored_only, started,
                prepared - started, preempted, sum(w.count for w in work), packed, None, packed,
            )
        )  # fmt: skip

    @staticmethod
    def _spec_launched(step: _SpecStep) -> _SpecStep:
        """The launched step with its readout on its way to the host: on CUDA, a pinned copy queued
        right behind it and an event after the copy (read later without waiting for a step launched
        after this one, which may overwrite a captured step's outputs)."""
        if step.packed.is_cuda:
            step.readout = torch.empty(step.packed.shape, dtype=step.packed.dtype, pin_memory=True)
            step.readout.copy_(step.packed, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        else:  # a captured step's outputs are its buffers, which the next step at its size rewrites
            step.readout = step.packed.clone()
        return step

    def _reserve_drafting(self, work: list[Work]) -> None:
        """Pages for the MTP recursion of the step's uniform decodes (K drafts fed, positions up to
        start + 2K − 1 written), asked before their batch is built so that its page table holds them
        (a captured speculative step computes those slots from it); a refusal leaves the item to the
        uncaptured draft pass, which drafts one token for it."""
        assert self.speculator is not None
        k = self.speculator.k
        for w in work:
            if w.drafts == k and w.count == k + 1:
                self.scheduler.reserve(w.seq, w.start + w.count + k - 1)

    @property
    def _captures_speculation(self) -> bool:
        """Whether the runner holds captured speculative steps (greedy or sampled)."""
        return any(
            getattr(self.runner, name, None) is not None for name in ("spec_steps", "sampled_spec_steps")
        )

    def _captured_kind(self, work: list[Work], lives: list[_Live], batch: StepBatch) -> str | None:
        """Which captured speculative step runs this one, if any: "greedy" (`Runner.spec_steps`) or
        "sampled" (`Runner.sampled_spec_steps`, for a batch with sampled requests) for a step of one
        rank whose every request is a decode feeding K drafts (no logprobs, penalties, logit bias or
        grammar), holding the pages its recursion writes, in a batch a captured step covers. For a
        sampled one, each sampled request is given its `DraftProbs` slot here."""
        assert self.speculator is not None
        if self.data_parallel > 1 or len(lives) != len(work):
            return None
        k, page_size = self.speculator.k, self.config.page_size
        for w, live in zip(work, lives):
            p = live.request.params
            if live.seq is not w.seq or w.drafts != k or w.count != k + 1:
                return None
            if has_penalties(p) or live.request.num_logprobs is not None:
                return None
            if live.constraint is not None:  # its rows are masked between the model and the verify
                return None
            if len(w.seq.pages) * page_size < w.start + w.count + k - 1:
                return None
        kind = "greedy" if all(live.request.params.greedy for live in lives) else "sampled"
        steps = getattr(self.runner, "spec_steps" if kind == "greedy" else "sampled_spec_steps", None)
        if steps is None or not steps.fits(batch, self.kv_cache):
            return None
        if kind == "sampled":  # each sampled request's draft distributions get their slot first
            probs, captured = self.speculator.probs, steps.rule.tensor
            for live in lives:
                if not live.request.params.greedy:
                    probs.slot(live.seq, captured.shape[-1], captured.device)
        return kind if steps.rule.current else None  # (a store grown since capture: uncaptured)

    def _captured_params(self, work: list[Work], lives: list[_Live]) -> Tensor:
        """A sampled captured step's parameter block (`CapturedRule.block`): each request's sampling,
        its draft-distribution slot and this step's seeds, drawn from its generator in the order the
        uncaptured path draws them (the verification's, then one per draft depth)."""
        assert self.speculator is not None
        k, probs = self.speculator.k, self.speculator.probs
        steps = self.runner.sampled_spec_steps
        params = [live.request.params for live in lives]
        slots, seeds = [], []
        for live, p in zip(lives, params):
            if p.greedy:
                slots.append(DraftProbs.SCRATCH)
                seeds.append([0] * (k + 1))
            else:
                slot = probs.find(live.seq)
                assert slot is not None, "a sampled request's slot is given by _captured_kind"
                slots.append(slot)
                seeds.append(draw_seeds([p] * (k + 1), [live.generator] * (k + 1)))
        return steps.rule.block(params, slots, seeds, steps.size_for(len(work)))

    def _spec_collect(self, step: _SpecStep, successor: _SpecStep | None = None) -> None:
        """Read a speculative step (its one host read: accepted counts, emitted tokens, next drafts),
        roll back the rejected drafts' KV, emit, publish. `successor`: the step planned from this one
        before it was read (`_spec_chain`), whose positions the host now corrects."""
        try:
            verified, drafted, lives = step.verified, step.drafted, step.lives
            width = verified.tokens.shape[1]
            if step.ready is not None:
                wait_event(step.ready)
            packed = step.readout.tolist()
            accepted = [row[0] for row in packed]
            emitted = [row[1 : row[0] + 2] for row in packed]
            chosen, top = verified.logprobs_to_host()
            if not step.asked:
                chosen, top = [[0.0] * len(e) for e in emitted], [[[]] * len(e) for e in emitted]
            known = time.monotonic()
            for w, count in zip(step.sampled, accepted):
                if w.drafts:
                    self.scheduler.accept(w, count)
            if successor is not None:  # planned at the largest acceptance: back to the true positions
                following = {w.seq: w for w in successor.work}
                for w, count in zip(step.sampled, accepted):
                    later = following.get(w.seq)
                    if later is not None:
                        later.start -= w.drafts - count
                        w.seq.computed = later.end
            alive = [
                self._live.get(lv.request.request_id) is lv for lv in lives
            ]  # not an ended one's extra step
            self.metrics.speculated(
                [w.drafts for w, on in zip(step.sampled, alive) if on],
                [a for a, on in zip(accepted, alive) if on],
            )
            drafts = {
                seq: packed[row][1 + width : 1 + width + depth] for seq, (row, depth) in drafted.depth.items()
            }
            self.scheduler.settle(step.work)
            self._emit(lives, emitted, chosen, top, known)
            for seq, tokens in drafts.items():
                if not seq.finished and self._live.get(seq.request_id) is not None:
                    self.scheduler.set_drafts(seq, tokens)
            self._finish_scored(
                [lv for lv in step.scored_only if self._live.get(lv.request.request_id) is lv]
            )
        except Exception as exc:
            self._step_failed(step.work, exc)
            return
        self._finish_step(step.work, step.started, step.host_seconds, known, step.fed, step.preempted)

    def _finish_step(
        self, work: list[Work], started: float, host_seconds: float, known: float, fed: int, preempted: int
    ) -> None:
        """A collected step's end: publish the pages it completed and record its time (from its launch
        or the previous collect, whichever is later) and host time (planning, then what followed the
        read at `known`)."""
        self.scheduler.publish(work)
        if self.tiers is not None:
            self.tiers.commit_saves()
        finished = time.monotonic()
        since = max(started, self._last_collected)
        self._last_collected = finished
        self._steps_finished += 1
        self.metrics.step(finished - since, host_seconds + (finished - known), fed, preempted)

    def _can_chain(self, step: _SpecStep) -> bool:
        """Whether the next step can be planned from this one before it is read: overlapped scheduling
        on, nobody waiting, every request a decode that fed K drafts and drafted K more, samples with
        no penalty, logprobs or logit bias, and stays inside its length limit even at full acceptance
        of this step and the next."""
        assert self.speculator is not None
        k = self.speculator.k
        if not self.config.async_scheduling or self.scheduler.waiting or self.num_submitted():
            return False
        if len(step.lives) != len(step.work) or not step.work:
            return False
        for w, live in zip(step.work, step.lives):
            p = live.request.params
            if (
                w.drafts != k
                or w.count != k + 1
                or live.seq is not w.seq
                or self._live.get(live.request.request_id) is not live
            ):
                return False
            if (
                has_penalties(p)
                or live.request.num_logprobs is not None
                or live.constraint is not None  # its masks need this step's tokens and drafts on the host
                or step.drafted.depth.get(w.seq, (0, 0))[1] != k
            ):
                return False
            if w.end + 2 * (k + 1) + k > min(w.seq.limit, self.config.max_model_len):
                return False
        return True

    def _spec_chain(self, previous: _SpecStep) -> _SpecStep | None:
        """Plan and launch the next step of `previous`'s requests before reading it: each feeds its last
        emitted token and its K new drafts, all still on the device, at the positions of full
        acceptance, corrected on the device by the drafts `previous` rejected. None when the pages for
        it cannot be had (then `previous` is read first)."""
        assert self.speculator is not None
        k = self.speculator.k
        started = time.monotonic()
        work = []
        for w in previous.work:
            if not self.scheduler.reserve(w.seq, w.end + (k + 1) + k):
                return None
            work.append(Work(w.seq, w.end, k + 1, True, from_device=True, epoch=w.seq.epoch, drafts=k))
        chunks = [SeqChunk([0] * (k + 1), w.start, w.seq.pages, "all") for w in work]
        batch = self._inputs.build(chunks, [w.seq for w in work])
        rows = [(r + 1) * (k + 1) - 1 for r in range(len(work))]
        kind = self._captured_kind(work, previous.lives, batch)
        if kind is not None:  # corrected inside the captured step
            return self._spec_launch(
                work, batch, rows, previous.lives, [], [], started, 0, None, previous.packed, kind
            )
        verified, drafted = previous.verified, previous.drafted
        lag = k - verified.counts  # the drafts each request's previous step rejected
        last = verified.tokens.gather(1, verified.counts[:, None])
        batch.input_ids.copy_(torch.cat([last, drafted.tokens[:, :k]], 1).view(-1))
        batch.positions.sub_(lag.repeat_interleave(k + 1))
        batch.seq_lens.sub_(lag.to(batch.seq_lens.dtype))
        owner = torch.arange(len(work), device=lag.device).repeat_interleave(k + 1)
        page = batch.page_table[owner, batch.positions // self.config.page_size]
        batch.slot_mapping.copy_(
            page.long() * self.config.page_size + batch.positions % self.config.page_size
        )
        draft_tokens = drafted.tokens[:, :k].reshape(-1)
        return self._spec_launch(work, batch, rows, previous.lives, [], [], started, 0, (draft_tokens, lag))

    def _history(self, live: _Live) -> History:
        """What the request's penalties read: for one with repetition, presence or frequency penalties,
        its row of the device-side `TrackedPenalties` (registered on first use), else the host lists."""
        p = live.request.params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return History(live.request.prompt_ids, live.output)
        if self._penalties is None:
            self._penalties = TrackedPenalties(self.runner.config.vocab_size, self.runner.device)
        slot = self._penalties.slot(live.seq, live.request.prompt_ids, live.output)
        return History(live.request.prompt_ids, live.output, self._penalties, slot)

    def _step_failed(self, work: list[Work], exc: Exception) -> None:
        log_event(
            log,
            "step_failed",
            level=logging.ERROR,
            error=f"{type(exc).__name__}: {exc}",
            trace=traceback.format_exc(limit=3),
        )
        error = f"engine error: {type(exc).__name__}: {exc}"
        for w in work:
            self._fail(w.seq.request_id, error)
        if self.dead is not None:  # the runner lost a rank: no request can run any more
            for request_id in list(self._live):
                self._fail(request_id, error)

    def _logit_rows(
        self, work: list[Work]
    ) -> tuple[list[int], list[_Live], list[tuple[_Live, int, int, int]], list[_Live]]:
        """Where the step's logits rows go: the rows to sample and their requests; the prompt rows to
        score as (request, first row, first position, count) — the row at position p scores prompt
        token p + 1, and positions scored before a preemption are not scored again; and the requests
        whose prompt is done that generate nothing (max_tokens 0: scoring only)."""
        rows, lives, scoring, scored_only = [], [], [], []
        row = 0
        for w in work:
            live = self._live[w.seq.request_id]
            count = w.count if w.all_logits or w.drafts else int(w.wants_logits)
            if w.all_logits:
                first = max(w.start, len(live.scored))
                end = min(w.start + w.count, w.seq.num_prompt - 1)
                if first < end:
                    scoring.append((live, row + first - w.start, first, end - first))
            if w.wants_logits and live.request.max_tokens == 0:
                scored_only.append(live)
            elif w.wants_logits:
                rows.append(row + count - 1)
                lives.append(live)
            row += count
        return rows, lives, scoring, scored_only

    def _score_prompts(self, logits: torch.Tensor, scoring: list[tuple[_Live, int, int, int]]) -> None:
        """Prompt logprobs from the raw logits (no penalty, bias or temperature, as vLLM's): each
        prompt token's logprob at the position before it, its rank (the tokens at least as likely,
        itself included: 1 for the most likely, as vLLM counts) and the position's top k. A request
        scored to its last prompt token stops asking for all rows."""
        for live, row, first, count in scoring:
            k, prompt = live.request.prompt_logprobs or 0, live.request.prompt_ids
            for at in range(0, count, SCORE_ROWS):
                size = min(SCORE_ROWS, count - at)
                logprobs = torch.log_softmax(logits[row + at : row + at + size].float(), dim=-1)
                targets = prompt[first + at + 1 : first + at + 1 + size]
                chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
                ranks = (logprobs >= chosen).sum(-1)
                values, ids = logprobs.topk(k, dim=-1)
                live.scored.extend(
                    (token, lp, rank, list(zip(top_ids, top_values)))
                    for token, lp, rank, top_ids, top_values in zip(
                        targets, chosen[:, 0].tolist(), ranks.tolist(), ids.tolist(), values.tolist()
                    )
                )
            if len(live.scored) == len(prompt) - 1:
                self.scheduler.stop_scoring(live.seq)

    def _prompt_logprobs_once(self, live: _Live) -> list | None:
        """The request's prompt logprobs for its first output (None if it did not ask, or later)."""
        if live.request.prompt_logprobs is None or live.prompt_sent:
            return None
        live.prompt_sent = True
        return live.scored

    def _finish_scored(self, lives: list[_Live]) -> None:
        """End the requests that only score their prompt (max_tokens 0), with their prompt logprobs."""
        emissions = []
        try:
            for live in lives:
                out = StepOutput(live.request.request_id, prompt_logprobs=self._prompt_logprobs_once(live))
                self._finish(live, out, "length")
                emissions.append((live.emit, out))
        finally:
            self._deliver(emissions)

    def _note_admission(self, seq: Sequence, now: float) -> None:
        live = self._live.get(seq.request_id)
        if live is not None and live.admitted_at is None:
            live.admitted_at = now
            self.metrics.admitted(seq.num_prompt, seq.cached_tokens, now - live.request.arrival)

    def _emit_sampled(self, lives: list[_Live], result: SampleResult, now: float) -> None:
        """One drawn token per row (see `_emit`)."""
        self._emit(
            lives,
            [[t] for t in result.tokens],
            [[c] for c in result.logprobs],
            [[t] for t in result.top],
            now,
        )

    def _emit(
        self,
        lives: list[_Live],
        tokens: list[list[int]],
        chosen: list[list[float]],
        top: list[list[list[tuple[int, float]]]],
        now: float,
    ) -> None:
        """Each request's new tokens (one, or with speculative decoding up to K + 1) join it in order
        until one ends it — a stop token (not appended), a stop string, its length — then detokenize
        and emit one output per request. A row whose request ended after the step was launched is
        dropped. `chosen` / `top`: each token's logprob and top logprobs (read if the request asked)."""
        emissions = []
        generated = 0  # counted once per step: a metric update per token costs host time
        counted: list[tuple[int, int]] = []  # (slot, token) of tracked penalised requests' new tokens
        tracked = self._penalties
        try:
            for lv, new, logprobs, tops in zip(lives, tokens, chosen, top):
                req = lv.request
                if self._live.get(req.request_id) is not lv:  # ended meanwhile: an extra step's row
                    continue
                if lv.first_token_at is None:
                    lv.first_token_at = now
                    self.metrics.ttft.observe(now - req.arrival)
                else:
                    self.metrics.itl.observe(now - lv.last_token_at)
                lv.last_token_at = now
                out = StepOutput(req.request_id, prompt_logprobs=self._prompt_logprobs_once(lv))
                reason = None
                for at, token in enumerate(new):
                    if lv.constraint is not None and lv.constraint.error:  # its mask held no real choice
                        reason, out.error = (
                            "error",
                            f"{STRUCTURED_ERROR}{lv.constraint.error.splitlines()[0]}",
                        )
                        break
                    stop_token = (token in self.eos_ids and not req.ignore_eos) or token in req.stop_token_ids
                    self.scheduler.append_token(lv.seq, None if stop_token else token)
                    if stop_token:
                        reason, out.stop_reason = "stop", token
                        break
                    lv.output.append(token)
                    if lv.constraint is not None and not lv.constraint.accept(token):
                        # the grammar's matcher failed (a limit met mid-way): this request ends, alone
                        reason, out.error = (
                            "error",
                            f"{STRUCTURED_ERROR}{lv.constraint.error or 'token refused'}",
                        )
                        break
                    if tracked is not None and lv.seq in tracked:
                        counted.append((tracked.slot(lv.seq, [], []), token))
                    out.token_ids.append(token)
                    out.text += lv.detok.push(token)
                    if req.num_logprobs is not None:
                        out.logprobs.append((token, logprobs[at], tops[at][: req.num_logprobs]))
                    generated += 1
                    if lv.detok.stopped_by is not None:
                        reason, out.stop_reason = "stop", lv.detok.stopped_by
                    elif len(lv.output) >= req.max_tokens or len(lv.seq.tokens) >= self.config.max_model_len:
                        reason = "length"
                    elif lv.constraint is not None and lv.constraint.done:  # its grammar admits nothing more
                        reason = "stop"
                    if reason is not None:
                        break
                if reason is not None:
                    out.text += lv.detok.flush()
                    self._finish(lv, out, reason)
                emissions.append((lv.emit, out))
        finally:  # rows done before a failing one keep their outputs (a finished one its last)
            if tracked is not None:
                tracked.record(counted)
            self.metrics.generation_tokens.inc(generated)
            self._deliver(emissions)

    @contextlib.contextmanager
    def _holding_outputs(self, work: list[Work] | None):
        """With the `work` of a step read inside, the outputs emitted inside are delivered on leaving,
        in order: a step read between the next one's model launch and its draws hands its outputs
        over once those draws are launched. The HTTP server's event loop then takes the GIL to stream
        them while the device works, not while the host builds the grammar masks the draws wait for
        (on the H200 that contention made a constrained step 3x slower served over HTTP than driven
        alone: bench/LOG.md). A consumer that raises fails the read step's requests, as when it raised
        while that step was read."""
        if work is None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            try:
                self._deliver(held)
            except Exception as exc:
                self._step_failed([w for w in work if w.seq.request_id in self._live], exc)

    def _deliver(self, emissions: list[tuple[Callable[[StepOutput], None], StepOutput]]) -> None:
        """Hand a step's outputs over (kept for later inside `_holding_outputs`): emits that share a
        `batch_sink` get them in one call. A consumer that raises (e.g. its event loop closed) does not
        keep the others from theirs; the first error is raised after every delivery was tried."""
        if self._held is not None:
            self._held.extend(emissions)
            return
        hand_over(emissions)

    def _usage(self, live: _Live, out: StepOutput) -> StepOutput:
        out.prompt_tokens = len(live.request.prompt_ids)
        out.completion_tokens = len(live.output)
        out.cached_tokens = live.seq.cached_tokens
        return out

    def _finish(self, live: _Live, out: StepOutput, reason: str) -> None:
        out.finished, out.finish_reason = True, reason
        self._forget(live.seq)
        self._usage(live, out)
        self.scheduler.finish(live.seq)
        del self._live[live.request.request_id]
        self._record_end(live, reason)

    def _record_end(self, live: _Live, reason: str) -> None:
        self.metrics.finished(
            live.request.request_id,
            reason,
            now=time.monotonic(),
            arrival=live.request.arrival,
            admitted=live.admitted_at,
            first_token=live.first_token_at,
            last_token=live.last_token_at,
            prompt_tokens=len(live.request.prompt_ids),
            generation_tokens=len(live.output),
            cached_tokens=live.seq.cached_tokens,
        )

    def _final(self, live: _Live, reason: str, error: str | None = None) -> StepOutput:
        out = StepOutput(live.request.request_id, finished=True, finish_reason=reason, error=error)
        return self._usage(live, out)

    def _forget(self, seq: Sequence) -> None:
        """A request left: its page-table row, its draft distributions and its store read go."""
        self._inputs.drop(seq)
        if self._penalties is not None:
            self._penalties.drop(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)
        if self.tiers is not None:
            self.tiers.forget(seq.request_id)

    def _fail(self, request_id: str, error: str) -> None:
        live = self._live.pop(request_id, None)
        self.scheduler.remove(request_id)
        if live is not None:
            self._forget(live.seq)
        if live is not None:
            self._record_end(live, "error")
            self._deliver([(live.emit, self._final(live, "error", error))])  # after any held outputs
