"""Triton decode attention (one query per request) over the paged KV cache: dynamic split-KV — the
step's KV tiles dealt in equal ranges to a fixed grid of CTAs × KV heads, a partial softmax result per
(CTA, request) it touches, then a combine kernel. All 8 query heads of a KV head share each K/V load
(GQA); FP8 caches make the keys, then the head dims, the MMA's rows (see `paged_attention`). The key
loop (`decode_keys`), a partial's store (`store_partial`) and the merge (`merge_partials`) are also what
the static split-KV baseline of the benchmarks runs (`bench/baselines/split_kv.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels import devices
from hy3c.kernels.attention.blocks import (
    BATCH_ARGS,
    LOG2E,
    attend_range,
    cache_flags,
    cache_strides,
    dequant_scales,
    find_request,
    gqa_shape,
    kv_descriptors_or_none,
    kv_sources,
    quantize_rows_e4m3,
    search_iterations,
)
from hy3c.kernels.attention.config import DECODE_CONFIG, LaunchConfig, decode_config
from hy3c.kernels.attention.plan import KV_TILE
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs

COMBINE_SLOTS = 16  # partial results the combine kernel loads per trip


@triton.jit
def store_partial(
    o_ptr,
    lse_ptr,
    acc,
    m_i,
    l_i,
    v_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One split's normalised output [GROUP, HEAD_DIM] and its log2-sum-exp (-inf if it saw no key)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * v_scale
    tl.store(o_ptr + g[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
    tl.store(lse_ptr + g, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))))


@triton.jit
def decode_keys(
    q_ptr,
    r,
    head,
    cache_k,
    cache_v,
    page_row_ptr,
    key_begin,
    key_end,
    stride_qt,
    stride_qh,
    stride_page,
    stride_off,
    stride_head,
    qk_scale,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    P_SCALE: tl.constexpr,
    TMA: tl.constexpr,
):
    """Request r's query rows of one KV head (padded to GROUP_PAD) over keys [key_begin, key_end): the
    unnormalised acc [GROUP_PAD, HEAD_DIM], running max and sum. FP8 KV: q quantized per row, the keys
    as the MMA's rows (e4m3 wgmma products; acc kept transposed until the end)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + r * stride_qt + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    full_end = key_begin + tl.maximum(key_end - key_begin, 0) // BLOCK_N * BLOCK_N
    if FP8:
        q8, q_scale = quantize_rows_e4m3(q)
        acc_t = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
        m_i, l_i, acc_t = attend_range(
            q8, q_scale, m_i, l_i, acc_t, cache_k, cache_v, page_row_ptr, key_begin, full_end, key_end,
            m_i, head, stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, 1,
            True, True, P_SCALE, TMA, False,
        )  # fmt: skip
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        m_i, l_i, acc = attend_range(
            q, 1.0, m_i, l_i, acc, cache_k, cache_v, page_row_ptr, key_begin, full_end, key_end, m_i,
            head, stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, 1, False,
            False, P_SCALE, TMA, False,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=BATCH_ARGS)
