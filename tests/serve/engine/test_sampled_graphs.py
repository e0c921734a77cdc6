"""Decode graphs that draw the next tokens themselves (issue 27: the fused sampler captured with the
decode step). CPU: the engine takes that path exactly for decode steps whose rows need nothing but the
draw (no penalties, bias or logprobs, no prompt rows) and its outputs equal the plain path's; the
parameter block's layout. GPU (`gpu`): replays with sampling equal the uncaptured step followed by
the fused sampler with the same seeds, at every captured batch size, padded or not."""

from __future__ import annotations

import pytest
import torch

import hy3c.runtime.artifact as artifact
from hy3c.compiler.driver import compile_artifact
from hy3c.model import SeqChunk, build_step_batch
from hy3c.ops.sample import SKIP_DRAW, block_columns
from hy3c.recipe import load_recipe
from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams, block_of, has_penalties

PAGE = 4


class GraphSampling:
    """The eager model, with a `step_sampled` like a runner's decode graphs with a sampler: decode
    batches (one token per request) are stepped and drawn by `hy3.sample`'s reference from the
    parameter block; anything else is refused (None)."""

    sampling_width = 8

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.sampled_steps = 0
        self.wide_decode_steps = 0  # decode steps of more requests than the block has columns
        self.blocks: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        return self.model.allocate_kv_cache(num_pages, page_size)

    def step(self, batch, kv_cache):
        b = batch.seq_lens.shape[0]
        self.wide_decode_steps += batch.input_ids.shape[0] == b > self.sampling_width
        return self.model.step(batch, kv_cache)

    def step_sampled(self, batch, kv_cache, block):
        b = batch.seq_lens.shape[0]
        if batch.input_ids.shape[0] != b or block.shape != (5, self.sampling_width):
            return None
        logits, hidden = self.model.step(batch, kv_cache)
        tokens, chosen, *_ = torch.ops.hy3.sample(logits, *block_columns(block, b), None, 0)
        self.sampled_steps += 1
        self.blocks.append(block)
        return logits, hidden, tokens, torch.stack([tokens.double(), chosen.double()], 1)


