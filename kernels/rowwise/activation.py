"""Triton SwiGLU activation: `hy3_triton::silu_and_mul` implements `hy3::silu_and_mul`, and
`hy3_triton::silu_and_mul_quant` adds the FP8 quantization of its rows for the next GEMM.

The torch reference takes two kernels (silu, multiply); in a decode step every launch costs a few
microseconds of gap. The rounding is the reference's: silu(gate) rounded to the input dtype, times up,
rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider
from hy3c.ops.quant import FP8_DTYPE

BLOCK = 1024  # elements of one output row per program
MAX_QUANT_ROW = 16384  # silu_and_mul_quant holds a whole output row (its absmax) in one program


@triton.jit
def _swiglu(row_ptr, c, ok, inter):
    """silu(gate) * up for columns c of one [gate | up] row, rounded as the reference: silu(gate) to the
    input dtype, then the product (returned in the input dtype)."""
    gate = tl.load(row_ptr + c, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    up = tl.load(row_ptr + inter + c, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up).to(gate.dtype)


@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr, rows, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    tl.store(out_ptr + row * stride_o + c, _swiglu(x_ptr + row * stride_x, c, ok, inter), mask=ok)


@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    rows,
    inter,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program: SwiGLU rounded as the reference, then FP8 with the row's absmax / 448 (or the
    static scale)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < inter
    y = _swiglu(x_ptr + row * stride_x, c, ok, inter).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=ok)


@torch.library.custom_op("hy3_triton::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(x: Tensor, scale: Tensor | None, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"silu_and_mul_quant expects [T, 2I] activations, got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    if inter > MAX_QUANT_ROW:
        raise ValueError(f"rows of {inter} elements exceed the kernel's {MAX_QUANT_ROW}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = x.shape[0]
    q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=x.device)
    q_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and inter:
        block = triton.next_power_of_2(inter)
        _silu_and_mul_quant_kernel[(rows,)](
            x,
            q,
            q_scale,
            scale.float().reshape(1) if scale is not None else q_scale,
            rows,
            inter,
            x.stride(0),
            q.stride(0),
            STATIC=scale is not None,
            BLOCK=block,
            num_warps=max(min(block // 512, 16), 1),
            **pdl_launch(x.device, pdl),
        )
    return q, q_scale


@silu_and_mul_quant.register_fake
def _(x: Tensor, scale: Tensor | None, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    rows = x.shape[0]
    return x.new_empty((rows, x.shape[-1] // 2), dtype=FP8_DTYPE), x.new_empty((rows, 1), dtype=torch.float32)


@torch.library.custom_op("hy3_triton::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor, *, pdl: bool = True) -> Tensor:
    inter = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], inter))
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-1])
    if x2.shape[0] and inter:
        out2 = out.view(-1, inter)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK))](
            x2,
            out2,
            x2.shape[0],
            inter,
            x2.stride(0),
            out2.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_launch(x.device, pdl),
        )
    return out


@silu_and_mul.register_fake
def _(x: Tensor, *, pdl: bool = True) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _supports_quant(node) -> str | None:
    x = node.args[0].meta.get("val")
    if x is not None and (
        x.dim() != 2 or (isinstance(x.shape[-1], int) and x.shape[-1] // 2 > MAX_QUANT_ROW)
    ):
        return f"expects [T, 2I] rows with I <= {MAX_QUANT_ROW}"
    return None


register_provider(
    Provider(
        "triton",
        "silu_and_mul",
        torch.ops.hy3_triton.silu_and_mul.default,
        frozenset({"cuda"}),
        variants=(PDL,),
    )
)
register_provider(
    Provider(
        "triton",
        "silu_and_mul_quant",
        torch.ops.hy3_triton.silu_and_mul_quant.default,
        frozenset({"cuda"}),
        supports=_supports_quant,
        variants=(PDL,),
    )
)
