"""Triton paged GQA attention over the hy3c KV cache (bf16 or FP8 e4m3 with per-tensor scales).

`hy3_triton::paged_attention` implements `hy3::paged_attention` and picks, from shapes alone (no host
sync, so CUDA graphs capture it):
  * a pure decode step (one query per request): **dynamic split-KV** decode. The step's KV tiles
    (`attention_plan` row 0) are dealt in equal contiguous ranges to a fixed grid of CTAs × KV heads;
    each CTA walks its range, emitting one partial softmax result (o, lse) per request it touches into
    slot `cta + request`; a combine kernel merges each request's partials. All 8 query heads of a KV
    head share each K/V load (GQA).
  * anything else (prefill chunks over a cached prefix, mixed batches): a causal flash-attention
    kernel over query blocks (`attention_plan` row 1) × KV heads, the query block's tokens × the
    group's heads forming the MMA rows.
`decode_attention_static` is the static split-KV baseline (every request cut into the same number of
splits), kept for benchmarks.

FP8 K/V go into the MMAs as loaded: q is quantized per row to e4m3 (scale absmax / 448), QKᵀ is an
e4m3 × e4m3 product, and so is PV, with P scaled into e4m3's range and V read K-major (keys contiguous)
from its pages, which FP8 caches store transposed ([kv_heads, head_dim, page], `hy3c.ops.attention`):
Hopper's FP8 wgmma takes its B operand only K-major. No conversion or shared-memory round trip is left
in the key loop, so FP8 decode streams its half-size KV like bf16 decode (BENCHMARKS.md, attention run
25: 1.90× bf16 on the mixed batch, where widening K/V to f16 reached 1.49-1.53×). Decode has only 16
query rows (one KV head's 8, padded) — too few for a wgmma (64 rows), and Triton lowers an e4m3 dot
with 16 rows to an f16 `mma.sync` with converted operands — so FP8 decode makes the keys, then the
head dims, the MMA's rows: Sᵀ = K·qᵀ, accᵀ += Vᵀ·Pᵀ (both e4m3 wgmma m64n16k32). The cost is P's
3-bit mantissa: a relative error of a few 1e-2 on the output, the size of the C8 cache's own
quantization error (the FA3 / TensorRT-LLM FP8 attention choice).

K/V blocks are gathered through the page table either with per-row pointer loads or — `LaunchConfig.tma`,
when a block lies inside one page (its size divides the page size) — as one TMA bulk copy per operand
from tensor descriptors over the layer's pages (`_page_descriptors`). A tail block's keys past the
sequence then come from the page's unused slots: their V is zeroed and their scores masked. Prefill
uses TMA where the page size allows (measured 1.14× the pointer loads at 8K, BENCHMARKS.md), FP8
decode too (64-key page slices); bf16 decode uses 128-key pointer loads (TMA blocks of 64 keys
measured 0.78-0.96×).

Key blocks that every query row sees whole (all of a decode range but its tail; the keys before a
prefill block's first query) take an unmasked path; only the tail / diagonal blocks pay for masks.
The softmax runs in base 2 with the scale folded into the exponent. With `LaunchConfig.lazy_rescale`
(a prefill option) the accumulator is rescaled only when some row's max grows by more than 2^8
(1.06–1.07× for FP8 prefill while its P·V was an f16 product; slower for bf16 prefill, for decode and
for FP8 prefill with the e4m3 P·V).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from hy3c.kernels.attention_plan import KV_TILE, PREFILL_ROWS, prefill_q_block
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import Provider, register_provider
from hy3c.ops.attention import v_pages_transposed
from hy3c.ops.quant import FP8_DTYPE

DECODE_SPLITS_STATIC = 16
E4M3_MAX = 448.0
COMBINE_SLOTS = 16  # partial results the combine kernel loads per trip
# integer arguments that change with the batch: Triton would otherwise compile a variant for 1 and for
# multiples of 16 — compilation (seconds) in the middle of live traffic
BATCH_ARGS = ["num_requests", "search_iters"]


@dataclass(frozen=True)
class LaunchConfig:
    """Tunables of one attention kernel (chosen by bench/attention_bench.py --sweep on the H200)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2  # dynamic decode only: CTAs per SM over all KV heads
    min_tiles_per_cta: int = 1  # dynamic decode only: ranges of at least this many KV tiles, as long as
    min_ctas_per_sm: int = 2  # … the equal share over this many CTAs per SM allows (tiles_per_cta)
    q_rows: int = PREFILL_ROWS  # prefill only: query rows per program (the plan must use the same)
    lazy_rescale: bool = False  # prefill: rescale acc only when a row's max grows by more than 2^8
    tma: bool = False  # K/V blocks by TMA bulk copies (block_n divides the page)
    max_registers: int = 0  # a cap on registers per thread (0: the compiler's choice), for more CTAs per SM

    def launch_options(self) -> dict[str, int]:
        """num_warps, num_stages and the register cap as Triton launch options."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return options | ({"maxnreg": self.max_registers} if self.max_registers else {})


# best of the H200 sweep (BENCHMARKS.md): decode reaches 99% of copy bandwidth on bf16 KV
DECODE_CONFIG = LaunchConfig(block_n=128, num_warps=4, num_stages=2, ctas_per_sm=2)
# FP8 KV: 64-key page slices by TMA, 2 stages. A batch takes 8 CTAs per SM (the best of attention runs
# 25 and 27 on the batch of 32: 1.85× bf16), with ranges of at least 16 tiles (4K keys) while 2 CTAs per
# SM stay busy, which keeps short requests from splitting into many partials (attention runs 6 and 7,
# end to end runs 10 and 11); fewer requests take 3 CTAs per SM and ranges of any size (one 128K request:
# 0.093 ms from CUDA graphs, 0.100 at 8 CTAs per SM; attention run 27).
FP8_BATCH_DECODE_CONFIG = LaunchConfig(
    block_n=64, num_warps=4, num_stages=2, ctas_per_sm=8, min_tiles_per_cta=16, min_ctas_per_sm=2, tma=True
)
FP8_BATCH_MIN_REQUESTS = 8
FP8_DECODE_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=2, ctas_per_sm=3, tma=True)


def decode_config(kv_dtype: torch.dtype, num_requests: int, page_size: int = 64) -> LaunchConfig:
    """The dynamic decode launch config for a KV dtype, batch size and page size (known on the host):
    pointer loads where a block does not tile the page."""
    if kv_dtype != FP8_DTYPE:
        return DECODE_CONFIG
    config = FP8_BATCH_DECODE_CONFIG if num_requests >= FP8_BATCH_MIN_REQUESTS else FP8_DECODE_CONFIG
    return config if page_size % config.block_n == 0 else replace(config, tma=False)


# prefill: 128 query rows (16 tokens × 8 heads at Hy3's GQA; the plan's PREFILL_ROWS), 64-key blocks as
# TMA bulk copies. bf16 KV: 4 warps, 2 stages — 96 KB of shared memory, so two CTAs per SM (3 stages: one);
# FP8 KV: 8 warps capped at 128 registers, 2 stages — two CTAs per SM as well (uncapped, 8 warps take 216
# registers). Timed interleaved with SDPA round by round (BENCHMARKS.md, attention run 38): bf16 0.88× SDPA
# at 8K (3 stages 0.83×), FP8 0.89× at 8K and 1.04× at 32K (4 warps, 3 stages: 0.80× and 1.07×).
# Pages that a 64-key block does not tile (a page size that 64 does not divide) take per-row pointer loads
# (bf16 335, FP8 321 TFLOP/s; attention runs 8-14). Lazy rescaling measured slower for bf16 (attention
# run 17) and, since P·V is an e4m3 product, for FP8 KV too (0.87× at 8K and 32K, attention run 25).
PREFILL_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=2, tma=True)
FP8_PREFILL_CONFIG = LaunchConfig(block_n=64, num_warps=8, num_stages=2, tma=True, max_registers=128)
PREFILL_CONFIG_ANY_PAGE = LaunchConfig(block_n=64, num_warps=4, num_stages=3)


def prefill_config(page_size: int, kv_dtype: torch.dtype) -> LaunchConfig:
    """The prefill launch config for a KV cache's page size and dtype."""
    config = FP8_PREFILL_CONFIG if kv_dtype == FP8_DTYPE else PREFILL_CONFIG
    return config if page_size % config.block_n == 0 else PREFILL_CONFIG_ANY_PAGE


