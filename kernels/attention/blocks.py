"""What the decode and prefill attention kernels share: the key-block loop (a block of keys gathered
through the page table by pointers or one TMA copy, its scores, the online softmax and P·V; an unmasked
path for whole blocks), the request search over a plan's prefix sums, FP8 helpers, and the host side's
cache strides, compile-time cache facts and TMA page descriptors."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from hy3c.kernels.attention.config import LaunchConfig
from hy3c.ops.attention import v_pages_transposed

E4M3_MAX = 448.0
# integer arguments that change with the batch: Triton would otherwise compile a variant for 1 and for
# multiples of 16 — compilation (seconds) in the middle of live traffic
BATCH_ARGS = ["num_requests", "search_iters"]
LOG2E = tl.constexpr(1.4426950408889634)
# lazy rescaling (LaunchConfig.lazy_rescale): the running max moves when a row's block max exceeds it by
# more than 2^8 (the FlashAttention-4 choice); probabilities against a stale max stay ≤ 256
LAZY_RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def find_request(starts_ptr, t, num_requests, iters):
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
def query_block(plan_ptr, qsl_ptr, seq_lens_ptr, tile, num_requests, search_iters):
    """The prefill grid's tile → (request, its query block, the request's first query row, query count,
    sequence length), from the plan's row 1 (a valid tile: below the plan's total). A request's last
    query block (the most keys under the causal mask) comes first: the long programs start in the first
    waves and the short ones fill the tail."""
    q_starts = plan_ptr + num_requests + 1
    r = find_request(q_starts, tile, num_requests, search_iters)
    block = tl.load(q_starts + r + 1) - 1 - tile
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    return r, block, q_start, q_len, tl.load(seq_lens_ptr + r)


@triton.jit
def quantize_rows_e4m3(q):
    """q rows to e4m3 with one scale per row (absmax / 448), for the FP8 QK product."""
    qf = q.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(qf), axis=1) / 448.0, 1e-12)
    return tl.clamp(qf / scale[:, None], -448.0, 448.0).to(tl.float8e4nv), scale


@triton.jit
def load_block(
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
def attend_block(
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
    TMA: cache_k / cache_v are tensor descriptors (`page_descriptors`) and the block lies inside one
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
    k, v = load_block(
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
def attend_range(
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
        m_i, l_i, acc = attend_block(
            q, q_scale, m_i, l_i, acc, cache_k, cache_v, page_row_ptr, key, key_end, row_limit, head,
            stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, 0, FP8,
            KEYS_AS_ROWS, P_SCALE, TMA, LAZY,
        )  # fmt: skip
    for key in range(full_end, key_end, BLOCK_N):
        m_i, l_i, acc = attend_block(
            q, q_scale, m_i, l_i, acc, cache_k, cache_v, page_row_ptr, key, key_end, row_limit, head,
            stride_page, stride_off, stride_head, qk_scale, PAGE_SIZE, HEAD_DIM, BLOCK_N, TAIL_MASK, FP8,
            KEYS_AS_ROWS, P_SCALE, TMA, LAZY,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def kv_sources(cache_ptr, k_desc, v_desc, stride_ckv, TMA: tl.constexpr):
    """The layer's K and V as the key blocks read them: tensor descriptors (TMA) or base pointers."""
    if TMA:
        cache_k = k_desc
        cache_v = v_desc
    else:
        cache_k = cache_ptr
        cache_v = cache_ptr + stride_ckv
    return cache_k, cache_v


@triton.jit
def dequant_scales(scales_ptr, FP8: tl.constexpr, P_SCALE: tl.constexpr):
    """The layer's K dequantization scale and the factor acc needs for V: its dequantization scale over
    the e4m3 P's scale (both 1.0 for a bf16 cache)."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1) / P_SCALE
    return k_scale, v_scale


def search_iterations(num_requests: int) -> int:
    return max(int(num_requests).bit_length() + 1, 1)


def cache_strides(kv_cache: Tensor) -> tuple[int, ...]:
    """Strides of one layer's [2, pages, page_size, kv_heads, head_dim] view: the kernels get the layer's
    base pointer from the host (64-bit), so no in-kernel layer offset can overflow int32."""
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4)


def cache_flags(kv_cache: Tensor, lazy: bool = False) -> dict[str, int | bool | float]:
    """Compile-time facts of the cache: FP8 (V pages transposed, e4m3 products) or not, the page size,
    and the scale that puts P into e4m3's range (P ≤ 1, or ≤ 2^8 under lazy rescaling, lands on 448)."""
    fp8 = v_pages_transposed(kv_cache)
    p_scale = E4M3_MAX / 2**LAZY_RESCALE_LOG2.value if lazy else E4M3_MAX
    return dict(FP8=fp8, P_SCALE=p_scale, PAGE_SIZE=kv_cache.shape[3])


def gqa_shape(q: Tensor, kv_cache: Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[4]
    return num_heads // num_kv_heads, num_kv_heads, head_dim


def kv_descriptors_or_none(kv_cache: Tensor, layer: int, config: LaunchConfig) -> tuple:
    return page_descriptors(kv_cache, layer, config.block_n) if config.tma else (None, None)


def page_descriptors(kv_cache: Tensor, layer: int, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
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
