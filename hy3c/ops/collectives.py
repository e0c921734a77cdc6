"""Collectives of the `hy3` dialect: the communication of a sharded program, as ops.

    bind_groups({0: tp_group, 1: ep_group})   # once per process, before a sharded program runs
    y = torch.ops.hy3.all_reduce(x, 0, 2)      # x summed over the 2 ranks of group 0
    unbind_groups()

A sharding pass emits these like any other op, so a sharded graph traces, serializes and is checked
like an unsharded one (docs/ARCHITECTURE.md §5: sharding is data). Each op is functional: it returns new tensors and
never writes its inputs (the program checks allow no mutation but the KV store's). Two int arguments
say where it communicates:

* `group`: a group id handed out by the compile context (0 for the TP group, say); a program names
  no process group, only the id, which `bind_groups` maps to a `torch.distributed` ProcessGroup at run
  time (one small table per process: passes keep no global state, the runtime binds the groups it
  created for the artifact's layout);
* `group_size`: the number of ranks in that group, so the fakes compute output shapes without any
  process group (tracing, `hy3c.program.check`'s meta run) and a group bound with another size is
  refused at run time instead of silently computing something else.

A `group_size` of 1 is the identity (a copy; `local_experts` keeps every id): single-rank programs and
CPU tests need no `torch.distributed` at all. The eager implementation of each op (its `*_reference`,
the `torch` provider) calls `torch.distributed` synchronously: NCCL on CUDA tensors, gloo on CPU ones.
No host syncs and no data-dependent host control flow (a rank is read from the group, never from a
tensor), so NCCL collectives run inside CUDA graphs. Under gloo every op here is exact for fp32, bf16
and fp16 (tests/ops/test_collectives.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from hy3c.ops.fused import add_rms_norm_reference

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# bounds a program's group arguments must keep (hy3c.program.check refuses others)
MAX_GROUPS = 64  # group ids 0 .. 63: one per parallel dimension and layout is a handful
MAX_GROUP_SIZE = 1 << 16  # ranks in one group

_GROUPS: Mapping[int, ProcessGroup] = MappingProxyType({})


# ---- the run-time group table ----------------------------------------------------------------------


def bind_groups(groups: Mapping[int, ProcessGroup]) -> None:
    """Make `groups` (group id → process group) the groups the collectives run over, replacing any
    bound before. Ids are ints in [0, MAX_GROUPS); every process of a group binds it under the same id."""
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed: only group_size 1 runs")
    table = dict(groups)
    for group, pg in table.items():
        if type(group) is not int or not 0 <= group < MAX_GROUPS:
            raise ValueError(f"group ids are ints in [0, {MAX_GROUPS}), got {group!r}")
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(
                f"group {group}: expected a torch.distributed ProcessGroup, got {type(pg).__name__}"
            )
    global _GROUPS
    _GROUPS = MappingProxyType(table)


def unbind_groups() -> None:
    """Forget every bound group (a sharded program then refuses to run; group_size 1 still does)."""
    global _GROUPS
    _GROUPS = MappingProxyType({})


def bound_groups() -> Mapping[int, ProcessGroup]:
    """The bound table (read-only)."""
    return _GROUPS


def process_group(op: str, group: int, group_size: int) -> ProcessGroup | None:
    """The process group `op` communicates over, None when there is nothing to do (group_size 1 and
    no group bound under that id). RuntimeError, naming the op and the group, when the program's
    group_size > 1 finds no group bound, or a bound group whose size is not group_size."""
    if group_size < 1:
        raise ValueError(f"hy3.{op}: group_size must be >= 1, got {group_size}")
    pg = _GROUPS.get(group)
    if pg is None:
        if group_size == 1:
            return None
        raise RuntimeError(
            f"hy3.{op}: no process group is bound for group {group} (the program expects {group_size} "
            "ranks); call hy3c.ops.collectives.bind_groups before running a sharded program"
        )
    size = dist.get_world_size(pg)
    if size != group_size:
        raise RuntimeError(
            f"hy3.{op}: group {group} is bound to a process group of {size} ranks, "
            f"the program expects {group_size}"
        )
    return pg if group_size > 1 else None


# ---- shared checks (the eager ops and their fakes raise the same errors) ----------------------------


def _check_dim(op: str, x: Tensor, dim: int) -> None:
    if not 0 <= dim < x.dim():
        raise ValueError(f"hy3.{op}: dim {dim} is outside [0, {x.dim()}) for a {x.dim()}-d tensor")


def _check_divisible(op: str, x: Tensor, dim: int, group_size: int) -> None:
    _check_dim(op, x, dim)
    size = x.shape[dim]
    if isinstance(size, torch.SymInt):  # tracing a dynamic token count: the step is padded to a multiple
        torch._check(size % group_size == 0, lambda: f"hy3.{op}: dim {dim} must divide by {group_size}")
        return
    if size % group_size:
        raise ValueError(
            f"hy3.{op}: dim {dim} of shape {tuple(x.shape)} does not divide into {group_size} equal chunks"
        )


def _dense(x: Tensor) -> Tensor:
    """A new contiguous copy: what every op returns at group_size 1 (outputs never alias inputs)."""
    return x.clone(memory_format=torch.contiguous_format)


def _gather_into(out: Tensor, x: Tensor, pg: ProcessGroup) -> None:
    # all_gather_single is torch 2.13's name (all_gather_into_tensor is deprecated there, the only one
    # before): dim-0 concatenation in group-rank order
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=pg)


def _reduce_scatter_into(out: Tensor, x: Tensor, pg: ProcessGroup) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, op=dist.ReduceOp.SUM, group=pg)


# ---- all_reduce -----------------------------------------------------------------------------------


def all_reduce_reference(x: Tensor, group: int, group_size: int) -> Tensor:
    out = _dense(x)
    pg = process_group("all_reduce", group, group_size)
    if pg is not None:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pg)
    return out


@torch.library.custom_op("hy3::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: int, group_size: int) -> Tensor:
    """x summed elementwise over the group's ranks (every rank gets the same sum): the reduction after a
    row-parallel GEMM, whose ranks each hold a partial product."""
    return all_reduce_reference(x, group, group_size)


@all_reduce.register_fake
def _(x: Tensor, group: int, group_size: int) -> Tensor:
    return x.new_empty(x.shape)


# ---- all_gather -----------------------------------------------------------------------------------


def all_gather_reference(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    _check_dim("all_gather", x, dim)
    pg = process_group("all_gather", group, group_size)
    if pg is None:
        return _dense(x)
    front = x.movedim(dim, 0).contiguous()  # the gathered dim first: one dense block per rank
    out = front.new_empty((group_size * front.shape[0], *front.shape[1:]))
    _gather_into(out, front, pg)
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("hy3::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    """The group's x concatenated along `dim` in group-rank order (dim's size × group_size): the token
    shards of a sequence-parallel region gathered before a column-parallel GEMM, or column shards."""
    return all_gather_reference(x, dim, group, group_size)


@all_gather.register_fake
def _(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    _check_dim("all_gather", x, dim)
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


# ---- reduce_scatter -------------------------------------------------------------------------------


def reduce_scatter_reference(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    _check_divisible("reduce_scatter", x, dim, group_size)
    pg = process_group("reduce_scatter", group, group_size)
    if pg is None:
        return _dense(x)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // group_size, *front.shape[1:]))
    _reduce_scatter_into(out, front, pg)
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("hy3::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    """x summed over the group, then this rank's chunk of it along `dim` (group rank g gets chunk g of
    group_size equal ones): the reduction after a row-parallel GEMM that leaves token shards."""
    return reduce_scatter_reference(x, dim, group, group_size)


@reduce_scatter.register_fake
def _(x: Tensor, dim: int, group: int, group_size: int) -> Tensor:
    _check_divisible("reduce_scatter", x, dim, group_size)
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


# ---- all_to_all -----------------------------------------------------------------------------------


def all_to_all_reference(x: Tensor, group: int, group_size: int) -> Tensor:
    _check_divisible("all_to_all", x, 0, group_size)
    pg = process_group("all_to_all", group, group_size)
    if pg is None:
        return _dense(x)
    inp = x.contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=pg)
    return out


@torch.library.custom_op("hy3::all_to_all", mutates_args=())
def all_to_all(x: Tensor, group: int, group_size: int) -> Tensor:
    """Equal splits along dim 0 exchanged: chunk j of x goes to group rank j, and chunk j of the output
    is what group rank j sent this rank (same shape as x): expert-parallel token dispatch and combine."""
    return all_to_all_reference(x, group, group_size)


@all_to_all.register_fake
def _(x: Tensor, group: int, group_size: int) -> Tensor:
    _check_divisible("all_to_all", x, 0, group_size)
    return x.new_empty(x.shape)


# ---- all_reduce_add_rms_norm (L2) -----------------------------------------------------------------


def all_reduce_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    process_group("all_reduce_add_rms_norm", group, group_size)  # its own name in a refusal
    return add_rms_norm_reference(all_reduce_reference(x, group, group_size), residual, weight, eps)


@torch.library.custom_op("hy3::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    """The tensor-parallel residual path in one op: total = all_reduce(x) + residual, normed =
    rms_norm(total) → (normed, total). Its reference is `all_reduce` then `hy3::add_rms_norm`'s; a
    CUDA provider can put the add and the norm in the all-reduce's epilogue."""
    return all_reduce_add_rms_norm_reference(x, residual, weight, eps, group, group_size)


