"""Whole speculative decode steps (`hy3c.runtime.spec_graphs`) through the engine: the step body a CUDA
graph captures — chained correction, verify, acceptance, MTP passes — run uncaptured on the CPU gives
the tokens of the uncaptured speculative path and of plain decoding (greedy, K = 1, 2, 3; padded
batches; chained steps; forced acceptance at 1.0 and 0.6), and is used for every steady decode; with
seeded sampled requests, the captured sampled step gives the uncaptured path's tokens (also under
preemption). GPU (`gpu`): the same through CUDA graph replays."""

from __future__ import annotations

import pytest
import torch

import hy3c.runtime.artifact as artifact
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.runtime.spec_graphs import SpecDecodeSteps
from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.engine.spec_decode import SpeculativeConfig
from hy3c.serve.engine.speculation import DraftProbs

from .conftest import free_cuda_memory, speculative_engine

PAGE = 4


@pytest.fixture(scope="module")
def cpu_artifact(tiny_ckpt, tmp_path_factory):
    out = compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("art") / "a", checkpoint=tiny_ckpt
    )
    return out.out


def _engine(
    art, k: int, captured: bool, forced: float | None = None, overlap: bool = True, num_pages: int = 96
) -> Engine:
    runner = artifact.load(art, "cpu", compile=False)
    speculative = SpeculativeConfig(num_speculative_tokens=k, forced_acceptance=forced) if k else None
    config = EngineConfig(
        num_pages=num_pages,
        page_size=PAGE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        speculative=speculative,
        async_scheduling=overlap,
    )
    engine = Engine(runner, Hy3Tokenizer.from_dir(art), config)
    if captured:
        assert engine.speculator is not None
        reason = runner.capture_spec_steps(
            engine.kv_cache, 32, [1, 2, 4, 8], k, PAGE, engine.speculator.captured_rule(), graphs=False
        )
        assert reason is None
        if forced is None:  # batches with sampled requests: the captured sampled steps
            engine.speculator.probs.reserve(config.max_num_seqs, runner.config.vocab_size, "cpu")
            rule = engine.speculator.captured_rule(sampled=True)
            assert (
                runner.capture_spec_steps(engine.kv_cache, 32, [1, 2, 4], k, PAGE, rule, False, True) is None
            )
    return engine


SAMPLED = [
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=12),
    SamplingParams(temperature=0.6, min_p=0.05, seed=13),
]


def _requests(sampled: bool = False) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}",
            [5 + i, 17, 33 + 2 * i, 9, 41][: 2 + i % 4],
            SAMPLED[i] if sampled and i else SamplingParams(temperature=0.0),
            max_tokens=30 + 7 * i,
            ignore_eos=True,
        )
        for i in range(3)
    ]


def _run(engine: Engine, sampled: bool = False) -> tuple[dict[str, list[int]], int, int]:
    """Each request's tokens; the captured steps run (greedy and sampled ones), and those of them
    planned from a step in flight."""
    runs = chained = 0
    for name in ("spec_steps", "sampled_spec_steps"):
        steps = getattr(engine.runner, name, None)
        if steps is None:
            continue

        def counting(batch, chained_from=None, params=None, run=steps.run):
            nonlocal runs, chained
            runs += 1
            chained += chained_from is not None
            return run(batch, chained_from, params)

        steps.run = counting
    requests = _requests(sampled)
    outputs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request, outputs[request.request_id].append)
    engine.run_until_done()
    assert engine.pool.num_free == engine.pool.usable, "pages leaked"
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}, runs, chained


