"""Decode steps written into the sampled decode graphs' inputs with one copy (issue 27: the GPU idled
~6% of a batch-1 step on the device operations that staged a batch between two graphs).

CPU: the decode graphs built uncaptured (`DecodeGraphs.capture(..., graphs=False)`) over the eager
model, the engine's outputs — greedy and seeded sampled, overlap on and off, batches growing and
shrinking, requests joining from a prefill, preemption by a tiny page pool — equal those of the same
graphs staged from batches (`run_sampled`), and the greedy ones those of the plain engine; the written
inputs' layout, padding and mirrors. GPU (`gpu`): a captured replay of a written step equals the
staged replay of the same batch, the in-flight tokens fed from the previous replay's draws."""

from __future__ import annotations

import pytest
import torch

from hy3c.model import SeqChunk, build_step_batch
from hy3c.ops.sample import SKIP_DRAW, block_columns
from hy3c.runtime.cuda_graphs import DecodeGraphs, DecodeInputs
from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams, block_of

PAGE = 4
SIZES = [1, 2, 4, 8]


def reference_draws(logits: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_pair` by `hy3.sample`'s reference: the block's rows that draw (not SKIP_DRAW) drawn with
    their seeds, the others token 0."""
    rows = logits.shape[0]
    columns = block_columns(block, rows)
    live = columns[1] != SKIP_DRAW
    tokens = torch.zeros(rows, dtype=torch.long)
    chosen = torch.zeros(rows)
    if live.any():
        drawn, logprobs, *_ = torch.ops.hy3.sample(logits[live], *(c[live] for c in columns), None, 0)
        tokens[live], chosen[live] = drawn, logprobs.float()
    return tokens, torch.stack([tokens.double(), chosen.double()], 1)


class GraphRunner:
    """The eager model behind sampled decode graphs as a runner holds them (`step`, `step_sampled`,
    `decode_graphs`, `step_written`), built uncaptured once the engine's cache exists (`build`)."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.graphs: DecodeGraphs | None = None
        self.written = 0
        self.staged = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.graphs

    @property
    def sampling_width(self) -> int | None:
        return None if self.graphs is None else self.graphs.sampling_width

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        return self.model.allocate_kv_cache(num_pages, page_size)

    def build(self, kv_cache: torch.Tensor, max_pages: int) -> None:
        graphs = DecodeGraphs.capture(
            self.model, None, kv_cache, SIZES, max_pages, sampler=reference_draws, graphs=False
        )
        assert isinstance(graphs, DecodeGraphs) and not graphs.captured
        self.graphs = graphs

    def step(self, batch, kv_cache):
        out = None if self.graphs is None else self.graphs.run(batch, kv_cache)
        return out if out is not None else self.model.step(batch, kv_cache)

    def step_sampled(self, batch, kv_cache, block):
        out = self.graphs.run_sampled(batch, kv_cache, block)
        self.staged += out is not None
        return out

    def step_written(self, b, table):
        self.written += 1
        return self.graphs.replay_written(b, table)


def _engine(runner, tokenizer, overlap: bool, num_pages: int = 96, written: bool = True) -> Engine:
    config = EngineConfig(
        num_pages=num_pages, page_size=PAGE, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=96
    )
    config.async_scheduling = overlap
    engine = Engine(runner, tokenizer, config)
    if isinstance(runner, GraphRunner):
        runner.build(engine.kv_cache, -(-config.max_model_len // PAGE))
    if not written:
        engine._launch_written = lambda *args: None
    return engine


def _run(engine: Engine, requests: list[GenerationRequest], late: list[GenerationRequest] = ()) -> dict:
    """Every request's tokens; `late` ones are submitted after a few steps (they join from a prefill)."""
    outputs: dict[str, list[StepOutput]] = {r.request_id: [] for r in [*requests, *late]}
    for request in requests:
        engine.submit(request, outputs[request.request_id].append)
    for _ in range(6):
        engine._iterate()
    for request in late:
        engine.submit(request, outputs[request.request_id].append)
    engine.run_until_done()
    assert engine.pool.num_free == engine.pool.usable, "pages leaked"
    return {name: [t for out in outs for t in out.token_ids] for name, outs in outputs.items()}


def _requests(count: int, salt: int = 0, sampled: bool = True) -> list[GenerationRequest]:
    requests = []
    for i in range(count):
        prompt = [5 + i + salt, 17, 33 + 2 * i, 9, 40 + salt][: 2 + (i + salt) % 4]
        params = SamplingParams(temperature=0.0)
        if sampled and i % 2:
            params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i + salt)
        requests.append(
            GenerationRequest(f"r{salt}-{i}", prompt, params, max_tokens=5 + 3 * i, ignore_eos=True)
        )
    return requests


@pytest.mark.parametrize("overlap", [True, False])
def test_written_steps_equal_staged_steps(model, tokenizer, overlap):
    staged = GraphRunner(model)
    expected = _run(_engine(staged, tokenizer, overlap, written=False), _requests(6), _requests(3, salt=7))
    assert staged.staged > 0 and staged.written == 0
    runner = GraphRunner(model)
    assert _run(_engine(runner, tokenizer, overlap), _requests(6), _requests(3, salt=7)) == expected
    assert runner.written > 0
    greedy = _run(_engine(model, tokenizer, overlap), _requests(6, sampled=False))
    assert _run(_engine(GraphRunner(model), tokenizer, overlap), _requests(6, sampled=False)) == greedy


def test_written_steps_under_preemption_and_with_other_steps_between(model, tokenizer):
    """A page pool that forces preemptions (rows written again from scratch), and requests with
    logprobs beside others (their steps are staged batches, fed from tokens the written steps drew)."""
    logprobs = GenerationRequest(
        "lp", [7, 8, 9], SamplingParams(temperature=0.0), 12, ignore_eos=True, num_logprobs=1
    )
    requests = [*_requests(8), logprobs]
    expected = _run(_engine(GraphRunner(model), tokenizer, True, num_pages=14, written=False), requests)
    runner = GraphRunner(model)
    engine = _engine(runner, tokenizer, True, num_pages=14)
    assert _run(engine, requests) == expected
    assert runner.written > 0 and engine.scheduler.num_preemptions > 0


def test_inputs_layout_padding_and_mirrors():
    inputs = DecodeInputs(6, max_pages=3, device=torch.device("cpu"))
    assert inputs.size == inputs.width == 8  # columns 16-byte aligned
    block = block_of([SamplingParams(temperature=0.5, top_k=3)] * 3, [1, 2, 3], width=8)
    inputs.write([11, 12, 13], [4, 5, 6], [40, 41, -1], [-1, 2, 0], [5, 6, 7], [2, 0, 1], block)
    assert inputs.wide[:, :4].tolist() == [[11, 12, 13, 0], [4, 5, 6, 0], [40, 41, -1, -1], [-1, 2, 0, -1]]
    assert inputs.lengths.tolist() == [5, 6, 7, 1, 1, 1, 1, 1] and inputs.rows[:4].tolist() == [2, 0, 1, 0]
    assert inputs.sampling[3].tolist() == [3, 3, 3] + [SKIP_DRAW] * 5
    table = torch.arange(12, dtype=torch.int32).view(4, 3)
    inputs.gather_pages(3, table)
    assert inputs.page_table[:3].tolist() == [[6, 7, 8], [0, 1, 2], [3, 4, 5]]
    # a smaller step after it, into the other mirror and then the first again: the columns past it
    # are padding in the device buffer, the graphs' table and either mirror
    for _ in range(2):
        inputs.write([21], [9], [50], [-1], [10], [3], block_of([SamplingParams()], [4], width=8))
        inputs.gather_pages(1, table)
        assert inputs.wide[:, :3].tolist() == [[21, 0, 0], [9, 0, 0], [50, -1, -1], [-1, -1, -1]]
        assert inputs.lengths[:3].tolist() == [10, 1, 1] and inputs.page_table[1:3].tolist() == [[0] * 3] * 2
        assert inputs.sampling[3, 1:].tolist() == [SKIP_DRAW] * 7
    with pytest.raises(ValueError, match="9 requests"):
        inputs.write(*[[0] * 9] * 6, block)
    with pytest.raises(ValueError, match="block"):
        inputs.write([1], [1], [1], [-1], [2], [0], block_of([SamplingParams()], [4], width=4))
    with pytest.raises(ValueError, match="page table of 2 pages"):
        inputs.gather_pages(1, table[:, :2])


# ---- GPU -------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_written_replays_equal_staged_replays(cuda_artifact):
    import hy3c.runtime.artifact as artifact

    runner = artifact.load(cuda_artifact, device="cuda", compile=False)
    kv = runner.allocate_kv_cache(64, 16)
    assert runner.capture_decode_graphs(kv, max_pages=4, batch_sizes=[1, 2, 4]) is None
    graphs = runner.decode_graphs
    width = graphs.sampling_width
    table = torch.zeros(8, 4, dtype=torch.int32, device="cuda")
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, top_p=0.9)]
    previous = None
    for count in (4, 1, 3, 2, 4):  # exact and padded sizes, shrinking and growing
        params = [kinds[r % 2] for r in range(count)]
        block = block_of(params, [31 + r for r in range(count)], width)
        ids = [3 + r for r in range(count)]
        chunks = [SeqChunk([ids[r]], 5 + r, [2 * r + 1, 2 * r + 2], "last") for r in range(count)]
        batch = build_step_batch(chunks, 16, "cuda")
        feed = [-1] * count
        if previous is not None:  # request 0's token is the previous step's draw of its row 1 or 0
            feed[0] = min(1, previous.shape[0] - 1)
            batch.input_ids[0] = previous[feed[0]]
        for r in range(count):
            table[r, :2] = torch.tensor([2 * r + 1, 2 * r + 2])
        staged_kv = kv.clone()
        logits, _, tokens, pair = (t.clone() for t in runner.step_sampled(batch, kv, block))
        kv_after, kv[:] = kv.clone(), staged_kv
        if previous is not None:
            graphs.inputs.drawn[: previous.shape[0]].copy_(previous)
        positions = [5 + r for r in range(count)]
        slots = [(2 * r + 1) * 16 + 5 + r for r in range(count)]
        graphs.inputs.write(
            ids, positions, slots, feed, [6 + r for r in range(count)], list(range(count)), block
        )
        written_logits, _, written_tokens, written_pair = runner.step_written(count, table)
        torch.testing.assert_close(written_logits, logits)
        assert written_tokens.tolist() == tokens.tolist()
        torch.testing.assert_close(written_pair, pair)
        torch.testing.assert_close(kv, kv_after)
        previous = tokens


@pytest.mark.gpu
def test_on_cuda_the_served_engine_writes_its_decode_steps_and_changes_nothing(cuda_artifact):
    """The engine `hy3c serve` builds, on the GPU: steady decodes are written steps, launched back to
    back under overlap (the mirrors taken in turn, batches shrinking as requests end), with the tokens
    of the same engine staging every step from a batch — greedy and seeded sampled alike."""
    from hy3c.serve.http.server import ServeOptions, build_engine

    from .conftest import free_cuda_memory

    results = {}
    for written in (True, False):
        engine = build_engine(ServeOptions(cuda_artifact, max_num_seqs=8, kv_memory_gib=1.0))[0]
        calls = [0]
        step_written = engine.runner.step_written

        def counting(b, step_written=step_written, calls=calls):
            calls[0] += 1
            return step_written(b)

        engine.runner.step_written = counting
        if not written:
            engine._launch_written = lambda *args: None
        results[written] = (_run(engine, _requests(6), _requests(3, salt=7)), calls[0])
        del engine
        free_cuda_memory()
    assert results[True][0] == results[False][0]
    assert results[True][1] > 20 and results[False][1] == 0
