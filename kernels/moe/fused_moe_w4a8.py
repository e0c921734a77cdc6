"""Triton FusedMoE GEMMs for W4A8 experts: int4 weights in groups, FP8 activations, FP8 tensor cores.

The weights are int4 values packed two per byte along the input dimension (w13 uint8 [E, 2I, H/2],
w2 [E, H, I/2]; column 2j in the low nibble) with one fp32 scale per `group` input columns (w13_scale
[E, 2I, H/g], w2_scale [E, H, I/g]); `hy3c.ops.moe` holds the reference. Each K step (one group or a
part of one; a K block of several groups steps through them, `w4a8_block_k`) is loaded as 32-bit words
of 8 values — half the bytes of an FP8 tile, staged through shared memory ahead of use by Triton's
pipeliner, which byte loads were not — and widened in registers, by one of two ways
(`MoeConfig.int4_subnormal`), exact either way:

* fp16: each nibble becomes an fp16 by bit operations (offset binary under the exponent of 1024), then
  e4m3 (~4 instructions a value);
* subnormal: an e4m3 byte whose exponent and mantissa bits are 0–8 is that number times 2⁻⁹, so |q| in a
  byte of its own, under q's sign bit, is the e4m3 value q · 2⁻⁹ (`_int4_tile_subnormal`): a few
  integer operations and two byte permutes a word (~2.5 instructions a value), the product scaled by 2⁹
  after the MMA. (Offset-binary bytes (q + 8) · 2⁻⁹, fewer operations, were tried: taking 8 · Σa back
  out after the MMA cost 2% of the result on rows with a mean, bench/LOG.md session 32.)

The block's product with the FP8 activation rows runs on the FP8 tensor cores into a fresh accumulator,
which is added to the running sum times the block's group scales: the only roundings are the int4
weights and the FP8 activations, as in the reference. The activations' scale (per token, or static) is
applied in the epilogue.

The layer around the two GEMMs is `fused_moe`'s: the same alignment (or pair blocks), the same
gate-up epilogue (silu(gate) · up, written once for the pair's row, as e4m3 with a static scale for the
down GEMM's input), the same quantization of the intermediate's rows with dynamic scales, the down GEMM
writing each pair's output in the model dtype, and the same combine (routing weights, shared expert).
Ids of −1 (expert parallelism) are skipped as there. With `swap_ab` (few tokens) the unpacked weights
are the MMA's rows (a register operand of the wgmma) and the tokens its columns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.moe.align import moe_align
from hy3c.kernels.moe.blocks import (
    TL_DTYPES,
    block_rows,
    program_block,
    quantize_activations,
    quantize_intermediate,
    quantize_tile,
)
from hy3c.kernels.moe.config import MoeConfig
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.ops.quant import FP8_DTYPE, check_int4_groups

MIN_GEMM_GROUP = 32  # K of an FP8 MMA: a K step, within one group's scale, is at least this


@triton.jit
def _int4_nibble(offset_words, shift: tl.constexpr):
    """The nibble at `shift` of each word (offset binary: q + 8) as the fp16 1024 + (q + 8)."""
    bits = ((offset_words >> shift) & 0xF) | 0x6400  # under fp16's exponent of 1024 (0x6400)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _packed_words(w_base, cols, col_ok, k, stride_wn, BLOCK_K: tl.constexpr):
    """Weight rows `cols` × input columns [k, k + BLOCK_K) of one expert as [BLOCK_N, BLOCK_K / 8] words
    of 8 packed two's-complement nibbles (column 8w + j in bits 4j..4j+3 of word w, as the little-endian
    bytes pack them). Word loads (not byte loads) are what Triton's pipeliner stages through shared
    memory ahead of their use."""
    word_cols = k // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(
        w_base.to(tl.pointer_type(tl.int32)) + cols[:, None] * (stride_wn // 4) + word_cols[None, :],
        mask=col_ok[:, None],
        other=0,
    )


@triton.jit
def _int4_tile(w_base, cols, col_ok, k, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows `cols` × input columns [k, k + BLOCK_K) of one expert as e4m3 [BLOCK_N, BLOCK_K]:
    each nibble made offset binary (q + 8), then the fp16 1024 + (q + 8) by bit operations, less 1032:
    exact, and no integer-to-float conversion."""
    # 0x88888888: every two's-complement nibble q becomes q + 8
    offset = _packed_words(w_base, cols, col_ok, k, stride_wn, BLOCK_K) ^ -0x77777778
    # the innermost join pairs nibbles 4 apart (shift +16), the middle one 2 apart (+8), the outer
    # one the low and high nibble of a byte (+4): reshaped, column j of a word is its nibble j
    low = tl.join(
        tl.join(_int4_nibble(offset, 0), _int4_nibble(offset, 16)),
        tl.join(_int4_nibble(offset, 8), _int4_nibble(offset, 24)),
    )
    high = tl.join(
        tl.join(_int4_nibble(offset, 4), _int4_nibble(offset, 20)),
        tl.join(_int4_nibble(offset, 12), _int4_nibble(offset, 28)),
    )
    values = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K]) - 1032.0
    return values.to(tl.float8e4nv)