def _decode_dynamic_kernel(
    q_ptr,
    cache_ptr,
    k_desc,
    v_desc,
    scales_ptr,
    page_table_ptr,
    seq_lens_ptr,
    plan_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_requests,
    search_iters,
    num_ctas,
    min_ctas,
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
    KV_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    FP8: tl.constexpr,
    P_SCALE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    head = tl.program_id(0)  # heads vary fastest: the CTAs with work spread over the SMs
    cta = tl.program_id(1)
    quota = _tiles_per_cta(plan_ptr, num_requests, num_ctas, min_ctas, MIN_TILES)
    total = tl.load(plan_ptr + num_requests)
    t = cta * quota
    t_end = tl.minimum(t + quota, total)
    k_scale, v_scale = dequant_scales(scales_ptr, FP8, P_SCALE)
    qk_scale = sm_scale * k_scale * LOG2E
    cache_k, cache_v = kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    while t < t_end:
        r = find_request(plan_ptr, t, num_requests, search_iters)
        first_tile = tl.load(plan_ptr + r)
        seg_end = tl.minimum(t_end, tl.load(plan_ptr + r + 1))
        key_begin = (t - first_tile) * KV_TILE
        key_end = tl.minimum((seg_end - first_tile) * KV_TILE, tl.load(seq_lens_ptr + r))
        acc, m_i, l_i = decode_keys(
            q_ptr, r, head, cache_k, cache_v, page_table_ptr + r * stride_pt, key_begin, key_end,
            stride_qt, stride_qh, stride_cpage, stride_coff, stride_chead, qk_scale, GROUP, GROUP_PAD,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, FP8, P_SCALE, TMA,
        )  # fmt: skip
        store_partial(
            part_o_ptr + (cta + r) * stride_po_slot + head * stride_po_head,
            part_lse_ptr + (cta + r) * stride_pl_slot + head * GROUP_PAD,
            acc,
            m_i,
            l_i,
            v_scale,
            GROUP,
            GROUP_PAD,
            HEAD_DIM,
        )
        t = seg_end


@triton.jit
def _tiles_per_cta(plan_ptr, num_requests, num_ctas, min_ctas, MIN_TILES: tl.constexpr):
    """The dynamic schedule's range per CTA (plan.tiles_per_cta)."""
    total = tl.load(plan_ptr + num_requests)
    return tl.maximum(
        tl.maximum(tl.cdiv(total, num_ctas), tl.minimum(MIN_TILES, tl.cdiv(total, min_ctas))), 1
    )


@triton.jit
def _request_slots(plan_ptr, r, num_requests, num_ctas, min_ctas, MIN_TILES: tl.constexpr):
    """[first, last) partial-result slots of request r under the dynamic schedule (empty: no tiles)."""
    quota = _tiles_per_cta(plan_ptr, num_requests, num_ctas, min_ctas, MIN_TILES)
    first_tile = tl.load(plan_ptr + r)
    last_tile = tl.load(plan_ptr + r + 1)
    first_slot = first_tile // quota + r
    last_slot = tl.where(last_tile > first_tile, (last_tile - 1) // quota + r + 1, first_slot)
    return first_slot, last_slot


@triton.jit
def merge_partials(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    r,
    query_head,
    first_slot,
    last_slot,
    stride_ot,
    stride_oh,
    stride_po_slot,
    stride_po_head,
    stride_pl_slot,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMBINE_SLOTS: tl.constexpr,
):
    """Merge request r's partial (o, lse) results in slots [first_slot, last_slot) into one query head's
    output row, COMBINE_SLOTS partials per trip (their loads issued together)."""
    head = query_head // GROUP
    g = query_head % GROUP
    d = tl.arange(0, HEAD_DIM)
    sl = tl.arange(0, COMBINE_SLOTS)
    m = tl.full([1], float("-inf"), tl.float32)
    total_w = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for base in range(first_slot, last_slot, COMBINE_SLOTS):
        slot = base + sl
        slot_ok = slot < last_slot
        lse = tl.load(
            part_lse_ptr + slot * stride_pl_slot + head * GROUP_PAD + g, mask=slot_ok, other=float("-inf")
        )
        o = tl.load(
            part_o_ptr + slot[:, None] * stride_po_slot + head * stride_po_head + g * HEAD_DIM + d[None, :],
            mask=slot_ok[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha + tl.sum(o * w[:, None], axis=0)
        total_w = total_w * alpha + tl.sum(w, axis=0)
        m = m_new
    result = acc / tl.where(total_w == 0.0, 1.0, total_w)
    tl.store(out_ptr + r * stride_ot + query_head * stride_oh + d, result.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_requests"])
def _decode_combine_kernel(
    out_ptr,
    plan_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_requests,
    num_ctas,
    min_ctas,
    stride_ot,
    stride_oh,
    stride_po_slot,
    stride_po_head,
    stride_pl_slot,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMBINE_SLOTS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge request r's partials under the dynamic schedule into one query head's output row. One
    program per (request, query head): a decode step's requests usually have few slots, so most
    programs finish in one trip."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    query_head = tl.program_id(1)
    first_slot, last_slot = _request_slots(plan_ptr, r, num_requests, num_ctas, min_ctas, MIN_TILES)
    merge_partials(
        out_ptr, part_o_ptr, part_lse_ptr, r, query_head, first_slot, last_slot, stride_ot, stride_oh,
        stride_po_slot, stride_po_head, stride_pl_slot, GROUP, GROUP_PAD, HEAD_DIM, COMBINE_SLOTS,
    )  # fmt: skip


def num_decode_ctas(
    device: torch.device, num_kv_heads: int, ctas_per_sm: int = DECODE_CONFIG.ctas_per_sm
) -> int:
    """CTAs per KV head for dynamic decode: `ctas_per_sm` waves of the GPU's SMs (16 on CPU)."""
    if device.type != "cuda":
        return 16
    return max(ctas_per_sm * devices.num_sms(device) // num_kv_heads, 1)


def refuse_prefill_options(config: LaunchConfig) -> None:
    if config.lazy_rescale:
        raise ValueError("LaunchConfig.lazy_rescale is a prefill option (decode measured slower with it)")


def combine_partials(
    out: Tensor,
    plan: Tensor,
    part_o: Tensor,
    part_lse: Tensor,
    num_ctas: int = 1,
    min_ctas: int = 1,
    min_tiles: int = 1,
    pdl: bool = True,
) -> Tensor:
    """Merge the split-KV partials (part_o [slots, kv_heads, group, head_dim], part_lse [slots, kv_heads,
    group_pad]) into out [requests, heads, head_dim]: the dynamic schedule's slots (from the plan, the
    grid and min_tiles)."""
    num_requests, heads, head_dim = out.shape
    group = part_o.shape[2]
    _decode_combine_kernel[(num_requests, heads)](
        out,
        plan,
        part_o,
        part_lse,
        num_requests,
        num_ctas,
        min_ctas,
        out.stride(0),
        out.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        GROUP=group,
        GROUP_PAD=part_lse.shape[2],
        HEAD_DIM=head_dim,
        MIN_TILES=min_tiles,
        COMBINE_SLOTS=COMBINE_SLOTS,
        **pdl_launch(out.device, pdl),
    )
    return out


def decode_attention_dynamic(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    sm_scale: float,
    plan: Tensor,
    num_ctas: int | None = None,
    config: LaunchConfig | None = None,
    min_ctas: int | None = None,
    pdl: bool = True,
) -> Tensor:
    """Dynamic split-KV decode; the launch config defaults by KV dtype and batch size (`decode_config`),
    the grid (num_ctas per KV head, of which at least min_ctas get work) from it and the device."""
    group, num_kv_heads, head_dim = gqa_shape(q, kv_cache)
    num_requests = seq_lens.shape[0]
    config = config or decode_config(kv_cache.dtype, num_requests, kv_cache.shape[3])
    refuse_prefill_options(config)
    num_ctas = num_ctas or num_decode_ctas(q.device, num_kv_heads, config.ctas_per_sm)
    min_ctas = min(min_ctas or num_decode_ctas(q.device, num_kv_heads, config.min_ctas_per_sm), num_ctas)
    group_pad = max(16, triton.next_power_of_2(group))
    slots = num_ctas + num_requests
    part_o = torch.empty((slots, num_kv_heads, group, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((slots, num_kv_heads, group_pad), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim)
    _decode_dynamic_kernel[(num_kv_heads, num_ctas)](
        q,
        kv_cache[layer],
        *kv_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        plan,
        part_o,
        part_lse,
        num_requests,
        search_iterations(num_requests),
        num_ctas,
        min_ctas,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *cache_strides(kv_cache),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        KV_TILE=KV_TILE,
        BLOCK_N=config.block_n,
        MIN_TILES=config.min_tiles_per_cta,
        **cache_flags(kv_cache),
        TMA=config.tma,
        **config.launch_options(),
        **common,
        **pdl_launch(q.device, pdl),
    )
    return combine_partials(out, plan, part_o, part_lse, num_ctas, min_ctas, config.min_tiles_per_cta, pdl)
