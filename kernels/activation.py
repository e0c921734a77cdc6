"""Triton SwiGLU activation (`hy3_triton::silu_and_mul` implements `hy3::silu_and_mul`) and the
per-step attention plan (`hy3_triton::attention_plan` implements `hy3::attention_plan`), one launch each.

The torch references take two kernels (silu, multiply) and about a dozen (ceil-divisions, cumsums,
casts, concatenations) respectively; in a decode step every launch costs a few microseconds of gap.
silu_and_mul keeps the reference's rounding: silu(gate) rounded to the input dtype, times up, rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.registry import Provider, register_provider

BLOCK = 1024  # elements of one output row per program
MAX_PLAN_REQUESTS = 8192  # one program holds every request of the step
PLAN_BLOCK = 256  # at least this many lanes: one compiled variant for every batch up to 256 requests


@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_kernel(x_ptr, out_ptr, rows, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    gate = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + c, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@torch.library.custom_op("hy3_triton::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    inter = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], inter))
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-1])
    if x2.shape[0] and inter:
        out2 = out.view(-1, inter)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](
            x2, out2, x2.shape[0], inter, x2.stride(0), out2.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@triton.jit(do_not_specialize=["num_requests"])
def _attention_plan_kernel(
    seq_lens_ptr, qsl_ptr, plan_ptr, num_requests, kv_tile, q_block, BLOCK: tl.constexpr
):
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
def attention_plan(seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int) -> Tensor:
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
    )
    return plan


@attention_plan.register_fake
def _(seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int) -> Tensor:
    return seq_lens.new_empty((2, seq_lens.shape[0] + 1), dtype=torch.int32)


register_provider(
    Provider("triton", "silu_and_mul", torch.ops.hy3_triton.silu_and_mul.default, frozenset({"cuda"}))
)
register_provider(
    Provider("triton", "attention_plan", torch.ops.hy3_triton.attention_plan.default, frozenset({"cuda"}))
)