@triton.jit
def _e4m3_byte(words, byte: tl.constexpr):
    """Byte `byte` of each word, reinterpreted as e4m3."""
    return (words >> (8 * byte)).to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _interleave_bytes(even, odd, PRMT: tl.constexpr):
    """Words of bytes (e0 o0 e1 o1) and (e2 o2 e3 o3) from the words (e0 e1 e2 e3) and (o0 o1 o2 o3):
    two byte permutes on the GPU (`PRMT`, inline PTX), shifts and masks under TRITON_INTERPRET."""
    if PRMT:
        first, second = tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x5140;\n\tprmt.b32 $1, $2, $3, 0x7362;",
            "=r,=r,r,r",
            [even, odd],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        first = (even & 0xFF) | ((odd & 0xFF) << 8) | ((even & 0xFF00) << 8) | ((odd & 0xFF00) << 16)
        second = ((even >> 16) & 0xFF) | ((odd >> 8) & 0xFF00) | ((even >> 8) & 0xFF0000) | (odd & -0x1000000)
    return first, second


@triton.jit
def _sign_magnitude_bytes(nibbles):
    """Words of four bytes each holding a two's-complement nibble q (0–15) → the e4m3 bytes of q · 2⁻⁹:
    q's sign bit over |q| (0–8; 16 − nibble where q < 0). No carry or borrow crosses a byte."""
    negative = (nibbles >> 3) & 0x01010101
    magnitude = (nibbles ^ ((negative << 4) - negative)) + negative  # nibble ^ 15 + 1 = 16 − nibble
    return magnitude | (negative << 7)


@triton.jit
def _int4_tile_subnormal(
    w_base, cols, col_ok, k, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRMT: tl.constexpr
):
    """`_int4_tile`'s weights as the e4m3 bytes q · 2⁻⁹, [BLOCK_N, BLOCK_K]: an e4m3 byte of exponent and
    mantissa bits m ≤ 8 is m · 2⁻⁹ (exponent 0: subnormal m · 2⁻⁹; m = 8: exponent 1, 2⁻⁶), so |q| in a
    byte of its own under q's sign is q's e4m3 value, exact: two masks of each word give the even and
    the odd nibbles as bytes, `_sign_magnitude_bytes` makes them e4m3, two byte permutes put them in
    column order. `_group_product` takes the 2⁹ back out."""
    words = _packed_words(w_base, cols, col_ok, k, stride_wn, BLOCK_K)
    even = _sign_magnitude_bytes(words & 0x0F0F0F0F)  # nibbles 0, 2, 4, 6 as bytes 0-3
    odd = _sign_magnitude_bytes((words >> 4) & 0x0F0F0F0F)  # nibbles 1, 3, 5, 7
    first, second = _interleave_bytes(even, odd, PRMT)  # columns 0-3 and 4-7 of the word
    # a join's new axis varies faster than the axes before it and slower than those of later joins:
    # reshaped, column 4s + j of a word is byte j (j = 2t + u) of `first` (s = 0) or `second` (s = 1)
    b0 = tl.join(_e4m3_byte(first, 0), _e4m3_byte(second, 0))
    b1 = tl.join(_e4m3_byte(first, 1), _e4m3_byte(second, 1))
    b2 = tl.join(_e4m3_byte(first, 2), _e4m3_byte(second, 2))
    b3 = tl.join(_e4m3_byte(first, 3), _e4m3_byte(second, 3))
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, BLOCK_K])


