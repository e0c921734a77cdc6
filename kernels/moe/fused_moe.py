"""Triton FusedMoE: routed experts of one MoE layer + the shared expert's output, bf16 or FP8 W8A8.

    out = fused_moe(x, topk_weights, topk_ids, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                    shared, x_q=None, x_q_scale=None)

1. `align.moe_align` (one Triton program, or device-side torch ops above 1024 pairs; no host sync): the
   (token, slot) pairs sorted by expert and padded per expert to a multiple of BLOCK_M (`sorted_ids`,
   pad value = T·k), the expert of every M block, and the padded total. With the config's
   `pair_blocks` there is no alignment: M block i holds pair i alone (its expert read from the top-k
   ids) — one launch fewer, and no weight read twice when the pairs' experts are distinct (one token).
2. gate-up GEMM: each program takes one M block of one expert and BLOCK_N columns of both the gate
   and the up halves, reads its activation rows *through* `sorted_ids` (with pair blocks, its pair's
   token row; no gather copy), and writes silu(gate) · up for its (token, slot) rows — the
   intermediate is written once, half-size.
3. down GEMM over the intermediate rows: each pair's expert output in the model dtype (half the bytes
   of fp32 rows; the one-token Gluon kernels write fp32 rows already weighted).
4. combine: each token's k rows times their routing weights summed in fp32, plus the shared expert's
   output, written once.

Expert parallelism: an id of −1 (`hy3.local_experts`: the token's expert is held by another rank) is a
pair with nothing to do here. The alignment drops it from every expert's block list, a pair block of it
returns at once, the Gluon kernels' programs of it too, the quantization of the intermediate skips its
row, and the combine leaves its row unread: no GEMM computes it, nothing writes its rows. Without −1 ids
this costs one compare per program (and the combine's and the intermediate quantization's read of each
pair's id).

With a `pair_blocks` config (one token) on an sm_90 GPU, steps 2–3 run as the warp-specialized Gluon
kernels of `fused_moe_gluon` (weight streams that start before the data they multiply, the intermediate
quantized by the down kernel itself), unless the program chose the Triton kernels (`gluon=False`).
With a `persistent` config (prefill sizes) on an sm_90 GPU, steps 2–3 run as the persistent
warp-specialized Gluon GEMMs of `fused_moe_persistent` (one program per SM over the tiles, activations
gathered into the alignment's order and fed by TMA), under the same condition.

FP8: weights e4m3 with per-channel ([E, rows]) or per-tensor ([E, 1]) scales; activations e4m3 with a
static per-tensor scale or dynamic per-token scales; fp8 × fp8 tensor-core products, scales applied in
the epilogues. The activations are quantized either by one row-wise kernel before each GEMM, or — the
config's `quant_on_load`, for few tokens — inside the GEMM as its rows are loaded (a dynamic scale is
the row's absmax / 448, found by a first pass over the row): bit-identical, two launches fewer. With
per-token scales x may also come already quantized (x_q, x_q_scale: the norm's FP8 rows, pass
`fuse_moe_input_quant`), and the gate-up GEMM reads those. With a static scale for the down GEMM's
input, the gate-up epilogue writes the intermediate as e4m3 itself (half the bytes, no quantization
launch; the same values as the row-wise kernel).

Weight tiles are pointer loads or — the config's `tma` — TMA bulk copies from a tensor descriptor over
the stacked weights ([E · 2I, H] and [E · H, I]; block_n must tile each expert's rows, a K block past the
last column is zero-filled). With the config's `swap_ab` the weights are the MMA's rows and the few
tokens its columns (accᵀ = W · aᵀ, transposed back in the epilogue): on Hopper a block_n × block_m
tile is a wgmma (m64nBLOCK_Mk32 for e4m3, reading the weights from shared memory as they are), where
16 token rows × block_n weights lower to `mma.sync` with every FP8 weight widened in registers.

Launch configs per token-count bucket: `config` (from the running GPU's table in `configs/`, written by
`bench/moe_bench.py --sweep`, or the built-in defaults); the alignment of step 1: `align`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from hy3c.kernels import devices, overrides
from hy3c.kernels.moe import fused_moe_gluon, fused_moe_persistent
from hy3c.kernels.moe.align import moe_align
from hy3c.kernels.moe.blocks import (
    TL_DTYPES,
    block_rows,
    program_block,
    quantize_activations,
    quantize_intermediate,
    quantize_tile,
)
from hy3c.kernels.moe.config import MoeConfig, config_kind, select_config, table_for
from hy3c.kernels.moe.fused_moe_w4a8 import MIN_GEMM_GROUP, routed_pairs_w4a8
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import HOPPER, PDL, Provider, Target, Variant, register_provider
from hy3c.ops.fused import check_moe_input_quant
from hy3c.ops.quant import FP8_DTYPE

ROW_SCALE_CHUNK = tl.constexpr(1024)  # columns per trip of the row-absmax pass of `quant_on_load`


@triton.jit
def _row_scales(ptr, rows, row_ok, stride, width, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Per-row FP8 scales as `quant_fp8_per_token` computes them: max(absmax / 448, 1e-12)."""
    amax = tl.zeros([BLOCK_M], tl.float32)
    for k in range(0, width, CHUNK):  # wide chunks: few dependent trips before the GEMM's loads start
        rk = k + tl.arange(0, CHUNK)
        a = tl.load(
            ptr + rows[:, None].to(tl.int64) * stride + rk[None, :],
            mask=row_ok[:, None] & (rk[None, :] < width),
            other=0.0,
        )
        amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
    return tl.maximum(amax / 448.0, 1e-12)


