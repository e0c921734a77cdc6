"""Chunked-prefill attention over the paged KV cache: causal flash attention over query blocks
(`plan`'s row 1) × KV heads, a block's tokens × the GQA group's heads forming the MMA rows, over
the cached prefix and the new tokens (a query offset per request). `prefill_attention` runs the
warp-specialized Gluon kernel (`prefill_gluon`) where the program chose it (`gluon`) and the inputs
allow it (bf16 KV on sm_90), else the Triton kernel below."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels import devices, overrides
from hy3c.kernels.attention import prefill_gluon
from hy3c.kernels.attention.blocks import (
    BATCH_ARGS,
    LOG2E,
    attend_range,
    cache_flags,
    cache_strides,
    dequant_scales,
    gqa_shape,
    kv_descriptors_or_none,
    kv_sources,
    quantize_rows_e4m3,
    query_block,
    search_iterations,
)
from hy3c.kernels.attention.config import LaunchConfig, prefill_config, triton_prefill_config
from hy3c.kernels.attention.plan import prefill_q_block
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs


@triton.jit(do_not_specialize=BATCH_ARGS)
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    k_desc,
    v_desc,
    scales_ptr,
    page_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    plan_ptr,
    num_requests,
    search_iters,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cpage,
    stride_coff,
    stride_chead,
    stride_pt,
    GROUP: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    P_SCALE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA: tl.constexpr,
    LAZY: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    # one KV head at a time over the grid (its K/V stay in L2 while its query blocks run; with the heads
    # interleaved, 32K-token prefill measured 7% slower)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if tile >= tl.load(plan_ptr + 2 * num_requests + 1):  # past the plan's query blocks
        return
    r, block, q_start, q_len, length = query_block(
        plan_ptr, qsl_ptr, seq_lens_ptr, tile, num_requests, search_iters
    )
    ROWS: tl.constexpr = Q_BLOCK * GROUP
    m_rows = tl.arange(0, ROWS)
    token = block * Q_BLOCK + m_rows // GROUP
    qh = head * GROUP + m_rows % GROUP
    row_ok = token < q_len
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + token)[:, None].to(tl.int64) * stride_qt + qh[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    position = length - q_len + token  # absolute position of each query row (padding rows: past the end)
    k_scale, v_scale = dequant_scales(scales_ptr, FP8, P_SCALE)
    qk_scale = sm_scale * k_scale * LOG2E
    q_scale = tl.full([ROWS], 1.0, tl.float32)
    if FP8:
        q, q_scale = quantize_rows_e4m3(q)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first_position = length - q_len + block * Q_BLOCK
    key_end = tl.minimum(first_position + Q_BLOCK, length)
    full_end = (first_position + 1) // BLOCK_N * BLOCK_N  # keys every row of the block sees
    cache_k, cache_v = kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    m_i, l_i, acc = attend_range(
        q,
        q_scale,
        m_i,
        l_i,
        acc,
        cache_k,
        cache_v,
        page_table_ptr + r * stride_pt,
        0,
        full_end,
        key_end,
        position,
        head,
        stride_cpage,
        stride_coff,
        stride_chead,
        qk_scale,
        PAGE_SIZE,
        HEAD_DIM,
        BLOCK_N,
        2,
        FP8,
        False,
        P_SCALE,
        TMA,
        LAZY,
    )
    result = acc / l_i[:, None] * v_scale
    tl.store(
        out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot + qh[:, None] * stride_oh + d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def prefill_attention(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
    plan: Tensor,
    config: LaunchConfig | None = None,
    gluon: bool = True,
    pdl: bool = True,
) -> Tensor:
    """Causal prefill over the cached prefix and the new tokens; `gluon`, `pdl`: the program's variants
    (the Gluon kernel where the inputs allow it; programmatic dependent launch for the Triton one).
    An explicit config decides the kernel itself (a warp-specialized one: Gluon where it can run)."""
    gluon = overrides.variant(overrides.GLUON, gluon)
    config = config or prefill_config(kv_cache.dtype, kv_cache.shape[3], gluon)
    group, num_kv_heads, head_dim = gqa_shape(q, kv_cache)
    num_requests = seq_lens.shape[0]
    q_block = prefill_q_block(group, config.q_rows)
    if config.warp_specialized:
        if config.lazy_rescale:
            raise ValueError("lazy_rescale: the Triton prefill kernel only (warp_specialized=False)")
        why_not = prefill_gluon.unsupported_inputs(
            q.dtype, kv_cache.dtype, head_dim, q_block * group
        ) or prefill_gluon.unsupported_launch(q, kv_cache)
        if why_not is None and gluon:
            args = (q, kv_cache, layer, page_table, seq_lens, query_start_loc, sm_scale, plan, q_block)
            return prefill_gluon.prefill_attention_gluon(*args, config)
        if gluon:
            devices.fall_back("prefill_attention_gluon", q.device, why_not, "the Triton prefill kernel")
        config = triton_prefill_config(kv_cache.dtype, kv_cache.shape[3])
    out = torch.empty_like(q)
    max_tiles = triton.cdiv(q.shape[0], q_block) + num_requests
    _prefill_kernel[(max_tiles, num_kv_heads)](
        q,
        out,
        kv_cache[layer],
        *kv_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        query_start_loc,
        plan,
        num_requests,
        search_iterations(num_requests),
        sm_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *cache_strides(kv_cache),
        page_table.stride(0),
        GROUP=group,
        Q_BLOCK=q_block,
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        **cache_flags(kv_cache, config.lazy_rescale),
        TMA=config.tma,
        LAZY=config.lazy_rescale,
        **config.launch_options(),
        **pdl_launch(q.device, pdl),
    )
    return out
