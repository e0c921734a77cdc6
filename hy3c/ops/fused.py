"""L2 fused ops (DESIGN §3). Each reference is the composition of the L1 references it replaces, so
a fused op is always checkable against the unfused graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.ops.attention import attention_reference, kv_store_reference
from hy3c.ops.norm import rms_norm_reference
from hy3c.ops.rope import rope_reference


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


@torch.library.custom_op("hy3::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Residual add + RMSNorm: (rms_norm(x + residual), x + residual)."""
    return add_rms_norm_reference(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def qknorm_rope_quant_kvstore_reference(
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
) -> Tensor:
    head_dim = kv_cache.shape[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    t = qkv.shape[0]
    q = rope_reference(
        rms_norm_reference(q.reshape(t, num_heads, head_dim), q_norm_weight, eps), positions, theta
    )
    k = rope_reference(
        rms_norm_reference(k.reshape(t, num_kv_heads, head_dim), k_norm_weight, eps), positions, theta
    )
    kv_store_reference(k, v.reshape(t, num_kv_heads, head_dim), kv_cache, kv_scales, layer, slot_mapping)
    return q


@torch.library.custom_op("hy3::qknorm_rope_quant_kvstore", mutates_args=("kv_cache",))
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
) -> Tensor:
    """Split packed qkv [T, (H + 2·Hkv)·D]; per-head RMSNorm on q and k; RoPE on q and k; store k and v
    (quantized to the cache dtype with kv_scales) into the pages of `layer`; return q [T, H, D]."""
    return qknorm_rope_quant_kvstore_reference(
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
):
    return qkv.new_empty((qkv.shape[0], num_heads, kv_cache.shape[-1]))


def attention_plan_reference(seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int) -> Tensor:
    zero = torch.zeros(1, dtype=torch.int32, device=seq_lens.device)
    kv_tiles = (seq_lens.to(torch.int32) + kv_tile - 1) // kv_tile
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    q_blocks = (q_lens + q_block - 1) // q_block
    return torch.stack(
        [
            torch.cat([zero, kv_tiles.cumsum(0).to(torch.int32)]),
            torch.cat([zero, q_blocks.cumsum(0).to(torch.int32)]),
        ]
    )


@torch.library.custom_op("hy3::attention_plan", mutates_args=())
def attention_plan(seq_lens: Tensor, query_start_loc: Tensor, kv_tile: int, q_block: int) -> Tensor:
    """Per-step attention work plan [2, B + 1] int32: prefix sums of KV tiles and of query blocks
    (see hy3c.kernels.attention_plan)."""
    return attention_plan_reference(seq_lens, query_start_loc, kv_tile, q_block)


@attention_plan.register_fake
def _(seq_lens, query_start_loc, kv_tile, q_block):
    return seq_lens.new_empty((2, query_start_loc.shape[0]), dtype=torch.int32)


@torch.library.custom_op("hy3::paged_attention", mutates_args=())
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
    """`hy3::attention` with the step's precomputed work plan (the reference ignores the plan)."""
    return attention_reference(q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale)


@paged_attention.register_fake
def _(q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale, plan):
    return torch.empty_like(q)
