"""L2 fused ops (docs/ARCHITECTURE.md §4). Each reference is the composition of the L1 references it
replaces, so a fused op is always checkable against the unfused graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.ops.attention import attention_reference, kv_store_reference
from hy3c.ops.moe import moe_experts_reference, topk_routing_reference
from hy3c.ops.norm import rms_norm_reference
from hy3c.ops.quant import FP8_DTYPE, per_token_scale, quantize_fp8
from hy3c.ops.rope import hadamard_reference, rope_reference


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


def add_rms_norm_quant_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm_quant expects [T, H] activations, got {tuple(x.shape)}")
    normed, total = add_rms_norm_reference(x, residual, weight, eps)
    if scale is None:
        q_scale = per_token_scale(normed)
    else:
        q_scale = scale.float().reshape(1, 1).expand(normed.shape[0], 1).contiguous()
    return normed, total, quantize_fp8(normed, q_scale), q_scale


@torch.library.custom_op("hy3::add_rms_norm_quant", mutates_args=())
def add_rms_norm_quant(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Residual add + RMSNorm + FP8 quantization of the normed rows for the next GEMM: (normed, x +
    residual, q e4m3, q_scale [T, 1]) — per-token dynamic scales, or the static per-tensor `scale`."""
    return add_rms_norm_quant_reference(x, residual, weight, eps, scale)


@add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, scale):
    rows = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(x), torch.empty_like(x, dtype=FP8_DTYPE), rows


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
    hadamard: bool = False,
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
    if hadamard:
        q, k = hadamard_reference(q), hadamard_reference(k)
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
    hadamard: bool = False,
) -> Tensor:
    """Split packed qkv [T, (H + 2·Hkv)·D]; per-head RMSNorm on q and k; RoPE on q and k; optionally the
    same Hadamard rotation of q and k (scores unchanged, k's outliers spread before FP8); store k and v
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
        hadamard,
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
    (see hy3c.kernels.attention.plan)."""
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


def router_gemm_reference(x: Tensor, weight: Tensor, w_hi: Tensor, w_lo: Tensor) -> Tensor:
    return torch.nn.functional.linear(x.float(), weight.float())


@torch.library.custom_op("hy3::router_gemm", mutates_args=())
def router_gemm(x: Tensor, weight: Tensor, w_hi: Tensor, w_lo: Tensor) -> Tensor:
    """fp32 router logits x·Wᵀ [T, E]. w_hi/w_lo are W split into two bf16 parts (W ≈ W_hi + W_lo/256)
    for the dual-BF16 kernel; the reference uses the fp32 weight."""
    return router_gemm_reference(x, weight, w_hi, w_lo)


@router_gemm.register_fake
def _(x, weight, w_hi, w_lo):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("hy3::topk_routing", mutates_args=())
def topk_routing(logits: Tensor, bias: Tensor, top_k: int, scale: float) -> tuple[Tensor, Tensor]:
    """The router after its GEMM: sigmoid, top-k of score + bias, renormalised unbiased weights × scale."""
    return topk_routing_reference(logits, bias, top_k, scale)


@topk_routing.register_fake
def _(logits, bias, top_k, scale):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("hy3::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    shared: Tensor | None,
    x_q: Tensor | None = None,
    x_q_scale: Tensor | None = None,
) -> Tensor:
    """Routed experts combined, plus the shared expert's output (added in the model dtype). With FP8
    experts and per-token activation scales, x may also come already quantized per token (x_q e4m3
    [T, H] and x_q_scale [T, 1], e.g. the norm's FP8 rows): bit-identical to quantizing inside when
    both come from the same provider's kernels (the Triton ones share their expressions; the torch
    references theirs)."""
    check_moe_input_quant(x, w13, a13_scale, x_q, x_q_scale)
    rows_q = None if x_q is None else (x_q, x_q_scale)
    routed = moe_experts_reference(
        x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, rows_q
    )
    return routed if shared is None else routed + shared


def check_moe_input_quant(
    x: Tensor, w13: Tensor, a13_scale: Tensor | None, x_q: Tensor | None, x_q_scale: Tensor | None
) -> None:
    """fused_moe's pre-quantized input: both parts or neither, FP8 or W4A8 experts with per-token scales only,
    shapes [T, H] and [T, 1]."""
    if x_q is None and x_q_scale is None:
        return
    if x_q is None or x_q_scale is None:
        raise ValueError("fused_moe: x_q and x_q_scale come together")
    if w13.dtype not in (FP8_DTYPE, torch.uint8) or a13_scale is not None:
        raise ValueError(
            "fused_moe: a pre-quantized x_q needs FP8 or W4A8 experts with per-token activation scales"
        )
    if (
        x_q.dtype != FP8_DTYPE
        or x_q.shape != x.shape
        or x_q.stride(-1) != 1
        or x_q_scale.dtype != torch.float32
        or tuple(x_q_scale.shape) != (x.shape[0], 1)
    ):
        raise ValueError(
            f"fused_moe: x_q must be e4m3 {tuple(x.shape)} with unit column stride and x_q_scale fp32 "
            f"[{x.shape[0]}, 1], got {x_q.dtype} {tuple(x_q.shape)} stride {x_q.stride()} and "
            f"{x_q_scale.dtype} {tuple(x_q_scale.shape)}"
        )


@fused_moe.register_fake
def _(x, *inputs_that_do_not_shape_the_output):
    return torch.empty_like(x)
