"""Triton RMSNorm and residual add + RMSNorm: one launch per op instead of a chain of torch kernels.

* `hy3_triton::rms_norm(x, weight, eps)` implements `hy3::rms_norm`;
* `hy3_triton::add_rms_norm(x, residual, weight, eps)` implements `hy3::add_rms_norm`
  → (rms_norm(x + residual), x + residual);
* `hy3_triton::add_rms_norm_quant(x, residual, weight, eps, scale)` implements
  `hy3::add_rms_norm_quant`: the same, plus the FP8 quantization of the normed rows the next GEMM
  reads (per-row dynamic scale, or the static per-tensor one) in the same pass.

The torch references run as ~9 kernels each (add, cast, square, mean, add, rsqrt, multiply, cast,
weight) — with two norms per layer, most of a small decode step's launches. Here one program owns a
row (up to `MAX_ROW` elements, held in registers), with the reference's rounding: the residual sum in
the input dtype, statistics in fp32, the normalised value rounded to the input dtype, then times the
weight, rounded once.
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


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    rows,
    cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    stride_q,
    ADD: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < cols
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if ADD:  # the sum in fp32, rounded once to the input dtype (what torch's bf16 add does)
        residual = tl.load(res_ptr + row * stride_r + c, mask=ok, other=0.0).to(tl.float32)
        total = (xf + residual).to(dtype)
        tl.store(sum_ptr + row * stride_s + c, total, mask=ok)
        xf = total.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / cols + eps)
    normed = (xf * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    y = (w * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + c, y, mask=ok)
    if QUANT > 0:  # FP8 of the rounded output for the next GEMM: 1 = per-row dynamic, 2 = static scale
        yf = y.to(tl.float32)
        if QUANT == 1:
            scale = tl.maximum(tl.max(tl.abs(yf), axis=0) / 448.0, 1e-12)
        else:
            scale = tl.load(static_ptr)
        tl.store(scale_ptr + row, scale)
        q = tl.clamp(yf / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=ok)


def _rows(t: Tensor) -> Tensor:
    """t as [rows, cols] with unit stride along cols (a copy only when the last dim is strided)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


def launch(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
    quant: str | None = None,
    scale: Tensor | None = None,
    pdl: bool = True,
) -> tuple[Tensor, ...]:
    """→ (out, total or None) — and (q, q_scale) after them when `quant` is "dynamic" or "static"."""
    cols = x.shape[-1]
    if cols > MAX_ROW:
        raise ValueError(f"rows of {cols} elements exceed the kernel's {MAX_ROW}")
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else None
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device) if quant else None
    q_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quant else None
    if rows:
        res2 = _rows(residual) if residual is not None else x2
        out2 = out.view(-1, cols)
        total2 = total.view(-1, cols) if total is not None else out2
        q2 = q if q is not None else out2
        static = scale.float().reshape(1) if scale is not None else out2
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out2,
            total2,
            q2,
            q_scale if q_scale is not None else out2,
            static,
            rows,
            cols,
            eps,
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            total2.stride(0),
            q2.stride(0),
            ADD=residual is not None,
            QUANT={None: 0, "dynamic": 1, "static": 2}[quant],
            BLOCK=block,
            num_warps=max(min(block // 512, 16), 1),
            **pdl_launch(x.device, pdl),
        )
    return (out, total) if not quant else (out, total, q, q_scale)


@torch.library.custom_op("hy3_triton::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, *, pdl: bool = True) -> Tensor:
    return launch(x, None, weight, eps, pdl=pdl)[0]


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float, *, pdl: bool = True) -> Tensor:
    return x.new_empty(x.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("hy3_triton::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, pdl: bool = True
) -> tuple[Tensor, Tensor]:
    out, total = launch(x, residual, weight, eps, pdl=pdl)
    return out, total


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("hy3_triton::add_rms_norm_quant", mutates_args=())
def add_rms_norm_quant(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Tensor | None, *, pdl: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm_quant expects [T, H] activations, got {tuple(x.shape)}")
    out, total, q, q_scale = launch(
        x, residual, weight, eps, "static" if scale is not None else "dynamic", scale, pdl
    )
    return out, total, q, q_scale


@add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, scale, *, pdl=True):
    rows = x.new_empty((x.shape[0], 1), dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape, dtype=FP8_DTYPE), rows


def _supports(node) -> str | None:
    x = node.args[0].meta.get("val")
    if x is not None and isinstance(x.shape[-1], int) and x.shape[-1] > MAX_ROW:
        return f"rows longer than {MAX_ROW}"
    return None


def _supports_add(node) -> str | None:
    x, residual = (node.args[i].meta.get("val") for i in (0, 1))
    if x is not None and residual is not None and (x.shape != residual.shape or x.dtype != residual.dtype):
        return "x and residual differ in shape or dtype"
    if node.target is torch.ops.hy3.add_rms_norm_quant.default and x is not None and x.dim() != 2:
        return "the quantized form expects [T, H] activations"
    return _supports(node)


register_provider(
    Provider(
        "triton",
        "rms_norm",
        torch.ops.hy3_triton.rms_norm.default,
        frozenset({"cuda"}),
        supports=_supports,
        variants=(PDL,),
    )
)
register_provider(
    Provider(
        "triton",
        "add_rms_norm_quant",
        torch.ops.hy3_triton.add_rms_norm_quant.default,
        frozenset({"cuda"}),
        supports=_supports_add,
        variants=(PDL,),
    )
)
register_provider(
    Provider(
        "triton",
        "add_rms_norm",
        torch.ops.hy3_triton.add_rms_norm.default,
        frozenset({"cuda"}),
        supports=_supports_add,
        variants=(PDL,),
    )
)