def _run(runner, tokenizer, requests: list[GenerationRequest], overlap: bool = True) -> dict[str, list[int]]:
    config = EngineConfig(
        num_pages=96, page_size=PAGE, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=96
    )
    config.async_scheduling = overlap
    engine = Engine(runner, tokenizer, config)
    outputs: dict[str, list[StepOutput]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.submit(request, outputs[request.request_id].append)
    engine.run_until_done()
    return {name: [t for out in outs for t in out.token_ids] for name, outs in outputs.items()}


def _greedy(count: int, **extra) -> list[GenerationRequest]:
    prompts = [[5 + i, 17, 33 + 2 * i, 9][: 2 + i % 3] for i in range(count)]
    return [
        GenerationRequest(
            f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=9 + i, ignore_eos=True, **extra
        )
        for i, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_steps_draw_in_the_graph_with_the_plain_paths_outputs(model, tokenizer, overlap):
    requests = _greedy(5)
    plain = _run(model, tokenizer, requests, overlap)
    runner = GraphSampling(model)
    assert _run(runner, tokenizer, _greedy(5), overlap) == plain
    assert runner.sampled_steps > 0  # every decode step of up to 8 requests
    assert all(block.dtype == torch.int32 and block.shape == (5, 8) for block in runner.blocks)


def test_rows_needing_more_than_a_draw_take_the_plain_path(model, tokenizer):
    runner = GraphSampling(model)
    _run(runner, tokenizer, _greedy(3, num_logprobs=2))  # logprobs: the sampler reads the logits again
    assert runner.sampled_steps == 0
    penalised = _greedy(2)
    penalised[1].params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    _run(runner, tokenizer, penalised)
    assert runner.sampled_steps == 0
    # 10 requests decode together (wider than the block: the plain path) until fewer than 9 are left
    many = [
        GenerationRequest(f"m{i}", [3, 4 + i], SamplingParams(temperature=0.0), 3 + i, ignore_eos=True)
        for i in range(10)
    ]
    plain = _run(model, tokenizer, many)
    assert _run(runner, tokenizer, many) == plain
    assert runner.wide_decode_steps > 0 and runner.sampled_steps > 0


def test_parameter_block_layout():
    params = [SamplingParams(temperature=0.5, top_p=0.9, top_k=7, min_p=0.1), SamplingParams(temperature=0.0)]
    block = block_of(params, [11, 0], width=8)
    assert block.shape == (5, 8) and block.dtype == torch.int32
    temperature, top_k, top_p, min_p, seeds = block_columns(block, 2)
    assert temperature.tolist() == [0.5, 0.0] and top_k.tolist() == [7, 0] and seeds.tolist() == [11, 0]
    assert top_p[0].item() == pytest.approx(0.9) and min_p[0].item() == pytest.approx(0.1)
    assert block_of(params, [1, 2]).shape == (5, 4)  # rows padded to a multiple of 4
    assert block[3, 2:].tolist() == [SKIP_DRAW] * 6  # a graph's padding rows are not drawn
    assert block_of(params * 3, [1] * 6, width=4).shape == (5, 8)  # never fewer columns than rows
    assert not has_penalties(params[0])
    assert has_penalties(SamplingParams(logit_bias=((3, 1.0),)))
    assert has_penalties(SamplingParams(presence_penalty=0.5))


@pytest.fixture(scope="module")
def cuda_runner(tiny_ckpt, tmp_path_factory):
    out = compile_artifact(
        load_recipe("h200-bf16"), tmp_path_factory.mktemp("art") / "h200", checkpoint=tiny_ckpt
    )
    return artifact.load(out.out, device="cuda", compile=False)


def _decode_batch(count: int):
    chunks = [SeqChunk([3 + i], 5 + i, [2 * i + 1, 2 * i + 2], "last") for i in range(count)]
    return build_step_batch(chunks, 16, "cuda")


@pytest.mark.gpu
def test_sampled_replays_equal_the_step_then_the_fused_sampler(cuda_runner):
    from hy3c.kernels.sampler.fused_sampler import fused_sample

    runner = cuda_runner
    kv = runner.allocate_kv_cache(64, 16)
    assert runner.capture_decode_graphs(kv, max_pages=4, batch_sizes=[1, 2, 4]) is None
    width = runner.sampling_width
    assert width == 4
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, min_p=0.05),
    ]
    for count in (4, 1, 3, 2):  # exact, then smaller (padded) batches
        params = kinds[:count]
        block = block_of(params, [101 + r for r in range(count)], width)
        batch = _decode_batch(count)
        reference_kv = kv.clone()
        logits, _ = runner(*batch.model_args(reference_kv))
        expected, expected_logprobs = fused_sample(logits, *block_columns(block.cuda(), count))
        drawn = runner.step_sampled(batch, kv, block)
        assert drawn is not None
        _, _, tokens, pair = drawn
        assert tokens.tolist() == expected.tolist()
        assert pair.is_contiguous() and pair[:, 0].long().tolist() == expected.tolist()
        torch.testing.assert_close(pair[:, 1].float(), expected_logprobs, atol=2e-2, rtol=2e-2)
    # a replay for the logits alone (the engine samples them itself) skips the captured draws, whatever
    # the last sampled replay's parameters were, and the next sampled replay draws as before
    graphs = runner.step_graphs[1]
    batch = _decode_batch(4)
    block = block_of([kinds[1]] * 4, [7, 8, 9, 10], width)
    eager, _ = runner(*batch.model_args(kv.clone()))  # (the graphs run on the captured cache only)
    runner.step_sampled(batch, kv, block)
    logits, _ = runner.step(batch, kv)
    torch.testing.assert_close(logits, eager, atol=2e-2, rtol=2e-2)
    assert graphs.sampling[3].tolist() == [SKIP_DRAW] * width
    expected, _ = fused_sample(eager, *block_columns(block.cuda(), 4))
    assert runner.step_sampled(batch, kv, block)[2].tolist() == expected.tolist()
    assert graphs.sampling[3].tolist() == [20] * width
    with pytest.raises(ValueError, match="parameter block"):
        runner.step_sampled(_decode_batch(1), kv, block_of(kinds[:1], [0], 8))  # not the graphs' width
    prefill = build_step_batch([SeqChunk([3, 4], 0, [1], "last")], 16, "cuda")
    assert runner.step_sampled(prefill, kv, block_of(kinds[:1], [0], width)) is None


@pytest.mark.gpu
def test_draws_reach_the_host_without_blocking_on_the_device():
    """The staged copy of a step's draws returns while the stream is busy (a strided pinned view
    would be staged through pageable memory and wait for the device)."""
    from hy3c.serve.engine.sampler import HostStaging, staged_draws

    staging = HostStaging()
    for rows in (3, 1, 70):  # below and above the first buffer's size
        assert staging.take(rows).is_contiguous() and staging.take(rows).shape == (rows, 2)
    pair = torch.stack(
        [torch.arange(5, device="cuda").double(), torch.full((5,), -0.5, device="cuda").double()], 1
    )
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for a while (~0.1 s)
    pending = staged_draws(pair[:, 0].long(), pair, staging)
    assert not torch.cuda.current_stream().query()  # returned before the device got there
    result = pending.result()
    assert result.tokens == [0, 1, 2, 3, 4] and result.logprobs == [-0.5] * 5
