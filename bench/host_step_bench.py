"""Host time per decode step of the serving engine against the context length, on the CPU.

Drives the real `Engine` (serve/engine/core.py) with a step model that does no work (fixed logits of
the tiny vocabulary), so what is left of a step is host work: scheduling, building the step's inputs,
collecting, emitting, publishing pages. `--requests` greedy requests whose prompts hold `--contexts`
tokens each are prefilled, then decoded; per context it reports the median over the decode steps of
the engine's own host time (`EngineMetrics.step`'s `host_seconds`, the `hy3c:engine_host_seconds`
histogram) and of the wall time of one engine iteration (the sampler included), the fastest of
`--rounds` runs (other processes' load only ever adds). The page size is the h20-w8a8c8 recipe's (64).

`--builder step-inputs` runs the engine as it is — its batches from `StepInputs`
(serve/engine/step_inputs.py), pages published from each sequence's cursor (`PagePool.publish(...,
since)`), penalties read from the device-side `TrackedPenalties`; `build_step_batch` patches the engine
back to what it was before issue 27 — the page table rebuilt each step, the walk from page 0, the
penalties' seen tokens and counts rebuilt from the host lists each step; `both` (the default) measures
both. `--repetition-penalty` makes the requests sample with one; `--profile` prints cProfile's
heaviest functions over each run's decode steps.

    python bench/host_step_bench.py [--contexts 1024 32768 131072] [--requests 2] [--steps 300]
        [--rounds 3] [--builder build_step_batch|step-inputs|both] [--repetition-penalty 1.1] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from tqdm import tqdm

from hy3c.checkpoint.tiny_tokenizer import train_tiny_tokenizer
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.config import Hy3Config, preset_config
from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
from hy3c.recipe import load_recipe
from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest
from hy3c.serve.engine.metrics import EngineMetrics
from hy3c.serve.engine.sampler import History, SamplingParams
from hy3c.serve.engine.scheduler import Sequence

BUILDERS = ("build_step_batch", "step-inputs")


class IdleModel:
    """A `StepModel` that computes nothing: every logits row is the same fixed vector (greedy draws
    one token that is no EOS), the hidden states are uninitialized."""

    def __init__(self, config: Hy3Config) -> None:
        self.config = config
        row = torch.randn(config.vocab_size, generator=torch.Generator().manual_seed(0))
        row[config.eos_token_ids] = -1e9
        self._logits = row.expand(4096, -1)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        return torch.empty(0)

    def step(self, batch: StepBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = batch.logits_indices.shape[0]
        return self._logits[:rows], torch.empty(batch.input_ids.shape[0], 1)


class HostTimes(EngineMetrics):
    """Engine metrics that also keep each step's host seconds and fed tokens."""

    def __init__(self, max_model_len: int) -> None:
        super().__init__(max_model_len)
        self.steps: list[tuple[float, int]] = []

    def step(self, seconds: float, host_seconds: float, tokens: int, preemptions: int) -> None:
        super().step(seconds, host_seconds, tokens, preemptions)
        self.steps.append((host_seconds, tokens))


def use_build_step_batch(engine: Engine) -> None:
    """Make this engine build its batches as before `StepInputs` (this process only): the page table
    rebuilt from every chunk's pages each step (`build_step_batch`)."""
    page_size, device = engine.config.page_size, engine.runner.device

    def build(chunks: list[SeqChunk], owners: list[Sequence], feed=()) -> StepBatch:
        return build_step_batch(chunks, page_size, device)

    engine._inputs.build = build


def publish_from_page_zero(engine: Engine) -> None:
    """Make this engine's pool walk every request's pages from the first when publishing (this process
    only), as before the scheduler kept a cursor per sequence (`PagePool.publish(..., since)`)."""
    pool = engine.pool
    publish = pool.publish

    def publish_all(
        tokens: list[int], pages: list[int], computed: int, keys: list[bytes], since: int = 0
    ) -> int:
        return publish(tokens, pages, computed, keys)

    pool.publish = publish_all