@pytest.fixture(scope="module")
def plain(cpu_artifact):
    return _run(_engine(cpu_artifact, 0, False))[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_captured_step_body_gives_the_tokens_of_plain_decoding(cpu_artifact, plain, k):
    """Greedy: the captured step body (most drafts refused on random weights, so the correction and
    rollback run every step) emits what plain decoding and the uncaptured speculative path emit;
    steps planned from the one in flight are corrected inside it."""
    tokens, runs, chained = _run(_engine(cpu_artifact, k, True))
    assert tokens == plain
    assert runs > 10 and chained > 0
    uncaptured, _, _ = _run(_engine(cpu_artifact, k, False))
    assert uncaptured == plain
    read_first, runs, chained = _run(_engine(cpu_artifact, k, True, overlap=False))
    assert read_first == plain and runs > 10 and chained == 0


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_captured_step_body_under_forced_acceptance(cpu_artifact, alpha):
    """Forced acceptance: at 1.0 every draft is accepted (K + 1 tokens a step, the recursion at its
    deepest positions); at 0.6 the coins decide, drawn for real rows only (3 requests padded to a
    captured size of 4), so the captured path makes the uncaptured path's decisions."""
    captured, runs, chained = _run(_engine(cpu_artifact, 2, True, forced=alpha))
    uncaptured, _, _ = _run(_engine(cpu_artifact, 2, False, forced=alpha))
    assert captured == uncaptured and runs > 0 and chained > 0


@pytest.mark.parametrize("k", [1, 2])
def test_captured_sampled_steps_give_the_uncaptured_tokens(cpu_artifact, k):
    """Batches with seeded sampled requests (one greedy beside them; filters and none) replay the
    captured sampled step: the rejection rule, drafts drawn from q kept by slot, the seeds drawn in the
    uncaptured path's order — the same tokens as the uncaptured path, chained steps included, with
    overlap and without, and under preemption by a small page pool."""
    uncaptured, runs, _ = _run(_engine(cpu_artifact, k, False), sampled=True)
    assert runs == 0
    captured, runs, chained = _run(_engine(cpu_artifact, k, True), sampled=True)
    assert captured == uncaptured and runs > 10 and chained > 0
    read_first, runs, chained = _run(_engine(cpu_artifact, k, True, overlap=False), sampled=True)
    assert read_first == uncaptured and runs > 10 and chained == 0
    tight = _engine(cpu_artifact, k, False, num_pages=20)
    expected = _run(tight, sampled=True)[0]
    assert tight.scheduler.num_preemptions > 0
    engine = _engine(cpu_artifact, k, True, num_pages=20)
    tokens, runs, _ = _run(engine, sampled=True)
    assert tokens == expected and runs > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.speculator.probs._slots == {}  # every slot let go


def test_the_padding_block_keeps_the_zero_row_zero(cpu_artifact):
    """The capture's warm-up runs the sampled rule on the padding block: greedy rows writing the
    scratch row, never the zero row (which requests without draft distributions read)."""
    engine = _engine(cpu_artifact, 1, True)
    with torch.no_grad():
        engine.runner.sampled_spec_steps.steps[2].body()  # what a capture's warm-up runs
    probs = engine.speculator.probs.probs
    assert probs[DraftProbs.ZERO].abs().sum() == 0 and not probs.isnan().any()


def test_captured_steps_refuse_without_a_device_or_drafts():
    kv = torch.zeros(1)
    accept = torch.eq
    assert (
        SpecDecodeSteps.capture(None, None, kv, [1], 4, 1, PAGE, accept) == "CUDA graphs need a CUDA device"
    )
    assert "no speculative step" in SpecDecodeSteps.capture(
        None, None, kv, [1], 4, 0, PAGE, accept, graphs=False
    )


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_on_cuda_captured_steps_replay_and_give_the_uncaptured_tokens(cuda_artifact, k, sampled):
    """The served engine on the GPU: steady decodes — greedy, and seeded sampled beside a greedy one —
    replay the captured speculative steps, with the tokens of the engine whose speculative steps run
    uncaptured."""
    results = {}
    for captured in (True, False):
        engine = speculative_engine(cuda_artifact, k)
        for steps in (engine.runner.spec_steps, engine.runner.sampled_spec_steps):
            assert steps is not None and steps.captured
        if not captured:
            engine.runner.spec_steps = engine.runner.sampled_spec_steps = None
        results[captured] = _run(engine, sampled)
        del engine  # its KV cache goes before the next engine takes one
        free_cuda_memory()
    assert results[True][0] == results[False][0]
    assert results[True][1] > 10 and results[True][2] > 0 and results[False][1] == 0
