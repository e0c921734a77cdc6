"""CUDA graphs for speculative decoding's shapes (issue 27): the step program at q tokens per request with
every token a logits row (verify), the draft program at q = K+1 with one device-side logits row per
request and at q = 1 (recursion), `hidden_prev` a static input. CPU tests: which batches a graph covers,
the refusals, the sharded runner's names; GPU tests (`gpu`): replays equal uncaptured runs, padding
requests write no KV."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import hy3c.runtime.artifact as artifact
from hy3c.compiler.driver import compile_artifact
from hy3c.model import SeqChunk, build_step_batch
from hy3c.recipe import load_recipe
from hy3c.runtime.cuda_graphs import DecodeGraphs
from hy3c.runtime.distributed import ShardedRunner

PAGE = 16


def _batch(lengths: list[int], logits: str, device: str = "cpu"):
    """One chunk per request of `lengths[i]` tokens at position 5·i, each on its own two pages."""
    chunks = [
        SeqChunk(list(range(3, 3 + n)), 5 * i, [2 * i + 1, 2 * i + 2], logits) for i, n in enumerate(lengths)
    ]
    return build_step_batch(chunks, PAGE, device)


def _graphs(q: int, rows: int, kv: torch.Tensor, sizes=(1, 2, 4)) -> DecodeGraphs:
    """Graphs of the given shape without capturing anything (for `fits`)."""
    return DecodeGraphs(dict.fromkeys(sizes), kv, max_pages=4, query_len=q, rows_per_request=rows)


def test_decode_graphs_cover_one_token_per_request():
    kv = torch.zeros(1)
    graphs = _graphs(1, 1, kv)
    assert graphs.fits(_batch([1, 1, 1], "last"), kv)
    assert not graphs.fits(_batch([1, 1, 1], "last"), torch.zeros(1))  # another cache
    assert not graphs.fits(_batch([1] * 5, "last"), kv)  # more requests than the largest graph
    assert not graphs.fits(_batch([2, 1], "last"), kv)  # a prefill chunk
    assert not graphs.fits(_batch([1, 1], "none"), kv)  # logits rows as captured


def test_verify_graphs_cover_uniform_requests_with_every_token_a_row():
    kv = torch.zeros(1)
    graphs = _graphs(3, 3, kv)
    assert graphs.fits(_batch([3, 3], "all"), kv)  # logits_owner shows q tokens per request
    assert not graphs.fits(_batch([2, 4], "all"), kv)  # as many tokens, not q each
    assert not graphs.fits(_batch([3, 3], "last"), kv)
    assert not graphs.fits(_batch([1, 1], "all"), kv)


def test_draft_graphs_need_the_callers_query_len_at_q_above_one():
    kv = torch.zeros(1)
    graphs = _graphs(3, 1, kv)
    uniform, mixed = _batch([3, 3], "last"), _batch([2, 4], "last")
    assert not graphs.fits(uniform, kv)  # one row per request: the host cannot tell q from it
    assert graphs.fits(uniform, kv, query_len=3)
    assert not graphs.fits(uniform, kv, query_len=2)
    assert _graphs(1, 1, kv).fits(_batch([1, 1], "last"), kv)  # the recursion's q = 1
    assert not graphs.fits(mixed, kv) and graphs.fits(_batch([3], "last"), kv, query_len=3)


def test_capture_refusals_say_why():
    assert DecodeGraphs.capture(None, None, torch.zeros(1), [1], 4) == "CUDA graphs need a CUDA device"


def test_runner_draft_capture_without_a_draft_program(tiny_ckpt, tmp_path):
    out = compile_artifact(
        load_recipe("cpu-reference"), tmp_path / "art", checkpoint=tiny_ckpt, with_mtp=False
    )
    runner = artifact.load(out.out, "cpu", compile=False)
    kv = runner.allocate_kv_cache(4, PAGE)
    assert "no draft program" in runner.capture_draft_graphs(kv, 4, [1], (1,))
    assert runner.capture_decode_graphs(kv, 4, [1], (1, 3)) == "CUDA graphs need a CUDA device"
    assert runner.decode_graphs is None and runner.draft_graphs == {}


def test_sharded_runner_has_no_draft_program(tiny_ckpt, tmp_path):
    out = compile_artifact(load_recipe("cpu-reference"), tmp_path / "art", checkpoint=tiny_ckpt)
    runner = artifact.load(out.out, "cpu", compile=False)
    sharded = ShardedRunner(runner, None, timedelta(seconds=10))
    assert sharded.num_draft_layers == 0
    kv = runner.allocate_kv_cache(4, PAGE)
    assert sharded.capture_draft_graphs(kv, 4, [1], (1,)) == "sharded artifacts hold no draft program"
    assert "one token per request" in sharded.capture_decode_graphs(kv, 4, [1], (1, 3))
    with pytest.raises(RuntimeError, match="num_draft_layers is 0"):
        sharded.draft(_batch([1], "last"), torch.zeros(1, runner.config.hidden_size), None)


@pytest.fixture(scope="module")
def cuda_runner(tiny_ckpt, tmp_path_factory):
    out = compile_artifact(
        load_recipe("h200-bf16"), tmp_path_factory.mktemp("art") / "h200", checkpoint=tiny_ckpt
    )
    return artifact.load(out.out, device="cuda", compile=False)


def _close(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_verify_graphs_replay_the_step_program(cuda_runner):
    runner = cuda_runner
    kv = runner.allocate_kv_cache(64, PAGE)
    assert runner.capture_decode_graphs(kv, max_pages=4, batch_sizes=[1, 2, 4], query_lens=(1, 3)) is None
    assert sorted(runner.step_graphs) == [1, 3] and runner.decode_graphs is runner.step_graphs[1]
    for lengths in ([3, 3, 3], [3], [3, 3, 3, 3], [3, 3]):  # padded, exact, then smaller again
        batch = _batch(lengths, "all", "cuda")
        reference = kv.clone()
        direct = runner(*batch.model_args(reference))
        assert runner.step_graphs[3].fits(batch, kv)
        replayed = runner.step(batch, kv)
        _close(replayed, direct)
        torch.testing.assert_close(kv, reference)  # the same KV written, none by padding requests


@pytest.mark.gpu
def test_draft_graphs_replay_the_draft_program(cuda_runner):
    runner = cuda_runner
    hidden = runner.config.hidden_size
    kv = runner.allocate_kv_cache(64, PAGE)
    assert runner.capture_draft_graphs(kv, max_pages=4, batch_sizes=[1, 2, 4], query_lens=(3, 1)) is None
    # q = K+1 = 3 tokens per request, the logits row of each request anywhere in it (device-side index)
    batch = _batch([3, 3, 3], "last", "cuda")
    batch.logits_indices = torch.tensor([1, 3, 8], device="cuda")
    hidden_prev = torch.randn(9, hidden, dtype=runner.dtype, device="cuda")
    reference = kv.clone()
    direct = runner._run_draft(
        batch.input_ids,
        batch.positions,
        hidden_prev,
        reference,
        *batch.model_args(reference)[3:],
    )
    replayed = runner.draft(batch, hidden_prev, kv, query_len=3)
    assert replayed[0].shape == (3, runner.config.vocab_size) and replayed[1].shape == (9, hidden)
    _close(replayed, direct)
    torch.testing.assert_close(kv, reference)
    assert kv[runner.config.num_hidden_layers].abs().sum() > 0  # the MTP layer's own KV layer
    # the recursion: one token per request, its hidden_prev the draft program's own hidden
    step = _batch([1, 1], "last", "cuda")
    prev = replayed[1].index_select(0, torch.tensor([1, 3], device="cuda"))
    reference = kv.clone()
    direct = runner._run_draft(
        step.input_ids, step.positions, prev, reference, *step.model_args(reference)[3:]
    )
    assert runner.draft_graphs[1].fits(step, kv)
    _close(runner.draft(step, prev, kv), direct)
    torch.testing.assert_close(kv, reference)
    # a batch no graph covers runs uncaptured
    mixed = _batch([2, 4], "last", "cuda")
    assert not any(g.fits(mixed, kv) for g in runner.draft_graphs.values())
    assert runner.draft(mixed, torch.randn(6, hidden, dtype=runner.dtype, device="cuda"), kv)[0].shape[0] == 2
