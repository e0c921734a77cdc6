"""Triton: per-head QK RMSNorm + neox RoPE + FP8 quantization + paged KV store, in one pass over qkv.

`hy3_triton::qknorm_rope_quant_kvstore` implements the L2 op `hy3::qknorm_rope_quant_kvstore`. One
program handles a block of tokens and one or more groups of heads (all of them for large batches, so the
rotary cos/sin are computed once per token block); a group holds heads of one kind:
  * q heads (in groups of up to MAX_Q_GROUP): RMSNorm with q_norm, RoPE, written to q_out;
  * the kv heads' K: RMSNorm with k_norm, RoPE, quantized with kv_scales[layer, 0], stored at the slot;
  * the kv heads' V: quantized with kv_scales[layer, 1], stored at the slot.
An FP8 cache stores V pages transposed ([kv_heads, head_dim, page], `hy3c.ops.attention`): there a
key's values lie a page apart, so V gets programs of its own, spread evenly among the token blocks,
V_TOKENS tokens of V_HEADS KV heads each, that store [head_dim, tokens] tiles head by head: a
prefill's consecutive slots as aligned vectors of V_TOKENS bytes (`_store_v_transposed`), other tokens
byte by byte (79% of copy bandwidth at 16K tokens over an FP8 cache, BENCHMARKS.md).
Angles are position × inv_freq with inv_freq computed on the host exactly like the reference (so long
contexts rotate identically). Rounding follows the reference: normalized value rounded to the model
dtype, times the weight, rounded again, rotated in fp32, rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider
from hy3c.ops.attention import v_pages_transposed
from hy3c.ops.quant import FP8_DTYPE
from hy3c.ops.rope import hadamard_matrix

MAX_Q_GROUP = 8
# tokens and KV heads per V program (FP8 caches, V pages transposed), the heads stored one after the
# other: 16 × 2 is the fastest shape at 16K tokens (`bench/attention_bench.py --sweep`); the V programs
# are spread among the token blocks rather than placed first in the grid (faster)
V_TOKENS = 16
V_HEADS = 2
BLOCK_T = 4  # tokens per program, with NUM_WARPS warps (best of the H200 sweep)
NUM_WARPS = 8
# From this many tokens on, a program walks all head groups of its tokens, computing the rotary cos/sin
# once (they dominated the instruction count: 0.247 ms → 0.175 ms at 16K tokens); fewer tokens keep one
# group per program for parallelism. Two program shapes only: each one is a compiled variant, which the
# serving warm-up must meet before traffic does.
SHARED_ROPE_MIN_TOKENS = 2048
_INV_FREQ: dict[tuple[str, int, float], Tensor] = {}
_HADAMARD: dict[tuple[str, int], Tensor] = {}


def inv_freq(device: torch.device, head_dim: int, theta: float) -> Tensor:
    """fp32 [head_dim / 2] rotary inverse frequencies, as the reference computes them (cached)."""
    key = (str(device), head_dim, theta)
    if key not in _INV_FREQ:
        steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        _INV_FREQ[key] = 1.0 / (theta**steps)
    return _INV_FREQ[key]


@triton.jit
def _norm_rope(
    x1, x2, w1, w2, cos, sin, eps, HALF: tl.constexpr, ROPE: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    """x1, x2 [T, H, HALF] fp32 halves of each head → normed (and rotated) halves, rounded like the
    reference; w1/w2 [HALF], cos/sin [T, 1, HALF]."""
    ms = (tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF)
    r = tl.rsqrt(ms + eps)[:, :, None]
    n1 = (w1[None, None, :] * (x1 * r).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    n2 = (w2[None, None, :] * (x2 * r).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32)
    if ROPE:
        return n1 * cos - n2 * sin, n2 * cos + n1 * sin
    return n1, n2


@triton.jit
def _hadamard(x1, x2, h_ptr, HALF: tl.constexpr):
    """Rotate each head [x1 | x2] (halves [T, H, HALF], fp32) by the orthonormal Hadamard matrix of size
    2·HALF: [[A, A], [A, -A]] / sqrt(2) with A = the one of size HALF (at h_ptr), so the halves become
    (x1 + x2)·A / sqrt(2) and (x1 - x2)·A / sqrt(2): TF32 tensor-core products (10-bit mantissas, below
    the bf16 rounding of the result; the reference multiplies in fp32)."""
    T: tl.constexpr = x1.shape[0]
    H: tl.constexpr = x1.shape[1]
    i = tl.arange(0, HALF)
    a = tl.load(h_ptr + i[:, None] * HALF + i[None, :])
    s = tl.reshape(x1 + x2, [T * H, HALF])
    d = tl.reshape(x1 - x2, [T * H, HALF])
    y1 = tl.dot(s, a, input_precision="tf32") * 0.7071067811865476
    y2 = tl.dot(d, a, input_precision="tf32") * 0.7071067811865476
    return tl.reshape(y1, [T, H, HALF]), tl.reshape(y2, [T, H, HALF])


@triton.jit
def _process_group(
    group,
    rows,
    tok,
    tok_ok,
    cos,
    sin,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    cache_ptr,
    scales_ptr,
    slot_ptr,
    had_ptr,
    eps,
    stride_q_t,
    stride_q_h,
    stride_c_kv,
    stride_c_page,
    stride_c_off,
    stride_c_head,
    page_size,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_GROUP: tl.constexpr,
    FP8: tl.constexpr,
    KV_POW2: tl.constexpr,
    HADAMARD: tl.constexpr,
):
    """One group of heads for the block's tokens: q heads [group·Q_GROUP, …) for group < NUM_Q_HEADS /
    Q_GROUP, then the kv heads' K (norm, rope, quantize, store), then their V (quantize, store)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)
    out_dtype = q_out_ptr.dtype.element_ty
    num_q_groups: tl.constexpr = NUM_Q_HEADS // Q_GROUP
    if group < num_q_groups:
        h = group * Q_GROUP + tl.arange(0, Q_GROUP)
        base = rows + h[None, :, None] * HEAD_DIM + d[None, None, :]
        mask = tok_ok[:, None, None]
        x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(qw_ptr + d).to(tl.float32)
        w2 = tl.load(qw_ptr + HALF + d).to(tl.float32)
        o1, o2 = _norm_rope(x1, x2, w1, w2, cos, sin, eps, HALF, True, out_dtype)
        if HADAMARD:  # from the rotated values rounded to the model dtype, as the reference
            o1, o2 = _hadamard(
                o1.to(out_dtype).to(tl.float32), o2.to(out_dtype).to(tl.float32), had_ptr, HALF
            )
        dst = (
            q_out_ptr
            + tok.to(tl.int64)[:, None, None] * stride_q_t
            + h[None, :, None] * stride_q_h
            + d[None, None, :]
        )
        tl.store(dst, o1.to(out_dtype), mask=mask)
        tl.store(dst + HALF, o2.to(out_dtype), mask=mask)
    else:
        slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1)
        is_v = group - num_q_groups  # 0: K, 1: V
        hk = tl.arange(0, KV_POW2)
        kv_mask = (slot >= 0)[:, None, None] & (hk < NUM_KV_HEADS)[None, :, None]
        kv_src = (
            rows
            + (NUM_Q_HEADS + is_v * NUM_KV_HEADS) * HEAD_DIM
            + hk[None, :, None] * HEAD_DIM
            + d[None, None, :]
        )
        y1 = tl.load(kv_src, mask=kv_mask, other=0.0).to(tl.float32)
        y2 = tl.load(kv_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        if is_v == 0:
            kw1 = tl.load(kw_ptr + d).to(tl.float32)
            kw2 = tl.load(kw_ptr + HALF + d).to(tl.float32)
            y1, y2 = _norm_rope(y1, y2, kw1, kw2, cos, sin, eps, HALF, True, out_dtype)
            y1 = y1.to(out_dtype).to(tl.float32)
            y2 = y2.to(out_dtype).to(tl.float32)
            if HADAMARD:
                y1, y2 = _hadamard(y1, y2, had_ptr, HALF)
                y1 = y1.to(out_dtype).to(tl.float32)
                y2 = y2.to(out_dtype).to(tl.float32)
        safe_slot = tl.where(slot >= 0, slot, 0).to(tl.int64)
        page = safe_slot // page_size
        offset = safe_slot % page_size
        where = is_v * stride_c_kv + page * stride_c_page + offset * stride_c_off
        kv_dst = cache_ptr + where[:, None, None] + hk[None, :, None] * stride_c_head + d[None, None, :]
        cache_dtype = cache_ptr.dtype.element_ty
        if FP8:
            scale = tl.load(scales_ptr + is_v)
            y1 = tl.clamp(y1 / scale, -448.0, 448.0)
            y2 = tl.clamp(y2 / scale, -448.0, 448.0)
        tl.store(kv_dst, y1.to(cache_dtype), mask=kv_mask)
        tl.store(kv_dst + HALF, y2.to(cache_dtype), mask=kv_mask)


@triton.jit
def _store_v_transposed(
    qkv_ptr,
    cache_ptr,
    scales_ptr,
    slot_ptr,
    first_token,
    head,
    num_tokens,
    stride_qkv_t,
    stride_c_kv,
    stride_c_page,
    page_size,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_TOKENS: tl.constexpr,
    V_HEADS: tl.constexpr,
):
    """KV heads [head, head + V_HEADS)'s V of tokens [first_token, first_token + V_TOKENS), quantized
    with kv_scales[layer, 1], into V pages stored [kv_heads, head_dim, page], one head after the other
    (the slots' checks shared).

    The stores go by aligned windows of slots: with s the first token's slot and r = s % V_TOKENS, the
    two windows of tokens [first_token - r + k·V_TOKENS, … + V_TOKENS), k = 0, 1, cover the program's
    tokens. A window whose tokens sit at the consecutive slots s - r + k·V_TOKENS + j of one page (a
    prefill's, wherever its run starts) is stored whole, a vector of V_TOKENS bytes per head dim at an
    address the compiler knows to be aligned — even its tokens outside the program's, which their own
    program stores too with the same bytes. The program's other tokens store byte by byte."""
    at = tl.arange(0, V_TOKENS)
    d = tl.arange(0, HEAD_DIM)[:, None]
    v_col = (NUM_Q_HEADS + NUM_KV_HEADS + head) * HEAD_DIM + d
    rows = (head * HEAD_DIM + d) * page_size
    page_base = cache_ptr + stride_c_kv
    scale = tl.load(scales_ptr + 1)
    first_slot = tl.load(slot_ptr + first_token).to(tl.int64)
    shift = tl.where(first_slot >= 0, first_slot % V_TOKENS, 0)
    for w in tl.static_range(2):  # unrolled: whole_0 and whole_1 are set below
        tok = first_token - shift + w * V_TOKENS + at
        in_batch = (tok >= 0) & (tok < num_tokens)
        slot = tl.load(slot_ptr + tok, mask=in_batch, other=-1)
        # the window's first slot, a multiple of V_TOKENS as the compiler sees: aligned vector stores
        window_slot = tl.maximum(first_slot, 0) // V_TOKENS * V_TOKENS + w * V_TOKENS
        whole = tl.min(tl.where(slot == window_slot + at, 1, 0), axis=0) == 1
        whole = whole & (window_slot % page_size + V_TOKENS <= page_size) & ((w == 0) | (shift > 0))
        if whole:  # window 1 holds none of the program's tokens if shift = 0
            src = qkv_ptr + tok.to(tl.int64)[None, :] * stride_qkv_t + v_col
            page = window_slot // page_size  # (an offset by subtraction keeps the slot's alignment known)
            key = page_base + page * stride_c_page + (window_slot - page * page_size) + at[None, :] + rows
            for hh in tl.static_range(V_HEADS):
                v = tl.load(src + hh * HEAD_DIM)
                v = tl.clamp(v.to(tl.float32) / scale, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
                tl.store(key + hh * HEAD_DIM * page_size, v)
        if w == 0:
            whole_0 = whole
        else:
            whole_1 = whole
    if not (whole_0 & (whole_1 | (shift == 0))):  # some of the program's tokens are left
        own = first_token + at
        covered = tl.where(at + shift < V_TOKENS, whole_0, whole_1)
        own_slot = tl.load(slot_ptr + own, mask=own < num_tokens, other=-1)
        left = (own_slot >= 0) & ~covered
        safe_slot = tl.where(left, own_slot, 0).to(tl.int64)
        own_key = page_base + (safe_slot // page_size) * stride_c_page + safe_slot % page_size
        own_src = qkv_ptr + own.to(tl.int64)[None, :] * stride_qkv_t + v_col
        for hh in tl.static_range(V_HEADS):
            own_v = tl.load(own_src + hh * HEAD_DIM, mask=left[None, :], other=0.0).to(tl.float32)
            own_v = tl.clamp(own_v / scale, -448.0, 448.0).to(cache_ptr.dtype.element_ty)
            tl.store(own_key[None, :] + rows + hh * HEAD_DIM * page_size, own_v, mask=left[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _qknorm_rope_kvstore_kernel(
    qkv_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    inv_freq_ptr,
    q_out_ptr,
    cache_ptr,
    scales_ptr,
    slot_ptr,
    had_ptr,
    num_tokens,
    eps,
    stride_qkv_t,
    stride_q_t,
    stride_q_h,
    stride_c_kv,
    stride_c_page,
    stride_c_off,
    stride_c_head,
    page_size,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_GROUP: tl.constexpr,
    FP8: tl.constexpr,
    KV_POW2: tl.constexpr,
    HADAMARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    V_T: tl.constexpr,
    V_TOKENS: tl.constexpr,
    V_HEADS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token block, j) handles head groups [j·GROUPS_PER_PROGRAM, …): the rotary cos/sin of the
    block are computed once and shared by all of them. V_T (FP8 cache): V is not a group; V programs of
    their own (column 0 of the grid's rows, spread evenly among the token blocks) store it instead: the
    v-th, v = i · NUM_KV_HEADS / V_HEADS + g, KV heads [g·V_HEADS, …)'s V of tokens [i·V_TOKENS, …)."""
    wait_for_inputs(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    num_groups: tl.constexpr = NUM_Q_HEADS // Q_GROUP + 1 + (not V_T)
    block = tl.program_id(0)
    if V_T:
        head_groups: tl.constexpr = NUM_KV_HEADS // V_HEADS
        v_programs = tl.cdiv(num_tokens, V_TOKENS) * head_groups
        # spread evenly among the token blocks: of programs [0, p], (p + 1)·V // N store V
        total = v_programs + tl.cdiv(num_tokens, BLOCK_T)
        v_before = block.to(tl.int64) * v_programs // total
        v_through = (block.to(tl.int64) + 1) * v_programs // total
        is_v = v_through > v_before
        v_index = v_before.to(tl.int32)
        token_block = block - v_through.to(tl.int32)
        if is_v:
            if tl.program_id(1) == 0:
                _store_v_transposed(
                    qkv_ptr, cache_ptr, scales_ptr, slot_ptr, v_index // head_groups * V_TOKENS,
                    v_index % head_groups * V_HEADS, num_tokens, stride_qkv_t, stride_c_kv, stride_c_page,
                    page_size, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, V_TOKENS, V_HEADS,
                )  # fmt: skip
            return
        block = token_block
    tok = block * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    d = tl.arange(0, HALF)
    rows = qkv_ptr + tok.to(tl.int64)[:, None, None] * stride_qkv_t
    pos = tl.load(pos_ptr + tok, mask=tok_ok, other=0).to(tl.float32)
    angles = pos[:, None, None] * tl.load(inv_freq_ptr + d)[None, None, :]
    cos = tl.cos(angles)
    sin = tl.sin(angles)
    for i in tl.static_range(GROUPS_PER_PROGRAM):
        group = tl.program_id(1) * GROUPS_PER_PROGRAM + i
        if group < num_groups:
            _process_group(
                group,
                rows,
                tok,
                tok_ok,
                cos,
                sin,
                qw_ptr,
                kw_ptr,
                q_out_ptr,
                cache_ptr,
                scales_ptr,
                slot_ptr,
                had_ptr,
                eps,
                stride_q_t,
                stride_q_h,
                stride_c_kv,
                stride_c_page,
                stride_c_off,
                stride_c_head,
                page_size,
                NUM_Q_HEADS,
                NUM_KV_HEADS,
                HEAD_DIM,
                Q_GROUP,
                FP8,
                KV_POW2,
                HADAMARD,
            )


def _hadamard_half(device: torch.device, head_dim: int) -> Tensor:
    """The orthonormal Hadamard matrix of size head_dim / 2 the kernel builds the full rotation from."""
    key = (str(device), head_dim // 2)
    if key not in _HADAMARD:
        _HADAMARD[key] = hadamard_matrix(head_dim // 2, device)
    return _HADAMARD[key]


def q_group(num_heads: int) -> int:
    """q heads per program: the largest power of two <= MAX_Q_GROUP dividing num_heads."""
    group = MAX_Q_GROUP
    while num_heads % group:
        group //= 2
    return group


def _check(qkv: Tensor, kv_cache: Tensor, num_heads: int, num_kv_heads: int) -> int:
    head_dim = kv_cache.shape[-1]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv width {qkv.shape[-1]} != (heads {num_heads} + 2·{num_kv_heads}) × {head_dim}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two")
    return head_dim


def launch(
    qkv: Tensor,
    positions: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    eps: float,
    theta: float,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    slot_mapping: Tensor,
    num_heads: int,
    num_kv_heads: int,
    hadamard: bool = False,
    block_t: int = BLOCK_T,
    num_warps: int = NUM_WARPS,
    groups_per_program: int | None = None,
    v_tokens: int = V_TOKENS,
    v_heads: int | None = None,
    pdl: bool = True,
) -> Tensor:
    """q [tokens, heads, head_dim] (see the op). Tunables: block_t tokens per program with num_warps
    warps, groups_per_program head groups per program (default by the token count), v_tokens tokens (a
    power of two) and v_heads KV heads (dividing the KV heads; default V_HEADS where it divides them,
    else 1) per V program (FP8 caches)."""
    head_dim = _check(qkv, kv_cache, num_heads, num_kv_heads)
    num_tokens = qkv.shape[0]
    q = qkv.new_empty((num_tokens, num_heads, head_dim))
    if num_tokens == 0:
        return q
    qkv = qkv.contiguous() if qkv.stride(-1) != 1 else qkv
    group = q_group(num_heads)
    v_transposed = v_pages_transposed(kv_cache)
    num_groups = num_heads // group + (1 if v_transposed else 2)
    if groups_per_program is None:
        groups_per_program = num_groups if num_tokens >= SHARED_ROPE_MIN_TOKENS else 1
    if v_heads is None:
        v_heads = V_HEADS if num_kv_heads % V_HEADS == 0 else 1
    if v_heads < 1 or num_kv_heads % v_heads:
        raise ValueError(f"v_heads {v_heads} must divide the KV heads ({num_kv_heads})")
    if v_tokens < 1 or v_tokens & (v_tokens - 1):
        raise ValueError(f"v_tokens {v_tokens} must be a power of two")
    v_programs = triton.cdiv(num_tokens, v_tokens) * (num_kv_heads // v_heads) if v_transposed else 0
    grid = (triton.cdiv(num_tokens, block_t) + v_programs, triton.cdiv(num_groups, groups_per_program))
    layer_cache = kv_cache[layer]  # the layer's base pointer computed on the host, in 64 bits
    strides = (qkv.stride(0), q.stride(0), q.stride(1), *layer_cache.stride()[:4])
    _qknorm_rope_kvstore_kernel[grid](
        qkv,
        positions,
        q_norm_weight,
        k_norm_weight,
        inv_freq(qkv.device, head_dim, theta),
        q,
        layer_cache,
        kv_scales[layer],
        slot_mapping,
        _hadamard_half(qkv.device, head_dim) if hadamard else positions,
        num_tokens,
        eps,
        *strides,
        layer_cache.shape[2],
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        Q_GROUP=group,
        FP8=kv_cache.dtype == FP8_DTYPE,
        KV_POW2=triton.next_power_of_2(num_kv_heads),
        HADAMARD=hadamard,
        BLOCK_T=block_t,
        GROUPS_PER_PROGRAM=groups_per_program,
        V_T=v_transposed,
        V_TOKENS=v_tokens,
        V_HEADS=v_heads,
        num_warps=num_warps,
        **pdl_launch(qkv.device, pdl),
    )
    return q


@torch.library.custom_op("hy3_triton::qknorm_rope_quant_kvstore", mutates_args=("kv_cache",))
def qknorm_rope_quant_kvstore(
    qkv: Tensor,
    positions: Tensor,
    q_norm_weight: Tensor,
    k_norm_weight: Tensor,
    eps: float,
    theta: float,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    slot_mapping: Tensor,
    num_heads: int,
    num_kv_heads: int,
    hadamard: bool = False,
    *,
    pdl: bool = True,
) -> Tensor:
    return launch(
        qkv,
        positions,
        q_norm_weight,
        k_norm_weight,
        eps,
        theta,
        kv_cache,
        kv_scales,
        layer,
        slot_mapping,
        num_heads,
        num_kv_heads,
        hadamard,
        pdl=pdl,
    )


@qknorm_rope_quant_kvstore.register_fake
def _(
    qkv,
    positions,
    q_norm_weight,
    k_norm_weight,
    eps,
    theta,
    kv_cache,
    kv_scales,
    layer,
    slot_mapping,
    num_heads,
    num_kv_heads,
    hadamard=False,
    *,
    pdl=True,
):
    return qkv.new_empty((qkv.shape[0], num_heads, kv_cache.shape[-1]))


def _supports(node) -> str | None:
    cache = node.args[6].meta.get("val")
    head_dim = cache.shape[-1] if cache is not None else 0
    if head_dim < 2 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    hadamard = node.args[12] if len(node.args) > 12 else node.kwargs.get("hadamard", False)
    rows = BLOCK_T * min(q_group(node.args[10]), triton.next_power_of_2(node.args[11]))
    if hadamard and (rows < 16 or head_dim < 32):
        return f"the Hadamard rotation's MMA needs >= 16 rows ({rows}) and head_dim >= 32 ({head_dim})"
    return None


register_provider(
    Provider(
        "triton",
        "qknorm_rope_quant_kvstore",
        torch.ops.hy3_triton.qknorm_rope_quant_kvstore.default,
        frozenset({"cuda"}),
        cuda_graph_safe=True,
        supports=_supports,
        variants=(PDL,),
    )
)