@all_reduce_add_rms_norm.register_fake
def _(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


# ---- local_experts --------------------------------------------------------------------------------


def local_experts_reference(
    topk_weights: Tensor, topk_ids: Tensor, num_local: int, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    if num_local < 1:
        raise ValueError(f"hy3.local_experts: num_local must be >= 1, got {num_local}")
    pg = process_group("local_experts", group, group_size)
    rank = 0 if pg is None else dist.get_rank(pg)
    local = topk_ids.contiguous().to(torch.int32) - rank * num_local
    mine = (local >= 0) & (local < num_local)
    return topk_weights.contiguous().masked_fill(~mine, 0), local.masked_fill(~mine, -1)


@torch.library.custom_op("hy3::local_experts", mutates_args=())
def local_experts(
    topk_weights: Tensor, topk_ids: Tensor, num_local: int, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    """Expert parallelism: group rank g holds experts [g·num_local, (g + 1)·num_local). The router's
    top-k as this rank's experts see it: ids of local experts become local ids (id − g·num_local,
    int32), every other id −1 with weight 0. g comes from the process group, never from data, so the
    ids are always within [−1, num_local). (weights, ids), shaped like the inputs."""
    return local_experts_reference(topk_weights, topk_ids, num_local, group, group_size)


@local_experts.register_fake
def _(
    topk_weights: Tensor, topk_ids: Tensor, num_local: int, group: int, group_size: int
) -> tuple[Tensor, Tensor]:
    if num_local < 1:
        raise ValueError(f"hy3.local_experts: num_local must be >= 1, got {num_local}")
    return topk_weights.new_empty(topk_weights.shape), topk_ids.new_empty(topk_ids.shape, dtype=torch.int32)


# ---- shard_tokens ---------------------------------------------------------------------------------


def shard_tokens_reference(x: Tensor, group: int, group_size: int) -> Tensor:
    _check_divisible("shard_tokens", x, 0, group_size)
    pg = process_group("shard_tokens", group, group_size)
    rank = 0 if pg is None else dist.get_rank(pg)
    rows = x.shape[0] // group_size
    return x[rank * rows : (rank + 1) * rows].clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("hy3::shard_tokens", mutates_args=())
def shard_tokens(x: Tensor, group: int, group_size: int) -> Tensor:
    """This rank's rows of a tensor every rank of the group holds whole: group rank g gets chunk g of
    group_size equal chunks along dim 0 (sequence parallelism: the residual stream enters its token
    shards). g comes from the process group; nothing is communicated."""
    return shard_tokens_reference(x, group, group_size)


@shard_tokens.register_fake
def _(x: Tensor, group: int, group_size: int) -> Tensor:
    _check_divisible("shard_tokens", x, 0, group_size)
    return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))


# ---- GEMM + collective fusions (sequence parallelism) ------------------------------------------------


def gemm_reduce_scatter_reference(x: Tensor, weight: Tensor, group: int, group_size: int) -> Tensor:
    process_group("gemm_reduce_scatter", group, group_size)  # its own name in a missing group's error
    return reduce_scatter_reference(torch.nn.functional.linear(x, weight), 0, group, group_size)


@torch.library.custom_op("hy3::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter(x: Tensor, weight: Tensor, group: int, group_size: int) -> Tensor:
    """A row-parallel GEMM and the reduce-scatter of its token rows: reduce_scatter(x Wᵀ, dim 0). One op
    so a provider can start sending the finished tiles' rows while later tiles compute."""
    return gemm_reduce_scatter_reference(x, weight, group, group_size)


@gemm_reduce_scatter.register_fake
def _(x: Tensor, weight: Tensor, group: int, group_size: int) -> Tensor:
    _check_divisible("gemm_reduce_scatter", x, 0, group_size)
    return x.new_empty((x.shape[0] // group_size, weight.shape[0]))


def allgather_gemm_reference(x: Tensor, weight: Tensor, group: int, group_size: int) -> tuple[Tensor, Tensor]:
    process_group("allgather_gemm", group, group_size)
    gathered = all_gather_reference(x, 0, group, group_size)
    return gathered, torch.nn.functional.linear(gathered, weight)


@torch.library.custom_op("hy3::allgather_gemm", mutates_args=())
def allgather_gemm(x: Tensor, weight: Tensor, group: int, group_size: int) -> tuple[Tensor, Tensor]:
    """The all-gather of token shards and the column-parallel GEMM that reads them: (gathered rows,
    gathered Wᵀ). One op so a provider can multiply each peer's rows as they arrive; the gathered
    rows are returned for the other readers of the same input (a MoE's router and experts)."""
    return allgather_gemm_reference(x, weight, group, group_size)


@allgather_gemm.register_fake
def _(x: Tensor, weight: Tensor, group: int, group_size: int) -> tuple[Tensor, Tensor]:
    rows = x.shape[0] * group_size
    return x.new_empty((rows, x.shape[1])), x.new_empty((rows, weight.shape[0]))
