"""Triton per-step attention plan: `hy3_triton::attention_plan` implements `hy3::attention_plan` (see
`hy3c.kernels.attention.plan`) in one launch, where the torch reference takes about a dozen kernels
(ceil-divisions, cumsums, casts, concatenations) at the start of every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider

MAX_PLAN_REQUESTS = 8192  # one program holds every request of the step
PLAN_BLOCK = 256  # at least this many lanes: one compiled variant for every batch up to 256 requests


@triton.jit(do_not_specialize=["num_requests"])
def _attention_plan_kernel(
    seq_lens_ptr,
    qsl_ptr,
    plan_ptr,
    num_requests,
    kv_tile,
    q_block,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    r = tl.arange(0, BLOCK)
    ok = r < num_requests
    kv_tiles = (tl.load(seq_lens_ptr + r, mask=ok, other=0) + kv_tile - 1) // kv_tile
    q_lens = tl.load(qsl_ptr + r + 1, mask=ok, other=0) - tl.load(qsl_ptr + r, mask=ok, other=0)
    q_blocks = (q_lens + q_block - 1) // q_block
    stride = num_requests + 1
    tl.store(plan_ptr + r + 1, tl.cumsum(kv_tiles, axis=0), mask=ok)
    tl.store(plan_ptr + stride + r + 1, tl.cumsum(q_blocks, axis=0), mask=ok)
    first = r == 0
    tl.store(plan_ptr + r, tl.zeros_like(r), mask=first)
    tl.store(plan_ptr + stride + r, tl.zeros_like(r), mask=first)


@torch.library.custom_op("hy3_triton::attention_plan", mutates_args=())
def attention_plan(
    seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int, *, pdl: bool = True
) -> Tensor:
    num_requests = seq_lens.shape[0]
    if num_requests > MAX_PLAN_REQUESTS:
        raise ValueError(f"{num_requests} requests exceed the plan kernel's {MAX_PLAN_REQUESTS}")
    plan = torch.empty((2, num_requests + 1), dtype=torch.int32, device=seq_lens.device)
    _attention_plan_kernel[(1,)](
        seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32),
        plan,
        num_requests,
        kv_tile,
        q_block,
        BLOCK=max(triton.next_power_of_2(num_requests), PLAN_BLOCK),
        **pdl_launch(seq_lens.device, pdl),
    )
    return plan


@attention_plan.register_fake
def _(seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int, *, pdl: bool = True) -> Tensor:
    return seq_lens.new_empty((2, seq_lens.shape[0] + 1), dtype=torch.int32)


register_provider(
    Provider(
        "triton",
        "attention_plan",
        torch.ops.hy3_triton.attention_plan.default,
        frozenset({"cuda"}),
        variants=(PDL,),
    )
)
