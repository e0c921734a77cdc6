"""Where a served engine's decode step goes, on the GPU, without HTTP in the way.

Builds the engine exactly as `hy3c serve ART` does (`build_engine`: KV cache, CUDA graphs, warm-up),
then drives it on this thread (`run_until_done`) with greedy requests of random prompts, and prints:

- per setting (overlapped scheduling on / off, each concurrency): TPOT (median over requests), the
  engine's step and host time per step, and — from a torch.profiler trace of the steady decode
  steps — the GPU's busy time per step and its idle share between kernels;
- the decode graph's bare replay time at batch 1 and 32 (CUDA events around `graph.replay()`), the
  floor a step can reach;
- the host work per step split by phase (schedule, inputs, sampler, runner, collect, …);
- every host synchronisation seen in steady decode (`torch.cuda.set_sync_debug_mode`), with the
  stack that caused it;
- with `--contexts`: the overlapped engine's decode step and host time at each context length
  (`--context-requests` requests of that many prompt tokens);
- with `--long-prompts`: decode protection — `--decoders` requests decode while that many prompts of
  `--long-len` tokens are prefilled; the decoders' inter-token latency (median, p99, max) during the
  prefill, with the prefill chunk per step at the token budget and at `--long-prefill-token-threshold`;
- with `--json-schema JSON`: every request's output follows that schema (structured outputs: the
  grammar masks' host work shows among the phases);
- with `--host-profile`: each setting's top host functions (cProfile, by own time) over one more window;
- with `--kernel-table`: each setting's top device kernels (time and launches a step) in its trace;
- with `--gap-table`: each setting's device idle time charged to the activity that ends each gap
  (the copies and staging kernels launched between two graphs show there);
- `--overlap on|off|both` picks the settings run (each setting's row also prints as it ends);
  `--written on|off|both` whether decode steps are written into the sampled graphs' inputs with one
  copy (`DecodeInputs`; on) or built as batches and staged into the graph (off: the path before),
  and under speculation whether batches with sampled requests replay the captured sampled step (on)
  or run uncaptured (off); `--temperature T [--top-p P]` samples the requests (seeded), else greedy;
- with `--speculative-config` (as `hy3c serve`'s): the engine speculates, and the verify and draft
  graphs' bare replays give the speedup MTP can reach at acceptances 0.57 and 0.9 (and projected to
  80 layers).

    python3 bench/engine_probe.py ART [--concurrency 1 32] [--input-len 1024] [--output-len 200]
        [--contexts 1024 32768 131072] [--long-prompts 2 --long-len 65536 --decoders 8]
        [--long-prefill-token-threshold 1024] [--skip-settings] [--json-schema JSON] [--random-weights SEED]
        [--overlap both] [--host-profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import itertools
import json
import pstats
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from hy3c.serve.engine import core
from hy3c.serve.engine.core import GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.engine.spec_decode import mean_accepted_length
from hy3c.serve.http.server import ServeOptions, build_engine


class PhaseClock:
    """Host seconds spent inside wrapped callables, by name (nested calls count in both)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: object, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


GRAMMAR = None  # the compiled --json-schema, when given


TEMPERATURE, TOP_P = 0.0, 1.0  # the requests' sampling (--temperature, --top-p)


def sampling(seed: int) -> SamplingParams:
    """A request's sampling: greedy, or seeded at TEMPERATURE and TOP_P."""
    if TEMPERATURE == 0.0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=seed)


def submit(engine, count: int, input_len: int, output_len: int, salt: int) -> dict[str, list[float]]:
    """`count` greedy requests of distinct random prompts (under GRAMMAR when set); returns request →
    its output times."""
    vocab = engine.runner.config.vocab_size
    times: dict[str, list[float]] = {}
    generator = torch.Generator().manual_seed(salt)
    for i in range(count):
        name = f"probe-{salt}-{i}"
        prompt = torch.randint(0, vocab, (input_len,), generator=generator).tolist()
        times[name] = []

        def emit(out: StepOutput, stamps=times[name]) -> None:
            stamps.extend([time.perf_counter()] * len(out.token_ids))  # a stamp per token

        request = GenerationRequest(
            name, prompt, sampling(salt * 1000 + i), output_len, ignore_eos=True, grammar=GRAMMAR
        )
        engine.submit(request, emit)
    return times


