"""Triton: the MoE router — dual-BF16 router GEMM and fused sigmoid/bias/top-k routing.

* `hy3_triton::router_gemm(x, w, w_hi, w_lo)`: fp32 logits of x [M, K] (bf16) against the fp32 router
  weight, computed as X·W_hiᵀ + X·W_loᵀ / 256 with W_hi = bf16(W), W_lo = bf16((W − W_hi)·256): one
  kernel reads X once, runs both bf16 tensor-core products into two fp32 accumulators and combines them
  in the epilogue. For small M the K dimension is split over programs: each split stores its partial
  sums, and the last split of an output tile to arrive (an arrival counter per tile) adds them in split
  order — one launch, and deterministic, unlike atomic adds, so expert choices do not change between
  runs. On the H200 it beat the fp32 cuBLAS GEMM at every M from 1 to 4096 (BENCHMARKS.md), so no row
  count falls back to fp32; only activations that are not bf16 (an fp32 model) take the fp32 GEMM.
* `hy3_triton::topk_routing(logits, bias, top_k, scale)`: sigmoid, + bias for selection, top-k by
  repeated arg-max, weights = unbiased scores renormalised × scale — one program per token block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider
from hy3c.ops.quant import split_router_weight

__all__ = ["router_gemm_dual_bf16", "split_router_weight"]


@triton.jit(do_not_specialize=["M"])
def _router_gemm_kernel(
    x_ptr,
    hi_ptr,
    lo_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_split,
    k_per_split,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k in range(k_begin, k_end, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0
        )
        w_offs = rn[None, :] * stride_wn + rk[:, None]
        w_mask = (rn[None, :] < N) & k_ok[:, None]
        acc_hi += tl.dot(a, tl.load(hi_ptr + w_offs, mask=w_mask, other=0.0))
        acc_lo += tl.dot(a, tl.load(lo_ptr + w_offs, mask=w_mask, other=0.0))
    out = acc_hi + acc_lo * (1.0 / 256.0)
    tile = rm[:, None] * stride_om + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLITS == 1:
        tl.store(out_ptr + tile, out, mask=mask)
    else:  # the last split of this tile to arrive sums all partials in split order (deterministic)
        tl.store(partial_ptr + split * stride_split + tile, out, mask=mask)
        counter = counter_ptr + pid_m * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(
                    partial_ptr + s * stride_split + tile, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptr + tile, total, mask=mask)
            tl.atomic_xchg(counter, 0)  # zero again for the next launch (and CUDA-graph replay)


_COUNTERS: dict[str, list[Tensor]] = {}


def _arrival_counters(device: torch.device, needed: int) -> Tensor:
    """Zeroed int32 arrival counters, one per output tile of a split-K launch.

    The kernel leaves every counter it used at zero, so one buffer serves every launch on the device.
    Buffers live as long as the process (a captured CUDA graph keeps using the one it saw; graphs are
    captured after warm-up runs, which allocate outside the capture; allocating inside a capture is refused,
    since the zeroing would only be recorded). One stream at a time: two launches running concurrently on
    different streams would share the counters.
    """
    buffers = _COUNTERS.setdefault(str(device), [])
    for buffer in buffers:
        if buffer.numel() >= needed:
            return buffer
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("router_gemm's arrival counters must be allocated by a warm-up run before capture")
    buffers.append(torch.zeros(max(triton.next_power_of_2(needed), 256), dtype=torch.int32, device=device))
    return buffers[-1]


def router_gemm_dual_bf16(
    x: Tensor,
    w_hi: Tensor,
    w_lo: Tensor,
    splits: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    pdl: bool = True,
) -> Tensor:
    """fp32 X·Wᵀ from the split weight; tile and K-split chosen from M unless given (the bench sweeps)."""
    m, k = x.shape
    n = w_hi.shape[0]
    block_m = block_m or (16 if m <= 16 else 64)
    block_k = 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if splits is None:  # about one program per SM when M is small: a power of two up to 16 (swept best)
        splits = (
            1 << (max(min(132 // tiles, 16, triton.cdiv(k, block_k)), 1).bit_length() - 1) if x.is_cuda else 2
        )
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    out = x.new_empty((m, n), dtype=torch.float32)
    partial = x.new_empty((splits, m, n), dtype=torch.float32) if splits > 1 else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    counters = _arrival_counters(x.device, grid[0] * grid[1]) if splits > 1 else out
    _router_gemm_kernel[grid](
        x,
        w_hi,
        w_lo,
        out,
        partial,
        counters,
        m,
        n,
        k,
        x.stride(0),
        w_hi.stride(0),
        out.stride(0),
        partial.stride(0),
        k_per_split,
        SPLITS=splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        num_stages=3,
        **pdl_launch(x.device, pdl),
    )
    return out


@torch.library.custom_op("hy3_triton::router_gemm", mutates_args=())
def router_gemm(x: Tensor, weight: Tensor, w_hi: Tensor, w_lo: Tensor, *, pdl: bool = True) -> Tensor:
    if x.dtype != torch.bfloat16:  # an fp32 (reference-precision) model: the plain fp32 GEMM
        return x.float() @ weight.t()
    return router_gemm_dual_bf16(x, w_hi, w_lo, pdl=pdl)


@router_gemm.register_fake
def _(x, weight, w_hi, w_lo, *, pdl=True):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@triton.jit(do_not_specialize=["M"])
def _topk_routing_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    M,
    N,
    stride_lm,
    scale,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    N_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.arange(0, N_POW2)
    row_ok = rm < M
    logits = tl.load(
        logits_ptr + rm[:, None] * stride_lm + rn[None, :],
        mask=row_ok[:, None] & (rn[None, :] < N),
        other=0.0,
    )
    scores = tl.sigmoid(logits)
    choice = tl.where(
        rn[None, :] < N, scores + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :], float("-inf")
    )
    slot = tl.arange(0, K_POW2)
    ids = tl.zeros([BLOCK_M, K_POW2], tl.int32)
    weights = tl.zeros([BLOCK_M, K_POW2], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        hit = rn[None, :] == best[:, None]
        picked = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        ids = tl.where(slot[None, :] == j, best[:, None], ids)
        weights = tl.where(slot[None, :] == j, picked[:, None], weights)
        choice = tl.where(hit, float("-inf"), choice)
    weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20) * scale
    out_mask = row_ok[:, None] & (slot[None, :] < TOP_K)
    tl.store(weights_ptr + rm[:, None] * TOP_K + slot[None, :], weights, mask=out_mask)
    tl.store(ids_ptr + rm[:, None] * TOP_K + slot[None, :], ids, mask=out_mask)


@torch.library.custom_op("hy3_triton::topk_routing", mutates_args=())
def topk_routing(
    logits: Tensor, bias: Tensor, top_k: int, scale: float, *, pdl: bool = True
) -> tuple[Tensor, Tensor]:
    m, n = logits.shape
    weights = logits.new_empty((m, top_k), dtype=torch.float32)
    ids = logits.new_empty((m, top_k), dtype=torch.int32)
    if m:
        block_m = 4
        _topk_routing_kernel[(triton.cdiv(m, block_m),)](
            logits,
            bias,
            weights,
            ids,
            m,
            n,
            logits.stride(0),
            scale,
            TOP_K=top_k,
            K_POW2=triton.next_power_of_2(top_k),
            BLOCK_M=block_m,
            N_POW2=triton.next_power_of_2(n),
            num_warps=4,
            **pdl_launch(logits.device, pdl),
        )
    return weights, ids


@topk_routing.register_fake
def _(logits, bias, top_k, scale, *, pdl=True):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


register_provider(
    Provider(
        "triton",
        "router_gemm",
        torch.ops.hy3_triton.router_gemm.default,
        frozenset({"cuda"}),
        variants=(PDL,),
    )
)
register_provider(
    Provider(
        "triton",
        "topk_routing",
        torch.ops.hy3_triton.topk_routing.default,
        frozenset({"cuda"}),
        variants=(PDL,),
    )
)
