"""Prometheus metrics of the server, through `prometheus_client`, with vLLM's names under `hy3c:`.

Each `EngineMetrics` has its own `CollectorRegistry` (tests run several servers in one process) and
renders it with a leading `model_name` label, as vLLM labels its series. vLLM's names and meanings:

* gauges, read from the engine when scraped (right when nothing runs): `num_requests_running`,
  `num_requests_waiting`, `kv_cache_usage_perc` (the fraction of KV pages held by requests; published
  prefix pages nobody holds stay reusable but do not count, as in vLLM), `cache_config_info`;
* counters: `prompt_tokens`, `generation_tokens`, `num_preemptions`, `prefix_cache_queries` and
  `prefix_cache_hits` (in tokens, at each request's first admission), `request_success` by
  `finished_reason` (stop, length, abort, error);
* histograms: `time_to_first_token_seconds`, `inter_token_latency_seconds`, and per finished request
  (stop or length) `e2e_request_latency_seconds`, `request_queue_time_seconds` (arrival → first
  scheduled), `request_prefill_time_seconds` (→ first token), `request_decode_time_seconds` (first →
  last token), `request_inference_time_seconds` (prefill + decode),
  `request_time_per_output_token_seconds`, `request_prompt_tokens`, `request_generation_tokens`,
  `iteration_tokens_total` (tokens per engine step);
* speculative decoding's counters (`speculated`, once per step): `spec_decode_num_drafts` (requests that
  drafted, summed over steps), `spec_decode_num_draft_tokens`, `spec_decode_num_accepted_tokens` and
  `spec_decode_num_accepted_tokens_per_pos` by `position` (0-based: drafts accepted at that position), so
  the acceptance rate is accepted / draft tokens, the mean acceptance length 1 + accepted / drafts and
  a position's acceptance rate its count / drafts, as vLLM reads them.

Ours: `engine_step_seconds` and `engine_host_seconds` (a step's wall time and its host part),
`engine_idle_seconds` by `state` (`empty`, `held`: the loop's turns with no step running),
`kernel_builds_total` by kernel (Triton variants built while serving) and `request_aborted_total`.

The engine's interface: the counters and histograms it updates itself (`prompt_tokens`,
`generation_tokens`, `ttft`, `itl`, `aborted`, `kernel_builds`), `watch` (the state gauges),
`admitted`, `step`, `speculated` and `finished`. `submitted` and `RequestUsage` give the HTTP access log each
request's token counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The text format would add a `<name>_created` series (a creation timestamp) beside every counter and
# histogram: twice the lines, no use to a scraper, and a render that differs between two fresh servers.
prometheus_client.disable_created_metrics()

_FAST_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.001, 0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass
class RequestUsage:
    """Token counts of one HTTP request, summed over its generations (each of `n` choices counts its
    prompt) as the engine finishes them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# set by the HTTP gate around each request; read by `EngineMetrics.submitted` in the request's context
CURRENT_USAGE: ContextVar[RequestUsage | None] = ContextVar("hy3c_request_usage", default=None)


