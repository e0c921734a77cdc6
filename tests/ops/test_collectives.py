"""The collectives of the hy3 dialect (hy3c.ops.collectives): opcheck, fakes, the group table and its
errors in this process; then 2- and 4-rank gloo groups (tests/dist.py) running every op, each rank's
output compared here with what the single-process arithmetic makes of all ranks' inputs.

Inputs of the multi-rank runs are multiples of 1/4 within ±2, so every sum is exact in fp32 and bf16
whatever order gloo adds in: the comparisons are exact (one fp32 case of random values is compared
within rounding and must agree bitwise across ranks).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import hy3c.ops  # noqa: F401
from hy3c.ops import COLLECTIVE_OPS
from hy3c.ops.collectives import bind_groups, bound_groups, unbind_groups
from hy3c.ops.fused import add_rms_norm_reference
from hy3c.ops.moe import moe_experts_reference
from tests.dist import RankError, run_ranks

hy3 = torch.ops.hy3

GROUP = 3  # the id the multi-rank runs bind their group under (not 0: the id must be the one looked up)
EPS = 1e-6
NUM_LOCAL = 3  # experts per rank in the local_experts cases
TOP_K = 2
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _no_groups_left():
    unbind_groups()
    yield
    unbind_groups()


def _cases(x, w, ids, group, size):
    """op name → arguments, each op once."""
    return {
        "all_reduce": (x, group, size),
        "all_gather": (x, 1, group, size),
        "reduce_scatter": (x, 0, group, size),
        "all_to_all": (x, group, size),
        "all_reduce_add_rms_norm": (x, x.flip(0), torch.rand(x.shape[-1]), EPS, group, size),
        "local_experts": (w, ids, NUM_LOCAL, group, size),
        "shard_tokens": (x, group, size),
        "gemm_reduce_scatter": (x, x[:5], group, size),
        "allgather_gemm": (x, x[:5], group, size),
    }


def _router_out(rows: int, experts: int, generator: torch.Generator | None = None):
    weights = torch.rand(rows, TOP_K, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:TOP_K] for _ in range(rows)])
    return weights, ids.to(torch.int32)


# ---- one process: opcheck, identity at group_size 1, fakes, errors ---------------------------------


@pytest.mark.parametrize("name", COLLECTIVE_OPS)
def test_opcheck_at_group_size_1(name):
    args = _cases(torch.randn(8, 12), *_router_out(8, NUM_LOCAL), 0, 1)[name]
    torch.library.opcheck(getattr(hy3, name).default, args)


@pytest.mark.parametrize("name", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_group_size_1_is_a_copy(name):
    x = torch.randn(12, 8).t()  # not contiguous: the copy is
    y = getattr(hy3, name)(*_cases(x, None, None, 0, 1)[name])
    assert torch.equal(y, x) and y.is_contiguous() and y.data_ptr() != x.data_ptr()


def test_group_size_1_fused_is_add_rms_norm_and_local_experts_keep_every_id():
    x, residual, weight = torch.randn(5, 16), torch.randn(5, 16), torch.rand(16)
    got = hy3.all_reduce_add_rms_norm(x, residual, weight, EPS, 0, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, add_rms_norm_reference(x, residual, weight, EPS)))
    w, ids = _router_out(5, NUM_LOCAL)
    lw, lids = hy3.local_experts(w, ids, NUM_LOCAL, 0, 1)
    assert torch.equal(lw, w) and torch.equal(lids, ids) and lids.dtype == torch.int32


@pytest.mark.parametrize("mode", ["fake", "meta"])
def test_fakes_compute_shapes_without_a_process_group(mode):
    """group_size 4 with nothing bound: shapes come from the arguments alone (tracing, the program
    checks' meta run)."""
    assert not dist.is_initialized() and not bound_groups()
    make = torch.empty
    with FakeTensorMode() if mode == "fake" else torch.device("meta"):
        x, w = make(8, 12), make(8, TOP_K)
        ids = make(8, TOP_K, dtype=torch.int32)
        y = make(2, 8, 12, dtype=torch.bfloat16)
        shapes = {
            "all_reduce": hy3.all_reduce(x, 0, 4).shape,
            "all_gather 0": hy3.all_gather(x, 0, 0, 4).shape,
            "all_gather 2": hy3.all_gather(y, 2, 0, 4).shape,
            "reduce_scatter 0": hy3.reduce_scatter(x, 0, 0, 4).shape,
            "reduce_scatter 1": hy3.reduce_scatter(y, 1, 0, 4).shape,
            "all_to_all": hy3.all_to_all(x, 0, 4).shape,
        }
        normed, total = hy3.all_reduce_add_rms_norm(x, x, make(12), EPS, 0, 4)
        lw, lids = hy3.local_experts(w, ids, NUM_LOCAL, 0, 4)
        dtype = hy3.all_gather(y, 2, 0, 4).dtype
    assert {k: list(v) for k, v in shapes.items()} == {
        "all_reduce": [8, 12],
        "all_gather 0": [32, 12],
        "all_gather 2": [2, 8, 48],
        "reduce_scatter 0": [2, 12],
        "reduce_scatter 1": [2, 2, 12],
        "all_to_all": [8, 12],
    }
    assert dtype == torch.bfloat16
    assert [list(normed.shape), list(total.shape)] == [[8, 12], [8, 12]]
    assert (lw.shape, lw.dtype, lids.shape, lids.dtype) == (w.shape, w.dtype, ids.shape, torch.int32)


def test_collectives_trace_as_one_node_each():
    """torch.export (as the compiler traces) keeps each collective as one hy3 node, its fake's shapes."""

    class Sharded(torch.nn.Module):
        def forward(self, x, w, ids):
            a = hy3.all_reduce(x, 0, 2)
            b = hy3.reduce_scatter(hy3.all_gather(a, 1, 0, 2), 1, 0, 2)
            c = hy3.all_to_all(b, 1, 2)
            normed, total = hy3.all_reduce_add_rms_norm(c, x, torch.ones(x.shape[-1]), EPS, 0, 2)
            lw, lids = hy3.local_experts(w, ids, NUM_LOCAL, 1, 2)
            shard = hy3.shard_tokens(x, 0, 2)
            scattered = hy3.gemm_reduce_scatter(x, x[:5], 0, 2)
            gathered, product = hy3.allgather_gemm(x, x[:5], 0, 2)
            return normed, total, lw, lids, shard, scattered, gathered, product

    x, (w, ids) = torch.randn(8, 12), _router_out(8, 2 * NUM_LOCAL)
    graph = torch.export.export(Sharded(), (x, w, ids)).graph
    called = [n.target for n in graph.nodes if n.op == "call_function" and "hy3" in str(n.target)]
    assert called == [getattr(hy3, n).default for n in COLLECTIVE_OPS]
    gathered = next(n for n in graph.nodes if n.target is hy3.all_gather.default)
    assert list(gathered.meta["val"].shape) == [8, 24]


def test_sharded_ops_refuse_to_run_without_their_group():
    x = torch.randn(8, 12)
    with pytest.raises(
        RuntimeError, match=r"^hy3.all_reduce: no process group is bound for group 0 \(the pro"
    ):
        hy3.all_reduce(x, 0, 2)
    for name, args in _cases(x, *_router_out(8, 2 * NUM_LOCAL), 5, 2).items():
        with pytest.raises(RuntimeError, match=rf"^hy3.{name}: no process group is bound for group 5 "):
            getattr(hy3, name)(*args)


@pytest.mark.parametrize("fake", [False, True])
def test_shapes_that_do_not_split_are_refused(fake):
    with FakeTensorMode() if fake else torch.device("cpu"):
        x = torch.empty(6, 10)
        with pytest.raises(
            ValueError, match=r"hy3.reduce_scatter: dim 1 of shape \(6, 10\) does not divide into 4"
        ):
            hy3.reduce_scatter(x, 1, 0, 4)
        with pytest.raises(
            ValueError, match=r"hy3.all_to_all: dim 0 of shape \(6, 10\) does not divide into 4"
        ):
            hy3.all_to_all(x, 0, 4)
        with pytest.raises(ValueError, match=r"hy3.all_gather: dim 2 is outside \[0, 2\)"):
            hy3.all_gather(x, 2, 0, 1)
        with pytest.raises(ValueError, match=r"hy3.reduce_scatter: dim -1 is outside \[0, 2\)"):
            hy3.reduce_scatter(x, -1, 0, 1)
        with pytest.raises(ValueError, match="hy3.local_experts: num_local must be >= 1, got 0"):
            hy3.local_experts(torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32), 0, 0, 1)


