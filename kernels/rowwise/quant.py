"""Triton FP8 activation quantization: one pass per row instead of a chain of torch ops.

* `hy3_triton::quant_fp8_per_token(x)`: row absmax → scale = absmax / 448 (≥ 1e-12) → e4m3 with
  round-to-nearest and saturation; returns (q [T, K] e4m3, scale [T, 1] fp32).
* `hy3_triton::quant_fp8(x, scale)`: the same cast with a static per-tensor scale.
Rows up to `MAX_ROW` elements are held in registers (one read); the math matches the torch reference
(`x / scale`, clamp ±448, cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider
from hy3c.ops.quant import FP8_DTYPE

MAX_ROW = 16384


@triton.jit
def row_to_e4m3(x, row, static_ptr, scale_ptr, STATIC: tl.constexpr):
    """One row (fp32, in registers) as e4m3 values (still fp32: x / scale clamped to ±448) by the static
    scale at static_ptr, or by its own absmax / 448 (≥ 1e-12), which is stored at scale_ptr + row."""
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        tl.store(scale_ptr + row, scale)
    return tl.clamp(x / scale, -448.0, 448.0)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    K,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    q = row_to_e4m3(x, row, static_ptr, scale_ptr, STATIC)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def _launch(x: Tensor, static: Tensor | None, pdl: bool) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    if cols > MAX_ROW:
        raise ValueError(f"rows of {cols} elements exceed the kernel's {MAX_ROW}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = static if static is not None else torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quant_rows_kernel[(rows,)](
            x,
            q,
            scale,
            scale,
            cols,
            x.stride(0),
            q.stride(0),
            STATIC=static is not None,
            BLOCK=block,
            num_warps=max(min(block // 512, 16), 1),
            **pdl_launch(x.device, pdl),
        )
    return q, scale


@torch.library.custom_op("hy3_triton::quant_fp8_per_token", mutates_args=())
def quant_fp8_per_token(x: Tensor, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    return _launch(x, None, pdl)


@quant_fp8_per_token.register_fake
def _(x: Tensor, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("hy3_triton::quant_fp8", mutates_args=())
def quant_fp8(x: Tensor, scale: Tensor, *, pdl: bool = True) -> Tensor:
    return _launch(x, scale.float().reshape(1), pdl)[0]


@quant_fp8.register_fake
def _(x: Tensor, scale: Tensor, *, pdl: bool = True) -> Tensor:
    return torch.empty_like(x, dtype=FP8_DTYPE)


def _supports(node) -> str | None:
    x = node.args[0].meta.get("val")
    if x is not None and x.dim() != 2:
        return "expects a 2-D activation"
    if x is not None and isinstance(x.shape[-1], int) and x.shape[-1] > MAX_ROW:
        return f"rows longer than {MAX_ROW}"
    return None


register_provider(
    Provider(
        "triton",
        "quant_fp8_per_token",
        torch.ops.hy3_triton.quant_fp8_per_token.default,
        frozenset({"cuda"}),
        supports=_supports,
        variants=(PDL,),
    )
)
register_provider(
    Provider(
        "triton",
        "quant_fp8",
        torch.ops.hy3_triton.quant_fp8.default,
        frozenset({"cuda"}),
        supports=_supports,
        variants=(PDL,),
    )
)
