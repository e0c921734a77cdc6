"""The `cublas` providers: vendor GEMMs through torch, no host synchronization (CUDA-graph safe).

* `hy3_cublas::moe_experts`: routed experts as two `torch._grouped_mm` calls over tokens sorted by
  expert (counts by scatter-add, so no data-dependent output sizes), SwiGLU between them, the top-k
  weighted combine in fp32 by index_add. BF16/FP16 weights. Ids of −1 (expert parallelism: experts of
  another rank) sort after the last expert's rows, past the groups' last offset: no GEMM computes them,
  and their rows are combined into a spare output row that is left out.
* `hy3_cublas::scaled_mm`: FP8 GEMM through `torch._scaled_mm` with per-tensor or row-wise
  (per-token × per-channel) scales, bf16 output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hy3c.kernels.registry import Provider, register_provider
from hy3c.ops.quant import FP8_DTYPE


def grouped_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Σ_j topk_weights[:, j] · expert_{topk_ids[:, j]}(x), skipping ids of −1: the (token, slot) pairs
    sorted by expert, −1 keyed as expert E so that those pairs come last, past the groups' last offset,
    where the grouped GEMMs compute nothing (the rows there are left as they were allocated); the
    combine adds those rows into the spare output row T, which is dropped."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    held = flat >= 0
    key = torch.where(held, flat, num_experts)
    order = key.argsort(stable=True)
    token = order // top_k
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)
    gate_up = torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offsets)
    inter = gate_up.shape[-1] // 2
    hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    down = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets)
    weighted = down.float() * topk_weights.reshape(-1)[order, None]
    out = torch.zeros(num_tokens + 1, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, torch.where(held[order], token, num_tokens), weighted)
    return out[:num_tokens].to(x.dtype)


@torch.library.custom_op("hy3_cublas::moe_experts", mutates_args=())
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
    return grouped_moe(x, topk_weights, topk_ids, w13, w2)


@moe_experts.register_fake
def _(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale):
    return x.new_empty(x.shape)


def _moe_supports(node) -> str | None:
    w13 = node.args[3].meta.get("val")
    if w13 is not None and w13.dtype in (FP8_DTYPE, torch.uint8):
        return f"{'FP8' if w13.dtype == FP8_DTYPE else 'W4A8'} experts (grouped_mm takes bf16/fp16)"
    return None


@torch.library.custom_op("hy3_cublas::scaled_mm", mutates_args=())
def scaled_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    rows, cols = a.shape[0], b.shape[0]
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        sa, sb = a_scale.reshape(()), b_scale.reshape(())
    else:
        sa = a_scale.float().reshape(-1, 1).expand(rows, 1).contiguous()
        sb = b_scale.float().reshape(1, -1).expand(1, cols).contiguous()
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


@scaled_mm.register_fake
def _(a, b, a_scale, b_scale, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _scaled_mm_supports(node) -> str | None:
    a, b = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if a is None or b is None:
        return None
    if a.shape[-1] % 16 or b.shape[0] % 16:
        return "K and N must be multiples of 16"
    if node.args[4] != torch.bfloat16:
        return "row-wise scaled FP8 GEMM returns bf16 only"
    return None


register_provider(
    Provider(
        "cublas",
        "moe_experts",
        torch.ops.hy3_cublas.moe_experts.default,
        frozenset({"cuda"}),
        cuda_graph_safe=True,
        supports=_moe_supports,
    )
)
register_provider(
    Provider(
        "cublas",
        "scaled_mm",
        torch.ops.hy3_cublas.scaled_mm.default,
        frozenset({"cuda"}),
        cuda_graph_safe=True,
        supports=_scaled_mm_supports,
    )
)
