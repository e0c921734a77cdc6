"""A sharded program (tensor-parallel MLP with the fused all-reduce + residual + RMSNorm, expert
parallelism through local_experts, and each other collective once) serializes, passes the program
checks (hy3c.program.check) and runs on one process per rank under gloo, equal to the unsharded
arithmetic; the collectives' contracts refuse the programs that break them.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx

import hy3c.kernels  # noqa: F401  (the provider ops a crafted program may name)
from hy3c.config import preset_config
from hy3c.ops import COLLECTIVE_OPS
from hy3c.ops.collectives import bind_groups, unbind_groups
from hy3c.ops.fused import add_rms_norm_reference
from hy3c.ops.moe import moe_experts_reference, router_reference
from hy3c.program.check import STEP_INPUTS, STEP_SIZES, ProgramError, step_inputs
from hy3c.program.serialize import graph_to_json, read_program
from tests.dist import run_ranks

hy3, aten = torch.ops.hy3, torch.ops.aten
CONFIG = preset_config("tiny")  # vocab 512, hidden 64, 8 experts, top-2
RANKS = 2
TP, EP = 0, 1  # the group ids of the program (both the world group when it runs)
FFN, INTER = 32, 8  # the dense MLP's width (split over TP) and each expert's
EPS, TOP_K = 1e-5, 2
H, V, E = CONFIG.hidden_size, CONFIG.vocab_size, CONFIG.num_experts


def _full_weights() -> dict[str, torch.Tensor]:
    """The unsharded model's weights (seeded: every process makes the same)."""
    g = torch.Generator().manual_seed(26)
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    return {
        "embed": torch.randn(V, H, generator=g),
        "w1": rand(FFN, H),  # column-parallel: rows split
        "w2": rand(H, FFN),  # row-parallel: columns split
        "norm": 1 + 0.1 * torch.randn(H, generator=g),
        "router": rand(E, H),
        "bias": 0.01 * torch.randn(E, generator=g),
        "w13": rand(E, 2 * INTER, H),  # expert-parallel: experts split
        "w2e": rand(E, H, INTER),
        "lm_head": rand(V, H),
    }