def test_the_group_table_takes_only_group_ids_and_process_groups():
    with pytest.raises(ValueError, match=r"group ids are ints in \[0, 64\), got 64"):
        bind_groups({64: object()})
    with pytest.raises(ValueError, match="got '0'"):
        bind_groups({"0": object()})
    with pytest.raises(TypeError, match="group 0: expected a torch.distributed ProcessGroup, got object"):
        bind_groups({0: object()})
    assert not bound_groups()


def test_experts_reference_skips_id_minus_1():
    """local_experts' −1 (an expert held by another rank) adds nothing to the experts' reference, even
    where the last expert — what −1 would index — overflows."""
    hidden, inter, experts = 8, 4, 2
    x = torch.randn(3, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    ids = torch.tensor([[0, -1], [0, -1], [0, -1]], dtype=torch.int32)
    only_0 = moe_experts_reference(x, weights[:, :1], ids[:, :1], w13, w2, None, None, None, None)
    w2[-1] = float("inf")
    with_none = moe_experts_reference(x, weights, ids, w13, w2, None, None, None, None)
    assert torch.equal(with_none, only_0)


# ---- several ranks (gloo) -------------------------------------------------------------------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rank_inputs(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s inputs (every process can make every rank's: the parent computes the expected)."""
    g = _generator(1000 * world_size + rank)
    quarters = lambda *shape: torch.randint(-8, 9, shape, generator=g).float() / 4  # noqa: E731
    # the router is replicated: every rank routes the same tokens to the same experts
    weights, ids = _router_out(8, world_size * NUM_LOCAL, _generator(world_size))
    return {
        "x": quarters(8, 12),  # rows and columns divide by 2 and 4
        "y": quarters(4, 4, 8),
        "residual": quarters(8, 12),
        "norm_weight": torch.rand(12, generator=g),
        "random": torch.randn(16, 24, generator=g),
        "topk_weights": weights,
        "topk_ids": ids,
    }


def _run_every_op(rank: int, world_size: int, opcheck: bool) -> dict[str, object]:
    """On each rank: every op over the world group bound as GROUP, in fp32 and bf16; the errors of a
    group of the wrong size; opcheck under the real group (2 ranks)."""
    bind_groups({GROUP: dist.group.WORLD})
    n = world_size
    inp = _rank_inputs(rank, world_size)
    out: dict[str, object] = {}
    for dtype in DTYPES:
        x, y = inp["x"].to(dtype), inp["y"].to(dtype)
        name = str(dtype).removeprefix("torch.")
        out[f"all_reduce {name}"] = hy3.all_reduce(x, GROUP, n)
        out[f"all_gather 0 {name}"] = hy3.all_gather(x, 0, GROUP, n)
        out[f"all_gather 1 {name}"] = hy3.all_gather(x, 1, GROUP, n)
        out[f"all_gather y2 {name}"] = hy3.all_gather(y, 2, GROUP, n)
        out[f"reduce_scatter 0 {name}"] = hy3.reduce_scatter(x, 0, GROUP, n)
        out[f"reduce_scatter 1 {name}"] = hy3.reduce_scatter(x, 1, GROUP, n)
        out[f"reduce_scatter y2 {name}"] = hy3.reduce_scatter(y, 2, GROUP, n)
        out[f"all_to_all {name}"] = hy3.all_to_all(x, GROUP, n)
        out[f"all_to_all y {name}"] = hy3.all_to_all(y, GROUP, n)
        args = (x, inp["residual"].to(dtype), inp["norm_weight"].to(dtype), EPS, GROUP, n)
        out[f"all_reduce_add_rms_norm {name}"] = hy3.all_reduce_add_rms_norm(*args)
    out["all_reduce random"] = hy3.all_reduce(inp["random"], GROUP, n)
    out["local_experts"] = hy3.local_experts(inp["topk_weights"], inp["topk_ids"], NUM_LOCAL, GROUP, n)
    out["shard_tokens"] = hy3.shard_tokens(inp["x"], GROUP, n)
    weight = _rank_inputs(0, world_size)["x"][:5]  # the same weight on every rank
    out["gemm_reduce_scatter"] = hy3.gemm_reduce_scatter(inp["x"], weight, GROUP, n)
    out["allgather_gemm"] = hy3.allgather_gemm(inp["x"], weight, GROUP, n)
    out["x is unchanged"] = torch.equal(inp["x"], _rank_inputs(rank, world_size)["x"])
    for label, size in (("mismatched", 2 * n), ("group_size 1", 1)):
        try:
            hy3.all_reduce(inp["x"], GROUP, size)
        except RuntimeError as exc:
            out[f"error {label}"] = str(exc)
    if opcheck:
        cases = _cases(inp["x"], inp["topk_weights"], inp["topk_ids"], GROUP, n)
        for name, args in cases.items():
            torch.library.opcheck(getattr(hy3, name).default, args)
        out["opcheck"] = sorted(cases)
    unbind_groups()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n} ranks")
