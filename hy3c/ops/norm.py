"""RMSNorm ops: `hy3::rms_norm` (over the last dim) and `hy3::qk_norm` (per attention head).

Numerics follow HF `HYV3RMSNorm` (docs/ARCHITECTURE.md §1.4): statistics in fp32, the normalised value
cast back to the input dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


@torch.library.custom_op("hy3::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = weight * (x / sqrt(mean(x²) + eps)) over the last dim; x [..., H], weight [H]."""
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("hy3::qk_norm", mutates_args=())
def qk_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm: x [T, heads, head_dim], weight [head_dim] shared by all heads."""
    return rms_norm_reference(x, weight, eps)


@qk_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)