def _shard(full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    cols = slice(rank * FFN // RANKS, (rank + 1) * FFN // RANKS)
    experts = slice(rank * E // RANKS, (rank + 1) * E // RANKS)
    return {
        **full,
        "w1": full["w1"][cols].contiguous(),
        "w2": full["w2"][:, cols].contiguous(),
        "w13": full["w13"][experts].contiguous(),
        "w2e": full["w2e"][experts].contiguous(),
    }


def _sharded_graph() -> fx.GraphModule:
    """One rank's program, as a sharding pass would write it (parameters of one rank's shapes, meta)."""
    root = torch.nn.Module()
    for name, tensor in _shard(_full_weights(), 0).items():
        root.register_parameter(name, torch.nn.Parameter(tensor.to("meta"), requires_grad=False))
    g = fx.Graph()
    step = {name: g.placeholder(name) for name in STEP_INPUTS}
    w = {name: g.get_attr(name) for name in dict(root.named_parameters())}
    call, item = g.call_function, lambda node, i: g.call_function(operator.getitem, (node, i))
    emb = call(aten.embedding.default, (w["embed"], step["input_ids"]))
    partial = call(aten.linear.default, (call(aten.linear.default, (emb, w["w1"])), w["w2"]))
    fused = call(hy3.all_reduce_add_rms_norm.default, (partial, emb, w["norm"], EPS, TP, RANKS))
    normed, total = item(fused, 0), item(fused, 1)
    routed = call(hy3.router.default, (normed, w["router"], w["bias"], TOP_K, 1.0))
    local = call(hy3.local_experts.default, (item(routed, 0), item(routed, 1), E // RANKS, EP, RANKS))
    experts = call(
        hy3.moe_experts.default,
        (normed, item(local, 0), item(local, 1), w["w13"], w["w2e"], None, None, None, None),
    )
    mixed = call(aten.add.Tensor, (call(hy3.all_reduce.default, (experts, EP, RANKS)), total))
    gathered = call(hy3.all_gather.default, (mixed, 1, TP, RANKS))  # [T, 2H]
    scattered = call(hy3.reduce_scatter.default, (gathered, 1, TP, RANKS))  # [T, H]: 2 × mixed
    pairs = call(aten.reshape.default, (scattered, [-1, 2]))  # T·H/2 rows: divides at any T
    hidden = call(aten.reshape.default, (call(hy3.all_to_all.default, (pairs, TP, RANKS)), [-1, H]))
    rows = call(aten.index_select.default, (hidden, 0, step["logits_indices"]))
    logits = call(aten.to.dtype, (call(aten.linear.default, (rows, w["lm_head"])), torch.float32))
    g.output((logits, hidden))
    return fx.GraphModule(root, g)


def _check(data) -> None:
    read_program(data).check_shapes(CONFIG, torch.float32, torch.float32)


def _step_args() -> tuple[torch.Tensor, ...]:
    """Real step inputs of STEP_SIZES[0]'s sizes (only the token ids and the logits rows are read)."""
    metas = step_inputs(CONFIG, torch.float32, STEP_SIZES[0])
    args = [torch.zeros(m.shape, dtype=m.dtype) for m in metas]
    g = torch.Generator().manual_seed(3)
    args[0] = torch.randint(0, V, args[0].shape, generator=g)
    args[-1] = torch.randperm(STEP_SIZES[0].tokens, generator=g)[: args[-1].shape[0]]
    return tuple(args)


def _expected(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank `rank` must return, from the unsharded weights on one process."""
    full, args = _full_weights(), _step_args()
    emb = full["embed"][args[0]]
    normed, total = add_rms_norm_reference(emb @ full["w1"].T @ full["w2"].T, emb, full["norm"], EPS)
    weights, ids = router_reference(normed, full["router"], full["bias"], TOP_K, 1.0)
    mixed = moe_experts_reference(normed, weights, ids, full["w13"], full["w2e"], *[None] * 4) + total
    pairs = (RANKS * mixed).reshape(-1, 2)
    hidden = torch.cat([pairs.chunk(RANKS)[rank]] * RANKS).reshape(-1, H)  # every rank sent the same
    return hidden[args[-1]] @ full["lm_head"].T, hidden


def _run_program(rank: int, world_size: int, data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    bind_groups({TP: dist.group.WORLD, EP: dist.group.WORLD})
    try:
        program = read_program(data)
        program.check_shapes(CONFIG, torch.float32, torch.float32)
        gm = program.bind(_shard(_full_weights(), rank))
        with torch.no_grad():
            return gm(*_step_args())
    finally:
        unbind_groups()


@pytest.fixture(scope="module")
def program():
    return graph_to_json(_sharded_graph())


def test_the_sharded_program_passes_the_checks(program):
    targets = {n["target"] for n in program["nodes"] if n["op"] == "call_function"}
    # (the sequence-parallel ops: in the programs of tests/compiler/test_sharding.py)
    sequence_parallel = {"shard_tokens", "gemm_reduce_scatter", "allgather_gemm"}
    assert {f"hy3.{op}.default" for op in COLLECTIVE_OPS if op not in sequence_parallel} <= targets
    _check(program)


def test_the_sharded_program_runs_on_two_ranks_as_the_unsharded_arithmetic(program):
    results = run_ranks(_run_program, RANKS, program, timeout=180)
    for rank, (logits, hidden) in enumerate(results):
        want_logits, want_hidden = _expected(rank)
        torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert logits.dtype == torch.float32 and list(logits.shape) == list(want_logits.shape)
    assert not torch.equal(results[0][1], results[1][1])  # all_to_all gave each rank its own chunks


def _node(data, target):
    return next(n for n in data["nodes"] if n.get("target") == target)


def _set(target, index, value):
    def edit(data):
        _node(data, target)["args"]["tuple"][index] = value

    return edit


def _both(first, second):
    def edit(data):
        first(data)
        second(data)

    return edit


def _retarget(target, new, extra=()):
    def edit(data):
        node = _node(data, target)
        node["target"] = new
        node["args"]["tuple"].extend(extra)

    return edit


def _ids_cast_to_int32(data):
    """local_experts reads ids computed from the router's (a cast): not a router's output."""
    at = data["nodes"].index(_node(data, "hy3.local_experts.default"))
    ids = _node(data, "hy3.local_experts.default")["args"]["tuple"][1]
    data["nodes"].insert(
        at,
        {"name": "cast", "op": "call_function", "target": "aten.to.dtype",
         "args": {"tuple": [ids, {"dtype": "int32"}]}, "kwargs": {}},
    )  # fmt: skip
    _node(data, "hy3.local_experts.default")["args"]["tuple"][1] = {"node": "cast"}


def _router_ids_to_the_local_experts(data):
    """moe_experts given the router's ids over all 8 experts, with 4 experts' weights."""
    router_ids = _node(data, "hy3.local_experts.default")["args"]["tuple"][1]
    _node(data, "hy3.moe_experts.default")["args"]["tuple"][2] = router_ids


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _set("hy3.local_experts.default", 2, 3),
            r"\(hy3.local_experts.default\): num_local 3 × group_size 2 is not the router's 8 experts",
        ),
        (_set("hy3.local_experts.default", 2, 8), r"num_local 8 × group_size 2 is not the router's 8"),
        (_set("hy3.local_experts.default", 2, 0), r"'num_local' is 0, outside \[1, 9\)"),
        (_ids_cast_to_int32, r"\(hy3.local_experts.default\): topk_ids must be the ids of a router$"),
        (_router_ids_to_the_local_experts, "topk_ids must be the ids of a router over at most 4 experts"),
        # every MoE provider skips the −1 ids of local_experts: the kernels as the references
        (_retarget("hy3.moe_experts.default", "hy3_cublas.moe_experts.default"), None),
        (_retarget("hy3.moe_experts.default", "hy3_triton.fused_moe.default", [None]), None),
        (_retarget("hy3.moe_experts.default", "hy3.fused_moe.default", [None]), None),  # the reference
        (_set("hy3.all_gather.default", 1, 2), r"\(hy3.all_gather.default\): argument 'dim' is 2, outside \[0, 2\)"),
        (_set("hy3.all_gather.default", 1, -1), r"'dim' is -1, outside \[0, 2\)"),
        (_set("hy3.all_gather.default", 1, 0), None),  # [2T, H]: then reduce_scatter dim 1 of 2T rows
        (
            _set("hy3.reduce_scatter.default", 1, 0),  # the token dim: 11 rows
            r"\(hy3.reduce_scatter.default\): argument 'x' has 11 rows along dim 0, not a multiple of "
            "group_size 2",
        ),
        (_set("hy3.reduce_scatter.default", 1, 2), r"'dim' is 2, outside \[0, 2\)"),
        (_set("hy3.all_reduce.default", 1, 64), r"\(hy3.all_reduce.default\): argument 'group' is 64, outside \[0, 64\)"),
        (_set("hy3.all_reduce.default", 1, -1), r"'group' is -1, outside \[0, 64\)"),
        (_set("hy3.all_to_all.default", 2, 0), r"'group_size' is 0, outside \[1, 65537\)"),
        (
            _both(_set("hy3.all_to_all.default", 1, 2), _set("hy3.all_to_all.default", 2, 3)),
            r"\(hy3.all_to_all.default\): argument 'x' has 352 rows along dim 0, not a multiple of group_size 3",
        ),
        (_set("hy3.all_to_all.default", 0, {"node": "linear_default"}), "has 11 rows along dim 0"),
        (
            _set("hy3.all_reduce_add_rms_norm.default", 1, {"node": "linear_default"}),
            r"\(hy3.all_reduce_add_rms_norm.default\): argument 'residual' has shape \[11, 16\]",
        ),
        (_set("hy3.all_reduce_add_rms_norm.default", 5, 1 << 17), r"'group_size' is 131072, outside"),
        (
            _set("hy3.all_reduce_add_rms_norm.default", 5, 4),  # TP is 2 ranks at the later collectives
            r"\(hy3.all_gather.default\): group 0 has 4 ranks at an earlier collective, not 2",
        ),
        (_set("hy3.local_experts.default", 3, TP), None),  # EP over the TP group: the same size
        (_set("hy3.all_reduce.default", 2, 1), "group 1 has 2 ranks at an earlier collective, not 1"),
    ],
)  # fmt: skip
def test_broken_collective_contracts_are_refused(program, edit, message):
    data = copy.deepcopy(program)
    edit(data)
    if message is None:
        _check(data)
        return
    with pytest.raises(ProgramError, match=message):
        _check(data)
