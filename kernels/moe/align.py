"""`moe_align`: the (token, slot) pairs of a MoE layer grouped by expert and padded per expert to a
multiple of the GEMM's M block, on the device and without a host sync — one Triton program up to
MAX_ALIGN_PAIRS pairs, device-side torch ops above.

A pair whose id is −1 has no expert on this rank (expert parallelism: `hy3.local_experts` gives −1 for
the experts other ranks hold) and is dropped: it enters no expert's block list, so no GEMM computes or
writes its row (the combine skips it too). Without −1 ids the test that drops them is the one that
already masks the lanes past the last pair."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs


def align_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `sorted_ids`: every pair plus at most block_m − 1 pad rows per expert that has a pair."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m


def moe_align_torch(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """`moe_align` as device-side torch ops (argsort, cumsum, searchsorted): for large pair counts.

    Ids of −1 count in a bin of their own past the last expert (`num_experts`), sort after every held
    pair, and are written to one spare row past the capacity, which the result leaves out."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, num_experts)  # −1: the spare bin, sorted last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # the spare bin takes no rows (a kernel: no host scalar copied in a graph)
    padded_end = padded.cumsum(0)
    order = key.argsort(stable=True)
    sorted_expert = key[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_expert]
    capacity = align_capacity(pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=flat.device)
    row = torch.where(sorted_expert < num_experts, (padded_end - padded)[sorted_expert] + rank, capacity)
    sorted_ids[row] = order.to(torch.int32)
    sorted_ids = sorted_ids[:capacity]
    padded_end = padded_end[:num_experts]
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    expert_ids = (
        torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    )
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["pairs", "capacity", "num_blocks"])
def _moe_align_kernel(
    ids_ptr,
    sorted_ptr,
    expert_ptr,
    padded_ptr,
    pairs,
    num_experts,
    capacity,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    P_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program, all pairs at once:

    1. expert histogram of the pairs; padded per-expert counts; their exclusive prefix sums (`begin`);
    2. the pairs sorted by (expert, pair id) — one key each, so the order within an expert is the pairs'
       order (stable); a pair's rank in its expert = its sorted position − the expert's first position;
       it goes to row begin[expert] + rank of `sorted_ids` (the rest of the rows hold the pad value);
    3. the expert of each M block: every expert with pairs marks its first block, a running max over the
       blocks carries the mark forward; blocks past the padded total get the last expert.

    Pairs with id −1 (no expert on this rank) and the lanes past the last pair are left out alike (`held`):
    uncounted, sorted after the held pairs, never stored.
    """
    wait_for_inputs(PDL)
    experts = tl.arange(0, E_POW2)
    lane = tl.arange(0, P_POW2)
    ids = tl.load(ids_ptr + lane, mask=lane < pairs, other=-1)
    held = ids >= 0
    counts = tl.histogram(ids, E_POW2, mask=held)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    begin = tl.cumsum(padded, axis=0) - padded
    first = tl.cumsum(counts, axis=0) - counts
    total = tl.sum(padded, axis=0)
    held_pairs = tl.sum(counts, axis=0)
    tl.store(padded_ptr, total)
    chunk = tl.arange(0, CHUNK)
    for start in range(0, capacity, CHUNK):
        tl.store(
            sorted_ptr + start + chunk, tl.zeros([CHUNK], tl.int32) + pairs, mask=start + chunk < capacity
        )
    for start in range(0, num_blocks, CHUNK):
        tl.store(expert_ptr + start + chunk, tl.zeros([CHUNK], tl.int32), mask=start + chunk < num_blocks)
    tl.debug_barrier()
    keys = tl.sort(tl.where(held, ids, E_POW2) * P_POW2 + lane)
    expert = tl.minimum(keys // P_POW2, E_POW2 - 1)
    rank = lane - tl.gather(first, expert, 0)
    tl.store(sorted_ptr + tl.gather(begin, expert, 0) + rank, keys % P_POW2, mask=lane < held_pairs)
    tl.store(expert_ptr + begin // BLOCK_M, experts, mask=padded > 0)
    tl.debug_barrier()
    carried = tl.zeros([1], tl.int32)
    for start in range(0, num_blocks, CHUNK):
        block = start + chunk
        mark = tl.load(expert_ptr + block, mask=block < num_blocks, other=0)
        owner = tl.maximum(tl.associative_scan(mark, 0, _running_max), carried)
        carried = tl.max(owner, axis=0, keep_dims=True)
        owner = tl.where(block * BLOCK_M >= total, num_experts - 1, owner)
        tl.debug_barrier()  # every thread has read the marks of this chunk before any is overwritten
        tl.store(expert_ptr + block, owner, mask=block < num_blocks)


# pairs per tile of the Triton align program (one compiled variant each: a step's token count picks one,
# so a serving warm-up of a few prefill lengths compiles them all); above the last, the torch ops
ALIGN_TILES = (64, 512, 1024)


MAX_ALIGN_PAIRS = ALIGN_TILES[-1]


def moe_align(
    topk_ids: Tensor, num_experts: int, block_m: int, pdl: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """(sorted_ids [P] int32, expert of each M block [P / block_m] int32, padded total [1] int32).

    `sorted_ids` lists the (token, slot) pair ids grouped by expert in stable order, each expert padded
    to a multiple of block_m with the pad value T·k; pairs with id −1 are in no expert's list. Up to
    MAX_ALIGN_PAIRS pairs this is one Triton launch; above it, device-side torch ops. Neither
    synchronizes with the host.
    """
    if topk_ids.numel() > MAX_ALIGN_PAIRS:
        return moe_align_torch(topk_ids, num_experts, block_m)
    return moe_align_triton(topk_ids, num_experts, block_m, pdl)


def moe_align_triton(
    topk_ids: Tensor, num_experts: int, block_m: int, pdl: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """`moe_align` as one Triton program (up to MAX_ALIGN_PAIRS pairs: all of them in one tile)."""
    pairs = topk_ids.numel()
    if pairs > MAX_ALIGN_PAIRS:
        raise ValueError(f"{pairs} (token, expert) pairs exceed the align kernel's {MAX_ALIGN_PAIRS}")
    capacity = align_capacity(pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    padded = torch.empty(1, dtype=torch.int32, device=device)
    tile = next(t for t in ALIGN_TILES if t >= pairs)
    _moe_align_kernel[(1,)](
        topk_ids.to(torch.int32).contiguous().view(-1),  # the kernels index the ids densely
        sorted_ids,
        expert_ids,
        padded,
        pairs,
        num_experts,
        capacity,
        capacity // block_m,
        BLOCK_M=block_m,
        E_POW2=max(triton.next_power_of_2(num_experts), 16),
        P_POW2=tile,
        CHUNK=256,
        num_warps=4,
        **pdl_launch(device, pdl),
    )
    return sorted_ids, expert_ids, padded
