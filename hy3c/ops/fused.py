"""L2 fused ops (DESIGN §3). Each reference is the composition of the L1 references it replaces, so
a fused op is always checkable against the unfused graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.ops.norm import rms_norm_reference


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