def tpot(times: dict[str, list[float]]) -> float:
    per_request = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return statistics.median(per_request)


LONG_GAP_US = 20.0  # inside a graph, kernels follow each other within a few µs; longer gaps wait on the host


def gpu_busy(trace_path: Path) -> tuple[float, float, int, float]:
    """(span s, busy s, kernels, idle s in gaps over LONG_GAP_US) of the device activity in a chrome
    trace: busy is the union of the kernel / memcpy / memset intervals, span from the first start to
    the last end; the long gaps are the idle time between steps, not the launch gaps within a graph."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return 0.0, 0.0, 0, 0.0
    busy, long_idle, start, end = 0.0, 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            if s - end > LONG_GAP_US:
                long_idle += s - end
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return (spans[-1][1] - spans[0][0]) * 1e-6, busy * 1e-6, len(spans), long_idle * 1e-6


def top_kernels(trace_path: Path, steps: int, top: int = 14) -> list[tuple[str, float, float]]:
    """The `top` device activities of a chrome trace by total time: (name, ms a step, count a step)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            total[e["name"][:90]] += e["dur"]
            count[e["name"][:90]] += 1
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return [(name, total[name] / steps * 1e-3, count[name] / steps) for name in ranked]


def gap_table(trace_path: Path, steps: int, top: int = 14) -> list[tuple[str, float, float, float]]:
    """Where the device waits: every idle gap between device activities (kernels, copies, sets) of a
    chrome trace charged to the activity that ends it. The `top` by gap time: (name, gap µs a step,
    busy µs a step, count a step). Launch gaps inside a graph land on its kernels; the ops a step
    launches between two graphs (input copies, staging kernels) show with their own gaps."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:90])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    gap: dict[str, float] = collections.Counter()
    busy: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    end = spans[0][0] if spans else 0.0
    for start, stop, name in spans:
        gap[name] += max(0.0, start - end)
        busy[name] += stop - start
        count[name] += 1
        end = max(end, stop)
    ranked = sorted(gap, key=gap.__getitem__, reverse=True)[:top]
    return [(name, gap[name] / steps, busy[name] / steps, count[name] / steps) for name in ranked]


def until_decoding(engine, times: dict[str, list[float]], extra: int = 8) -> None:
    """Iterate until every request has its first token, then `extra` more steps."""
    while any(not stamps for stamps in times.values()):
        engine._iterate()
    for _ in range(extra):
        engine._iterate()


def run_setting(engine, clock: PhaseClock, overlap: bool, concurrency: int, args, salt: int) -> dict:
    engine.config.async_scheduling = overlap
    times = submit(engine, concurrency, args.input_len, args.output_len, salt)
    until_decoding(engine, times)  # (output_len must outlast this and both windows)
    window = args.profile_steps
    clock.reset()
    emitted = sum(map(len, times.values()))
    started = time.perf_counter()
    for _ in range(window):  # unprofiled: the step time, the tokens it yields and the host phases
        engine._iterate()
    torch.cuda.synchronize()
    plain_step = (time.perf_counter() - started) / window
    tokens_per_step = (sum(map(len, times.values())) - emitted) / window
    phases = {name: clock.seconds[name] / window * 1e3 for name in clock.seconds}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            started = time.perf_counter()
            for _ in range(window):
                engine._iterate()
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        prof.export_chrome_trace(str(trace))
        span, busy, kernels, long_idle = gpu_busy(trace)
        kernel_table = top_kernels(trace, window) if args.kernel_table else []
        gaps = gap_table(trace, window) if args.gap_table else []
    served_graphs = captured_step_times(engine, concurrency)
    host_profile = profile_host(engine, window) if args.host_profile else ""
    engine.run_until_done()
    return {
        "overlap": overlap,
        "concurrency": concurrency,
        "tpot_ms": tpot(times) * 1e3,
        "step_ms": plain_step * 1e3,
        "tokens_per_s": tokens_per_step / plain_step,
        "window_step_ms": wall / window * 1e3,
        "gpu_busy_ms": busy / window * 1e3,
        "gpu_idle_pct": 100 * (1 - busy / span) if span else float("nan"),
        "between_steps_idle_pct": 100 * long_idle / span if span else float("nan"),
        "kernels_per_step": kernels / window,
        "phases_ms": phases,
        "served_graphs": served_graphs,
        "host_profile": host_profile,
        "kernel_table": kernel_table,
        "gap_table": gaps,
    }


def profile_host(engine, steps: int, top: int = 25) -> str:
    """The top `top` host functions by own time over `steps` more engine steps (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine._iterate()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def timed_replays(graph, repeats: int = 100) -> float:
    """Seconds per replay of a CUDA graph, its inputs as they are."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats * 1e-3


def captured_step_times(engine, batch: int) -> tuple[float, float] | None:
    """(the captured speculative step, its verify part) in seconds, replayed on the inputs of the
    last served step — real tokens, so the MoE routes as in serving (stale or zero inputs route every
    token to the same experts and flatter the step). The verify part replays the verify graph on the
    same inputs; the draft part is the rest (the MTP passes and the in-graph acceptance). The
    step's outputs and the forced-acceptance counter are restored afterwards, so serving goes on."""
    steps = getattr(engine.runner, "spec_steps", None)
    if steps is None or not steps.captured:
        return None
    size = next((n for n in steps.sizes if n >= batch), None)
    verify_graphs = engine.runner.step_graphs.get(steps.k + 1)
    if size is None or verify_graphs is None or size not in verify_graphs.graphs:
        return None
    torch.cuda.synchronize()
    step = steps.steps[size]
    forced = engine.speculator.forced
    saved = [step.packed.clone(), step.chained.clone()]
    counters = {} if forced is None else {d: t.clone() for d, t in forced._drawn.items()}
    step.chained.zero_()  # the inputs are already corrected: replays recompute the same step
    whole = timed_replays(step.graph)
    g = verify_graphs.graphs[size]
    g.inputs[7].copy_(step.token_rows)  # ids, positions, slots
    g.inputs[2].copy_(step.page_table)
    g.inputs[3].copy_(step.seq_lens)
    verify = timed_replays(g.graph)
    step.packed.copy_(saved[0])
    step.chained.copy_(saved[1])
    for device, value in counters.items():
        forced._drawn[device].copy_(value)
    torch.cuda.synchronize()
    return whole, verify


def context_step(engine, clock: PhaseClock, context: int, requests: int, steps: int = 40) -> dict:
    """The overlapped engine's steady decode step and host phases with `requests` prompts of `context`
    tokens."""
    engine.config.async_scheduling = True
    times = submit(engine, requests, context, steps + 20, salt=1000 + context)
    until_decoding(engine, times)
    clock.reset()
    started = time.perf_counter()
    for _ in range(steps):
        engine._iterate()
    torch.cuda.synchronize()
    step = (time.perf_counter() - started) / steps
    phases = {name: clock.seconds[name] / steps * 1e3 for name in clock.seconds}
    engine.run_until_done()
    return {"context": context, "step_ms": step * 1e3, "phases_ms": phases}


def protection(engine, args, threshold: int) -> dict:
    """Decoders' inter-token gaps while long prompts prefill, chunked at `threshold` tokens per step
    (0: the token budget)."""
    engine.config.async_scheduling = True
    engine.scheduler.long_prefill_token_threshold = threshold
    decoders = submit(engine, args.decoders, 1024, 100_000, salt=2000 + threshold)
    until_decoding(engine, decoders)
    long = submit(engine, args.long_prompts, args.long_len, 1, salt=3000 + threshold)
    started = time.perf_counter()
    while any(not stamps for stamps in long.values()):
        engine._iterate()
    ended = time.perf_counter()
    gaps = sorted(
        b - a
        for stamps in decoders.values()
        for a, b in itertools.pairwise(stamps)
        if started <= a and b <= ended
    )
    for name in decoders:
        engine.abort(name)
    engine.run_until_done()
    engine.scheduler.long_prefill_token_threshold = 0

    def at(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3 if gaps else float("nan")

    return {
        "threshold": threshold,
        "prefill_s": ended - started,
        "gaps": len(gaps),
        "median_ms": at(0.5),
        "p99_ms": at(0.99),
        "max_ms": gaps[-1] * 1e3 if gaps else float("nan"),
    }


def replay_time(
    runner, batch: int, repeats: int = 200, query_len: int = 1, program: str = "step"
) -> float | None:
    """Seconds per bare replay of a captured graph for `batch` requests (its inputs as last left): the
    step program's at `query_len` tokens per request, or the draft program's (`program="draft"`)."""
    for graphs in (runner.step_graphs if program == "step" else runner.draft_graphs).values():
        if graphs.query_len == query_len and batch in graphs.graphs:
            return timed_replays(graphs.graphs[batch].graph, repeats)
    return None


def speculation_times(runner, k: int, batch: int) -> tuple[float, float, float] | None:
    """Seconds per bare replay at `batch` requests: plain decode, the verify step (K + 1 tokens per
    request) and the draft program's passes (K + 1 tokens, then K − 1 of one); None without graphs."""
    decode = replay_time(runner, batch)
    verify = replay_time(runner, batch, query_len=k + 1)
    first = replay_time(runner, batch, query_len=k + 1, program="draft")
    deeper = replay_time(runner, batch, program="draft") if k > 1 else 0.0
    if None in (decode, verify, first, deeper):
        return None
    return decode, verify, first + (k - 1) * deeper


def ideal_tokens_per_s(times: tuple[float, float, float], k: int, batch: int, alpha: float) -> float:
    """The issue's ideal: (1 + accepted) tokens per request for a verify step plus its draft passes."""
    _, verify, draft_s = times
    return mean_accepted_length(alpha, k) * batch / (verify + draft_s)


def speculation_costs(runner, k: int, batch: int) -> str | None:
    """The speculative step's graph costs at `batch` requests against plain decode, and the speedup
    they allow at the issue's acceptances: (1 + accepted) / (1 + t_draft / t_step), t_step the verify
    step; projected to 80 layers with t_step scaled by 80 / (the artifact's layers) and t_draft kept."""
    times = speculation_times(runner, k, batch)
    if times is None:
        return None
    decode, verify, draft_s = times
    layers = runner.config.num_hidden_layers
    cells = []
    for alpha in (0.57, 0.9):
        length = mean_accepted_length(alpha, k)  # 1 + accepted
        ideal = length / (1 + draft_s / verify)
        projected = length / (1 + draft_s / (verify * 80 / layers))
        cells.append(
            f"α {alpha}: ideal {ideal:.2f}× ({ideal_tokens_per_s(times, k, batch, alpha):.0f} tok/s), "
            f"80 layers {projected:.2f}×"
        )
    return (
        f"| {batch} | {decode * 1e3:.3f} | {verify * 1e3:.3f} | {draft_s * 1e3:.3f} | "
        + " | ".join(cells)
        + " |"
    )


def find_syncs(engine, args) -> list[tuple[int, str]]:
    """The host synchronisations of steady overlapped decode at concurrency 1: (count, stack)."""
    engine.config.async_scheduling = True
    submit(engine, 1, args.input_len, 64, salt=99)
    for _ in range(10):
        engine._iterate()
    seen: collections.Counter[str] = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "debug mode is a prototype" in str(message):  # torch's notice on turning the mode on
            return
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        seen[f"{message}\n{stack}"] += 1

    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(20):
                engine._iterate()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    warnings.showwarning = shown
    engine.run_until_done()
    return [(count, text) for text, count in seen.most_common()]


def report_setting(row: dict) -> None:
    """A setting's step, TPOT and host phases as soon as it is measured (and its host profile)."""
    turn = (", masks in turn" if row.get("in_turn") else "") + (", staged" if row.get("staged") else "")
    phases = ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["phases_ms"].items(), key=lambda kv: -kv[1]))
    print(
        f"[setting] overlap {'on' if row['overlap'] else 'off'}{turn} C={row['concurrency']}: "
        f"step {row['step_ms']:.3f} ms, TPOT {row['tpot_ms']:.3f} ms, GPU busy {row['gpu_busy_ms']:.3f} ms; "
        f"host ms/step: {phases}",
        flush=True,
    )
    if row["host_profile"]:
        print(row["host_profile"], flush=True)
    for name, ms, count in row["kernel_table"]:
        print(f"  {ms:8.3f} ms/step {count:6.1f}/step  {name}", flush=True)
    if row["gap_table"]:
        print("  device idle charged to the activity after it (µs a step: gap, busy; count a step):")
    for name, gap_us, busy_us, count in row["gap_table"]:
        print(f"  gap {gap_us:7.1f} busy {busy_us:7.1f} {count:6.1f}/step  {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=200)
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--contexts", type=int, nargs="*", default=[])
    parser.add_argument("--context-requests", type=int, default=2)
    parser.add_argument("--long-prompts", type=int, default=0)
    parser.add_argument("--long-len", type=int, default=65536)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=1024)
    parser.add_argument("--skip-settings", action="store_true", help="only --contexts / --long-prompts")
    parser.add_argument(
        "--speculative-config", default=None, help="as hy3c serve's (MTP): also times its graphs"
    )
    parser.add_argument("--json-schema", default=None, help="every request under this JSON schema")
    parser.add_argument("--random-weights", type=int, default=None, help="as hy3c serve's")
    parser.add_argument("--overlap", choices=("both", "on", "off"), default="both")
    parser.add_argument("--host-profile", action="store_true", help="cProfile one more window per setting")
    parser.add_argument("--kernel-table", action="store_true", help="each setting's top device kernels")
    parser.add_argument(
        "--written",
        choices=("both", "on", "off"),
        default="on",
        help="decode steps written into the graphs' inputs (on), staged from batches (off), or both;"
        " off also runs sampled speculative steps uncaptured",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="requests sampled (seeded) at it")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--gap-table", action="store_true", help="each setting's device idle, by the activity that ends it"
    )
    args = parser.parse_args()
    global TEMPERATURE, TOP_P
    TEMPERATURE, TOP_P = args.temperature, args.top_p
    options = ServeOptions(
        artifact=args.artifact,
        random_weights=args.random_weights,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        speculative_config=args.speculative_config,
    )
    engine, _, _ = build_engine(options)
    if args.json_schema is not None:
        from hy3c.serve.agent.structured import Grammars, GrammarSpec

        global GRAMMAR
        grammars = Grammars(engine.tokenizer, engine.runner.config.vocab_size)
        GRAMMAR = grammars.compile(GrammarSpec("json", json.loads(args.json_schema), "--json-schema"))
    clock = PhaseClock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine._inputs, "build", "inputs.build")
    clock.wrap(core, "_feed_from_device", "feed_from_device")
    clock.wrap(core, "upload_block", "upload_block")
    clock.wrap(engine.runner, "step", "runner.step")
    clock.wrap(core, "sample_async", "sample_async")
    clock.wrap(core, "staged_draws", "staged_draws")
    clock.wrap(core, "sampling_block", "sampling_block")
    clock.wrap(engine.runner, "step_sampled", "runner.step_sampled")
    clock.wrap(engine.runner, "step_written", "runner.step_written")
    clock.wrap(engine._inputs, "write_decode", "inputs.write_decode")
    clock.wrap(engine, "_collect", "collect (incl. wait)")
    clock.wrap(engine, "_emit", "emit")
    clock.wrap(engine.scheduler, "publish", "publish")
    clock.wrap(engine, "_launch", "launch (all)")
    clock.wrap(engine, "_grammar_masks", "grammar masks")
    clock.wrap(core, "fill_masks", "fill_masks")
    clock.wrap(engine._mask_staging, "take", "masks: staging take")
    clock.wrap(engine._mask_staging, "upload", "masks: upload")
    clock.wrap(engine, "_emit_sampled", "emit sampled")
    if args.json_schema is not None:
        import llguidance.torch

        clock.wrap(llguidance.torch, "fill_next_token_bitmask_par", "masks on llguidance's pool")
    rows = []
    salt = 0
    overlaps = {"both": (False, True), "on": (True,), "off": (False,)}[args.overlap]
    for concurrency in [] if args.skip_settings else args.concurrency:
        for overlap in overlaps:
            for staged in {"on": (False,), "off": (True,), "both": (False, True)}[args.written]:
                salt += 1
                # staged: decode steps built as batches and staged into the graph (the path before
                # DecodeInputs), for a before/after in one run
                # (and under speculation, sampled steps uncaptured: the path before CapturedRule)
                launch_written = engine._launch_written
                sampled_steps = getattr(engine.runner, "sampled_spec_steps", None)
                if staged:
                    engine._launch_written = lambda *_: None
                    engine.runner.sampled_spec_steps = None
                rows.append(
                    {**run_setting(engine, clock, overlap, concurrency, args, salt), "staged": staged}
                )
                engine._launch_written = launch_written
                if sampled_steps is not None:
                    engine.runner.sampled_spec_steps = sampled_steps
                report_setting(rows[-1])
        if args.json_schema is not None and True in overlaps:  # again with every mask filled in turn
            from hy3c.serve.agent import structured

            pool_after, structured.PARALLEL_AFTER_S = structured.PARALLEL_AFTER_S, float("inf")
            in_turn, structured.IN_TURN_AT_MOST = structured.IN_TURN_AT_MOST, 1 << 30
            salt += 1
            rows.append({**run_setting(engine, clock, True, concurrency, args, salt), "in_turn": True})
            structured.PARALLEL_AFTER_S, structured.IN_TURN_AT_MOST = pool_after, in_turn
            report_setting(rows[-1])
    if rows:
        print(f"\nengine probe: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.artifact}")
        print(f"input {args.input_len}, output {args.output_len}, profile window {args.profile_steps} steps")
        print("step ms: a decode step, unprofiled; TPOT: over the whole run, profiled window included")
        print(
            "| overlap | C | step ms | tok/s | TPOT ms | step ms, profiled | GPU busy ms/step | GPU idle %, profiled "
            f"| idle in gaps > {LONG_GAP_US:.0f} µs % | kernels/step |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {'on' if r['overlap'] else 'off'}{' (masks in turn)' if r.get('in_turn') else ''}"
                f"{' (staged)' if r.get('staged') else ''} | "
                f"{r['concurrency']} | {r['step_ms']:.3f} | "
                f"{r['tokens_per_s']:.0f} | "
                f"{r['tpot_ms']:.3f} | {r['window_step_ms']:.3f} | {r['gpu_busy_ms']:.3f} | {r['gpu_idle_pct']:.1f} | "
                f"{r['between_steps_idle_pct']:.1f} | "
                f"{r['kernels_per_step']:.0f} |"
            )
        for concurrency in args.concurrency:
            seconds = replay_time(engine.runner, concurrency)
            if seconds is not None:
                print(f"bare decode-graph replay, batch {concurrency}: {seconds * 1e3:.3f} ms")
        print("\nhost ms per step by phase (nested phases count in both):")
        for r in rows:
            listed = ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(r["phases_ms"].items(), key=lambda kv: -kv[1])
            )
            turn = (", masks in turn" if r.get("in_turn") else "") + (", staged" if r.get("staged") else "")
            print(f"  overlap {'on' if r['overlap'] else 'off'}{turn} C={r['concurrency']}: {listed}")
    if args.contexts:
        print(f"\noverlapped decode step by context ({args.context_requests} requests):")
        print(
            "| context tokens | step ms | host ms launching | StepInputs.build ms | schedule ms | collect ms |"
        )
        print("|---|---|---|---|---|---|")
        for context in args.contexts:
            r = context_step(engine, clock, context, args.context_requests)
            ph = r["phases_ms"]
            print(
                f"| {context} | {r['step_ms']:.3f} | {ph.get('launch (all)', 0):.3f} | "
                f"{ph.get('inputs.build', 0):.3f} | {ph.get('schedule', 0):.3f} | "
                f"{ph.get('collect (incl. wait)', 0):.3f} |",
                flush=True,
            )
    if args.long_prompts:
        print(
            f"\ndecode protection: {args.decoders} decoders while {args.long_prompts} prompts of "
            f"{args.long_len} tokens prefill (budget {engine.scheduler.max_num_batched_tokens} tokens per step)"
        )
        print("| prefill chunk cap | prefill s | decoder gaps | median ms | p99 ms | max ms |")
        print("|---|---|---|---|---|---|")
        for threshold in (0, args.long_prefill_token_threshold):
            r = protection(engine, args, threshold)
            cap = "budget" if not threshold else str(threshold)
            print(
                f"| {cap} | {r['prefill_s']:.2f} | {r['gaps']} | {r['median_ms']:.2f} | "
                f"{r['p99_ms']:.2f} | {r['max_ms']:.2f} |",
                flush=True,
            )
    speculative = engine.config.speculative
    if speculative is not None:
        k = speculative.num_speculative_tokens
        print(f"\nspeculative step graphs, K = {k} (bare replays; speedups vs plain decode at that batch):")
        print("| batch | decode ms | verify ms | draft passes ms | α 0.57 | α 0.9 |")
        print("|---|---|---|---|---|---|")
        for concurrency in args.concurrency:
            print(speculation_costs(engine.runner, k, concurrency) or f"| {concurrency} | (no graphs) |")
        alpha = speculative.forced_acceptance
        if alpha is not None:
            length = mean_accepted_length(alpha, k)
            layers = engine.runner.config.num_hidden_layers
            print(
                f"\nmeasured (forced acceptance α {alpha}: {length:.3f} tokens per request and step) against"
                " the ideal from the captured step replayed on the served inputs:"
            )
            print(
                "| overlap | C | tok/s | step ms (served) | graph ms | verify ms | draft ms | ideal tok/s "
                "| measured / ideal | ideal speedup at 80 layers |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                if r["served_graphs"] is None:
                    continue
                whole, verify = r["served_graphs"]
                ideal = length * r["concurrency"] / whole
                draft_s = whole - verify
                projected = length / (1 + draft_s / (verify * 80 / layers))
                print(
                    f"| {'on' if r['overlap'] else 'off'} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
                    f"{r['step_ms']:.3f} | {whole * 1e3:.3f} | {verify * 1e3:.3f} | {draft_s * 1e3:.3f} | "
                    f"{ideal:.0f} | {r['tokens_per_s'] / ideal:.2f} | {projected:.2f}× |"
                )
    if args.skip_settings:
        return
    syncs = find_syncs(engine, args)
    print(f"\nhost synchronisations in 20 steady overlapped steps at C=1: {sum(c for c, _ in syncs)}")
    for count, text in syncs:
        print(f"--- {count}x: {text}")


if __name__ == "__main__":
    main()