def ranks(request):
    """(world_size, every rank's inputs, every rank's outputs) of one run of all the ops."""
    n = request.param
    results = run_ranks(_run_every_op, n, n == 2, timeout=180)
    return n, [_rank_inputs(r, n) for r in range(n)], results


def _each(ranks, dtypes=DTYPES):
    """(every rank's inputs, one rank's outputs, its rank, dtype name, dtype) for every rank and dtype."""
    n, inputs, results = ranks
    for rank in range(n):
        for dtype in dtypes:
            yield inputs, results[rank], rank, str(dtype).removeprefix("torch."), dtype


def test_all_reduce_sums_over_the_group(ranks):
    for inputs, out, rank, name, dtype in _each(ranks):
        expected = sum(i["x"] for i in inputs).to(dtype)
        got = out[f"all_reduce {name}"]
        assert got.dtype == dtype and torch.equal(got, expected), (rank, name)
        assert out["x is unchanged"]


def test_all_reduce_of_random_values_is_the_sum_and_the_same_on_every_rank(ranks):
    _, inputs, results = ranks
    expected = sum(i["random"] for i in inputs)
    first = results[0]["all_reduce random"]
    torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-6)
    for out in results[1:]:
        assert torch.equal(out["all_reduce random"], first)  # TP replicas stay bit-identical