class _ModelLabelled:
    """A registry's metrics with `model_name` added to every sample (a collector for rendering)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.registry, self.model = registry, model

    def collect(self) -> Iterator[prometheus_client.Metric]:
        for family in self.registry.collect():
            family.samples = [
                s._replace(labels={"model_name": self.model, **s.labels}) for s in family.samples
            ]
            yield family


class EngineMetrics:
    def __init__(self, max_model_len: int = 4096) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=False)
        tokens = one_two_five_buckets(max_model_len)
        self.running = Gauge("hy3c:num_requests_running", "Requests in the running batch.", registry=reg)
        self.waiting = Gauge("hy3c:num_requests_waiting", "Requests waiting to be scheduled.", registry=reg)
        self.kv_usage = Gauge(
            "hy3c:kv_cache_usage_perc", "Fraction of KV pages held by requests (1 = all).", registry=reg
        )
        self.cache_info = Gauge(
            "hy3c:cache_config_info",
            "The KV cache's configuration (labels; value 1).",
            ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
            registry=reg,
        )
        self.prompt_tokens = Counter("hy3c:prompt_tokens", "Prompt tokens received.", registry=reg)
        self.generation_tokens = Counter("hy3c:generation_tokens", "Tokens generated.", registry=reg)
        self.preemptions = Counter(
            "hy3c:num_preemptions", "Sequences preempted for lack of KV pages.", registry=reg
        )
        self.prefix_queries = Counter(
            "hy3c:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=reg
        )
        self.prefix_hits = Counter(
            "hy3c:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=reg
        )
        self.success = Counter(
            "hy3c:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=reg
        )
        self.aborted = Counter(
            "hy3c:request_aborted", "Requests aborted (client disconnect or shutdown).", registry=reg
        )
        self.ttft = Histogram(
            "hy3c:time_to_first_token_seconds", "Time to first token.", buckets=_FAST_BUCKETS, registry=reg
        )
        self.itl = Histogram(
            "hy3c:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=_FAST_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "hy3c:request_time_per_output_token_seconds",
            "Decode time of a request over its output tokens after the first.",
            buckets=_FAST_BUCKETS,
            registry=reg,
        )

        def per_request(name: str, help_: str) -> Histogram:
            return Histogram(name, help_, buckets=_REQUEST_BUCKETS, registry=reg)

        self.e2e = per_request("hy3c:e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = per_request("hy3c:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill_time = per_request(
            "hy3c:request_prefill_time_seconds", "First scheduled to the first token."
        )
        self.decode_time = per_request("hy3c:request_decode_time_seconds", "First token to the last token.")
        self.inference_time = per_request(
            "hy3c:request_inference_time_seconds", "First scheduled to the last token (prefill + decode)."
        )
        self.request_prompt_tokens = Histogram(
            "hy3c:request_prompt_tokens", "Prompt tokens per request.", buckets=tokens, registry=reg
        )
        self.request_generation_tokens = Histogram(
            "hy3c:request_generation_tokens", "Generated tokens per request.", buckets=tokens, registry=reg
        )
        self.step_tokens = Histogram(
            "hy3c:iteration_tokens_total",
            "Tokens fed to the model per engine step.",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=reg,
        )
        self.step_time = Histogram(
            "hy3c:engine_step_seconds", "Wall time of one engine step.", buckets=_FAST_BUCKETS, registry=reg
        )
        self.host_time = Histogram(
            "hy3c:engine_host_seconds",
            "Host time of one engine step outside the model and the sampler: scheduling, batch building,"
            " detokenization and emitting.",
            buckets=_FAST_BUCKETS,
            registry=reg,
        )
        self.idle_time = Counter(
            "hy3c:engine_idle_seconds",
            "Engine loop turns with no step running, by state: `empty` (no request in the engine) or"
            " `held` (requests in the engine, none of them steppable yet: waiting for a KV load from the"
            " store, for pages or for a prefix another request is writing).",
            ["state"],
            registry=reg,
        )
        self.kernel_builds = Counter(
            "hy3c:kernel_builds",
            "Triton kernel variants built while serving (compiled, or read from the disk cache); each one"
            " stalls the engine step that needs it. Warm-up should leave this at zero.",
            ["kernel"],
            registry=reg,
        )
        self.spec_drafts = Counter(
            "hy3c:spec_decode_num_drafts", "Draft runs verified (one per request and step).", registry=reg
        )
        self.spec_draft_tokens = Counter(
            "hy3c:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=reg
        )
        self.spec_accepted_tokens = Counter(
            "hy3c:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=reg
        )
        self.spec_accepted_per_pos = Counter(
            "hy3c:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
            registry=reg,
        )
        self._usage: dict[str, RequestUsage] = {}
        self._idle_lock = threading.Lock()  # `idle_from`: the engine thread and a scrape
        self._idle_since: float | None = None

    # ---- set up --------------------------------------------------------------------------------------
    def watch(
        self, running: Callable[[], int], waiting: Callable[[], int], kv_usage: Callable[[], float]
    ) -> None:
        """Read the state gauges from these functions at each scrape (called from the HTTP thread)."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)

    def watch_tiers(self, tiers) -> None:
        """The KV tiers' gauges (`kv_tiers.KVTiers`), read at each scrape: per tier (`l2`, `l3`) the
        pages looked up, found and stored, bytes loaded into / stored from GPU pages, seconds spent, the
        store's failures, dropped writes and degraded state (1: serving on L1 + L2 only)."""
        reg, stats = self.registry, tiers.stats
        pages = Gauge(
            "hy3c:kv_tier_pages", "KV tier page counts by tier and event.", ["tier", "event"], registry=reg
        )
        for tier in ("l2", "l3"):
            for event in ("queries", "hits", "stored"):
                pages.labels(tier, event).set_function(lambda name=f"{tier}_{event}": getattr(stats, name))
        pages.labels("l2", "evicted").set_function(lambda: stats.l2_evicted)
        pages.labels("l2", "resident").set_function(lambda: tiers.blocks_used)
        pages.labels("l3", "dropped").set_function(lambda: stats.l3_dropped)
        pages.labels("l3", "failures").set_function(lambda: stats.l3_failures)
        moved = Gauge("hy3c:kv_tier_bytes", "KV bytes by direction.", ["direction"], registry=reg)
        moved.labels("loaded").set_function(lambda: stats.loaded_bytes)
        moved.labels("stored").set_function(lambda: stats.stored_bytes)
        seconds = Gauge("hy3c:kv_tier_seconds", "Seconds spent by operation.", ["op"], registry=reg)
        seconds.labels("load").set_function(lambda: stats.load_seconds)
        seconds.labels("l3_read").set_function(lambda: stats.l3_read_seconds)
        seconds.labels("l3_write").set_function(lambda: stats.l3_write_seconds)
        degraded = Gauge(
            "hy3c:kv_l3_degraded", "1 while the L3 store is degraded (L1 + L2 only).", registry=reg
        )
        degraded.set_function(lambda: float(tiers.degraded))

    def describe_cache(self, page_size: int, num_pages: int, dtype: str) -> None:
        """`cache_config_info`: vLLM's label names for the page size, page count and KV dtype."""
        self.cache_info.labels(str(page_size), str(num_pages), dtype, "True").set(1)

    # ---- engine events -------------------------------------------------------------------------------
    def submitted(self, request_id: str) -> None:
        """A request entered the engine (API side): its final counts go to the HTTP request's usage."""
        usage = CURRENT_USAGE.get()
        if usage is not None:
            self._usage[request_id] = usage

    def admitted(self, prompt_tokens: int, cached_tokens: int, queue_seconds: float) -> None:
        """A request was scheduled for the first time, reusing `cached_tokens` of its prompt."""
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.queue_time.observe(queue_seconds)

    def step(self, seconds: float, host_seconds: float, tokens: int, preemptions: int) -> None:
        """One engine step: its wall and host time, the tokens it fed, the sequences it preempted."""
        self.step_time.observe(seconds)
        self.host_time.observe(host_seconds)
        self.step_tokens.observe(tokens)
        if preemptions:
            self.preemptions.inc(preemptions)

    def held(self, seconds: float) -> None:
        """A turn of the engine loop that ran no step while requests were in the engine."""
        self.idle_time.labels("held").inc(seconds)

    def idle_from(self, since: float) -> None:
        """An empty turn (no request in the engine) began at `since` and waits: counted as it goes, so a
        scrape in the middle of the wait sees the part so far (`idle_to` adds the rest)."""
        with self._idle_lock:
            self._idle_since = since

    def idle_to(self) -> None:
        """The empty turn `idle_from` opened has ended."""
        with self._idle_lock:
            if self._idle_since is not None:
                self.idle_time.labels("empty").inc(time.monotonic() - self._idle_since)
            self._idle_since = None

    def _count_open_idle(self) -> None:
        """At a scrape: the open empty turn's time so far into the counter, the rest left open."""
        with self._idle_lock:
            if self._idle_since is not None:
                now = time.monotonic()
                self.idle_time.labels("empty").inc(now - self._idle_since)
                self._idle_since = now

    def speculated(self, num_drafts: list[int], accepted: list[int]) -> None:
        """One step's verification: per request the drafts it fed and how many were accepted (a request
        with no drafts counts nothing). Each counter moves once per step."""
        runs = sum(1 for k in num_drafts if k > 0)
        if not runs:
            return
        self.spec_drafts.inc(runs)
        self.spec_draft_tokens.inc(sum(num_drafts))
        self.spec_accepted_tokens.inc(sum(accepted))
        reached = [0] * max(num_drafts)
        for a in accepted:
            for position in range(a):
                reached[position] += 1
        for position, count in enumerate(reached):
            self.spec_accepted_per_pos.labels(str(position)).inc(count)

    def finished(
        self,
        request_id: str,
        reason: str,
        *,
        now: float,
        arrival: float,
        admitted: float | None = None,
        first_token: float | None = None,
        last_token: float | None = None,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """A request ended (stop, length, abort or error; times from `time.monotonic`). The latency and
        size histograms take the requests that completed (stop, length) only."""
        self.success.labels(reason).inc()
        usage = self._usage.pop(request_id, None)
        if usage is not None:
            usage.prompt_tokens += prompt_tokens
            usage.completion_tokens += generation_tokens
            usage.cached_tokens += cached_tokens
        if reason not in ("stop", "length"):
            return
        self.e2e.observe(now - arrival)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        if admitted is None or first_token is None or last_token is None:
            return
        self.prefill_time.observe(first_token - admitted)
        self.decode_time.observe(last_token - first_token)
        self.inference_time.observe(last_token - admitted)
        if generation_tokens > 1:
            self.tpot.observe((last_token - first_token) / (generation_tokens - 1))

    # ---- reading ---------------------------------------------------------------------------------------
    def sample(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), by its exposed name without `model_name`."""
        self._count_open_idle()
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self, model: str) -> str:
        """The Prometheus text format, every series labelled `model_name=model`."""
        self._count_open_idle()
        return prometheus_client.generate_latest(_ModelLabelled(self.registry, model)).decode()