@triton.jit
def _weight_tile(
    w_desc, w_base, first_row, cols, col_ok, rk, k_ok, k, stride_wn, TMA: tl.constexpr, SWAP_AB: tl.constexpr
):
    """One tile of an expert's weight rows as the MMA takes it: [BLOCK_N, BLOCK_K] when the weights are
    its rows (SWAP_AB), else [BLOCK_K, BLOCK_N]. A TMA box of the stacked weights (w_desc, from
    first_row) or pointer loads from w_base (the first row of the expert's gate, up or down weights),
    masked at the edges."""
    if TMA:
        tile = w_desc.load([first_row, k])
        if not SWAP_AB:
            tile = tl.trans(tile)
    elif SWAP_AB:
        tile = tl.load(
            w_base + cols[:, None] * stride_wn + rk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0
        )
    else:
        tile = tl.load(
            w_base + cols[None, :] * stride_wn + rk[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0
        )
    return tile


@triton.jit(do_not_specialize=["pairs", "num_m_blocks"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    padded_ptr,
    xs_ptr,
    ws_ptr,
    hs_ptr,
    pairs,
    top_k,
    inter,
    hidden,
    num_m_blocks,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    A_PER_ROW: tl.constexpr,
    W_PER_ROW: tl.constexpr,
    QUANT_ON_LOAD: tl.constexpr,
    QUANT_H: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    TMA: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    num_n_blocks = tl.cdiv(inter, BLOCK_N)
    pid_m, pid_n = program_block(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    if not PAIR_BLOCKS:  # noqa: SIM102 (a compile-time test: pair blocks never load the padded total)
        if pid_m * BLOCK_M >= tl.load(padded_ptr):
            return
    pair, expert = block_rows(pid_m, sorted_ptr, expert_ptr, pairs, BLOCK_M, PAIR_BLOCKS)
    if PAIR_BLOCKS:  # noqa: SIM102 (a compile-time test: aligned blocks never hold a pair of id -1)
        if expert < 0:  # no expert on this rank (expert parallelism): nothing to compute or write
            return
    row_ok = pair < pairs
    token = pair // top_k
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert * stride_we
    if QUANT_ON_LOAD:
        if A_PER_ROW:
            a_scale = _row_scales(x_ptr, token, row_ok, stride_xm, hidden, BLOCK_M, ROW_SCALE_CHUNK)[:, None]
        else:
            a_scale = tl.load(xs_ptr)
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, hidden, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < hidden
        a = tl.load(
            x_ptr + token[:, None].to(tl.int64) * stride_xm + rk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if QUANT_ON_LOAD:
            a = quantize_tile(a, a_scale, w_ptr.dtype.element_ty)
        first_row = (expert * 2 * inter + pid_n * BLOCK_N).to(tl.int32)
        wg = _weight_tile(w_desc, w_base, first_row, cols, col_ok, rk, k_ok, k, stride_wn, TMA, SWAP_AB)
        wu = _weight_tile(
            w_desc,
            w_base + inter * stride_wn,
            first_row + inter,
            cols,
            col_ok,
            rk,
            k_ok,
            k,
            stride_wn,
            TMA,
            SWAP_AB,
        )
        if SWAP_AB:
            acc_g += tl.dot(wg, tl.trans(a))
            acc_u += tl.dot(wu, tl.trans(a))
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if FP8:
        if not QUANT_ON_LOAD:
            if A_PER_ROW:
                a_scale = tl.load(xs_ptr + token, mask=row_ok, other=0.0)[:, None]
            else:
                a_scale = tl.load(xs_ptr)
        if W_PER_ROW:
            sg = tl.load(ws_ptr + expert * stride_wse + cols, mask=col_ok, other=0.0)[None, :]
            su = tl.load(ws_ptr + expert * stride_wse + inter + cols, mask=col_ok, other=0.0)[None, :]
        else:
            sg = tl.load(ws_ptr + expert * stride_wse)
            su = sg
        acc_g = acc_g * a_scale * sg
        acc_u = acc_u * a_scale * su
    gate = acc_g.to(ACT_DTYPE).to(tl.float32)  # rounded like the reference's gate-up GEMM output
    up = acc_u.to(ACT_DTYPE).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(ACT_DTYPE).to(tl.float32)
    h = (act * up).to(ACT_DTYPE)
    if QUANT_H:  # a static FP8 scale for the down GEMM's input: the intermediate is written as e4m3
        h = quantize_tile(h, tl.load(hs_ptr), out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :],
        h,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit(do_not_specialize=["pairs", "num_m_blocks"])
def _down_kernel(
    h_ptr,
    w_ptr,
    w_desc,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    padded_ptr,
    hs_ptr,
    ws_ptr,
    pairs,
    hidden,
    inter,
    num_m_blocks,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    A_PER_ROW: tl.constexpr,
    W_PER_ROW: tl.constexpr,
    QUANT_ON_LOAD: tl.constexpr,
    TMA: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    num_n_blocks = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = program_block(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    if not PAIR_BLOCKS:  # noqa: SIM102 (a compile-time test: pair blocks never load the padded total)
        if pid_m * BLOCK_M >= tl.load(padded_ptr):
            return
    pair, expert = block_rows(pid_m, sorted_ptr, expert_ptr, pairs, BLOCK_M, PAIR_BLOCKS)
    if PAIR_BLOCKS:  # noqa: SIM102 (a compile-time test: aligned blocks never hold a pair of id -1)
        if expert < 0:  # no expert on this rank (expert parallelism): nothing to compute or write
            return
    row_ok = pair < pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert * stride_we
    if QUANT_ON_LOAD:
        if A_PER_ROW:
            h_scale = _row_scales(h_ptr, pair, row_ok, stride_hm, inter, BLOCK_M, ROW_SCALE_CHUNK)[:, None]
        else:
            h_scale = tl.load(hs_ptr)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, inter, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        k_ok = rk < inter
        a = tl.load(
            h_ptr + pair[:, None].to(tl.int64) * stride_hm + rk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if QUANT_ON_LOAD:
            a = quantize_tile(a, h_scale, w_ptr.dtype.element_ty)
        first_row = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
        w = _weight_tile(w_desc, w_base, first_row, cols, col_ok, rk, k_ok, k, stride_wn, TMA, SWAP_AB)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a))
        else:
            acc += tl.dot(a, w)
    if SWAP_AB:
        acc = tl.trans(acc)
    if FP8:
        if QUANT_ON_LOAD:
            acc = acc * h_scale
        elif A_PER_ROW:
            acc = acc * tl.load(hs_ptr + pair, mask=row_ok, other=0.0)[:, None]
        else:
            acc = acc * tl.load(hs_ptr)
        if W_PER_ROW:
            acc = acc * tl.load(ws_ptr + expert * stride_wse + cols, mask=col_ok, other=0.0)[None, :]
        else:
            acc = acc * tl.load(ws_ptr + expert * stride_wse)
    # each expert's output in the model dtype, as the reference rounds it (the combine weights it)
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _combine_kernel(
    y_ptr,
    ids_ptr,
    topk_w_ptr,
    shared_ptr,
    out_ptr,
    hidden,
    stride_ym,
    stride_sm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token] = Σ_j w_j · y[token · TOP_K + j] (+ shared[token]), in fp32: y holds each pair's
    expert output in the model dtype and w_j is the pair's routing weight (flat at topk_w_ptr), or —
    WEIGHTED — y holds those products already (fp32). A pair of id −1 (flat top-k ids at ids_ptr) adds
    nothing: no kernel wrote its row of y, which is not read."""
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        held = tl.load(ids_ptr + pair) >= 0
        y = tl.load(y_ptr + pair.to(tl.int64) * stride_ym + cols, mask=ok & held, other=0.0).to(tl.float32)
        if not WEIGHTED:
            y = y * tl.load(topk_w_ptr + pair)
        acc += y
    out_dtype = out_ptr.dtype.element_ty
    result = acc.to(out_dtype)
    if HAS_SHARED:
        result = (
            result.to(tl.float32)
            + tl.load(shared_ptr + token.to(tl.int64) * stride_sm + cols, mask=ok, other=0.0).to(tl.float32)
        ).to(out_dtype)
    tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, result, mask=ok)


def _weight_descriptors(w13: Tensor, w2: Tensor, cfg: MoeConfig) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of the stacked expert weights, [E · 2I, H] and [E · H, I], with [block_n, block_k]
    boxes (the down GEMM's own, `MoeConfig.down`, for w2). block_n must divide each expert's rows (a box
    never reaches the next expert's); a K block past the last column is zero-filled by the copy, as the
    masked activations are."""
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    down = cfg.down()
    if not _tma_fits(cfg, inter, hidden):
        raise ValueError(
            f"TMA weight tiles need block_n ({cfg.block_n}, down {down.block_n}) to divide the expert "
            f"widths ({inter}, {hidden})"
        )
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("TMA weight tiles need contiguous stacked expert weights")
    return (
        TensorDescriptor(w13, [experts * two_inter, hidden], [hidden, 1], [cfg.block_n, cfg.block_k]),
        TensorDescriptor(w2, [experts * hidden, inter], [inter, 1], [down.block_n, down.block_k]),
    )


def _tma_fits(cfg: MoeConfig, inter: int, hidden: int) -> bool:
    """Whether each GEMM's block_n divides the rows of each expert's weights it reads by TMA boxes."""
    return inter % cfg.block_n == 0 and hidden % cfg.down().block_n == 0


def fit_to_widths(cfg: MoeConfig, w13: Tensor) -> MoeConfig:
    """A tuned config (chosen for Hy3's widths) for these experts: TMA weight tiles only where each
    GEMM's block_n divides the expert widths (small test models take the same config with pointer loads)."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    if cfg.tma and not _tma_fits(cfg, inter, hidden):
        return dataclasses.replace(cfg, tma=False)
    return cfg


def _unit_column_stride(t: Tensor | None) -> Tensor | None:
    """t itself when its columns are adjacent (graph outputs are), else a row-major copy."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def fused_moe_triton(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    shared: Tensor | None,
    x_q: Tensor | None = None,
    x_q_scale: Tensor | None = None,
    config: MoeConfig | None = None,
    gluon: bool = True,
    pdl: bool = True,
) -> Tensor:
    """The layer (the module docstring) with the config of the token count's bucket from the running
    GPU's table unless `config` is given; `gluon`, `pdl`: the program's variants (the one-token Gluon
    GEMMs where a pair-block config and the experts allow them; programmatic dependent launch)."""
    check_moe_input_quant(x, w13, a13_scale, x_q, x_q_scale)
    # the kernels step rows by stride only
    x, shared, x_q = (_unit_column_stride(t) for t in (x, shared, x_q))
    num_tokens, hidden = x.shape
    out = x.new_empty((num_tokens, hidden))
    if num_tokens == 0:
        return out
    fp8, w4a8 = w13.dtype == FP8_DTYPE, w13.dtype == torch.uint8
    kind = config_kind(fp8, a13_scale is not None, w4a8)
    cfg = config or fit_to_widths(select_config(num_tokens, kind, devices.gpu_name(x.device)), w13)
    if cfg.quant_on_load and cfg.block_m > 32:  # the row-absmax pass holds BLOCK_M × 1024 values
        raise ValueError(f"quant_on_load needs block_m <= 32 (got {cfg.block_m})")
    weights = (w13, w2, w13_scale, w2_scale, a13_scale, a2_scale)
    if w4a8:
        per_pair = routed_pairs_w4a8(x, x_q, x_q_scale, topk_ids, *weights, cfg, pdl)
        weighted = False
    else:
        per_pair, weighted = _routed_pairs(
            x, x_q, x_q_scale, topk_weights, topk_ids, weights, cfg, gluon, pdl
        )
    top_k = topk_ids.shape[1]
    _combine_kernel[(num_tokens, triton.cdiv(hidden, cfg.combine_block))](
        per_pair,
        topk_ids.to(torch.int32).contiguous().view(-1),  # flat, as the GEMMs read them (a view if int32)
        topk_weights.float().contiguous().view(-1),
        shared if shared is not None else x,
        out,
        hidden,
        per_pair.stride(0),
        shared.stride(0) if shared is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        BLOCK=cfg.combine_block,
        HAS_SHARED=shared is not None,
        WEIGHTED=weighted,
        num_warps=4,
        enable_fp_fusion=False,  # each weighted row rounded before it is summed, as the Gluon rows are
        **pdl_launch(x.device, pdl),
    )
    return out


def _routed_pairs(
    x: Tensor,
    x_q: Tensor | None,
    x_q_scale: Tensor | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
    weights: tuple[Tensor | None, ...],
    cfg: MoeConfig,
    gluon: bool,
    pdl: bool,
) -> tuple[Tensor, bool]:
    """Each pair's expert output for bf16 or FP8 experts, and whether it is weighted already: the
    one-token Gluon GEMMs' (weighted, fp32) where the config pairs blocks and they run, else the Triton
    kernels' (in the model dtype, for the combine to weight)."""
    w13, w2, w13_scale, w2_scale = weights[:4]
    _check_scale_widths(w13, w2, w13_scale, w2_scale)
    if cfg.split_k != 1:
        raise ValueError(f"fused_moe: split_k {cfg.split_k} is for W4A8 experts only (bf16 / FP8 take 1)")
    if cfg.pair_blocks and _gluon_runs(x, w13, w2, overrides.variant(overrides.GLUON, gluon)):
        return _routed_pairs_gluon(x, x_q, x_q_scale, topk_weights, topk_ids, *weights, pdl), True
    if cfg.persistent and _persistent_runs(x, w13, w2, cfg, overrides.variant(overrides.GLUON, gluon)):
        return _routed_pairs_persistent(x, x_q, x_q_scale, topk_ids, *weights, cfg, pdl), False
    return _routed_pairs_triton(x, x_q, x_q_scale, topk_ids, *weights, cfg, pdl), False


def _gluon_runs(x: Tensor, w13: Tensor, w2: Tensor, gluon: bool) -> bool:
    """Whether a pair-block layer runs the Gluon GEMMs: the program chose them and these experts and
    this GPU take them (a GPU that cannot is logged)."""
    if not gluon:
        return False
    why_not = fused_moe_gluon.unsupported_inputs(w13, w2, x.dtype) or fused_moe_gluon.unsupported_launch(
        w13, w2
    )
    if why_not is not None:
        devices.fall_back("fused_moe_gluon", x.device, why_not, "the Triton pair-block kernels")
    return why_not is None


def _persistent_runs(x: Tensor, w13: Tensor, w2: Tensor, cfg: MoeConfig, gluon: bool) -> bool:
    """Whether a `persistent` config runs the persistent Gluon GEMMs: the program chose the Gluon kernels
    and this config, these experts and this GPU take them (a launch that cannot is logged)."""
    if not gluon:
        return False
    why_not = fused_moe_persistent.unsupported(
        cfg, w13, w2, x.dtype
    ) or fused_moe_persistent.unsupported_launch(w13, w2)
    if why_not is not None:
        devices.fall_back("fused_moe_persistent", x.device, why_not, "the config's Triton kernels")
    return why_not is None


def _routed_pairs_persistent(
    x: Tensor,
    x_q: Tensor | None,
    x_q_scale: Tensor | None,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    cfg: MoeConfig,
    pdl: bool,
) -> Tensor:
    """Each pair's expert output, [pairs, hidden] in x's dtype (unweighted: the combine weights it), by
    the persistent Gluon GEMMs (`fused_moe_persistent`): alignment, the activations' quantization (FP8,
    unless x_q) and their rows gathered in sorted order, gate-up, the intermediate's row-wise
    quantization (dynamic FP8), down."""
    persistent = fused_moe_persistent
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    pairs = num_tokens * top_k
    fp8 = w13.dtype == FP8_DTYPE
    sorted_ids, expert_ids, padded = moe_align(topk_ids, num_experts, persistent.BLOCK_M, pdl)
    dummy = x.new_empty(1, dtype=torch.float32)
    if x_q is not None:  # already quantized per token (the norm's FP8 rows)
        a, a_scale, a_mode = x_q, x_q_scale.reshape(-1).contiguous(), persistent.SCALE_PER_TOKEN
    elif fp8:
        a, a_scale, per_row = quantize_activations(x, a13_scale, False, pdl)
        a_mode = persistent.SCALE_PER_TOKEN if per_row else persistent.SCALE_STATIC
    else:
        a, a_scale, a_mode = x, dummy, persistent.SCALE_NONE
    quant_h = fp8 and a2_scale is not None  # static: the gate-up epilogue quantizes the intermediate
    h = x.new_empty((sorted_ids.shape[0], two_inter // 2), dtype=FP8_DTYPE if quant_h else x.dtype)
    persistent.grouped_gemm(
        persistent.gather_rows(a, sorted_ids, top_k),
        w13,
        h,
        sorted_ids,
        expert_ids,
        padded,
        a_scale,
        a_mode.value,
        w13_scale,
        a2_scale,
        pairs,
        top_k,
        cfg,
        x.dtype,
        gate_up=True,
    )
    h_scale, h_mode = dummy, persistent.SCALE_NONE
    if quant_h:
        h_scale, h_mode = a2_scale.float().reshape(1), persistent.SCALE_STATIC
    elif fp8:  # dynamic: each sorted row's own scale (pad rows skipped: the down GEMM never stores them)
        h, h_scale = quantize_intermediate(h, persistent.pad_rows(sorted_ids, pairs), False, pdl)
        h_mode = persistent.SCALE_PER_ROW
    per_pair = x.new_empty((pairs, hidden))
    persistent.grouped_gemm(
        h,
        w2,
        per_pair,
        sorted_ids,
        expert_ids,
        padded,
        h_scale,
        h_mode.value,
        w2_scale,
        None,
        pairs,
        top_k,
        cfg,
        x.dtype,
        gate_up=False,
    )
    return per_pair


def _check_scale_widths(w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None) -> None:
    """FP8 weight scales per tensor ([E, 1]) or per output channel ([E, rows]) — the kernels tell the two
    apart by the last dimension, so anything else would be read out of bounds."""
    for name, w, scale in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
        if scale is not None and (scale.shape[0] != w.shape[0] or scale.shape[-1] not in (1, w.shape[1])):
            raise ValueError(
                f"fused_moe: {name} must be [{w.shape[0]}, 1] or [{w.shape[0]}, {w.shape[1]}], got {tuple(scale.shape)}"
            )


def _routed_pairs_gluon(
    x: Tensor,
    x_q: Tensor | None,
    x_q_scale: Tensor | None,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    pdl: bool,
) -> Tensor:
    """Each pair's weighted expert output by the Gluon kernels (`fused_moe_gluon`): the MoE input as the
    norm quantized it (x_q), or x — quantized on load with the static or a dynamic scale for FP8."""
    fp8 = w13.dtype == FP8_DTYPE
    dummy = x.new_empty(1, dtype=torch.float32)
    if x_q is not None:
        a, a_scale, mode = x_q, x_q_scale.reshape(-1).contiguous(), fused_moe_gluon.ROW_AS_IS
    elif not fp8:
        a, a_scale, mode = x, dummy, fused_moe_gluon.ROW_AS_IS
    elif a13_scale is not None:
        a, a_scale, mode = x, a13_scale.float().reshape(1), fused_moe_gluon.ROW_STATIC
    else:
        a, a_scale, mode = x, dummy, fused_moe_gluon.ROW_DYNAMIC
    return fused_moe_gluon.routed_pairs(
        a,
        a_scale,
        mode.value,
        w13,
        w2,
        w13_scale,
        w2_scale,
        a2_scale if fp8 else None,
        topk_ids,
        topk_weights,
        x.dtype,
        pdl_launch(x.device, pdl)["PDL"],
    )


def _routed_pairs_triton(
    x: Tensor,
    x_q: Tensor | None,
    x_q_scale: Tensor | None,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    cfg: MoeConfig,
    pdl: bool,
) -> Tensor:
    """Each pair's expert output, [pairs, hidden] in x's dtype (unweighted: the combine weights it), by
    the Triton kernels: alignment (unless pair blocks), gate-up, the intermediate's quantization (FP8
    with dynamic scales, unless on load), down. The rows of pairs with id −1 are left unwritten."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    pairs = num_tokens * top_k
    fp8 = w13.dtype == FP8_DTYPE
    flat_ids = topk_ids.to(torch.int32).contiguous().view(-1)  # the kernels index the ids densely
    if cfg.pair_blocks:  # block i: pair i alone, its expert from the top-k ids (no alignment launch)
        expert_ids = flat_ids
        sorted_ids = padded = expert_ids  # unread
    else:
        sorted_ids, expert_ids, padded = moe_align(topk_ids, num_experts, cfg.block_m, pdl)
    num_m_blocks = expert_ids.shape[0]
    dummy = x.new_empty(1, dtype=torch.float32)
    a, a_scale, a_per_row = (x, dummy, False)
    if x_q is not None:  # already quantized per token (the norm's FP8 rows)
        a, a_scale, a_per_row = x_q, x_q_scale.reshape(-1).contiguous(), True
    elif fp8:
        a, a_scale, a_per_row = quantize_activations(x, a13_scale, cfg.quant_on_load, pdl)
    quant_h = fp8 and a2_scale is not None  # static: the gate-up epilogue quantizes the intermediate
    hidden_act = x.new_empty((pairs, inter), dtype=FP8_DTYPE if quant_h else x.dtype)
    h_scale_static = a2_scale.float().reshape(1) if quant_h else dummy
    w13_s = w13_scale if w13_scale is not None else dummy
    w13_desc, w2_desc = _weight_descriptors(w13, w2, cfg) if cfg.tma else (None, None)
    common = dict(
        BLOCK_M=cfg.block_m,
        GROUP_M=cfg.group_m,
        FP8=fp8,
        TMA=cfg.tma,
        SWAP_AB=cfg.swap_ab,
        PAIR_BLOCKS=cfg.pair_blocks,
    )
    down = cfg.down()
    _gate_up_kernel[(num_m_blocks * triton.cdiv(inter, cfg.block_n),)](
        a,
        w13,
        w13_desc,
        hidden_act,
        sorted_ids,
        expert_ids,
        padded,
        a_scale,
        w13_s,
        h_scale_static,
        pairs,
        top_k,
        inter,
        hidden,
        num_m_blocks,
        a.stride(0),
        w13.stride(0),
        w13.stride(1),
        hidden_act.stride(0),
        w13_s.stride(0) if w13_scale is not None else 0,
        A_PER_ROW=a_per_row,
        W_PER_ROW=w13_scale is not None and w13_scale.shape[-1] > 1,
        QUANT_ON_LOAD=fp8 and cfg.quant_on_load and x_q is None,
        QUANT_H=quant_h,
        ACT_DTYPE=TL_DTYPES[x.dtype],
        **common,
        **_tiles(cfg),
        **pdl_launch(x.device, pdl),
    )
    h, h_scale, h_per_row = (hidden_act, h_scale_static, False)
    if fp8 and not quant_h:  # dynamic scales: per pair row, the rows of id −1 skipped
        (h, h_scale), h_per_row = quantize_intermediate(hidden_act, flat_ids, cfg.quant_on_load, pdl), True
    per_pair = x.new_empty((pairs, hidden))
    w2_s = w2_scale if w2_scale is not None else dummy
    _down_kernel[(num_m_blocks * triton.cdiv(hidden, down.block_n),)](
        h,
        w2,
        w2_desc,
        per_pair,
        sorted_ids,
        expert_ids,
        padded,
        h_scale,
        w2_s,
        pairs,
        hidden,
        inter,
        num_m_blocks,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        w2_s.stride(0) if w2_scale is not None else 0,
        A_PER_ROW=h_per_row,
        W_PER_ROW=w2_scale is not None and w2_scale.shape[-1] > 1,
        QUANT_ON_LOAD=fp8 and cfg.quant_on_load and not quant_h,
        **common,
        **_tiles(down),
        **pdl_launch(x.device, pdl),
    )
    return per_pair


def _tiles(cfg: MoeConfig) -> dict[str, int]:
    """One GEMM's tile and launch shape (the down GEMM's from `MoeConfig.down`)."""
    return dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@torch.library.custom_op("hy3_triton::fused_moe", mutates_args=())
def fused_moe(
    x: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    shared: Tensor | None,
    x_q: Tensor | None = None,
    x_q_scale: Tensor | None = None,
    *,
    gluon: bool = True,
    pdl: bool = True,
) -> Tensor:
    args = (
        x,
        topk_weights,
        topk_ids,
        w13,
        w2,
        w13_scale,
        w2_scale,
        a13_scale,
        a2_scale,
        shared,
        x_q,
        x_q_scale,
    )
    return fused_moe_triton(*args, gluon=gluon, pdl=pdl)


@fused_moe.register_fake
def _(x, *inputs_that_do_not_shape_the_output, gluon=True, pdl=True):
    return x.new_empty(x.shape)  # row-major, as the kernel writes it whatever x's strides


def _gluon_supports(node, target: Target) -> str | None:
    """The one-token Gluon GEMMs' conditions that a node's fake tensors show
    (`fused_moe_gluon.unsupported_inputs`); they run where the config pairs blocks (one token), and the
    persistent ones (`fused_moe_persistent`, the same widths and dtypes) where it is `persistent`."""
    x, w13, w2 = (node.args[i].meta.get("val") for i in (0, 3, 4))
    if x is None or w13 is None or w2 is None:
        return "no shapes recorded"
    return fused_moe_gluon.unsupported_inputs(w13, w2, x.dtype)


def _triton_supports(node) -> str | None:
    """W4A8 experts need groups of at least an FP8 MMA's K (`fused_moe_w4a8.MIN_GEMM_GROUP`)."""
    w13, w13_scale = (getattr(node.args[i], "meta", {}).get("val") for i in (3, 5))
    if w13 is None or w13.dtype != torch.uint8 or w13_scale is None or w13_scale.dim() != 3:
        return None
    group = 2 * w13.shape[2] // max(w13_scale.shape[2], 1)
    if group < MIN_GEMM_GROUP:
        return f"W4A8 groups of {group} columns (the Triton GEMMs need at least {MIN_GEMM_GROUP})"
    return None


register_provider(
    Provider(
        "triton",
        "fused_moe",
        torch.ops.hy3_triton.fused_moe.default,
        frozenset({"cuda"}),
        supports=_triton_supports,
        variants=(PDL, Variant("gluon", HOPPER, _gluon_supports)),
        config_table=table_for,
    )
)
