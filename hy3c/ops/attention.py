"""Paged KV cache ops: `hy3::kv_store` and `hy3::attention`.

KV cache layout (one tensor for all layers, MTP layers included):
    kv_cache  [num_kv_layers, 2 (k, v), num_pages, page_size, num_kv_heads, head_dim]
    kv_scales [num_kv_layers, 2] fp32 — per-tensor dequant scales, used when kv_cache is FP8 (C8)
A token's slot is `page_id * page_size + offset`; a negative slot means "padding, do not store".
An FP8 cache stores its V pages transposed: each page's bytes hold [num_kv_heads, head_dim, page_size]
(`v_pages`), a key's values strided by page_size and the keys of a head dim contiguous — the layout the
attention kernels' e4m3 PV product reads (Hopper's FP8 MMA takes its B operand only K-major: the keys).
K pages, and both K and V of a bf16 cache, are [page_size, num_kv_heads, head_dim] as the shape says.
Every page keeps its size, so page copies (prefix cache tiers) and cache sizing ignore the difference.

Batch metadata for `attention` (B requests, T query tokens in total):
    page_table      [B, max_pages] int32   pages of each request, in order
    seq_lens        [B] int32              KV length of each request *including* this step's tokens
    query_start_loc [B + 1] int32          request r owns query rows query_start_loc[r]:query_start_loc[r+1]
The queries of a request are its last tokens: query i of a request with n queries and KV length L sits
at position L - n + i and attends causally to KV positions 0 .. L - n + i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.ops.quant import FP8_DTYPE, quantize_fp8


def quantize_to_cache_dtype(x: Tensor, scale: Tensor, cache_dtype: torch.dtype) -> Tensor:
    """Cast K or V to the cache dtype; FP8 divides by the per-tensor scale and saturates at ±448."""
    if cache_dtype == FP8_DTYPE:
        return quantize_fp8(x, scale)
    return x.to(cache_dtype)


def v_pages_transposed(kv_cache: Tensor) -> bool:
    """Whether the cache's V pages are stored [num_kv_heads, head_dim, page_size] (FP8 caches)."""
    return kv_cache.dtype == FP8_DTYPE


def v_pages(kv_cache: Tensor, layer: int) -> Tensor:
    """Layer's V pages as stored: [pages, page_size, kv_heads, head_dim], or for an FP8 cache
    [pages, kv_heads, head_dim, page_size]."""
    v = kv_cache[layer, 1]
    if v_pages_transposed(kv_cache):
        pages, page_size, kv_heads, head_dim = v.shape
        return v.view(pages, kv_heads, head_dim, page_size)
    return v


def kv_store_reference(
    k: Tensor, v: Tensor, kv_cache: Tensor, kv_scales: Tensor, layer: int, slot_mapping: Tensor
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_flat = kv_cache[layer, 0].view(-1, *kv_cache.shape[-2:])
    k_flat[slots] = quantize_to_cache_dtype(k[valid], kv_scales[layer, 0], kv_cache.dtype)
    v_values = quantize_to_cache_dtype(v[valid], kv_scales[layer, 1], kv_cache.dtype)
    if v_pages_transposed(kv_cache):
        page_size = kv_cache.shape[3]
        v_pages(kv_cache, layer)[slots // page_size, :, :, slots % page_size] = v_values
    else:
        kv_cache[layer, 1].view(-1, *kv_cache.shape[-2:])[slots] = v_values


@torch.library.custom_op("hy3::kv_store", mutates_args=("kv_cache",))
def kv_store(
    k: Tensor, v: Tensor, kv_cache: Tensor, kv_scales: Tensor, layer: int, slot_mapping: Tensor
) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into the pages of `layer` at slot_mapping [T] (int64)."""
    kv_store_reference(k, v, kv_cache, kv_scales, layer, slot_mapping)


@kv_store.register_fake
def _(k: Tensor, v: Tensor, kv_cache: Tensor, kv_scales: Tensor, layer: int, slot_mapping: Tensor) -> None:
    return None


def gather_request_kv(
    kv_cache: Tensor, kv_scales: Tensor, layer: int, pages: Tensor, length: int
) -> tuple[Tensor, Tensor]:
    """K and V [length, num_kv_heads, head_dim] of one request, dequantized to fp32."""
    k = kv_cache[layer, 0, pages.long()]
    v = v_pages(kv_cache, layer)[pages.long()]
    if v_pages_transposed(kv_cache):
        v = v.permute(0, 3, 1, 2)  # [pages, page_size, kv_heads, head_dim] like K
    out = []
    for which, paged in ((0, k), (1, v)):
        flat = paged.reshape(-1, *kv_cache.shape[-2:])[:length].float()
        if kv_cache.dtype == FP8_DTYPE:
            flat = flat * kv_scales[layer, which]
        out.append(flat)
    return out[0], out[1]


def attention_reference(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
) -> Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    page_size = kv_cache.shape[3]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    for r, length in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[r], starts[r + 1]
        n = q_hi - q_lo
        if n == 0 or length == 0:
            continue
        pages = page_table[r, : (length + page_size - 1) // page_size]
        k, v = gather_request_kv(kv_cache, kv_scales, layer, pages, length)
        qr = q[q_lo:q_hi].float().view(n, num_kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,lhd->hgnl", qr, k) * sm_scale
        q_pos = torch.arange(length - n, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgnl,lhd->nhgd", probs, v)
        out[q_lo:q_hi] = o.reshape(n, num_heads, head_dim).to(q.dtype)
    return out


@torch.library.custom_op("hy3::attention", mutates_args=())
def attention(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
) -> Tensor:
    """Causal GQA attention of q [T, heads, head_dim] over the paged KV of `layer` (see module doc)."""
    return attention_reference(q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale)


@attention.register_fake
def _(q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale):
    return torch.empty_like(q)