@triton.jit
def _int4_weights(
    w_base,
    cols,
    col_ok,
    k,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUBNORMAL: tl.constexpr,
    PRMT: tl.constexpr,
):
    """One K block of weights as e4m3, by the widening the config chose (`MoeConfig.int4_subnormal`)."""
    if SUBNORMAL:
        tile = _int4_tile_subnormal(w_base, cols, col_ok, k, stride_wn, BLOCK_N, BLOCK_K, PRMT)
    else:
        tile = _int4_tile(w_base, cols, col_ok, k, stride_wn, BLOCK_N, BLOCK_K)
    return tile


@triton.jit
def _group_product(a, w, scale, SWAP_AB: tl.constexpr, SUBNORMAL: tl.constexpr):
    """One K block's product of FP8 rows a [BLOCK_M, BLOCK_K] and weights w [BLOCK_N, BLOCK_K] in a fresh
    fp32 accumulator, times the weight rows' group scales [BLOCK_N] (and 2⁹ for `_int4_tile_subnormal`'s
    q · 2⁻⁹ with SUBNORMAL): [BLOCK_N, BLOCK_M] with SWAP_AB (weights as the MMA's rows), else
    [BLOCK_M, BLOCK_N]."""
    if SUBNORMAL:
        scale = scale * 512.0
    if SWAP_AB:
        product = tl.dot(w, tl.trans(a)) * scale[:, None]
    else:
        product = tl.dot(a, tl.trans(w)) * scale[None, :]
    return product


@triton.jit
def _split_k_sum(
    acc_g, acc_u, part_ptr, arrived_ptr, pair, row_ok, cols, col_ok, inter, SPLIT_K: tl.constexpr
):
    """Split-K of the gate-up GEMM: this program's partial sums [BLOCK_M, BLOCK_N] of the gate and up
    columns added into the zeroed fp32 rows part [pairs, 2 · inter] (atomics, at L2), then the tile's
    arrival counter bumped (acquire-release: the adds before it are visible to whoever reads it after).
    Returns the tile's whole sums and True for the last of its SPLIT_K programs, which finishes the
    tile (the epilogue); the others stop. The parts are summed in arrival order: fp32 sums of a few
    terms, not bit-equal to one program's."""
    offsets = pair[:, None].to(tl.int64) * (2 * inter) + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    tl.atomic_add(part_ptr + offsets, acc_g, mask=ok)
    tl.atomic_add(part_ptr + offsets + inter, acc_u, mask=ok)
    last = tl.atomic_add(arrived_ptr, 1, sem="acq_rel") == SPLIT_K - 1
    acc_g = tl.load(part_ptr + offsets, mask=ok & last, other=0.0, cache_modifier=".cg")
    acc_u = tl.load(part_ptr + offsets + inter, mask=ok & last, other=0.0, cache_modifier=".cg")
    return acc_g, acc_u, last