def test_all_gather_concatenates_in_rank_order(ranks):
    for inputs, out, rank, name, dtype in _each(ranks):
        for key, tensor, dim in (("0", "x", 0), ("1", "x", 1), ("y2", "y", 2)):
            expected = torch.cat([i[tensor].to(dtype) for i in inputs], dim)
            assert torch.equal(out[f"all_gather {key} {name}"], expected), (rank, key, name)


def test_reduce_scatter_gives_each_rank_its_chunk_of_the_sum(ranks):
    for inputs, out, rank, name, dtype in _each(ranks):
        for key, tensor, dim in (("0", "x", 0), ("1", "x", 1), ("y2", "y", 2)):
            total = sum(i[tensor] for i in inputs).to(dtype)
            expected = total.chunk(len(inputs), dim)[rank]
            got = out[f"reduce_scatter {key} {name}"]
            assert got.is_contiguous() and torch.equal(got, expected), (rank, key, name)


def test_all_to_all_sends_chunk_j_to_rank_j(ranks):
    for inputs, out, rank, name, dtype in _each(ranks):
        for key, tensor in (("", "x"), (" y", "y")):
            expected = torch.cat([i[tensor].to(dtype).chunk(len(inputs), 0)[rank] for i in inputs])
            assert torch.equal(out[f"all_to_all{key} {name}"], expected), (rank, key, name)


def test_all_reduce_add_rms_norm_is_all_reduce_then_add_rms_norm(ranks):
    for inputs, out, rank, name, dtype in _each(ranks):
        mine = inputs[rank]
        reduced = sum(i["x"] for i in inputs).to(dtype)  # exact: what all_reduce returned (test above)
        expected = add_rms_norm_reference(
            reduced, mine["residual"].to(dtype), mine["norm_weight"].to(dtype), EPS
        )
        normed, total = out[f"all_reduce_add_rms_norm {name}"]
        assert torch.equal(normed, expected[0]) and torch.equal(total, expected[1]), (rank, name)
        assert normed.dtype == total.dtype == dtype


