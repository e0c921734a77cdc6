"""Where one request's time to first token goes when most of its prompt is a prefix hit, without HTTP.

Builds the engine as `hy3c serve ART --kv-host-gib G` does (`build_engine`), then, one request at a
time (concurrency 1), greedy, one output token:

* cold: a fresh prompt of `--prompt-len` tokens (nothing cached);
* floor: a fresh prompt of only the tokens an `--hit`-share prefix hit leaves to compute;
* L1 hit: a request on a prefix a previous request computed (its pages still on the GPU);
* L2 hit: the same after the GPU's prefix cache was dropped (`reset_prefix_cache`): the pages come
  back from pinned host memory (`KVTiers.extend_prefix`).

Per case, the median over `--repeats` requests (each on its own prefix) of: TTFT (submit → first token
on the host), the engine iterations it took and each iteration's wall time, the host time of the
scheduler (which loads L2 pages), and of `extend_prefix` alone. Then one request per case under
torch.profiler: device busy time, host-to-device copy time and bytes, the top device activities.
The gain a hit can give is (cold − floor); the rest of a hit's TTFT is what the tiers add.

    python3 bench/prefix_ttft_probe.py ART [--random-weights 0] [--prompt-len 8192] [--hit 0.8]
        [--repeats 5] [--kv-host-gib 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import torch
from engine_probe import PhaseClock  # bench/ is the script's directory

from hy3c.serve.engine.core import GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.http.server import ServeOptions, build_engine


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer(PhaseClock):
    """`PhaseClock` (host seconds of wrapped callables, by name) with the engine iterations' wall times."""

    def __init__(self) -> None:
        super().__init__()
        self.iterations: list[float] = []

    def reset(self) -> None:
        super().reset()
        self.iterations.clear()


def first_token(engine, timer: Timer, name: str, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` to its first token on the host; drives the engine until done."""
    stamps: list[float] = []

    def emit(out: StepOutput) -> None:
        if out.token_ids and not stamps:
            stamps.append(time.perf_counter())

    sync()
    timer.reset()
    started = time.perf_counter()
    engine.submit(GenerationRequest(name, prompt, SamplingParams(temperature=0.0), 1, ignore_eos=True), emit)
    while not stamps:
        at = time.perf_counter()
        engine._iterate()
        timer.iterations.append(time.perf_counter() - at)
    ttft = stamps[0] - started
    engine.run_until_done()
    sync()
    return ttft


def device_summary(trace: Path, top: int = 8) -> dict:
    """Device busy ms (union of kernels, copies, sets), H2D copy ms and MB, and the top activities."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:80], e.get("args", {}).get("bytes", 0), e["cat"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, start, end = 0.0, None, None
    total: collections.Counter[str] = collections.Counter()
    h2d_us, h2d_bytes = 0.0, 0
    for s, e, name, size, cat in spans:
        total[name] += e - s
        if cat == "gpu_memcpy" and "HtoD" in name:
            h2d_us += e - s
            h2d_bytes += size
        if end is None or s > end:
            busy += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        busy += end - start
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return {
        "span_ms": span * 1e-3,
        "busy_ms": busy * 1e-3,
        "h2d_ms": h2d_us * 1e-3,
        "h2d_mb": h2d_bytes / 1e6,
        "top": [(name, total[name] * 1e-3) for name in ranked],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--random-weights", type=int, default=None, help="as hy3c serve's")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--hit", type=float, default=0.8, help="the prompt's share that is the shared prefix")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-host-gib", type=float, default=16.0)
    parser.add_argument("--kv-memory", type=float, default=None, help="GPU KV pool GiB (as hy3c serve's)")
    args = parser.parse_args()

    options = ServeOptions(
        artifact=args.artifact,
        random_weights=args.random_weights,
        kv_host_gib=args.kv_host_gib,
        kv_memory_gib=args.kv_memory,
    )
    engine, _, _ = build_engine(options)
    engine.config.async_scheduling = True
    timer = Timer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.tiers, "extend_prefix", "extend_prefix")
    timer.wrap(engine.tiers, "commit_saves", "commit_saves")
    vocab = engine.runner.config.vocab_size
    page = engine.pool.page_size
    shared = int(args.prompt_len * args.hit) // page * page
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    def prepared(name: str, repeat: int) -> list[int]:
        """The case's prompt, its prefix computed first (and moved to L2 only, for an L2 hit)."""
        if name == "cold":
            return tokens(args.prompt_len)
        if name == "floor":
            return tokens(args.prompt_len - shared)
        prefix = tokens(shared)
        first_token(engine, timer, f"{name}-{repeat}-seed", prefix + tokens(args.prompt_len - shared))
        if name == "L2 hit":
            engine.tiers.flush()
            engine.scheduler.reset_prefix_cache()
        return prefix + tokens(args.prompt_len - shared)

    def case(name: str, repeat: int) -> float:
        return first_token(engine, timer, f"{name}-{repeat}", prepared(name, repeat))

    cases = ("cold", "floor", "L1 hit", "L2 hit")
    for name in cases:  # warm-up: every kernel shape these requests take built before timing
        case(name, -1)
    print(
        f"prompt {args.prompt_len} tokens, shared prefix {shared} ({shared / args.prompt_len:.0%}), page {page}"
    )
    print(
        "| case | TTFT ms (median) | min | iterations | iteration ms (median request) | schedule ms | extend_prefix ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in cases:
        rows = []
        for repeat in range(args.repeats):
            ttft = case(name, repeat)
            rows.append(
                (ttft, list(timer.iterations), timer.seconds["schedule"], timer.seconds["extend_prefix"])
            )
        rows.sort(key=lambda row: row[0])
        ttft, iterations, schedule, extend = rows[len(rows) // 2]
        steps = " ".join(f"{s * 1e3:.1f}" for s in iterations)
        print(
            f"| {name} | {ttft * 1e3:.2f} | {rows[0][0] * 1e3:.2f} | {len(iterations)} | {steps} "
            f"| {schedule * 1e3:.2f} | {extend * 1e3:.2f} |",
            flush=True,
        )
    print(f"\nL2: {engine.tiers.stats}")
    for name in cases:
        prompt = prepared(name, 100)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                ttft = first_token(engine, timer, f"{name}-profiled", prompt)
            prof.export_chrome_trace(str(trace))
            summary = device_summary(trace)
        print(
            f"\n{name} (profiled: TTFT {ttft * 1e3:.2f} ms): device span {summary['span_ms']:.2f} ms, "
            f"busy {summary['busy_ms']:.2f}, H2D {summary['h2d_ms']:.2f} ms / {summary['h2d_mb']:.1f} MB"
        )
        for activity, ms in summary["top"]:
            print(f"  {ms:8.2f} ms  {activity}")
    print(
        f"\nmedian of {args.repeats}; torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU (dry run)'}"
    )


if __name__ == "__main__":
    main()