@triton.jit(do_not_specialize=["pairs", "num_m_blocks"])
def _gate_up_w4a8_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    padded_ptr,
    as_ptr,
    ws_ptr,
    hs_ptr,
    part_ptr,
    arrived_ptr,
    pairs,
    top_k,
    inter,
    hidden,
    num_m_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_wse,
    stride_wsn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_PER_ROW: tl.constexpr,
    QUANT_H: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    SUBNORMAL: tl.constexpr,
    PRMT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    num_n_blocks = tl.cdiv(inter, BLOCK_N)
    tile = tl.program_id(0) // SPLIT_K  # a tile's SPLIT_K programs are neighbours: they run together
    pid_m, pid_n = program_block(tile, num_m_blocks, num_n_blocks, GROUP_M)
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
    gate_base = w_ptr + expert * stride_we
    up_base = gate_base + inter * stride_wn
    gate_scales = ws_ptr + expert * stride_wse + cols * stride_wsn
    up_scales = gate_scales + inter * stride_wsn
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_part = hidden // SPLIT_K
    k_start = (tl.program_id(0) % SPLIT_K) * k_part
    for k in range(k_start, k_start + k_part, BLOCK_K):
        for sub in tl.static_range(0, BLOCK_K, SUB_K):  # a K block of several groups: one MMA a group
            rk = k + sub + tl.arange(0, SUB_K)
            a = tl.load(
                a_ptr + token[:, None].to(tl.int64) * stride_am + rk[None, :], mask=row_ok[:, None], other=0.0
            )
            wg = _int4_weights(gate_base, cols, col_ok, k + sub, stride_wn, BLOCK_N, SUB_K, SUBNORMAL, PRMT)
            wu = _int4_weights(up_base, cols, col_ok, k + sub, stride_wn, BLOCK_N, SUB_K, SUBNORMAL, PRMT)
            sg = tl.load(gate_scales + (k + sub) // GROUP, mask=col_ok, other=0.0)
            su = tl.load(up_scales + (k + sub) // GROUP, mask=col_ok, other=0.0)
            acc_g += _group_product(a, wg, sg, SWAP_AB, SUBNORMAL)
            acc_u += _group_product(a, wu, su, SWAP_AB, SUBNORMAL)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if SPLIT_K > 1:  # each program adds its part; the tile's last to arrive finishes it
        acc_g, acc_u, last = _split_k_sum(
            acc_g, acc_u, part_ptr, arrived_ptr + tile, pair, row_ok, cols, col_ok, inter, SPLIT_K
        )
        if not last:
            return
    if A_PER_ROW:
        a_scale = tl.load(as_ptr + token, mask=row_ok, other=0.0)[:, None]
    else:
        a_scale = tl.load(as_ptr)
    gate = (acc_g * a_scale).to(ACT_DTYPE).to(tl.float32)  # rounded like the reference's GEMM output
    up = (acc_u * a_scale).to(ACT_DTYPE).to(tl.float32)
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
def _down_w4a8_kernel(
    h_ptr,
    w_ptr,
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
    stride_wsn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_PER_ROW: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    SUBNORMAL: tl.constexpr,
    PRMT: tl.constexpr,
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
    scales = ws_ptr + expert * stride_wse + cols * stride_wsn
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, inter, BLOCK_K):
        for sub in tl.static_range(0, BLOCK_K, SUB_K):  # a K block of several groups: one MMA a group
            rk = k + sub + tl.arange(0, SUB_K)
            a = tl.load(
                h_ptr + pair[:, None].to(tl.int64) * stride_hm + rk[None, :], mask=row_ok[:, None], other=0.0
            )
            w = _int4_weights(w_base, cols, col_ok, k + sub, stride_wn, BLOCK_N, SUB_K, SUBNORMAL, PRMT)
            s = tl.load(scales + (k + sub) // GROUP, mask=col_ok, other=0.0)
            acc += _group_product(a, w, s, SWAP_AB, SUBNORMAL)
    if SWAP_AB:
        acc = tl.trans(acc)
    if A_PER_ROW:
        acc = acc * tl.load(hs_ptr + pair, mask=row_ok, other=0.0)[:, None]
    else:
        acc = acc * tl.load(hs_ptr)
    # each expert's output in the model dtype, as the reference's (the combine weights it)
    tl.store(
        out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _ptx_byte_permutes(device: torch.device) -> bool:
    """Whether the subnormal widening's byte interleave may be inline PTX `prmt`: on an NVIDIA GPU, not
    under TRITON_INTERPRET (which runs no PTX) nor on ROCm."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def check_w4a8_experts(
    x: Tensor, w13: Tensor, w2: Tensor, w13_scale: Tensor | None, w2_scale: Tensor | None
) -> int:
    """The group size of W4A8 experts for input rows x [T, H]: uint8 packed w13 [E, 2I, H/2] and w2
    [E, H, I/2], fp32 group scales [E, 2I, H/g] and [E, H, I/g] of one power-of-two group size of at
    least MIN_GEMM_GROUP (an FP8 MMA's K); anything else is an error naming the tensor."""
    experts, two_inter, hidden = w13.shape[0], w13.shape[1], 2 * w13.shape[2]
    inter = two_inter // 2
    if x.shape[-1] != hidden:
        raise ValueError(f"fused_moe: x has {x.shape[-1]} columns, the W4A8 experts {hidden}")
    if w2.dtype != torch.uint8 or tuple(w2.shape) != (experts, hidden, inter // 2):
        raise ValueError(
            f"fused_moe: W4A8 w2 must be uint8 [{experts}, {hidden}, {inter // 2}], got {w2.dtype} {tuple(w2.shape)}"
        )
    groups = []
    for name, scale, rows, columns in (
        ("w13_scale", w13_scale, two_inter, hidden),
        ("w2_scale", w2_scale, hidden, inter),
    ):
        if (
            scale is None
            or scale.dtype != torch.float32
            or scale.dim() != 3
            or tuple(scale.shape[:2]) != (experts, rows)
            or scale.shape[2] == 0
            or columns % scale.shape[2]
        ):
            got = None if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(
                f"fused_moe: W4A8 {name} must be fp32 [{experts}, {rows}, {columns} / group], got {got}"
            )
        group = columns // scale.shape[2]
        check_int4_groups(name, columns, group)
        groups.append(group)
    if groups[0] != groups[1]:
        raise ValueError(f"fused_moe: W4A8 w13 and w2 have different group sizes ({groups[0]}, {groups[1]})")
    if groups[0] < MIN_GEMM_GROUP:
        raise ValueError(
            f"fused_moe: the W4A8 GEMMs need groups of at least {MIN_GEMM_GROUP} columns (an FP8 MMA's K), "
            f"got {groups[0]}"
        )
    return groups[0]


def w4a8_block_k(cfg: MoeConfig, group: int, hidden: int, inter: int) -> tuple[int, int]:
    """The K block of the W4A8 GEMMs and its step, both powers of two of at least an FP8 MMA's K: a
    block within one group is one step (one MMA, one scale); a block of several groups (more bytes in
    flight a loop iteration) steps a group at a time and must divide both GEMMs' K (hidden and inter),
    else it is halved until it does."""
    block = 1 << (max(cfg.block_k, MIN_GEMM_GROUP).bit_length() - 1)  # a power of two, as the group is
    while block > group and (hidden % block or inter % block):
        block //= 2
    return block, min(block, group)


def _gate_up_split(cfg: MoeConfig, hidden: int, block_k: int) -> int:
    """The gate-up GEMM's K split (`MoeConfig.split_k`): for pair blocks only (one token, where 8 pairs ×
    the column blocks fill the GPU's SMs about one and a half times), into parts of whole K blocks."""
    if cfg.split_k == 1:
        return 1
    if not cfg.pair_blocks:
        raise ValueError(f"fused_moe: split_k {cfg.split_k} needs pair_blocks (the W4A8 one-token path)")
    if hidden % (cfg.split_k * block_k):
        raise ValueError(
            f"fused_moe: split_k {cfg.split_k} does not cut hidden {hidden} into K blocks of {block_k}"
        )
    return cfg.split_k


def routed_pairs_w4a8(
    x: Tensor,
    x_q: Tensor | None,
    x_q_scale: Tensor | None,
    topk_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor,
    w2_scale: Tensor,
    a13_scale: Tensor | None,
    a2_scale: Tensor | None,
    cfg: MoeConfig,
    pdl: bool,
) -> Tensor:
    """Each pair's expert output, [pairs, hidden] in x's dtype (unweighted: the combine weights it), for
    W4A8 experts: alignment (unless pair blocks), the activations' FP8 quantization (unless x_q),
    gate-up, the intermediate's quantization (dynamic scales), down. The rows of pairs with id −1 are
    left unwritten."""
    group = check_w4a8_experts(x, w13, w2, w13_scale, w2_scale)
    if cfg.persistent:
        raise ValueError("fused_moe: persistent GEMMs are for bf16 / FP8 experts, not W4A8")
    # the kernels step the packed bytes and the scales' groups by unit strides (parameters already are)
    w13, w2, w13_scale, w2_scale = (t.contiguous() for t in (w13, w2, w13_scale, w2_scale))
    for name, packed in (("w13", w13), ("w2", w2)):
        if packed.data_ptr() % 4:
            raise ValueError(
                f"fused_moe: W4A8 {name} must start on a 4-byte boundary (it is read as 32-bit words)"
            )
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    pairs = num_tokens * top_k
    block_k, sub_k = w4a8_block_k(cfg, group, hidden, inter)
    flat_ids = topk_ids.to(torch.int32).contiguous().view(-1)
    if cfg.pair_blocks:  # block i: pair i alone, its expert from the top-k ids (no alignment launch)
        expert_ids = flat_ids
        sorted_ids = padded = expert_ids  # unread
    else:
        sorted_ids, expert_ids, padded = moe_align(topk_ids, num_experts, cfg.block_m, pdl)
    num_m_blocks = expert_ids.shape[0]
    dummy = x.new_empty(1, dtype=torch.float32)
    if x_q is not None:
        a, a_scale, a_per_row = x_q, x_q_scale.reshape(-1).contiguous(), True
    else:
        a, a_scale, a_per_row = quantize_activations(x, a13_scale, False, pdl)
    quant_h = a2_scale is not None
    hidden_act = x.new_empty((pairs, inter), dtype=FP8_DTYPE if quant_h else x.dtype)
    h_scale_static = a2_scale.float().reshape(1) if quant_h else dummy
    num_tiles = num_m_blocks * triton.cdiv(inter, cfg.block_n)
    split_k = _gate_up_split(cfg, hidden, block_k)
    parts, arrived = dummy, dummy
    if split_k > 1:  # the gate-up's fp32 part sums and per-tile arrival counts: one zeroed buffer
        scratch = torch.zeros(pairs * 2 * inter + num_tiles, dtype=torch.int32, device=x.device)
        parts, arrived = scratch[: pairs * 2 * inter].view(torch.float32), scratch[pairs * 2 * inter :]
    common = dict(
        GROUP=group,
        BLOCK_M=cfg.block_m,
        GROUP_M=cfg.group_m,
        SWAP_AB=cfg.swap_ab,
        PAIR_BLOCKS=cfg.pair_blocks,
        SUBNORMAL=cfg.int4_subnormal,
        PRMT=_ptx_byte_permutes(x.device),
    )
    down = cfg.down()
    down_block_k, down_sub_k = w4a8_block_k(down, group, hidden, inter)
    _gate_up_w4a8_kernel[(num_tiles * split_k,)](
        a,
        w13,
        hidden_act,
        sorted_ids,
        expert_ids,
        padded,
        a_scale,
        w13_scale,
        h_scale_static,
        parts,
        arrived,
        pairs,
        top_k,
        inter,
        hidden,
        num_m_blocks,
        a.stride(0),
        w13.stride(0),
        w13.stride(1),
        hidden_act.stride(0),
        w13_scale.stride(0),
        w13_scale.stride(1),
        A_PER_ROW=a_per_row,
        QUANT_H=quant_h,
        ACT_DTYPE=TL_DTYPES[x.dtype],
        SPLIT_K=split_k,
        **common,
        **_tiles(cfg, block_k, sub_k),
        **pdl_launch(x.device, pdl),
    )
    h, h_scale, h_per_row = hidden_act, h_scale_static, False
    if not quant_h:  # dynamic scales: per pair row, the rows of id −1 skipped
        (h, h_scale), h_per_row = quantize_intermediate(hidden_act, flat_ids, False, pdl), True
    per_pair = x.new_empty((pairs, hidden))
    _down_w4a8_kernel[(num_m_blocks * triton.cdiv(hidden, down.block_n),)](
        h,
        w2,
        per_pair,
        sorted_ids,
        expert_ids,
        padded,
        h_scale,
        w2_scale,
        pairs,
        hidden,
        inter,
        num_m_blocks,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        w2_scale.stride(0),
        w2_scale.stride(1),
        A_PER_ROW=h_per_row,
        **common,
        **_tiles(down, down_block_k, down_sub_k),
        **pdl_launch(x.device, pdl),
    )
    return per_pair


def _tiles(cfg: MoeConfig, block_k: int, sub_k: int) -> dict[str, int]:
    """One GEMM's tile and launch shape (the down GEMM's from `MoeConfig.down`), its K block and step
    from `w4a8_block_k`."""
    return dict(
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        SUB_K=sub_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
