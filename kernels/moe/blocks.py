"""Pieces the FusedMoE kernels share (`fused_moe`, `fused_moe_w4a8`): which (token, slot) pairs an M
block holds and the grouped order of programs, and the FP8 quantization of activation rows and of the
intermediate's pair rows, as `rowwise.quant` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.rowwise.quant import quant_fp8, quant_fp8_per_token, row_to_e4m3
from hy3c.ops.quant import FP8_DTYPE

# the Triton dtype of each model dtype, as the kernels' epilogues round to it
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def quantize_tile(a, scale, dtype: tl.constexpr):
    """An activation tile to FP8 as the quantization kernels do: a / scale, clamped to ±448, cast."""
    return tl.clamp(a.to(tl.float32) / scale, -448.0, 448.0).to(dtype)


@triton.jit
def block_rows(pid_m, sorted_ptr, expert_ptr, pairs, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """The (token, slot) pair of each row of M block pid_m (pad rows hold `pairs`) and the block's expert:
    from the alignment (sorted ids, expert of each block) or — PAIR_BLOCKS — pair pid_m alone in row 0,
    its expert read from the flat top-k ids (expert_ptr)."""
    if PAIR_BLOCKS:
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, pairs)
    else:
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, tl.load(expert_ptr + pid_m).to(tl.int64)


@triton.jit
def program_block(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M M-blocks share each weight column block while it is in L2."""
    per_group = GROUP_M * num_n_blocks
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def quant_pair_rows_kernel(
    h_ptr, ids_ptr, q_ptr, scale_ptr, width, stride_h, stride_q, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """The intermediate's row of one (token, slot) pair to e4m3 with its dynamic scale, as
    `quant_fp8_per_token` does it (max(absmax / 448, 1e-12), x / scale clamped to ±448); a pair of id −1
    (flat top-k ids at ids_ptr) has no row — the gate-up never wrote it — and is skipped."""
    wait_for_inputs(PDL)
    pair = tl.program_id(0)
    if tl.load(ids_ptr + pair) < 0:
        return
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    h = tl.load(h_ptr + pair.to(tl.int64) * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    q = row_to_e4m3(h, pair, scale_ptr, scale_ptr, False)
    tl.store(q_ptr + pair.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_intermediate(h: Tensor, ids: Tensor, on_load: bool, pdl: bool) -> tuple[Tensor, Tensor]:
    """(down GEMM input, its per-row scales) for dynamic FP8: h itself for the down GEMM to quantize on
    load, or one `quant_pair_rows_kernel` pass over the pairs' rows (those of id −1 left alone)."""
    if on_load:
        return h, h.new_empty(1, dtype=torch.float32)
    pairs, width = h.shape
    q = torch.empty((pairs, width), dtype=FP8_DTYPE, device=h.device)
    scale = torch.empty(pairs, dtype=torch.float32, device=h.device)
    block = triton.next_power_of_2(width)
    quant_pair_rows_kernel[(pairs,)](
        h,
        ids,
        q,
        scale,
        width,
        h.stride(0),
        q.stride(0),
        BLOCK=block,
        num_warps=max(min(block // 512, 16), 1),
        **pdl_launch(h.device, pdl),
    )
    return q, scale


def quantize_activations(
    x: Tensor, static_scale: Tensor | None, on_load: bool, pdl: bool
) -> tuple[Tensor, Tensor, bool]:
    """(GEMM input, its scale, per-row scale?): one Triton pass per row (`rowwise.quant`) with a static
    per-tensor or dynamic per-token scale — or, `on_load`, x itself for the GEMM to quantize."""
    if on_load:
        per_row = static_scale is None
        return x, (x.new_empty(1, dtype=torch.float32) if per_row else static_scale.float()), per_row
    if static_scale is not None:
        return quant_fp8(x, static_scale, pdl=pdl), static_scale.float(), False
    q, scale = quant_fp8_per_token(x, pdl=pdl)
    return q, scale.reshape(-1), True
