"""The static split-KV decode baseline (FlashAttention-2 style): every request cut into the same number
of key ranges whatever its length, one program per (request, KV head, split), then a combine — what
`bench/attention_bench.py` measures hy3c's dynamic split-KV decode against
(`hy3c.kernels.attention.decode`).

    out = decode_attention_static(q, kv_cache, kv_scales, layer, page_table, seq_lens, sm_scale, splits=16)
    splits = heuristic_static_splits(requests * kv_heads, sms, key_blocks)   # FA2's choice from the grid

Each split runs the same key loop as the dynamic kernel (`decode_keys`: GQA-shared K/V loads, FP8 keys as
the MMA's rows) and its partials are merged the same way (`merge_partials`), so the two differ only in
how the keys are dealt to programs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.attention.blocks import (
    LOG2E,
    cache_flags,
    cache_strides,
    dequant_scales,
    gqa_shape,
    kv_descriptors_or_none,
    kv_sources,
)
from hy3c.kernels.attention.config import LaunchConfig, decode_config
from hy3c.kernels.attention.decode import (
    COMBINE_SLOTS,
    decode_keys,
    merge_partials,
    refuse_prefill_options,
    store_partial,
)
from hy3c.kernels.attention.plan import cdiv
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs

DECODE_SPLITS_STATIC = 16


@triton.jit
def _decode_static_kernel(
    q_ptr,
    cache_ptr,
    k_desc,
    v_desc,
    scales_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_o_ptr,
    part_lse_ptr,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ckv,
    stride_cpage,
    stride_coff,
    stride_chead,
    stride_pt,
    stride_po_slot,
    stride_po_head,
    stride_pl_slot,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    P_SCALE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(seq_lens_ptr + r)
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    key_begin = split * per_split
    key_end = tl.minimum(key_begin + per_split, length)
    k_scale, v_scale = dequant_scales(scales_ptr, FP8, P_SCALE)
    cache_k, cache_v = kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    acc, m_i, l_i = decode_keys(
        q_ptr, r, head, cache_k, cache_v, page_table_ptr + r * stride_pt, key_begin, key_end, stride_qt,
        stride_qh, stride_cpage, stride_coff, stride_chead, sm_scale * k_scale * LOG2E, GROUP, GROUP_PAD,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, FP8, P_SCALE, TMA,
    )  # fmt: skip
    slot = r * SPLITS + split
    store_partial(
        part_o_ptr + slot * stride_po_slot + head * stride_po_head,
        part_lse_ptr + slot * stride_pl_slot + head * GROUP_PAD,
        acc,
        m_i,
        l_i,
        v_scale,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
    )


@triton.jit
def _static_combine_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_po_slot,
    stride_po_head,
    stride_pl_slot,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    COMBINE_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Request r's SPLITS partials (slots r · SPLITS onward) into one query head's output row."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    query_head = tl.program_id(1)
    merge_partials(
        out_ptr, part_o_ptr, part_lse_ptr, r, query_head, r * SPLITS, (r + 1) * SPLITS, stride_ot,
        stride_oh, stride_po_slot, stride_po_head, stride_pl_slot, GROUP, GROUP_PAD, HEAD_DIM,
        COMBINE_SLOTS,
    )  # fmt: skip


def decode_attention_static(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    splits: int = DECODE_SPLITS_STATIC,
    config: LaunchConfig | None = None,
    pdl: bool = True,
) -> Tensor:
    """Every request split into `splits` equal KV ranges, whatever its length; the key blocks loaded as
    dynamic decode loads them (`decode_config`) unless config says otherwise; launched as our decode
    kernels are (`pdl`)."""
    group, num_kv_heads, head_dim = gqa_shape(q, kv_cache)
    num_requests = seq_lens.shape[0]
    config = config or decode_config(kv_cache.dtype, num_requests, kv_cache.shape[3])
    refuse_prefill_options(config)
    group_pad = max(16, triton.next_power_of_2(group))
    slots = num_requests * splits
    part_o = torch.empty((slots, num_kv_heads, group, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((slots, num_kv_heads, group_pad), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim)
    _decode_static_kernel[(num_requests, num_kv_heads, splits)](
        q,
        kv_cache[layer],
        *kv_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        part_o,
        part_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *cache_strides(kv_cache),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        SPLITS=splits,
        BLOCK_N=config.block_n,
        **cache_flags(kv_cache),
        TMA=config.tma,
        **config.launch_options(),
        **common,
        **pdl_launch(q.device, pdl),
    )
    _static_combine_kernel[(num_requests, q.shape[1])](
        out,
        part_o,
        part_lse,
        out.stride(0),
        out.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        SPLITS=splits,
        COMBINE_SLOTS=COMBINE_SLOTS,
        **common,
        **pdl_launch(q.device, pdl),
    )
    return out


def heuristic_static_splits(
    work_items: int, num_sms: int, key_blocks: int, max_splits: int = 128, keep: float = 0.85
) -> int:
    """KV splits per request as a FlashAttention-2-style static split-KV decode picks them: from the
    grid alone (work_items = requests × KV heads) and the longest request's key blocks, never from the
    mix of sequence lengths.

    No split once the grid fills 80% of the SMs; otherwise the fewest splits whose wave efficiency (work
    per wave over whole waves) is within `keep` of the best, among split counts that actually shorten
    each split.
    """
    if work_items >= 0.8 * num_sms:
        return 1
    limit = max(1, min(max_splits, num_sms, key_blocks))
    candidates = [s for s in range(1, limit + 1) if s == 1 or cdiv(key_blocks, s) != cdiv(key_blocks, s - 1)]

    def efficiency(splits: int) -> float:
        waves = work_items * splits / num_sms
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= keep * best)
