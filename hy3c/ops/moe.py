"""MoE ops: `hy3::router`, `hy3::moe_experts`, `hy3::silu_and_mul` (docs/ARCHITECTURE.md §1.3).

Expert weights are stacked: w13 [E, 2I, H] (gate rows first, then up rows), w2 [E, H, I]. FP8 experts
carry per-channel dequant scales w13_scale [E, 2I], w2_scale [E, H] and either static activation scales
a13_scale / a2_scale [1] or none (dynamic per-token activation quantization). W4A8 experts hold int4
weights packed two per byte along the input dimension (uint8 w13 [E, 2I, H/2], w2 [E, H, I/2];
`hy3c.ops.quant.pack_int4`) with a scale per group of input columns (w13_scale [E, 2I, H/g], w2_scale
[E, H, I/g] fp32) and FP8 activations (per token, or static): each product is an FP8 activation times
an exact int4 weight, and every group's sum is scaled by its weight scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hy3c.ops.quant import (
    FP8_DTYPE,
    dequantize_int4_groups,
    per_token_scale,
    quantize_fp8,
    scaled_mm_reference,
)

ROUTER_RENORM_EPS = 1e-20


def router_reference(
    x: Tensor, weight: Tensor, bias: Tensor, top_k: int, scaling: float
) -> tuple[Tensor, Tensor]:
    return topk_routing_reference(F.linear(x.float(), weight.float()), bias, top_k, scaling)


def topk_routing_reference(logits: Tensor, bias: Tensor, top_k: int, scaling: float) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + bias.float(), top_k, dim=-1)
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTER_RENORM_EPS) * scaling
    return weights, ids.to(torch.int32)


@torch.library.custom_op("hy3::router", mutates_args=())
def router(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, scaling: float) -> tuple[Tensor, Tensor]:
    """fp32 sigmoid router: select top_k of sigmoid(x Wᵀ) + bias, weight by the unbiased scores,
    renormalise and scale. x [T, H], weight [E, H], bias [E] → (weights [T, k] fp32, ids [T, k] int32)."""
    return router_reference(x, weight, bias, top_k, scaling)


@router.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, scaling: float) -> tuple[Tensor, Tensor]:
    shape = (x.shape[0], top_k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@torch.library.custom_op("hy3::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU activation: x [..., 2I] = [gate | up] → silu(gate) * up [..., I]."""
    return silu_and_mul_reference(x)


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul_quant_reference(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"silu_and_mul_quant expects [T, 2I] activations, got {tuple(x.shape)}")
    y = silu_and_mul_reference(x)
    if scale is None:
        q_scale = per_token_scale(y)
    else:
        q_scale = scale.float().reshape(1, 1).expand(y.shape[0], 1).contiguous()
    return quantize_fp8(y, q_scale), q_scale


@torch.library.custom_op("hy3::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """SwiGLU of x [T, 2I], quantized to FP8 for the next GEMM: (q [T, I] e4m3, q_scale [T, 1]) with
    per-token dynamic scales, or the static per-tensor `scale`."""
    return silu_and_mul_quant_reference(x, scale)


@silu_and_mul_quant.register_fake
def _(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    return x.new_empty((rows, x.shape[-1] // 2), dtype=FP8_DTYPE), x.new_empty((rows, 1), dtype=torch.float32)


def _expert_linear(
    x: Tensor,
    w: Tensor,
    w_scale: Tensor | None,
    a_scale: Tensor | None,
    x_q: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """x · wᵀ; FP8 or W4A8 weights: x quantized with the static a_scale or per token — or given already
    quantized per token as x_q = (e4m3 rows, their scales)."""
    if w.dtype not in (FP8_DTYPE, torch.uint8):
        return F.linear(x, w)
    if x_q is None:
        if a_scale is None:
            a_scale = per_token_scale(x)
        x_q = (quantize_fp8(x, a_scale), a_scale)
    if w.dtype == FP8_DTYPE:
        return scaled_mm_reference(x_q[0], w, x_q[1], w_scale, x.dtype)
    acc = x_q[0].float() @ dequantize_int4_groups(w, w_scale).t()
    return (acc * x_q[1].float().reshape(-1, 1)).to(x.dtype)


def moe_experts_reference(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    x_q: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The routed experts' weighted sum. x_q: x already quantized per token (FP8 rows [T, H], scales
    [T, 1]) — what the dynamic scheme would make of it — for the gate-up GEMMs to read. An id of −1 is
    an expert this rank does not hold (`hy3.local_experts`): it adds nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        rows_q = None if x_q is None else (x_q[0][tokens], x_q[1][tokens])
        gate_up = _expert_linear(
            x[tokens], w13[e], None if w13_scale is None else w13_scale[e], a13_scale, rows_q
        )
        hidden = silu_and_mul_reference(gate_up)
        y = _expert_linear(hidden, w2[e], None if w2_scale is None else w2_scale[e], a2_scale)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None])
    return out.to(x.dtype)


@torch.library.custom_op("hy3::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
) -> Tensor:
    """Σ_j topk_weights[:, j] · expert_{topk_ids[:, j]}(x) with fp32 accumulation; x [T, H] → [T, H]."""
    return moe_experts_reference(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)


@moe_experts.register_fake
def _(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale):
    return x.new_empty(x.shape)