def test_local_experts_keep_this_ranks_experts(ranks):
    n, inputs, results = ranks
    for rank in range(n):
        mine = inputs[rank]
        weights, ids = results[rank]["local_experts"]
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        for t in range(ids.shape[0]):
            for k in range(TOP_K):
                expert = int(mine["topk_ids"][t, k])
                local = expert - rank * NUM_LOCAL
                if 0 <= local < NUM_LOCAL:
                    assert (int(ids[t, k]), float(weights[t, k])) == (
                        local,
                        float(mine["topk_weights"][t, k]),
                    )
                else:
                    assert (int(ids[t, k]), float(weights[t, k])) == (-1, 0.0)
    # every (token, slot) is local on exactly one rank
    kept = sum((r["local_experts"][1] >= 0).int() for r in results)
    assert torch.equal(kept, torch.ones_like(kept))


def test_local_experts_summed_over_ranks_are_the_experts_of_the_router(ranks):
    """Expert parallelism end to end in the reference: each rank's experts over its local ids, summed
    over the ranks, equal all experts over the router's ids."""
    n, inputs, results = ranks
    hidden, inter = 12, 4
    g = _generator(7)
    x = torch.randn(8, hidden, generator=g)
    w13 = torch.randn(n * NUM_LOCAL, 2 * inter, hidden, generator=g)
    w2 = torch.randn(n * NUM_LOCAL, hidden, inter, generator=g)
    parts = []
    for rank, out in enumerate(results):
        mine = slice(rank * NUM_LOCAL, (rank + 1) * NUM_LOCAL)
        parts.append(moe_experts_reference(x, *out["local_experts"], w13[mine], w2[mine], *[None] * 4))
    full = moe_experts_reference(x, inputs[0]["topk_weights"], inputs[0]["topk_ids"], w13, w2, *[None] * 4)
    torch.testing.assert_close(sum(parts), full, rtol=1e-5, atol=1e-5)


def test_a_group_of_another_size_is_refused(ranks):
    n, _, results = ranks
    for out in results:
        assert out["error mismatched"] == (
            f"hy3.all_reduce: group {GROUP} is bound to a process group of {n} ranks, "
            f"the program expects {2 * n}"
        )
        assert out["error group_size 1"].endswith(f"of {n} ranks, the program expects 1")


def test_gemm_collectives_are_the_gemm_and_the_collective(ranks):
    n, inputs, results = ranks
    weight = inputs[0]["x"][:5]
    gathered = torch.cat([inp["x"] for inp in inputs])
    summed = sum(torch.nn.functional.linear(inp["x"], weight) for inp in inputs)
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["gemm_reduce_scatter"], summed.chunk(n)[rank])
        rows, product = out["allgather_gemm"]
        assert torch.equal(rows, gathered)
        torch.testing.assert_close(product, torch.nn.functional.linear(gathered, weight))


def test_shard_tokens_is_each_ranks_chunk_of_rows(ranks):
    n, inputs, results = ranks
    for rank, out in enumerate(results):
        assert torch.equal(out["shard_tokens"], inputs[rank]["x"].chunk(n)[rank])


def test_opcheck_under_a_real_group(ranks):
    n, _, results = ranks
    if n != 2:
        pytest.skip("opcheck runs in the 2-rank group")
    assert all(out["opcheck"] == sorted(COLLECTIVE_OPS) for out in results)


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("rank one's own failure")
    return rank


def test_run_ranks_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(
        RankError, match=r"(?s)rank 1 of 2 raised:\nTraceback.*_raise_on_rank_1.*rank one's own"
    ):
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    assert not mp.active_children()


def test_run_ranks_times_out_a_hung_rank_and_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[(0, )?1\] of 2 did not finish within 10 s"):
        run_ranks(_hang_on_rank_1, 2, timeout=10)
    assert time.monotonic() - start < 30 and not mp.active_children()
