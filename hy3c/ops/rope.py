"""Rotary position embedding: `hy3::rope` (neox / rotate-half pairing, full rotary; docs/ARCHITECTURE.md
§1.2).

Angles are computed in fp32 exactly as HF does (`inv_freq = 1 / theta ** (arange(0, d, 2) / d)`,
`angle = position * inv_freq`); the rotation itself is done in fp32 and rounded once to the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin tables [T, head_dim] in fp32 for the given absolute positions."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rope_reference(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


@torch.library.custom_op("hy3::rope", mutates_args=())
def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate x [T, heads, head_dim] by the angles of positions [T] (int64)."""
    return rope_reference(x, positions, theta)


@rope.register_fake
def _(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    return torch.empty_like(x)


def hadamard_matrix(n: int, device: torch.device | str = "cpu") -> Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (fp32, n a power of two): H = [[A, A], [A, -A]]
    / sqrt(2) recursively. Symmetric, so x @ H rotates rows and (x @ H) · (y @ H) = x · y."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0) / 2**0.5
    return h


def hadamard_reference(x: Tensor) -> Tensor:
    """Rotate the last dimension by the Hadamard matrix (fp32 product, rounded once to x's dtype). Applied
    to both q and k it leaves every score q·k unchanged and spreads outlier channels of k before FP8."""
    return (x.float() @ hadamard_matrix(x.shape[-1], x.device)).to(x.dtype)
