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


INT4_MIN, INT4_MAX = -8, 7
INT4_GROUP = 128  # input columns per W4A8 weight scale (the Hy3 stack's, ModelOpt's and AngelSlim's)


MIN_INT4_GROUP = 16  # the smallest group the formats take (the Triton GEMMs need 32: an FP8 MMA's K)


def check_int4_groups(name: str, columns: int, group: int) -> None:
    """W4A8 weights pack two values per byte and share a scale per `group` input columns: a power of two
    of at least MIN_INT4_GROUP that divides the columns."""
    if group < MIN_INT4_GROUP or group & (group - 1) or columns % group:
        raise ValueError(
            f"{name}: W4A8 group size {group} must be a power of two of at least {MIN_INT4_GROUP} and divide "
            f"the {columns} input columns"
        )


def quantize_int4_groups(weight: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Symmetric round-to-nearest int4 over groups of `group` input (last-dim) columns.

    weight [..., N, K] → (packed uint8 [..., N, K/2]: column 2j in the low nibble and 2j + 1 in the high
    one, two's complement in [-8, 7]; scale fp32 [..., N, K/group] = absmax(group) / 7), so that
    weight ≈ value · scale of its group."""
    check_int4_groups("weight", weight.shape[-1], group)
    if weight.dim() < 2 or weight.numel() <= _INT4_CHUNK_VALUES:
        return _quantize_int4_block(weight, group)
    # a large weight (all of a layer's experts) a slice of its first dimension at a time: the fp32
    # temporaries of the whole would be 4× its values in bytes, more than a GPU holds beside the model
    packed = weight.new_empty((*weight.shape[:-1], weight.shape[-1] // 2), dtype=torch.uint8)
    scale = weight.new_empty((*weight.shape[:-1], weight.shape[-1] // group), dtype=torch.float32)
    step = max(1, _INT4_CHUNK_VALUES * weight.shape[0] // weight.numel())
    for start in range(0, weight.shape[0], step):
        packed[start : start + step], scale[start : start + step] = _quantize_int4_block(
            weight[start : start + step], group
        )
    return packed, scale


_INT4_CHUNK_VALUES = 1 << 26  # values quantized at once: 256 MiB of fp32 temporaries each


def _quantize_int4_block(weight: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """`quantize_int4_groups` of one block of rows, in one pass."""
    w = weight.float().unflatten(-1, (-1, group))
    scale = (w.abs().amax(dim=-1) / INT4_MAX).clamp_min(_MIN_SCALE)
    values = torch.round(w / scale.unsqueeze(-1)).clamp(INT4_MIN, INT4_MAX).to(torch.int8).flatten(-2)
    return pack_int4(values), scale


def pack_int4(values: Tensor) -> Tensor:
    """int8 values in [-8, 7], [..., K] → uint8 [..., K/2] (column 2j low nibble, 2j + 1 high)."""
    nibbles = values.to(torch.uint8) & 0xF
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] → int8 values [..., K] in [-8, 7] (the inverse of `pack_int4`)."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    values = torch.stack((low, high), dim=-1).flatten(-2)
    return values - ((values & 8) << 1)


def dequantize_int4_groups(packed: Tensor, scale: Tensor) -> Tensor:
    """The fp32 weight [..., N, K] of int4 values packed [..., N, K/2] with group scales [..., N, K/g]."""
    values = unpack_int4(packed).float()
    group = values.shape[-1] // scale.shape[-1]
    return (values.unflatten(-1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(-2)
