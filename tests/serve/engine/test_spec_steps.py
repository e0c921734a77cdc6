"""Whole speculative decode steps (`hy3c.runtime.spec_graphs`) through the engine: the step body a CUDA
graph captures — chained correction, verify, acceptance, MTP passes — run uncaptured on the CPU gives
the tokens of the uncaptured speculative path and of plain decoding (greedy, K = 1, 2, 3; padded
batches; chained steps; forced acceptance at 1.0 and 0.6), and is used for every steady decode. GPU (`gpu`):
the same through CUDA graph replays."""

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

from .conftest import free_cuda_memory, speculative_engine

PAGE = 4


@pytest.fixture(scope="module")
def cpu_artifact(tiny_ckpt, tmp_path_factory):
    out = compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("art") / "a", checkpoint=tiny_ckpt
    )
    return out.out


def _engine(art, k: int, captured: bool, forced: float | None = None, overlap: bool = True) -> Engine:
    runner = artifact.load(art, "cpu", compile=False)
    speculative = SpeculativeConfig(num_speculative_tokens=k, forced_acceptance=forced) if k else None
    config = EngineConfig(
        num_pages=96,
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
            engine.kv_cache, 32, [1, 2, 4, 8], k, PAGE, engine.speculator.accept_captured, graphs=False
        )
        assert reason is None
    return engine


def _requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}",
            [5 + i, 17, 33 + 2 * i, 9, 41][: 2 + i % 4],
            SamplingParams(temperature=0.0),
            max_tokens=30 + 7 * i,
            ignore_eos=True,
        )
        for i in range(3)
    ]


def _run(engine: Engine) -> tuple[dict[str, list[int]], int, int]:
    """Each request's tokens; the captured steps run, and those of them planned from a step in flight."""
    runs = chained = 0
    steps = getattr(engine.runner, "spec_steps", None)
    if steps is not None:
        run = steps.run

        def counting(batch, chained_from=None):
            nonlocal runs, chained
            runs += 1
            chained += chained_from is not None
            return run(batch, chained_from)

        steps.run = counting
    requests = _requests()
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
@pytest.mark.parametrize("k", [1, 2])
def test_on_cuda_captured_steps_replay_and_give_the_uncaptured_tokens(cuda_artifact, k):
    """The served engine on the GPU: steady greedy decodes replay the captured speculative step, with
    the tokens of the engine whose speculative steps run uncaptured."""
    results = {}
    for captured in (True, False):
        engine = speculative_engine(cuda_artifact, k)
        assert engine.runner.spec_steps is not None and engine.runner.spec_steps.captured
        if not captured:
            engine.runner.spec_steps = None
        results[captured] = _run(engine)
        del engine  # its KV cache goes before the next engine takes one
        free_cuda_memory()
    assert results[True][0] == results[False][0]
    assert results[True][1] > 10 and results[True][2] > 0 and results[False][1] == 0
