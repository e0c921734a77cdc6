"""`hy3c bench serve`: load an OpenAI-compatible server and report what `vllm bench serve` reports, under
its flag names and JSON keys.

    hy3c bench serve --base-url http://127.0.0.1:8000 --dataset-name random --num-prompts 200 \\
        --max-concurrency 32 --random-input-len 512 --random-output-len 128 --save-result

Datasets (token ids drawn from what the server's /tokenize returns for a built-in text, so they are
valid for any vocabulary):
* `random`: `--random-prefix-len` tokens shared by every prompt, then `--random-input-len` random ones,
  `--random-output-len` tokens out (both lengths drawn from ±`--random-range-ratio`);
* `prefix_repetition` (also spelled `prefix-repetition`): `--prefix-repetition-num-prefixes` random
  prefixes of `--prefix-repetition-prefix-len` tokens, each shared by an equal part of the prompts,
  then `--prefix-repetition-suffix-len` random tokens; `--prefix-repetition-output-len` out. Ours:
  `--prefix-repetition-hit-ratio R` sizes the shared prefix (within the prompt's length, prefix +
  suffix) so that a share R of all prompt tokens repeat earlier ones — what a cache that never
  forgets would serve: each prefix's first sending is a miss, so with P prefixes over N prompts the
  prefix is R · N / (N − P) of each prompt (with many prefixes the working set outgrows the GPU's
  pages, which is what the KV tiers are for);
* `hy3-trace` (ours): lengths shaped like the Hy3 stack's production load — inputs log-normal around
  68K tokens with a long tail (σ 1, cut at 4× the median), outputs around 900 (σ 0.5), both times
  `--trace-scale` so it fits a slice on one GPU — where `--trace-reuse R` of each prompt is the start of
  its session's context (sessions of about 8 requests, as agent turns re-send their history).

With `--tokenizer` (a local `tokenizer.json` or a directory holding one, as vLLM's flag points at a
model's files; hub names are not fetched) the prompts are built with that tokenizer instead, so the
server needs no /tokenize or /detokenize.

Requests arrive all at once (`--request-rate inf`) or by a Poisson process (gamma intervals for
`--burstiness` ≠ 1) seeded by `--seed`; at most `--max-concurrency` are in flight. Each streams from
`--endpoint` (/v1/completions; /v1/chat/completions sends the prompt's text as a user message; the
default follows vLLM's `--backend`: `openai-chat` is the chat endpoint, the other OpenAI-compatible
ones completions) with `ignore_eos` for `random` (as vLLM) and `hy3-trace` (`--ignore-eos` for the other) and
the usage chunk, which gives the token counts. Request bodies are JSON-encoded before the run starts
(a 32K-id prompt takes ~3 ms to encode: the client's time, not the server's TTFT). A progress bar shows
completed requests.

The result has vLLM's keys — `duration`, `completed`, `failed`, `total_input_tokens`,
`total_output_tokens`, `request_throughput`, `request_goodput` (requests meeting every `--goodput`
SLO, per second), `output_throughput`, `total_token_throughput`, `max_output_tokens_per_s`,
`max_concurrent_requests`, and `mean_`, `median_`, `std_`, `p<N>_` `<metric>_ms` for each of
`--percentile-metrics` at `--metric-percentiles` (numpy's percentiles) — plus the per-request lists
(`input_lens`, `output_lens`, `ttfts`, `itls`, `start_times`, `latencies`, `generated_texts`,
`errors`) that `--save-detailed` keeps in the saved file. Ours: `dataset_name`, the default
percentiles 50 and 90 beside vLLM's 99, and, against a hy3c server, the engine's steps during the run
from /metrics: `engine_steps`, `engine_step_ms` (mean), `engine_host_ms` (its host part: scheduling,
batch building, detokenization), `engine_kernel_builds` (Triton variants built during the run), `engine_busy_percent` (the steps' time
over the run's), `engine_idle_empty_percent` / `engine_idle_held_percent` (the share of the run in the
engine loop's turns that ran no step, with no request in the engine / with requests it could not step
yet: a KV load from the store, pages, a prefix another request writes), `engine_ttft_ms` / `engine_queue_ms` /
`engine_prefill_ms` (means of the server's TTFT and its two parts: `ttft_report`),
`prefix_cache_hit_rate` (prompt tokens found in any KV tier / looked up, in %) and, with KV tiers,
`kv_l2_hit_pages` / `kv_l3_hit_pages`;
when the server drafted during the run (speculative decoding), vLLM's keys from its spec-decode counters:
`spec_decode_acceptance_rate` (accepted / draft tokens, in %), `spec_decode_acceptance_length` (mean
acceptance length: 1 + accepted / drafts, the bonus token included), `spec_decode_num_drafts`,
`spec_decode_draft_tokens`, `spec_decode_accepted_tokens` and
`spec_decode_per_position_acceptance_rates` (per draft position: accepted there / drafts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer
from tqdm import tqdm

_TEXT = (
    "The compiler traces the model into a graph, rewrites it into fused kernels and serves it. "
    "Requests arrive, share prefixes, stream tokens back and leave; the scheduler keeps the GPU busy. "
) * 8
DATASETS = ("random", "prefix_repetition", "prefix-repetition", "hy3-trace")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# vLLM's `--backend`s that speak OpenAI's API, and the endpoint each sends to (the others are not
# OpenAI-compatible: TGI, TensorRT-LLM, DeepSpeed-MII, audio, embeddings)
BACKENDS = {
    "vllm": ENDPOINTS[0],
    "openai": ENDPOINTS[0],
    "openai-chat": ENDPOINTS[1],
    "sglang": ENDPOINTS[0],
    "lmdeploy": ENDPOINTS[0],
    "scalellm": ENDPOINTS[0],
}
METRICS = ("ttft", "tpot", "itl", "e2el")
_METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
DETAILED_KEYS = (
    "input_lens", "output_lens", "ttfts", "itls", "start_times", "latencies", "generated_texts", "errors",
)  # fmt: skip


@dataclass
class BenchConfig:
    """The run's settings, named and defaulted as `vllm bench serve`'s flags."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # None: the backend's (`route`)
    backend: str | None = None  # one of BACKENDS; None: named after the endpoint in the result
    tokenizer: str | None = None  # a tokenizer.json or its directory; None: the server's /tokenize
    model: str | None = None
    api_key: str | None = None
    dataset_name: str = "random"
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_prefix_len: int = 0
    random_range_ratio: float = 0.0
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    prefix_repetition_hit_ratio: float | None = None  # the prefix's share of each prompt (ours)
    trace_scale: float = 1.0
    trace_reuse: float = 0.8
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    extra_body: dict = field(default_factory=dict)  # merged into every request's body (vLLM's flag)
    goodput: dict[str, float] = field(default_factory=dict)  # metric → SLO in ms
    percentile_metrics: tuple[str, ...] = METRICS
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    disable_tqdm: bool = False
    label: str | None = None  # the result's label (default: the backend) and its file name's start

    def check(self) -> None:
        """Each bad setting is a ValueError naming its flag."""
        if self.dataset_name not in DATASETS:
            raise ValueError(
                f"--dataset-name: {self.dataset_name!r} is not one of {', '.join((*DATASETS[:2], DATASETS[3]))}"
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.endpoint is not None and self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if self.backend is not None and self.endpoint not in (None, BACKENDS[self.backend]):
            raise ValueError(
                f"--backend {self.backend} sends to {BACKENDS[self.backend]}, not --endpoint {self.endpoint}"
            )
        if self.tokenizer is not None and not self.tokenizer_file.is_file():
            raise ValueError(
                f"--tokenizer {self.tokenizer}: no tokenizer.json there (give a local file or directory)"
            )
        positive = {
            "num-prompts": self.num_prompts,
            "random-input-len": self.random_input_len,
            "random-output-len": self.random_output_len,
            "prefix-repetition-prefix-len": self.prefix_repetition_prefix_len,
            "prefix-repetition-suffix-len": self.prefix_repetition_suffix_len,
            "prefix-repetition-num-prefixes": self.prefix_repetition_num_prefixes,
            "prefix-repetition-output-len": self.prefix_repetition_output_len,
            "request-rate": self.request_rate,
            "burstiness": self.burstiness,
        }
        if self.max_concurrency is not None:
            positive["max-concurrency"] = self.max_concurrency
        for flag, value in positive.items():
            if not value > 0:
                raise ValueError(f"--{flag} must be positive (got {value})")
        ratio = self.prefix_repetition_hit_ratio
        if ratio is not None and not 0 <= ratio < 1:
            raise ValueError(f"--prefix-repetition-hit-ratio must lie in [0, 1) (got {ratio})")
        if ratio is not None and ratio > 0 and self.dataset in ("prefix_repetition", "prefix-repetition"):
            reachable = 1 - min(self.prefix_repetition_num_prefixes, self.num_prompts) / self.num_prompts
            if ratio >= reachable:
                raise ValueError(
                    f"--prefix-repetition-hit-ratio {ratio}: {self.prefix_repetition_num_prefixes} prefixes"
                    f" over {self.num_prompts} prompts miss at each prefix's first sending, so under"
                    f" {reachable:.3f} can hit (fewer prefixes or more prompts)"
                )
        if not 0 < self.trace_scale <= 1:
            raise ValueError(f"--trace-scale must lie in (0, 1] (got {self.trace_scale})")
        if not 0 <= self.trace_reuse < 1:
            raise ValueError(f"--trace-reuse must lie in [0, 1) (got {self.trace_reuse})")
        if self.random_prefix_len < 0:
            raise ValueError(f"--random-prefix-len must be at least 0 (got {self.random_prefix_len})")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"--random-range-ratio must lie in [0, 1) (got {self.random_range_ratio})")
        for name, slo in self.goodput.items():
            if name not in ("ttft", "tpot", "e2el") or slo < 0:
                raise ValueError(
                    f"--goodput {name}:{slo}: give ttft, tpot or e2el with a non-negative value in ms"
                )
        for name in self.percentile_metrics:
            if name not in METRICS:
                raise ValueError(f"--percentile-metrics: {name!r} is not one of {','.join(METRICS)}")
        for p in self.metric_percentiles:
            if not 0 < p <= 100:
                raise ValueError(f"--metric-percentiles: {p:g} is not in (0, 100]")

    @property
    def dataset(self) -> str:
        return "prefix_repetition" if self.dataset_name == "prefix-repetition" else self.dataset_name

    @property
    def route(self) -> str:
        """The endpoint requests go to: `endpoint`, else the backend's, else /v1/completions."""
        return self.endpoint or BACKENDS.get(self.backend or "", ENDPOINTS[0])

    @property
    def chat(self) -> bool:
        return self.route == "/v1/chat/completions"

    @property
    def tokenizer_file(self) -> Path:
        """`tokenizer` itself, or the tokenizer.json inside that directory."""
        path = Path(str(self.tokenizer))
        return path / "tokenizer.json" if path.is_dir() else path


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50` → {"ttft": 500.0, "tpot": 50.0}; a malformed pair is a ValueError."""
    out = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: write METRIC:MS, e.g. ttft:500") from None
    return out


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


# ---- the workload ---------------------------------------------------------------------------------
def make_prompts(
    config: BenchConfig, pool: list[int], rng: np.random.Generator
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) for each request."""
    n = config.num_prompts

    def draw(count: int) -> list[int]:
        return [pool[i] for i in rng.integers(0, len(pool), count)]

    if config.dataset == "random":
        r = config.random_range_ratio

        def length(mean: int) -> np.ndarray:
            low, high = max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r)))
            return rng.integers(low, high + 1, n)

        prefix = draw(config.random_prefix_len)
        inputs, outputs = length(config.random_input_len), length(config.random_output_len)
        return [(prefix + draw(int(i)), int(o)) for i, o in zip(inputs, outputs)]
    if config.dataset == "hy3-trace":
        return trace_prompts(config, draw, rng)
    prefix_len, suffix_len = config.prefix_repetition_prefix_len, config.prefix_repetition_suffix_len
    if config.prefix_repetition_hit_ratio is not None:  # R of all tokens, the first sendings missing
        total, cold = prefix_len + suffix_len, min(config.prefix_repetition_num_prefixes, n)
        prefix_len = min(total - 1, round(config.prefix_repetition_hit_ratio * n / (n - cold) * total))
        suffix_len = total - prefix_len
    prefixes = [draw(prefix_len) for _ in range(config.prefix_repetition_num_prefixes)]
    prompts = [
        (prefixes[i % len(prefixes)] + draw(suffix_len), config.prefix_repetition_output_len)
        for i in range(n)
    ]
    return [prompts[i] for i in rng.permutation(n)]


TRACE_INPUT_MEDIAN, TRACE_OUTPUT_MEDIAN, TRACE_SESSION = 68_000, 900, 8


def trace_prompts(config: BenchConfig, draw, rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """The `hy3-trace` dataset (module docstring): per request a log-normal input and output length
    (scaled), the first `trace_reuse` of its prompt taken from its session's context."""
    n, scale = config.num_prompts, config.trace_scale
    median = max(16, int(TRACE_INPUT_MEDIAN * scale))
    inputs = np.clip(rng.lognormal(np.log(median), 1.0, n), 16, 4 * median).astype(int)
    outputs = np.clip(rng.lognormal(np.log(max(1, TRACE_OUTPUT_MEDIAN * scale)), 0.5, n), 1, None).astype(int)
    sessions = [draw(4 * median) for _ in range(max(1, n // TRACE_SESSION))]
    prompts = []
    for i, (length, out) in enumerate(zip(inputs, outputs)):
        shared = int(config.trace_reuse * length)
        prompts.append((sessions[i % len(sessions)][:shared] + draw(int(length) - shared), int(out)))
    return [prompts[i] for i in rng.permutation(n)]


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else
    gamma-distributed gaps (shape `burstiness`, mean 1/rate: a Poisson process at burstiness 1),
    scaled so that the last one comes at n/rate (the run's length does not depend on the seed)."""
    if math.isinf(rate):
        return np.zeros(n)
    times = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n))
    return times * (n / rate / times[-1])


# ---- one request ------------------------------------------------------------------------------------
async def _request(
    client: httpx.AsyncClient, config: BenchConfig, body: bytes, prompt_len: int, headers: dict
) -> RequestResult:
    """One request of the run; `body` is its JSON, encoded before the run (a 32K-id body takes ~3 ms to
    encode: the client's time, not the server's)."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    first, text = True, []
    try:
        async with client.stream(
            "POST", config.route, content=body, headers={**headers, "Content-Type": "application/json"}
        ) as response:
            if response.status_code != 200:
                result.error = (
                    f"HTTP {response.status_code}: {(await response.aread())[:200].decode(errors='replace')}"
                )
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if first:
                        result.ttft, first = now - start, False
                    else:
                        result.itl.append(now - last)
                    last = now
                    choice = chunk["choices"][0]
                    text.append(
                        (choice.get("delta", {}).get("content") if config.chat else choice.get("text")) or ""
                    )
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(text)
        result.success = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _get_json(client: httpx.AsyncClient, method: str, path: str, headers: dict, body=None) -> dict:
    """A setup request; any failure is one clear error naming the server and the route."""
    try:
        response = await client.request(method, path, headers=headers, json=body)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{client.base_url}{path}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise ConnectionError(f"{client.base_url}{path}: HTTP {response.status_code} {response.text[:200]}")
    return response.json()


# ---- the engine's view (hy3c servers) ---------------------------------------------------------------
_STEP, _HOST, _BUILDS = "hy3c:engine_step_seconds", "hy3c:engine_host_seconds", "hy3c:kernel_builds"
_DRAFTS, _DRAFT_TOKENS = "hy3c:spec_decode_num_drafts", "hy3c:spec_decode_num_draft_tokens"
_ACCEPTED, _PER_POS = "hy3c:spec_decode_num_accepted_tokens", "hy3c:spec_decode_num_accepted_tokens_per_pos"
_QUERIES, _HITS, _TIERS = "hy3c:prefix_cache_queries", "hy3c:prefix_cache_hits", "hy3c:kv_tier_pages"
_TTFT, _QUEUE = "hy3c:time_to_first_token_seconds", "hy3c:request_queue_time_seconds"
_PREFILL, _IDLE = "hy3c:request_prefill_time_seconds", "hy3c:engine_idle_seconds"
_FAMILIES = (
    _STEP, _HOST, _BUILDS, _DRAFTS, _DRAFT_TOKENS, _ACCEPTED, _PER_POS, _QUERIES, _HITS, _TIERS, _TTFT, _QUEUE,
    _PREFILL, _IDLE,
)  # fmt: skip


async def _engine_totals(client: httpx.AsyncClient) -> dict[str, float] | None:
    """Sums and counts of hy3c's step-time histograms, the kernel builds and the spec-decode counters
    from /metrics (a position's count under `<name>_total:<position>`); None for a server without them."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_engine_totals(response.text)


def parse_engine_totals(text: str) -> dict[str, float] | None:
    """`_engine_totals` from a /metrics text (summed over `model_name`s)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in _FAMILIES:
            for sample in family.samples:
                if family.name == _TIERS:  # a gauge per tier and event: `<name>:<tier>:<event>`
                    key = f"{sample.name}:{sample.labels.get('tier')}:{sample.labels.get('event')}"
                    totals[key] = totals.get(key, 0.0) + sample.value
                elif family.name == _IDLE:  # a counter per state: `<name>:<state>`
                    key = f"{sample.name}:{sample.labels.get('state')}"
                    totals[key] = totals.get(key, 0.0) + sample.value
                elif sample.name.endswith(("_sum", "_count", "_total")):
                    key = sample.name
                    if family.name == _PER_POS:
                        key = f"{key}:{sample.labels.get('position', '0')}"
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals if f"{_STEP}_count" in totals else None


def engine_report(before: dict | None, after: dict | None) -> dict:
    """The engine's steps during the run (count, mean step time, its host part, kernel builds), and
    speculative decoding's acceptance when the server drafted (`spec_report`)."""
    if before is None or after is None:
        return {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta[f"{_STEP}_count"]
    if steps <= 0:
        return {}
    return {
        "engine_steps": int(steps),
        "engine_step_ms": delta[f"{_STEP}_sum"] / steps * 1e3,
        "engine_host_ms": delta.get(f"{_HOST}_sum", 0.0) / steps * 1e3,
        "engine_kernel_builds": int(delta.get(f"{_BUILDS}_total", 0.0)),
        **ttft_report(delta),
        **{
            f"engine_idle_{state}_s": delta[f"{_IDLE}_total:{state}"]
            for state in ("empty", "held")
            if f"{_IDLE}_total:{state}" in delta
        },
        **cache_report(delta),
        **spec_report(delta),
    }


def ttft_report(delta: dict[str, float]) -> dict:
    """Where the server's time to first token goes, means over the run: `engine_ttft_ms` (the request
    made in the HTTP process → its first token, the engine's TTFT histogram), `engine_queue_ms`
    (→ first scheduled: the hand-off to the engine and the wait for a step's budget, pages or a KV
    load) and `engine_prefill_ms` (first scheduled → first token). The client's TTFT less
    `engine_ttft_ms` is the request's HTTP path (sending, parsing, validating, the first chunk back)."""
    report = {}
    for key, name in (
        ("engine_ttft_ms", _TTFT),
        ("engine_queue_ms", _QUEUE),
        ("engine_prefill_ms", _PREFILL),
    ):
        count = delta.get(f"{name}_count", 0.0)
        if count > 0:
            report[key] = delta[f"{name}_sum"] / count * 1e3
    return report


def cache_report(delta: dict[str, float]) -> dict:
    """The prefix cache over the run: prompt tokens found (every tier) against those looked up, and
    the pages the KV tiers found (`l2` / `l3`) when the server has them."""
    queries, hits = delta.get(f"{_QUERIES}_total", 0.0), delta.get(f"{_HITS}_total", 0.0)
    report = {"prefix_cache_hit_rate": hits / queries * 100 if queries else 0.0}
    for tier in ("l2", "l3"):
        key = f"{_TIERS}:{tier}:hits"
        if key in delta:
            report[f"kv_{tier}_hit_pages"] = int(delta[key])
    return report


def spec_report(delta: dict[str, float]) -> dict:
    """vLLM's spec-decode keys from the counters' changes over the run; empty when nothing was drafted."""
    drafts, drafted = delta.get(f"{_DRAFTS}_total", 0.0), delta.get(f"{_DRAFT_TOKENS}_total", 0.0)
    if drafts <= 0 or drafted <= 0:
        return {}
    accepted = delta.get(f"{_ACCEPTED}_total", 0.0)
    prefix = f"{_PER_POS}_total:"
    per_pos = {int(key[len(prefix) :]): value for key, value in delta.items() if key.startswith(prefix)}
    return {
        "spec_decode_acceptance_rate": accepted / drafted * 100,
        "spec_decode_acceptance_length": 1 + accepted / drafts,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(drafted),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": [
            per_pos.get(position, 0.0) / drafts for position in range(max(per_pos, default=-1) + 1)
        ],
    }


# ---- the run ----------------------------------------------------------------------------------------
async def run_benchmark(config: BenchConfig) -> dict:
    """Send the workload and return the result (see the module docstring for its keys)."""
    config.check()
    local = _local_tokenizer(config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    rng = np.random.default_rng(config.seed)
    limits = httpx.Limits(max_connections=(config.max_concurrency or config.num_prompts) + 4)
    async with httpx.AsyncClient(
        base_url=config.base_url, timeout=httpx.Timeout(6 * 3600.0), limits=limits
    ) as client:
        model = config.model or (await _get_json(client, "GET", "/v1/models", headers))["data"][0]["id"]
        if local is None:
            pool = (await _get_json(client, "POST", "/tokenize", headers, {"prompt": _TEXT}))["tokens"]
        else:
            pool = local.encode(_TEXT, add_special_tokens=False).ids
        workload = make_prompts(config, sorted(set(pool)), rng)
        arrivals = arrival_times(config.num_prompts, config.request_rate, config.burstiness, rng)
        bodies = [
            json.dumps(
                await _body(client, config, model, prompt, out, headers, local), ensure_ascii=False
            ).encode()
            for prompt, out in workload
        ]
        gate = (
            asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()
        )
        bar = tqdm(total=config.num_prompts, disable=config.disable_tqdm, desc="requests", unit="req")

        async def send(i: int, start: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                result = await _request(client, config, bodies[i], len(workload[i][0]), headers)
            bar.update(1)
            return result

        engine_before = await _engine_totals(client)
        start = time.perf_counter()
        results = await asyncio.gather(*(send(i, start) for i in range(config.num_prompts)))
        duration = time.perf_counter() - start
        bar.close()
        engine = engine_report(engine_before, await _engine_totals(client))
    if engine:  # the share of the run the engine spent in steps (its steps never overlap in time)
        engine["engine_busy_percent"] = engine["engine_steps"] * engine["engine_step_ms"] / 10 / duration
        for state in ("empty", "held"):  # and in turns that ran no step
            if f"engine_idle_{state}_s" in engine:
                engine[f"engine_idle_{state}_percent"] = engine.pop(f"engine_idle_{state}_s") * 100 / duration
    for r in results:
        r.start_time -= start
    report = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if config.chat else "openai",
        "backend": config.backend or ("openai-chat" if config.chat else "openai"),
        "label": config.label,
        "model_id": model,
        "tokenizer_id": config.tokenizer,
        "num_prompts": config.num_prompts,
        "dataset_name": config.dataset,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        **summarize(results, duration, config),
        **engine,
    }
    return report


def _local_tokenizer(config: BenchConfig) -> Tokenizer | None:
    """`--tokenizer`'s tokenizer, or None for the server's; a file `tokenizers` cannot read is a
    ValueError naming the flag."""
    if config.tokenizer is None:
        return None
    try:
        return Tokenizer.from_file(str(config.tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"--tokenizer {config.tokenizer}: not a tokenizer.json: {exc}") from None


async def _body(
    client: httpx.AsyncClient,
    config: BenchConfig,
    model: str,
    prompt: list[int],
    out: int,
    headers: dict,
    local: Tokenizer | None,
) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": out,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": config.ignore_eos or config.dataset in ("random", "hy3-trace"),
    }
    if config.chat:
        if local is None:
            text = (await _get_json(client, "POST", "/detokenize", headers, {"tokens": prompt}))["prompt"]
        else:
            text = local.decode(prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    for name in ("temperature", "top_p", "top_k"):
        if getattr(config, name) is not None:
            body[name] = getattr(config, name)
    return {**body, **config.extra_body}


def summarize(results: list[RequestResult], duration: float, config: BenchConfig) -> dict:
    """vLLM's result keys from the per-request results (times in ms where the key says so)."""
    done = [r for r in results if r.success]
    out_lens = [r.output_tokens if r.success else 0 for r in results]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    itls = [x for r in done for x in r.itl]
    tpot_of = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in done]
    tpots = [t for r, t in zip(done, tpot_of) if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(out_lens)
    slo = {"ttft": ttfts, "tpot": tpot_of, "e2el": e2els}
    good = sum(
        all(slo[name][i] * 1e3 <= limit for name, limit in config.goodput.items()) for i in range(len(done))
    )
    report = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if config.goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        **_peaks(done),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": out_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "start_times": [r.start_time for r in results],
        "latencies": [r.latency for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in config.percentile_metrics:
        values = np.asarray(series[name] or [0.0]) * 1e3
        report[f"mean_{name}_ms"] = float(np.mean(values))
        report[f"median_{name}_ms"] = float(np.median(values))
        report[f"std_{name}_ms"] = float(np.std(values))
        for p in config.metric_percentiles:
            report[f"p{_percent(p)}_{name}_ms"] = float(np.percentile(values, p))
    return report


def _peaks(done: list[RequestResult]) -> dict:
    """The most output tokens received in one second of the run, and the most requests in flight."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    token_times = np.concatenate([r.start_time + r.ttft + np.cumsum([0.0, *r.itl]) for r in done])
    per_second = np.bincount(np.floor(token_times - token_times.min()).astype(int))
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    in_flight = np.cumsum([delta for _, delta in events])
    return {
        "max_output_tokens_per_s": float(per_second.max()),
        "max_concurrent_requests": int(in_flight.max()),
    }


def _percent(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def format_report(report: dict, config: BenchConfig) -> str:
    """The result as `vllm bench serve` prints it, with the engine's steps for a hy3c server."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    if config.max_concurrency is not None:
        row("Maximum request concurrency:", config.max_concurrency)
    if not math.isinf(config.request_rate):
        row("Request rate configured (RPS):", config.request_rate, ".2f")
    row("Benchmark duration (s):", report["duration"], ".2f")
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"], ".2f")
    if report["request_goodput"] is not None:
        row("Request goodput (req/s):", report["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", report["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", report["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", report["max_concurrent_requests"])
    row("Total token throughput (tok/s):", report["total_token_throughput"], ".2f")
    for name in config.percentile_metrics:
        short, title = _METRIC_TITLES[name]
        lines.append(f" {title} ".center(width, "-"))
        row(f"Mean {short} (ms):", report[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", report[f"median_{name}_ms"], ".2f")
        for p in config.metric_percentiles:
            row(f"P{_percent(p)} {short} (ms):", report[f"p{_percent(p)}_{name}_ms"], ".2f")
    if "engine_steps" in report:
        lines.append(" Engine (hy3c /metrics) ".center(width, "-"))
        row("Engine steps:", report["engine_steps"])
        row("Mean step (ms):", report["engine_step_ms"], ".2f")
        row("  of which host (ms):", report["engine_host_ms"], ".2f")
        if "engine_busy_percent" in report:  # (a report built from /metrics alone has no run time)
            row("Engine busy (% of the run):", report["engine_busy_percent"], ".1f")
            for state, label in (("empty", "no request"), ("held", "requests held")):
                if f"engine_idle_{state}_percent" in report:
                    row(f"Engine idle, {label} (%):", report[f"engine_idle_{state}_percent"], ".1f")
        for key, label in (
            ("engine_ttft_ms", "Server TTFT, mean (ms):"),
            ("engine_queue_ms", "  arrival to scheduled (ms):"),
            ("engine_prefill_ms", "  scheduled to first token (ms):"),
        ):
            if key in report:
                row(label, report[key], ".2f")
        row("Kernel variants built:", report["engine_kernel_builds"])
        row("Prefix cache hit rate (%):", report["prefix_cache_hit_rate"], ".2f")
        for tier in ("l2", "l3"):
            if f"kv_{tier}_hit_pages" in report:
                row(f"  pages found in {tier.upper()}:", report[f"kv_{tier}_hit_pages"])
    if "spec_decode_num_drafts" in report:
        lines.append(" Speculative Decoding ".center(width, "-"))
        row("Acceptance rate (%):", report["spec_decode_acceptance_rate"], ".2f")
        row("Acceptance length:", report["spec_decode_acceptance_length"], ".2f")
        row("Drafts:", report["spec_decode_num_drafts"])
        row("Draft tokens:", report["spec_decode_draft_tokens"])
        row("Accepted tokens:", report["spec_decode_accepted_tokens"])
        lines.append("Per-position acceptance (%):")
        for position, rate in enumerate(report["spec_decode_per_position_acceptance_rates"]):
            row(f"  Position {position}:", rate * 100, ".2f")
    if report["failed"]:
        errors = sorted({e for e in report["errors"] if e})[:5]
        lines.append(f"errors: {errors}")
    lines.append("=" * width)
    return "\n".join(lines)


def result_path(config: BenchConfig, report: dict, filename: str | None, directory: str | None) -> Path:
    """Where `--save-result` writes: `--result-filename`, or vLLM's name for the run
    (`{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`), inside `--result-dir` if given."""
    if filename is None:
        concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
        model = str(report["model_id"]).rstrip("/").split("/")[-1]
        label = config.label or report["backend"]
        filename = f"{label}-{config.request_rate}qps{concurrency}-{model}-{report['date']}.json"
    path = Path(directory) / filename if directory else Path(filename)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