_LOG2E = tl.constexpr(1.4426950408889634)
# lazy rescaling (LaunchConfig.lazy_rescale): the running max moves when a row's block max exceeds it by
# more than 2^8 (the FlashAttention-4 choice); probabilities against a stale max stay ≤ 256
LAZY_RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def _find_request(starts_ptr, t, num_requests, iters):
    """Largest r in [0, num_requests) with starts[r] <= t (binary search over the prefix sums)."""
    lo = 0
    hi = num_requests
    for _ in range(iters):
        mid = (lo + hi) // 2
        go_right = ((tl.load(starts_ptr + mid) <= t) & (mid < hi)).to(tl.int32)
        lo = lo + (mid - lo) * go_right
        hi = hi + (mid - hi) * (1 - go_right)
    return lo


@triton.jit
def _quantize_rows_e4m3(q):
    """q rows to e4m3 with one scale per row (absmax / 448), for the FP8 QK product."""
    qf = q.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(qf), axis=1) / 448.0, 1e-12)
    return tl.clamp(qf / scale[:, None], -448.0, 448.0).to(tl.float8e4nv), scale


@triton.jit
def _load_block(
    cache_k,
    cache_v,
    page_row_ptr,
    key_start,
    valid,
    head,
    stride_page,
    stride_off,
    stride_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    TMA: tl.constexpr,
    V_T: tl.constexpr,
):
    """K [BLOCK_N, HEAD_DIM] of keys [key_start, key_start + BLOCK_N) and their V: [BLOCK_N, HEAD_DIM],
    or V_T (FP8 caches, V pages stored [kv_heads, head_dim, page]) Vᵀ [HEAD_DIM, BLOCK_N]. Keys that are
    not `valid` (MASK != 0) read as zero V (a TMA page slice brings the page's unused slots)."""
    n = key_start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if TMA:  # the block lies inside one page: one bulk copy per operand
        page = tl.load(page_row_ptr + key_start // PAGE_SIZE)
        k = cache_k.load([page * PAGE_SIZE + key_start % PAGE_SIZE, head * HEAD_DIM])
        if V_T:  # rows of the descriptor: (page, kv head, head dim); columns: the page's keys
            v = cache_v.load([page * (stride_page // PAGE_SIZE) + head * HEAD_DIM, key_start % PAGE_SIZE])
            if MASK != 0:
                v = tl.where(valid[None, :], v, tl.zeros_like(v))
        else:
            v = cache_v.load([page * PAGE_SIZE + key_start % PAGE_SIZE, head * HEAD_DIM])
            if MASK != 0:
                v = tl.where(valid[:, None], v, tl.zeros_like(v))
    else:
        if MASK == 0:
            page = tl.load(page_row_ptr + n // PAGE_SIZE)
        else:
            page = tl.load(page_row_ptr + n // PAGE_SIZE, mask=valid, other=0)
        page_base = page.to(tl.int64) * stride_page
        rows = (page_base + (n % PAGE_SIZE) * stride_off + head * stride_head)[:, None] + d[None, :]
        k_ptrs = cache_k + rows
        if V_T:
            v_keys = page_base + head * (HEAD_DIM * PAGE_SIZE) + n % PAGE_SIZE
            v_ptrs = cache_v + v_keys[None, :] + (d * PAGE_SIZE)[:, None]
        else:
            v_ptrs = cache_v + rows
        if MASK == 0:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=valid[None, :] if V_T else valid[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_block(
    q,
    q_scale,
    m_i,
    l_i,
    acc,
    cache_k,
    cache_v,
    page_row_ptr,
    key_start,
    key_limit,
    row_limit,
    head,
    stride_page,
    stride_off,
    stride_head,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    FP8: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    P_SCALE: tl.constexpr,
    TMA: tl.constexpr,
    LAZY: tl.constexpr,
):
    """One BLOCK_N block of keys [key_start, key_start + BLOCK_N) for the rows of q (online softmax in
    base 2, the scale folded into the exponent). MASK: 0 = every key valid and visible (no masking at
    all), 1 = keys past key_limit masked, 2 = also causal (key n visible to a row iff n <= row_limit).
    Every row must see at least one key in its first block (true for all callers), so m is finite.
    TMA: cache_k / cache_v are tensor descriptors (`_page_descriptors`) and the block lies inside one
    page (BLOCK_N divides PAGE_SIZE): one bulk copy per operand, no per-row pointers; a tail block's
    keys past key_limit come from the page's unused (zeroed or stale) slots, their V is zeroed and their
    scores masked.
    FP8 (V pages transposed): q is e4m3 with per-row scales q_scale, and both products are e4m3 MMAs —
    S = q·Kᵀ, then acc += P·V with P scaled by P_SCALE into e4m3 (the caller divides it out) and V
    K-major straight from its transposed page. KEYS_AS_ROWS (decode's 16 query rows, too few for a
    wgmma's 64): Sᵀ = K·qᵀ and accᵀ [HEAD_DIM, rows] += Vᵀ·Pᵀ, so the keys, then the head dims, are
    the MMA's rows.
    LAZY: the running max m (and with it acc and l) moves only when some row's block max exceeds it by
    more than 2^LAZY_RESCALE_LOG2 — otherwise the block's probabilities are taken against the old m
    (each ≤ 2^8, exact once acc is divided by l), which skips the rescale of acc in most blocks."""
    tl.static_assert(FP8 or not KEYS_AS_ROWS, "keys as the MMA rows: FP8 caches only")
    tl.static_assert(MASK != 2 or not KEYS_AS_ROWS, "keys as the MMA rows: decode (no causal mask)")
    n = key_start + tl.arange(0, BLOCK_N)
    valid = n < key_limit
    k, v = _load_block(
        cache_k, cache_v, page_row_ptr, key_start, valid, head, stride_page, stride_off, stride_head,
        PAGE_SIZE, HEAD_DIM, BLOCK_N, MASK, TMA, FP8,
    )  # fmt: skip
    if KEYS_AS_ROWS:  # scores transposed: [BLOCK_N, rows], reductions over axis 0
        s = tl.dot(k, tl.trans(q)) * q_scale[None, :]
        if MASK == 1:
            s = tl.where(valid[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[None, :])
        acc = tl.dot(v, (p * P_SCALE).to(tl.float8e4nv), acc * alpha[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
    else:
        if FP8:  # e4m3 q × e4m3 K: K goes to the MMA as loaded; q's per-row scales applied after
            s = tl.dot(q, tl.trans(k)) * q_scale[:, None]
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if MASK == 1:
            s = tl.where(valid[None, :], s, float("-inf"))
        if MASK == 2:
            s = tl.where(valid[None, :] & (n[None, :] <= row_limit[:, None]), s, float("-inf"))
        m_block = tl.max(s, axis=1) * qk_scale
        if LAZY:
            m_new = m_i
            if tl.max(m_block - m_i, axis=0) > LAZY_RESCALE_LOG2:
                m_new = tl.maximum(m_i, m_block)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
        else:
            m_new = tl.maximum(m_i, m_block)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
        p = tl.exp2(s * qk_scale - m_new[:, None])
        if FP8:
            acc = tl.dot((p * P_SCALE).to(tl.float8e4nv), tl.trans(v), acc)
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        l_i = l_i + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q,
    q_scale,
    m_i,
    l_i,
    acc,
    cache_k,
    cache_v,
    page_row_ptr,
    key_begin,
    full_end,
    key_end,
    row_limit,
    head,
    stride_page,
    stride_off,
    stride_head,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TAIL_MASK: tl.constexpr,
    FP8: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    P_SCALE: tl.constexpr,
    TMA: tl.constexpr,
    LAZY: tl.constexpr,
):
    """Keys [key_begin, key_end): the blocks before full_end are seen whole by every row (no masks), the
    rest with TAIL_MASK (1: keys past key_end; 2: also causal against row_limit)."""
    for key in range(key_begin, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, q_scale, m_i, l_i, acc, cache_k, cache_v, page_row_ptr, key, key_end, row_limit, head,
            stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, 0, FP8,
            KEYS_AS_ROWS, P_SCALE, TMA, LAZY,
        )  # fmt: skip
    for key in range(full_end, key_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, q_scale, m_i, l_i, acc, cache_k, cache_v, page_row_ptr, key, key_end, row_limit, head,
            stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, TAIL_MASK, FP8,
            KEYS_AS_ROWS, P_SCALE, TMA, LAZY,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _store_partial(
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
def _kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA: tl.constexpr):
    """The layer's K and V as the key blocks read them: tensor descriptors (TMA) or base pointers."""
    if TMA:
        cache_k = k_desc
        cache_v = v_desc
    else:
        cache_k = cache_ptr
        cache_v = cache_ptr + stride_ckv
    return cache_k, cache_v


@triton.jit
def _kv_scales(scales_ptr, FP8: tl.constexpr, P_SCALE: tl.constexpr):
    """The layer's K dequantization scale and the factor acc needs for V: its dequantization scale over
    the e4m3 P's scale (both 1.0 for a bf16 cache)."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1) / P_SCALE
    return k_scale, v_scale


@triton.jit
def _decode_keys(
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
        q8, q_scale = _quantize_rows_e4m3(q)
        acc_t = tl.zeros([HEAD_DIM, GROUP_PAD], tl.float32)
        m_i, l_i, acc_t = _attend_range(
            q8, q_scale, m_i, l_i, acc_t, cache_k, cache_v, page_row_ptr, key_begin, full_end, key_end,
            m_i, head, stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, 1,
            True, True, P_SCALE, TMA, False,
        )  # fmt: skip
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        m_i, l_i, acc = _attend_range(
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
    k_scale, v_scale = _kv_scales(scales_ptr, FP8, P_SCALE)
    qk_scale = sm_scale * k_scale * _LOG2E
    cache_k, cache_v = _kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    while t < t_end:
        r = _find_request(plan_ptr, t, num_requests, search_iters)
        first_tile = tl.load(plan_ptr + r)
        seg_end = tl.minimum(t_end, tl.load(plan_ptr + r + 1))
        key_begin = (t - first_tile) * KV_TILE
        key_end = tl.minimum((seg_end - first_tile) * KV_TILE, tl.load(seq_lens_ptr + r))
        acc, m_i, l_i = _decode_keys(
            q_ptr, r, head, cache_k, cache_v, page_table_ptr + r * stride_pt, key_begin, key_end,
            stride_qt, stride_qh, stride_cpage, stride_coff, stride_chead, qk_scale, GROUP, GROUP_PAD,
            HEAD_DIM, PAGE_SIZE, BLOCK_N, FP8, P_SCALE, TMA,
        )  # fmt: skip
        _store_partial(
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
    """The dynamic schedule's range per CTA (attention_plan.tiles_per_cta)."""
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


@triton.jit(do_not_specialize=BATCH_ARGS)
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
    STATIC_SPLITS: tl.constexpr,
    COMBINE_SLOTS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge request r's partial (o, lse) results into one query head's output row. One program per
    (request, query head) and COMBINE_SLOTS partials per trip (their loads issued together): a decode
    step's requests usually have few slots, so most programs finish in one trip."""
    wait_for_inputs(PDL)
    r = tl.program_id(0)
    query_head = tl.program_id(1)
    head = query_head // GROUP
    g = query_head % GROUP
    if STATIC_SPLITS > 0:
        first_slot = r * STATIC_SPLITS
        last_slot = first_slot + STATIC_SPLITS
    else:
        first_slot, last_slot = _request_slots(plan_ptr, r, num_requests, num_ctas, min_ctas, MIN_TILES)
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
    k_scale, v_scale = _kv_scales(scales_ptr, FP8, P_SCALE)
    cache_k, cache_v = _kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    acc, m_i, l_i = _decode_keys(
        q_ptr, r, head, cache_k, cache_v, page_table_ptr + r * stride_pt, key_begin, key_end, stride_qt,
        stride_qh, stride_cpage, stride_coff, stride_chead, sm_scale * k_scale * _LOG2E, GROUP, GROUP_PAD,
        HEAD_DIM, PAGE_SIZE, BLOCK_N, FP8, P_SCALE, TMA,
    )  # fmt: skip
    slot = r * SPLITS + split
    _store_partial(
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
    q_starts = plan_ptr + num_requests + 1
    if tile >= tl.load(q_starts + num_requests):
        return
    r = _find_request(q_starts, tile, num_requests, search_iters)
    # a request's last query block (the most keys under the causal mask) first: the long programs start
    # in the first waves and the short ones fill the tail
    block = tl.load(q_starts + r + 1) - 1 - tile
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    length = tl.load(seq_lens_ptr + r)
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
    k_scale, v_scale = _kv_scales(scales_ptr, FP8, P_SCALE)
    qk_scale = sm_scale * k_scale * _LOG2E
    q_scale = tl.full([ROWS], 1.0, tl.float32)
    if FP8:
        q, q_scale = _quantize_rows_e4m3(q)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first_position = length - q_len + block * Q_BLOCK
    key_end = tl.minimum(first_position + Q_BLOCK, length)
    full_end = (first_position + 1) // BLOCK_N * BLOCK_N  # keys every row of the block sees
    cache_k, cache_v = _kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA)
    m_i, l_i, acc = _attend_range(
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


def _search_iters(num_requests: int) -> int:
    return max(int(num_requests).bit_length() + 1, 1)


def _cache_strides(kv_cache: Tensor) -> tuple[int, ...]:
    """Strides of one layer's [2, pages, page_size, kv_heads, head_dim] view: the kernels get the layer's
    base pointer from the host (64-bit), so no in-kernel layer offset can overflow int32."""
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4)


def _cache_flags(kv_cache: Tensor, lazy: bool = False) -> dict[str, int | bool | float]:
    """Compile-time facts of the cache: FP8 (V pages transposed, e4m3 products) or not, the page size,
    and the scale that puts P into e4m3's range (P ≤ 1, or ≤ 2^8 under lazy rescaling, lands on 448)."""
    fp8 = v_pages_transposed(kv_cache)
    p_scale = E4M3_MAX / 2**LAZY_RESCALE_LOG2.value if lazy else E4M3_MAX
    return dict(FP8=fp8, P_SCALE=p_scale, PAGE_SIZE=kv_cache.shape[3])


def num_decode_ctas(
    device: torch.device, num_kv_heads: int, ctas_per_sm: int = DECODE_CONFIG.ctas_per_sm
) -> int:
    """CTAs per KV head for dynamic decode: `ctas_per_sm` waves of the GPU's SMs (16 on CPU)."""
    if device.type != "cuda":
        return 16
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(ctas_per_sm * sms // num_kv_heads, 1)


def _group(q: Tensor, kv_cache: Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[4]
    return num_heads // num_kv_heads, num_kv_heads, head_dim


def _refuse_prefill_options(config: LaunchConfig) -> None:
    if config.lazy_rescale:
        raise ValueError("LaunchConfig.lazy_rescale is a prefill option (decode measured slower with it)")


def _descriptors_or_none(kv_cache: Tensor, layer: int, config: LaunchConfig) -> tuple:
    return _page_descriptors(kv_cache, layer, config.block_n) if config.tma else (None, None)


def combine_partials(
    out: Tensor,
    plan: Tensor,
    part_o: Tensor,
    part_lse: Tensor,
    num_ctas: int = 1,
    min_ctas: int = 1,
    min_tiles: int = 1,
    static_splits: int = 0,
) -> Tensor:
    """Merge the split-KV partials (part_o [slots, kv_heads, group, head_dim], part_lse [slots, kv_heads,
    group_pad]) into out [requests, heads, head_dim]: the dynamic schedule's slots (from the plan, the
    grid and min_tiles) or `static_splits` slots per request (plan unread)."""
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
        STATIC_SPLITS=static_splits,
        MIN_TILES=min_tiles,
        COMBINE_SLOTS=COMBINE_SLOTS,
        **pdl_launch(out.device),
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
) -> Tensor:
    """Dynamic split-KV decode; the launch config defaults by KV dtype and batch size (`decode_config`),
    the grid (num_ctas per KV head, of which at least min_ctas get work) from it and the device."""
    group, num_kv_heads, head_dim = _group(q, kv_cache)
    num_requests = seq_lens.shape[0]
    config = config or decode_config(kv_cache.dtype, num_requests, kv_cache.shape[3])
    _refuse_prefill_options(config)
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
        *_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        plan,
        part_o,
        part_lse,
        num_requests,
        _search_iters(num_requests),
        num_ctas,
        min_ctas,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *_cache_strides(kv_cache),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        KV_TILE=KV_TILE,
        BLOCK_N=config.block_n,
        MIN_TILES=config.min_tiles_per_cta,
        **_cache_flags(kv_cache),
        TMA=config.tma,
        **config.launch_options(),
        **common,
        **pdl_launch(q.device),
    )
    return combine_partials(out, plan, part_o, part_lse, num_ctas, min_ctas, config.min_tiles_per_cta)


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
) -> Tensor:
    """Baseline: every request split into `splits` equal KV ranges, whatever its length; the key blocks
    as dynamic decode loads them (`decode_config`) unless config says otherwise."""
    group, num_kv_heads, head_dim = _group(q, kv_cache)
    num_requests = seq_lens.shape[0]
    config = config or decode_config(kv_cache.dtype, num_requests, kv_cache.shape[3])
    _refuse_prefill_options(config)
    group_pad = max(16, triton.next_power_of_2(group))
    part_o = torch.empty(
        (num_requests * splits, num_kv_heads, group, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(
        (num_requests * splits, num_kv_heads, group_pad), dtype=torch.float32, device=q.device
    )
    out = torch.empty_like(q)
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim)
    _decode_static_kernel[(num_requests, num_kv_heads, splits)](
        q,
        kv_cache[layer],
        *_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        part_o,
        part_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *_cache_strides(kv_cache),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        SPLITS=splits,
        BLOCK_N=config.block_n,
        **_cache_flags(kv_cache),
        TMA=config.tma,
        **config.launch_options(),
        **common,
        **pdl_launch(q.device),
    )
    return combine_partials(out, seq_lens, part_o, part_lse, static_splits=splits)


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
) -> Tensor:
    config = config or prefill_config(kv_cache.shape[3], kv_cache.dtype)
    group, num_kv_heads, head_dim = _group(q, kv_cache)
    num_requests = seq_lens.shape[0]
    q_block = prefill_q_block(group, config.q_rows)
    out = torch.empty_like(q)
    max_tiles = triton.cdiv(q.shape[0], q_block) + num_requests
    _prefill_kernel[(max_tiles, num_kv_heads)](
        q,
        out,
        kv_cache[layer],
        *_descriptors_or_none(kv_cache, layer, config),
        kv_scales[layer],
        page_table,
        seq_lens,
        query_start_loc,
        plan,
        num_requests,
        _search_iters(num_requests),
        sm_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *_cache_strides(kv_cache),
        page_table.stride(0),
        GROUP=group,
        Q_BLOCK=q_block,
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        **_cache_flags(kv_cache, config.lazy_rescale),
        TMA=config.tma,
        LAZY=config.lazy_rescale,
        **config.launch_options(),
        **pdl_launch(q.device),
    )
    return out


def _page_descriptors(
    kv_cache: Tensor, layer: int, block_n: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of one layer's K pages as [pages · page_size, kv_heads · head_dim] with
    [block_n, head_dim] boxes, and of its V pages alike — or, stored transposed (FP8), as
    [pages · kv_heads · head_dim, page_size] with [head_dim, block_n] boxes: a key block (starting at a
    multiple of block_n) is one bulk copy per operand when block_n divides the page size."""
    layer_cache = kv_cache[layer]
    _, pages, page_size, kv_heads, head_dim = layer_cache.shape
    if not layer_cache.is_contiguous():
        raise ValueError("TMA attention needs a contiguous KV cache layer")
    if page_size % block_n:
        raise ValueError(f"TMA attention needs block_n ({block_n}) to divide the page size ({page_size})")
    rows, width = pages * page_size, kv_heads * head_dim
    k = TensorDescriptor(layer_cache[0], [rows, width], [width, 1], [block_n, head_dim])
    if v_pages_transposed(kv_cache):
        v_rows = pages * kv_heads * head_dim
        v = TensorDescriptor(layer_cache[1], [v_rows, page_size], [page_size, 1], [head_dim, block_n])
    else:
        v = TensorDescriptor(layer_cache[1], [rows, width], [width, 1], [block_n, head_dim])
    return k, v


@torch.library.custom_op("hy3_triton::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
    plan: Tensor,
) -> Tensor:
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.shape[0] == seq_lens.shape[0]:  # one query per request: a decode step
        return decode_attention_dynamic(q, kv_cache, kv_scales, layer, page_table, seq_lens, sm_scale, plan)
    return prefill_attention(
        q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale, plan
    )


@paged_attention.register_fake
def _(q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale, plan):
    return torch.empty_like(q)


def _supports(node) -> str | None:
    q = node.args[0].meta.get("val")
    cache = node.args[1].meta.get("val")
    if q is None or cache is None:
        return None
    head_dim, group = q.shape[-1], q.shape[1] // cache.shape[4]
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    if group & (group - 1):
        return f"GQA group {group} is not a power of two"
    return None


register_provider(
    Provider(
        "triton",
        "paged_attention",
        torch.ops.hy3_triton.paged_attention.default,
        frozenset({"cuda"}),
        cuda_graph_safe=True,
        supports=_supports,
    )
)
