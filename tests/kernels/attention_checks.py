"""Accuracy checks of the paged attention kernels against the torch reference (CPU and GPU tests)."""

from __future__ import annotations

import torch

import hy3c.ops  # noqa: F401
from hy3c.ops.quant import FP8_DTYPE, per_token_scale, quantize_fp8

hy3 = torch.ops.hy3


def e4m3_rows(q: torch.Tensor) -> torch.Tensor:
    """q as the FP8 QK product sees it: each head's row quantized to e4m3 (scale absmax / 448), kept in
    fp32 (a bf16 rounding would add its own error)."""
    scale = per_token_scale(q)
    return quantize_fp8(q, scale).float() * scale


def abs_v(cache: torch.Tensor) -> torch.Tensor:
    """The cache with |V| in place of V (exact in e4m3 and bf16, whatever the page layout)."""
    out = cache.clone()
    out[:, 1] = cache[:, 1].float().abs().to(cache.dtype)
    return out


def fp8_reference_and_bound(q, cache, scales, layer, table, seq_lens, qsl, sm_scale):
    """FP8 KV: the reference over q's e4m3 rows (the QK product's input) and the bound of P's e4m3
    rounding on each output element — a relative 2^-4 on every probability, so at most (P·|V|) / 16 —
    plus 2e-3 (the bf16 output's rounding, subnormal probabilities)."""
    q_seen = e4m3_rows(q)
    ref = hy3.attention(q_seen, cache, scales, layer, table, seq_lens, qsl, sm_scale).float()
    p_abs_v = hy3.attention(q_seen, abs_v(cache), scales, layer, table, seq_lens, qsl, sm_scale).float()
    return ref, p_abs_v / 16 + 2e-3


def assert_attention_close(out, q, cache, scales, layer, table, seq_lens, qsl, sm_scale) -> None:
    """bf16 / fp32 KV: the reference within 2e-2. FP8 KV: every element within the e4m3 P bound."""
    if cache.dtype != FP8_DTYPE:
        ref = hy3.attention(q, cache, scales, layer, table, seq_lens, qsl, sm_scale).float()
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        return
    ref, bound = fp8_reference_and_bound(q, cache, scales, layer, table, seq_lens, qsl, sm_scale)
    excess = (out.float() - ref).abs() - bound
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} elements past the e4m3 P bound, by {excess.max():.2e}"
    )
