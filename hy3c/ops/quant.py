"""FP8 (e4m3) quantization ops: `hy3::quant_fp8`, `hy3::quant_fp8_per_token`, `hy3::dequant_fp8`,
`hy3::scaled_mm` (docs/ARCHITECTURE.md §1.7).

Scales are dequant multipliers: `x ≈ q * scale`. Weight scales are per output channel ([N] fp32; a
per-tensor checkpoint scale is expanded losslessly), activation scales are per tensor ([1], static,
calibrated) or per token ([T, 1], dynamic).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """Round x / scale to e4m3 (nearest even), saturating at ±448."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_token_scale(x: Tensor) -> Tensor:
    """Dynamic per-row scale [T, 1] fp32 = absmax(row) / 448."""
    return (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)


@torch.library.custom_op("hy3::quant_fp8", mutates_args=())
def quant_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """Static per-tensor quantization of x [T, K] with a calibrated scale [1]."""
    return quantize_fp8(x, scale)


@quant_fp8.register_fake
def _(x: Tensor, scale: Tensor) -> Tensor:
    return torch.empty_like(x, dtype=FP8_DTYPE)


@torch.library.custom_op("hy3::quant_fp8_per_token", mutates_args=())
def quant_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token quantization of x [T, K] → (q [T, K] e4m3, scale [T, 1] fp32)."""
    scale = per_token_scale(x)
    return quantize_fp8(x, scale), scale


@quant_fp8_per_token.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("hy3::dequant_fp8", mutates_args=())
def dequant_fp8(q: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """q * scale in `out_dtype`; scale broadcasts ([1], [T, 1] or [N, 1])."""
    return (q.float() * scale).to(out_dtype)


@dequant_fp8.register_fake
def _(q: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=out_dtype)


def scaled_mm_reference(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    acc = a.float() @ b.float().t()
    return (acc * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)).to(out_dtype)


@torch.library.custom_op("hy3::scaled_mm", mutates_args=())
def scaled_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """FP8 GEMM y = (a · a_scale) @ (b · b_scale)ᵀ with fp32 accumulation.

    a [M, K] e4m3 with a_scale [1] or [M, 1]; b [N, K] e4m3 (a Linear weight) with b_scale [1] or [N].
    """
    return scaled_mm_reference(a, b, a_scale, b_scale, out_dtype)


@scaled_mm.register_fake
def _(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def quantize_weight(weight: Tensor, granularity: str) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 weight and its dequant scale, over the last (input) dim.

    weight [N, K] → scale [N] (channel) or [1] (tensor); stacked experts [E, R, C] → [E, R] or [E, 1].
    """
    w = weight.float()
    if granularity == "channel":
        absmax = w.abs().amax(dim=-1)
    elif granularity == "tensor":
        absmax = (
            w.abs().reshape(w.shape[0], -1).amax(dim=-1, keepdim=True)
            if w.dim() == 3
            else w.abs().amax().reshape(1)
        )
    else:
        raise ValueError(f"unknown weight scale granularity {granularity!r} (tensor | channel)")
    scale = (absmax / FP8_MAX).clamp_min(_MIN_SCALE)
    return quantize_fp8(w, scale.unsqueeze(-1)), scale


def split_router_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 W → (W_hi, W_lo) bf16 with W ≈ W_hi + W_lo / 256 (relative error ~2^-17), for the dual-BF16
    router GEMM."""
    hi = weight.to(torch.bfloat16)
    lo = ((weight.float() - hi.float()) * 256.0).to(torch.bfloat16)
    return hi, lo
