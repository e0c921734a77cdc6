"""FusedMoE's two GEMMs at prefill sizes on Hopper, in Gluon: persistent, warp-specialized, TMA-fed.

At thousands of tokens the MoE layer is compute: 8K tokens × 8 slots × 3 · 4096 · 1536 weights are
2.5 TFLOP. The Triton kernels (`fused_moe`) launch one program per output tile, each of which fills
its pipeline, waits for its first copies and drains before the SM takes the next; their activation
rows arrive by pointer loads through the sorted pair ids. Here each GEMM is one program per SM that
walks its share of the tiles (the M blocks of the alignment, `moe_align`, × column blocks, grouped so
that GROUP_M M blocks share a weight block while it is in L2), three roles to a program:

    producer (1 warp): for every tile and K block, the activation box [128 rows, 128 bytes] and each
        operand's weight box [BLOCK_N rows, 128 bytes] by TMA into a ring slot, once both consumers
        have freed it — the next tile's copies start while the consumers finish this one
    consumer 0 and 1 (a warpgroup each, 64 of the tile's 128 rows): per K block, wgmma of their rows
        of the activation box against each weight box (FP8: each K block's products from zero, added
        to fp32 sums, as the Triton kernels' `acc += tl.dot`), the slot freed; at the tile's end the
        epilogue of the Triton kernels, on their own rows, while the producer fills the ring

    gate-up: h_sorted[row, cols] = silu(a·W_gateᵀ) · (a·W_upᵀ) for the rows in sorted order
    down:    per_pair[pair, cols] = h_sorted[row] · W_downᵀ, each row to its (token, slot) pair

TMA reads rows that are adjacent, so both GEMMs take their activations in the alignment's sorted order:
the MoE input's rows are gathered there first (`gather_rows`: one copy of the pairs' rows), and the
gate-up writes its intermediate there, which the down GEMM (after the intermediate's row-wise FP8
quantization, for dynamic scales) reads as it is. Pad rows are neither gathered nor quantized; the GEMMs
compute them from whatever the memory holds and never store them: a row of a wgmma's result depends on
that row of its activations only (and of its scales).

Same arithmetic as the Triton kernels (e4m3 values and scales, rounding to the model dtype; FP8 K blocks
of 128 summed in fp32). Requires sm_90, block_m 128, hidden and intermediate widths that tile into the
column blocks and 128-byte K boxes (`unsupported`). `fused_moe` runs it for a config with `persistent`
set where the program chose the Gluon kernels, else that config's Triton kernels. Gluon kernels cannot
run under TRITON_INTERPRET: the CPU tests compile these for sm_90 (tests/kernels/sm90_compile.py:
wgmma kept asynchronous, shared memory within budget); the GPU tests check both GEMMs against the
Triton kernels and the reference at Hy3's shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from hy3c.kernels import devices
from hy3c.kernels.moe.config import MoeConfig
from hy3c.ops.quant import FP8_DTYPE

# Gluon's TMA load is `async_copy_global_to_shared` until Triton 3.8, `async_load` from 3.8
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = 128  # rows of a tile: two warpgroups of 64
WG_ROWS = gl.constexpr(64)
BOX_BYTES = 128  # bytes of K per box: one 128-byte swizzle span
CONSUMER_REGISTERS = gl.constexpr(232)  # per consumer thread (setmaxnreg)
PRODUCER_REGISTERS = gl.constexpr(40)
# registers per thread at launch: three warpgroups (two consumers, the producer's) share the SM's 64K
LAUNCH_REGISTERS = (2 * CONSUMER_REGISTERS.value + PRODUCER_REGISTERS.value) // 3
SHARED_MEMORY_BUDGET = 200 * 1024  # the ring; the rest of the 227 KB goes to the compiler's scratch
# columns per operand: the gate-up's two 256-column accumulators (and FP8's partial sums) need more than
# a consumer's 232 registers (3.6 KB of spills a thread, ptxas), and the FP8 down's one 256-column too
MAX_BLOCK_N = 128

# how a tile's activation rows are scaled (FP8): not at all (bf16), one static scale, the scale of the
# row's token (the MoE input's per-token scales, through the pair id), the scale of the sorted row itself
SCALE_NONE, SCALE_STATIC, SCALE_PER_TOKEN, SCALE_PER_ROW = (gl.constexpr(i) for i in range(4))


@gluon.jit
def _tile_block(tile, m_blocks, N_BLOCKS: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped order (as `blocks.program_block`): GROUP_M M blocks share each weight column block."""
    per_group = GROUP_M * N_BLOCKS
    first_m = (tile // per_group) * GROUP_M
    group_size = gl.minimum(m_blocks - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_size, (tile % per_group) // group_size


@gluon.jit
def _producer(
    a_desc,
    w_desc,
    ring,
    padded_ptr,
    ROWS_PER_EXPERT: gl.constexpr,
    OPERAND_STRIDE: gl.constexpr,
    OPERANDS: gl.constexpr,
    N_BLOCKS: gl.constexpr,
    K_BLOCKS: gl.constexpr,
    GROUP_M: gl.constexpr,
    expert_ptr,
):
    """One warp: for each of the program's tiles and K blocks, the activation box and the weight boxes
    into ring slot c % NUM_BUF (c counting K blocks over the tiles), once both consumers freed it."""
    a_ring, w_ring, ready, empty = ring
    NUM_BUF: gl.constexpr = a_ring.shape[0]
    BLOCK_N: gl.constexpr = w_ring.shape[1]
    BLOCK_K: gl.constexpr = w_ring.shape[2]
    m_blocks = gl.load(padded_ptr) // a_ring.shape[1]
    c = 0
    for tile in range(gl.program_id(0), m_blocks * N_BLOCKS, gl.num_programs(0)):
        pid_m, pid_n = _tile_block(tile, m_blocks, N_BLOCKS, GROUP_M)
        w_row = gl.load(expert_ptr + pid_m) * ROWS_PER_EXPERT + pid_n * BLOCK_N
        for kb in range(K_BLOCKS):
            slot = c % NUM_BUF
            mbarrier.wait(empty.index(slot), ((c // NUM_BUF) & 1) ^ 1)  # a fresh barrier counts as freed
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + OPERANDS * w_desc.block_type.nbytes)
            _tma_load(a_desc, [pid_m * a_ring.shape[1], kb * BLOCK_K], ready.index(slot), a_ring.index(slot))
            for o in gl.static_range(OPERANDS):
                _tma_load(
                    w_desc,
                    [w_row + o * OPERAND_STRIDE, kb * BLOCK_K],
                    ready.index(slot),
                    w_ring.index(slot * OPERANDS + o),
                )
            c += 1


@gluon.jit
def _row_scale(as_ptr, rows, pair, valid, top_k, A_SCALE: gl.constexpr):
    """Each row's activation scale as [64, 1] (or a scalar): see SCALE_*."""
    if A_SCALE == SCALE_PER_TOKEN:
        scale = gl.load(as_ptr + pair // top_k, mask=valid, other=0.0)[:, None]
    elif A_SCALE == SCALE_PER_ROW:
        scale = gl.load(as_ptr + rows)[:, None]
    elif A_SCALE == SCALE_STATIC:
        scale = gl.load(as_ptr)
    else:
        scale = 1.0
    return scale


@gluon.jit
def _weight_scales(ws_ptr, expert, cols, stride_wse, W_PER_ROW: gl.constexpr):
    if W_PER_ROW:
        scale = gl.load(ws_ptr + expert * stride_wse + cols)[None, :]
    else:
        scale = gl.load(ws_ptr + expert * stride_wse)
    return scale


@gluon.jit
def _consumer(
    ring,
    padded_ptr,
    expert_ptr,
    sorted_ptr,
    out_ptr,
    as_ptr,
    ws_ptr,
    hs_ptr,
    pairs,
    top_k,
    stride_om,
    stride_wse,
    OPERAND_STRIDE: gl.constexpr,
    OPERANDS: gl.constexpr,
    N_BLOCKS: gl.constexpr,
    K_BLOCKS: gl.constexpr,
    GROUP_M: gl.constexpr,
    FP8: gl.constexpr,
    A_SCALE: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    QUANT_H: gl.constexpr,
    ACT_DTYPE: gl.constexpr,
    WG: gl.constexpr,
):
    """One warpgroup's 64 rows of each of the program's tiles (WG 0: the first 64): the products over the
    K blocks, then the epilogue — silu(gate) · up to the sorted rows (OPERANDS 2), or the rows of each
    (token, slot) pair (OPERANDS 1)."""
    a_ring, w_ring, ready, empty = ring
    NUM_BUF: gl.constexpr = a_ring.shape[0]
    BLOCK_N: gl.constexpr = w_ring.shape[1]
    INSTR_K: gl.constexpr = 256 // a_ring.dtype.primitive_bitwidth
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, INSTR_K]
    )
    zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=acc_layout)
    m_blocks = gl.load(padded_ptr) // a_ring.shape[1]
    c = 0
    for tile in range(gl.program_id(0), m_blocks * N_BLOCKS, gl.num_programs(0)):
        pid_m, pid_n = _tile_block(tile, m_blocks, N_BLOCKS, GROUP_M)
        acc_g = zero
        acc_u = zero
        for _ in range(K_BLOCKS):
            slot = c % NUM_BUF
            mbarrier.wait(ready.index(slot), (c // NUM_BUF) & 1)
            a = a_ring.index(slot).slice(WG * WG_ROWS, WG_ROWS)
            w_g = w_ring.index(slot * OPERANDS).permute((1, 0))
            if FP8:  # each K block from zero, added in fp32 (one operand at a time: half the registers)
                part = warpgroup_mma(a, w_g, zero, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                acc_g += part
                if OPERANDS == 2:
                    w_u = w_ring.index(slot * OPERANDS + 1).permute((1, 0))
                    part = warpgroup_mma(a, w_u, zero, use_acc=False, is_async=True)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                    acc_u += part
            elif OPERANDS == 2:
                acc_g = warpgroup_mma(a, w_g, acc_g, is_async=True)
                w_u = w_ring.index(slot * OPERANDS + 1).permute((1, 0))
                acc_u = warpgroup_mma(a, w_u, acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma(a, w_g, acc_g, is_async=True)
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
            mbarrier.arrive(empty.index(slot))
            c += 1

        rows = (
            pid_m * a_ring.shape[1]
            + WG * WG_ROWS
            + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
        )
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        pair = gl.load(sorted_ptr + rows)
        valid = (pair < pairs)[:, None]
        expert = gl.load(expert_ptr + pid_m)
        if OPERANDS == 2:
            gate = acc_g
            up = acc_u
            if FP8:
                a_scale = _row_scale(as_ptr, rows, pair, pair < pairs, top_k, A_SCALE)
                gate = gate * a_scale * _weight_scales(ws_ptr, expert, cols, stride_wse, W_PER_ROW)
                up = (
                    up
                    * a_scale
                    * _weight_scales(ws_ptr, expert, cols + OPERAND_STRIDE, stride_wse, W_PER_ROW)
                )
            gate = gate.to(ACT_DTYPE).to(gl.float32)  # rounded as the Triton epilogue rounds
            up = up.to(ACT_DTYPE).to(gl.float32)
            silu = (gate * (1 / (1 + gl.exp(-gate)))).to(ACT_DTYPE).to(gl.float32)
            h = (silu * up).to(ACT_DTYPE)
            if QUANT_H:  # a static FP8 scale for the down GEMM's input: the intermediate written as e4m3
                h = gl.minimum(gl.maximum(h.to(gl.float32) / gl.load(hs_ptr), -448.0), 448.0)
            offsets = rows[:, None].to(gl.int64) * stride_om + cols[None, :]
            gl.store(out_ptr + offsets, h.to(out_ptr.dtype.element_ty), mask=valid)
        else:
            y = acc_g
            if FP8:
                y = y * _row_scale(as_ptr, rows, pair, pair < pairs, top_k, A_SCALE)
                y = y * _weight_scales(ws_ptr, expert, cols, stride_wse, W_PER_ROW)
            offsets = pair[:, None].to(gl.int64) * stride_om + cols[None, :]
            gl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=valid)


@gluon.jit
def _grouped_gemm_kernel(
    a_desc,
    w_desc,
    out_ptr,
    sorted_ptr,
    expert_ptr,
    padded_ptr,
    as_ptr,
    ws_ptr,
    hs_ptr,
    pairs,
    top_k,
    stride_om,
    stride_wse,
    N: gl.constexpr,
    K: gl.constexpr,
    ROWS_PER_EXPERT: gl.constexpr,
    OPERANDS: gl.constexpr,
    NUM_BUF: gl.constexpr,
    GROUP_M: gl.constexpr,
    FP8: gl.constexpr,
    A_SCALE: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    QUANT_H: gl.constexpr,
    ACT_DTYPE: gl.constexpr,
):
    """One program per SM over tiles (M block, column block) of one GEMM: gate-up (OPERANDS 2, the gate
    and up rows N apart in each expert's ROWS_PER_EXPERT = 2N) or down (OPERANDS 1)."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    N_BLOCKS: gl.constexpr = N // BLOCK_N
    K_BLOCKS: gl.constexpr = K // BLOCK_K
    ROWS: gl.constexpr = a_desc.block_type.shape[0]
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, ROWS, BLOCK_K], a_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF * OPERANDS, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers free a slot
    fence_async_shared()
    ring = (a_ring, w_ring, ready, empty)
    gl.warp_specialize(
        [
            (
                _consumer,
                (ring, padded_ptr, expert_ptr, sorted_ptr, out_ptr, as_ptr, ws_ptr, hs_ptr, pairs, top_k,
                 stride_om, stride_wse, N, OPERANDS, N_BLOCKS, K_BLOCKS, GROUP_M, FP8, A_SCALE, W_PER_ROW,
                 QUANT_H, ACT_DTYPE, 0),
            ),
            (
                _consumer,
                (ring, padded_ptr, expert_ptr, sorted_ptr, out_ptr, as_ptr, ws_ptr, hs_ptr, pairs, top_k,
                 stride_om, stride_wse, N, OPERANDS, N_BLOCKS, K_BLOCKS, GROUP_M, FP8, A_SCALE, W_PER_ROW,
                 QUANT_H, ACT_DTYPE, 1),
            ),
            (
                _producer,
                (a_desc, w_desc, ring, padded_ptr, ROWS_PER_EXPERT, N, OPERANDS, N_BLOCKS, K_BLOCKS, GROUP_M,
                 expert_ptr),
            ),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8_DTYPE: gl.float8e4nv}


def _box_k(dtype: torch.dtype) -> int:
    return BOX_BYTES // dtype.itemsize


def ring_slots(block_n: int, operands: int) -> int:
    """Ring slots that SHARED_MEMORY_BUDGET holds: an activation box and `operands` weight boxes each."""
    return SHARED_MEMORY_BUDGET // ((BLOCK_M + operands * block_n) * BOX_BYTES)


def unsupported(cfg: MoeConfig, w13: Tensor, w2: Tensor, model_dtype: torch.dtype) -> str | None:
    """Why these kernels cannot run a layer with this config (None: they can): 128-row M blocks, e4m3
    weights in a bf16 / fp16 model or bf16 in bf16, column blocks of a power of two up to MAX_BLOCK_N
    that tile both expert widths, widths of whole 128-byte K boxes, two ring slots at least."""
    down = cfg.down()
    if cfg.block_m != BLOCK_M:
        return f"block_m {cfg.block_m}: the persistent kernels take {BLOCK_M}"
    if w2.dtype != w13.dtype or not (
        w13.dtype == model_dtype == torch.bfloat16 or (w13.dtype == FP8_DTYPE and model_dtype in _GL_DTYPES)
    ):
        return (
            f"{w13.dtype} / {w2.dtype} experts in a {model_dtype} model: bf16 in bf16, or e4m3 in bf16 / fp16"
        )
    hidden, inter = w13.shape[2], w2.shape[2]
    box_k = _box_k(w13.dtype)
    for name, block_n, width in (("block_n", cfg.block_n, inter), ("down block_n", down.block_n, hidden)):
        if block_n & (block_n - 1) or not 16 <= block_n <= MAX_BLOCK_N or width % block_n:
            return f"{name} {block_n} must be a power of two from 16 to {MAX_BLOCK_N} that divides {width}"
    if hidden % box_k or inter % box_k:
        return f"hidden {hidden} and intermediate {inter} must be multiples of {box_k}"
    if min(ring_slots(cfg.block_n, 2), ring_slots(down.block_n, 1)) < 2:
        return "fewer than two ring slots fit in shared memory"
    return None


def unsupported_launch(w13: Tensor, w2: Tensor) -> str | None:
    """What only a launch knows (None: they can run): an sm_90 GPU and contiguously stacked weights."""
    if devices.capability(w13.device) != (9, 0):
        return "not an sm_90 GPU"
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return "strided expert weights"
    return None


def _descriptor(t: Tensor, rows: int, block_rows: int) -> TensorDescriptor:
    """A [rows, width] view of t in [block_rows, 128-byte] boxes."""
    width = t.shape[-1]
    box = [block_rows, _box_k(t.dtype)]
    layout = gl.NVMMASharedLayout.get_default_for(box, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t.reshape(rows, width), [rows, width], [width, 1], box, layout)


@triton.jit
def _gather_rows_kernel(
    a_ptr, sorted_ptr, out_ptr, pairs, top_k, width, stride_a, stride_out, BLOCK: tl.constexpr
):
    """Row `program_id` of the sorted activations: its pair's token's row; a pad row (id `pairs`) is left
    as it is (computed by the GEMM, never stored)."""
    row = tl.program_id(0)
    pair = tl.load(sorted_ptr + row)
    if pair >= pairs:
        return
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < width
        values = tl.load(a_ptr + (pair // top_k).to(tl.int64) * stride_a + cols, mask=ok)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, values, mask=ok)


def gather_rows(a: Tensor, sorted_ids: Tensor, top_k: int) -> Tensor:
    """The MoE input's rows in the alignment's order ([len(sorted_ids), hidden]): each row the row of its
    pair's token; pad rows (past an expert's pairs, or past the padded total) are not written."""
    rows, width = sorted_ids.shape[0], a.shape[1]
    out = a.new_empty((rows, width))
    source, target = (a.view(torch.uint8), out.view(torch.uint8)) if a.dtype == FP8_DTYPE else (a, out)
    _gather_rows_kernel[(rows,)](
        source,
        sorted_ids,
        target,
        a.shape[0] * top_k,
        top_k,
        width,
        a.stride(0),
        out.stride(0),
        BLOCK=min(triton.next_power_of_2(width), 4096),
        num_warps=4,
    )
    return out


def pad_rows(sorted_ids: Tensor, pairs: int) -> Tensor:
    """−1 for each sorted row that holds no pair, 0 for the others: the ids `blocks.quantize_intermediate`
    reads to skip a row."""
    return torch.where(sorted_ids < pairs, 0, -1).to(torch.int32)


def grouped_gemm(
    a_sorted: Tensor,
    w: Tensor,
    out: Tensor,
    sorted_ids: Tensor,
    expert_ids: Tensor,
    padded: Tensor,
    a_scale: Tensor,
    a_scale_mode: int,
    w_scale: Tensor | None,
    h_static_scale: Tensor | None,
    pairs: int,
    top_k: int,
    cfg: MoeConfig,
    model_dtype: torch.dtype,
    gate_up: bool,
) -> None:
    """One GEMM of the layer into `out`: the gate-up (w = w13, out = the intermediate in sorted rows, e4m3
    with h_static_scale when given) or the down (w = w2, out = the per-pair rows). a_sorted: activations
    in the alignment's order; a_scale as a_scale_mode says (SCALE_*); pairs: T · k, the pad rows' id."""
    experts, rows_per_expert, k = w.shape
    n = rows_per_expert // 2 if gate_up else rows_per_expert
    tiles = cfg if gate_up else cfg.down()  # this GEMM's columns and ring depth
    block_n = tiles.block_n
    operands = 2 if gate_up else 1
    fp8 = w.dtype == FP8_DTYPE
    dummy = a_sorted.new_empty(1, dtype=torch.float32)
    w_s = w_scale if w_scale is not None else dummy
    quant_h = gate_up and h_static_scale is not None
    _grouped_gemm_kernel[(min(devices.num_sms(w.device), expert_ids.shape[0] * (n // block_n)),)](
        _descriptor(a_sorted, a_sorted.shape[0], BLOCK_M),
        _descriptor(w, experts * rows_per_expert, block_n),
        out,
        sorted_ids,
        expert_ids,
        padded,
        a_scale,
        w_s,
        h_static_scale.float().reshape(1) if quant_h else dummy,
        pairs,
        top_k,
        out.stride(0),
        w_s.stride(0) if w_scale is not None else 0,
        N=n,
        K=k,
        ROWS_PER_EXPERT=rows_per_expert,
        OPERANDS=operands,
        NUM_BUF=min(tiles.num_stages, ring_slots(block_n, operands)),
        GROUP_M=cfg.group_m,
        FP8=fp8,
        A_SCALE=a_scale_mode if fp8 else SCALE_NONE.value,
        W_PER_ROW=w_scale is not None and w_scale.shape[-1] > 1,
        QUANT_H=quant_h,
        ACT_DTYPE=_GL_DTYPES[model_dtype],
        num_warps=4,
        maxnreg=LAUNCH_REGISTERS,
    )
