"""`hy3c bench serve`: load an OpenAI-compatible server and report what `vllm bench serve` reports.

    hy3c bench serve --base-url http://127.0.0.1:8000 --workload random --num-prompts 200 --concurrency 32 \\
        --input-len 512 --output-len 128

Workloads: `random` (independent prompts of --input-len tokens) and `shared-prefix` (every prompt starts
with the same --prefix-len tokens, then --input-len random ones: exercises the prefix cache). Prompts are
token ids drawn from what the server's /tokenize returns for a built-in text, so they are valid for any
vocabulary. Requests stream from /v1/completions with `ignore_eos` (exactly --output-len tokens each) and
at most --concurrency in flight. Reported: request and output-token throughput, TTFT, TPOT, ITL and E2E
latency (mean, p50, p90, p99) and goodput — requests per second meeting --slo-ttft-ms and --slo-tpot-ms.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

_TEXT = (
    "The compiler traces the model into a graph, rewrites it into fused kernels and serves it. "
    "Requests arrive, share prefixes, stream tokens back and leave; the scheduler keeps the GPU busy. "
) * 8


@dataclass
class RequestStats:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestStats:
    start = time.perf_counter()
    last = None
    stats = RequestStats(ok=False)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                stats.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return stats
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stats.error = chunk["error"]["message"]
                    return stats
                if chunk.get("usage"):
                    stats.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft = now - start
                    else:
                        stats.itl.append(now - last)
                    last = now
        stats.e2e = time.perf_counter() - start
        stats.ok = True
    except httpx.HTTPError as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
    return stats


_STEP_METRICS = ("hy3c:engine_step_seconds", "hy3c:engine_host_seconds")
_BUILDS_METRIC = "hy3c:kernel_builds_total"


async def _engine_totals(client: httpx.AsyncClient) -> dict[str, list[float]] | None:
    """[sum, count] of hy3c's step-time histograms from /metrics; None for a server without them."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or _STEP_METRICS[0] not in response.text:
        return None
    totals = {name: [0.0, 0.0] for name in (*_STEP_METRICS, _BUILDS_METRIC)}
    for line in response.text.splitlines():
        for name in _STEP_METRICS:
            for index, suffix in enumerate(("_sum{", "_count{")):
                if line.startswith(name + suffix):
                    totals[name][index] = float(line.rsplit(" ", 1)[1])
        if line.startswith(_BUILDS_METRIC + "{"):
            totals[_BUILDS_METRIC][0] += float(line.rsplit(" ", 1)[1])
    return totals


def _engine_report(before, after) -> dict | None:
    """Engine steps during the run: mean step time and the host share (scheduler, batch, detokenizer)."""
    if before is None or after is None:
        return None
    steps = after[_STEP_METRICS[0]][1] - before[_STEP_METRICS[0]][1]
    if steps <= 0:
        return None
    step_s = after[_STEP_METRICS[0]][0] - before[_STEP_METRICS[0]][0]
    host_s = after[_STEP_METRICS[1]][0] - before[_STEP_METRICS[1]][0]
    builds = after[_BUILDS_METRIC][0] - before[_BUILDS_METRIC][0]
    return {
        "steps": int(steps),
        "step_ms": step_s / steps * 1e3,
        "host_ms": host_s / steps * 1e3,
        "kernel_builds": int(builds),
    }


async def _get_json(client: httpx.AsyncClient, method: str, path: str, headers: dict, body=None) -> dict:
    """A setup request; any failure is one clear error naming the server and the route."""
    try:
        response = await client.request(method, path, headers=headers, json=body)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{client.base_url}{path}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise ConnectionError(f"{client.base_url}{path}: HTTP {response.status_code} {response.text[:200]}")
    return response.json()


async def run_benchmark(
    base_url: str,
    workload: str,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 256,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    slo_ttft_ms: float = 1000.0,
    slo_tpot_ms: float = 100.0,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=concurrency + 4)
    ) as client:
        model = model or (await _get_json(client, "GET", "/v1/models", headers))["data"][0]["id"]
        pool = sorted(
            set((await _get_json(client, "POST", "/tokenize", headers, {"prompt": _TEXT}))["tokens"])
        )
        prefix = [rng.choice(pool) for _ in range(prefix_len)] if workload == "shared-prefix" else []
        prompts = [prefix + [rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: list[int]) -> RequestStats:
            async with gate:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                return await _one(client, "/v1/completions", body, headers)

        engine_before = await _engine_totals(client)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
        engine = _engine_report(engine_before, await _engine_totals(client))
    done = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    good = [
        r
        for r in done
        if r.ttft * 1e3 <= slo_ttft_ms
        and (r.output_tokens <= 1 or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 <= slo_tpot_ms)
    ]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "workload": workload,
        "num_prompts": num_prompts,
        "concurrency": concurrency,
        "input_len": input_len,
        "output_len": output_len,
        "prefix_len": prefix_len if workload == "shared-prefix" else 0,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in done]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpot).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([x for r in done for x in r.itl]).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.e2e for r in done]).items()},
        "goodput": len(good) / duration,
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "engine": engine,
    }


def format_report(report: dict) -> str:
    prefix = report["prefix_len"]
    prompt_len = f"{prefix} shared + {report['input_len']}" if prefix else str(report["input_len"])
    lines = [
        f"workload {report['workload']}: {report['completed']}/{report['num_prompts']} requests in {report['duration_s']:.2f} s "
        f"(concurrency {report['concurrency']}, {prompt_len} in / {report['output_len']} out tokens)",
        f"request throughput {report['request_throughput']:.2f} req/s, output {report['output_throughput']:.1f} tok/s, "
        f"goodput {report['goodput']:.2f} req/s (TTFT ≤ {report['slo']['ttft_ms']:.0f} ms, TPOT ≤ {report['slo']['tpot_ms']:.0f} ms)",
        f"{'metric':<6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}  (ms)",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = report[f"{name}_ms"]
        lines.append(
            f"{name.upper():<6} {row['mean']:9.2f} {row['p50']:9.2f} {row['p90']:9.2f} {row['p99']:9.2f}"
        )
    engine = report.get("engine")
    if engine:
        share = engine["host_ms"] / engine["step_ms"] * 100 if engine["step_ms"] else 0.0
        lines.append(
            f"engine: {engine['steps']} steps, {engine['step_ms']:.2f} ms per step, of which host "
            f"(scheduler, batch, detokenizer) {engine['host_ms']:.2f} ms ({share:.0f}%); the rest is the "
            f"model and the sampler; {engine['kernel_builds']} kernel variants built during the run"
        )
    if report["failed"]:
        lines.append(f"failed: {report['failed']} — {report['errors']}")
    return "\n".join(lines)