def measure(
    context: int,
    tokenizer: Hy3Tokenizer,
    args: argparse.Namespace,
    builder: str,
) -> tuple[float, float, str]:
    """Median host and loop milliseconds per decode step at `context` prompt tokens per request (host:
    the engine's `host_seconds`; loop: the wall time of an engine iteration, the sampler included),
    and the profile text (empty without `--profile`)."""
    config = preset_config("tiny")
    requests, steps, page_size = args.requests, args.steps, args.page_size
    max_len = context + steps + 64
    pages = requests * (-(-max_len // page_size)) + 8
    metrics = HostTimes(max_len)
    engine = Engine(
        IdleModel(config),
        tokenizer,
        EngineConfig(pages, page_size, max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=max_len),
        metrics,
    )
    params = SamplingParams(temperature=0.0, repetition_penalty=args.repetition_penalty)
    loops: list[float] = []
    profiler = cProfile.Profile() if args.profile else None
    try:
        if builder != "step-inputs":
            use_build_step_batch(engine)
            publish_from_page_zero(engine)
            engine._history = lambda live: History(live.request.prompt_ids, live.output)
        generator = torch.Generator().manual_seed(context)
        for r in range(requests):
            prompt = torch.randint(3, config.vocab_size, (context,), generator=generator).tolist()
            engine.submit(
                GenerationRequest(f"r{r}", prompt, params, steps, ignore_eos=True), lambda out: None
            )
        label = f"{builder} {context // 1024}K x{requests}"
        with tqdm(total=steps, desc=label, leave=False, file=sys.stderr) as bar:
            decoding = False
            while True:
                started = time.perf_counter()
                if not engine._iterate():
                    break
                if decoding:
                    loops.append(time.perf_counter() - started)
                    bar.update(1)
                elif metrics.steps and metrics.steps[-1][1] == requests:  # the first decode step collected
                    decoding = True
                    if profiler is not None:
                        profiler.enable()
    finally:
        if profiler is not None:
            profiler.disable()
    decode = [host for host, tokens in metrics.steps if tokens == requests]
    text = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
        text = out.getvalue()
    # the first decode steps warm caches up; the last ones end requests
    host = statistics.median(decode[10:-10] or decode)
    loop = statistics.median(loops[10:-10] or loops)
    return 1e3 * host, 1e3 * loop, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768, 131072])
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="decode steps per request")
    parser.add_argument("--rounds", type=int, default=3, help="runs per context; the fastest median counts")
    parser.add_argument("--page-size", type=int, default=load_recipe("h20-w8a8c8").serving.page_size)
    parser.add_argument("--builder", choices=(*BUILDERS, "both"), default="both")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    if min(args.requests, args.steps, args.rounds, args.page_size, *args.contexts) < 1:
        parser.error("--requests, --steps, --rounds, --page-size and every --contexts value must be ≥ 1")
    tokenizer = Hy3Tokenizer(train_tiny_tokenizer(preset_config("tiny").vocab_size), None, {})
    builders = BUILDERS if args.builder == "both" else (args.builder,)
    results: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(args.rounds):  # rounds interleave builders and contexts: load from elsewhere hits all
        for builder in builders:
            for context in args.contexts:
                host, loop, text = measure(context, tokenizer, args, builder)
                if text:
                    print(f"--- {builder}, profile at {context} tokens x {args.requests} ---\n{text}")
                best = results.get((builder, context), (host, loop))
                results[builder, context] = (min(best[0], host), min(best[1], loop))
    print(
        f"{args.requests} requests, page size {args.page_size}, repetition penalty {args.repetition_penalty},"
        f" fastest median of {args.rounds} rounds"
    )
    print(f"{'builder':<18}{'context':>8}{'host ms/step':>14}{'vs 1st':>8}{'loop ms/step':>14}{'vs 1st':>8}")
    for builder in builders:
        base = results[builder, args.contexts[0]]
        for context in args.contexts:
            host, loop = results[builder, context]
            print(
                f"{builder:<18}{context:>8}{host:>14.3f}{host / base[0]:>7.2f}x{loop:>14.3f}{loop / base[1]:>7.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
