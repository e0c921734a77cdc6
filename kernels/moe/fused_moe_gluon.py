"""FusedMoE's two GEMMs for one token on Hopper, written in Gluon: weight streams that do not wait.

At one token the MoE layer is a weight stream (8 experts × 3 · 4096 · 1536 weights; FP8: 151 MB) and
every microsecond of DRAM left idle shows. The Triton kernels (`fused_moe`, config `pair_blocks`) start
each GEMM's weight copies only after the kernel before it has finished, and FP8 with dynamic scales
needs a quantization launch between the two GEMMs. Here each GEMM is a
warp-specialized kernel over (token, slot) pairs, one pair and 128 output columns per program:

    producer (1 warp): the program's weight tiles, [128 rows, 128 bytes of K] TMA boxes, into a ring of
        shared-memory slots, each as soon as the consumer has freed its slot
    consumer (a warpgroup): the pair's activation row into shared memory (quantized to e4m3 as it is
        loaded where the row is bf16: its absmax / 448, or the static scale), then per K block
        accᵀ += W_tile · rowᵀ (wgmma, the weights as the MMA's rows, the row as column 0 of the
        MMA's 8), the slot freed; the epilogue as the Triton kernels'

    gate-up: h[pair, cols] = silu(gate) · up over 128 columns of the gate and of the up rows
        (e4m3 when the down GEMM's input scale is static, else the model dtype)
    down:    per_pair[pair, cols] = (h · W2ᵀ)[cols] · routing weight, fp32 (summed by the combine)

The down kernel is launched with programmatic dependent launch while the gate-up runs: its producer
reads the pair's expert (the router's top-k ids, final before the gate-up started) and starts the weight
copies at once, on SMs the gate-up leaves free and on each SM as the gate-up's programs end; only its
consumer waits for the gate-up's intermediate. The intermediate's dynamic scale is found by the down
kernel's consumer while its weights stream, so FP8 has no quantization launch between the GEMMs.

A pair whose id is −1 (expert parallelism: its expert is another rank's) has programs that return
before any copy starts; its rows are left unwritten, and the combine does not read them.

Same arithmetic as the Triton kernels (e4m3 values, scales, rounding to the model dtype; bf16 bit-equal,
FP8 summed per 128-column K block where Triton sums per 256). Requires sm_90, hidden and intermediate
widths that are multiples of 128 and of the K box, contiguous stacked weights (`unsupported_inputs`,
`unsupported_launch`); elsewhere, and where the program chose it (`gluon=False`), `fused_moe` runs its
Triton kernels. Timed against them in BENCHMARKS.md.
Gluon kernels cannot run under TRITON_INTERPRET: the CPU tests compile these for sm_90
(tests/kernels/sm90_compile.py: wgmma kept asynchronous, shared memory within budget); the GPU tests check
each GEMM against its arithmetic in fp64 and the layer against the Triton path and the reference.
They also compile the same with Triton 3.7.1, 3.8.0 and 3.9.0 (checked by hand, not in CI).
"""

from __future__ import annotations

import torch
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
from hy3c.ops.quant import FP8_DTYPE

# Gluon's TMA load is `async_copy_global_to_shared` until Triton 3.8, `async_load` from 3.8 (the old name
# is gone in 3.9); a barrier over the calling partition's warps is `thread_barrier` in 3.6, `barrier` from 3.7
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# a shared-memory view with another layout: `_reinterpret` until Triton 3.8, `reinterpret` from 3.9
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

BLOCK_ROWS = gl.constexpr(128)  # weight rows (output columns) per program: the MMA's M
ACT_ROWS = gl.constexpr(8)  # the activation operand's rows (wgmma's smallest N): row 0 the pair's, 7 unread
BOX_BYTES = 128  # bytes of K per weight box: one 128-byte swizzle span
PRODUCER_REGISTERS = gl.constexpr(40)
SHARED_MEMORY_BUDGET = 200 * 1024  # per gate-up program (one per SM)
DOWN_PROGRAM_BUDGET = 113 * 1024  # per down program: two per SM
DOWN_LAUNCH_REGISTERS = 128  # per thread at launch: two programs of two warpgroups per SM

# activation rows: as the MMA takes them, or quantized to e4m3 on load with a dynamic or static scale
ROW_AS_IS, ROW_DYNAMIC, ROW_STATIC = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)


@gluon.jit
def _wait_for_inputs():
    """griddepcontrol.wait: block until the kernel before this one has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _let_dependents_launch():
    """griddepcontrol.launch_dependents: the next kernel's programs may be placed once every program here
    has said so (they take only what this kernel's resident programs leave)."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.constexpr_function
def _pow2_at_least(n):
    return 1 << (n - 1).bit_length()


@gluon.constexpr_function
def _row_layout(block_k, num_warps):
    """[K blocks, 1, block_k] row tiles: 8 consecutive elements of a block per thread."""
    lanes_k = block_k // 8
    return gl.BlockedLayout([1, 1, 8], [32 // lanes_k, 1, lanes_k], [num_warps, 1, 1], [2, 1, 0])


@gluon.jit
def _activation_row(act, row_ptr, scale_ptr, MODE: gl.constexpr, FP8: gl.constexpr, K_BLOCKS: gl.constexpr):
    """The pair's activation row (K_BLOCKS blocks) into row 0 of each K block of act [≥ K_BLOCKS (a power
    of two), ACT_ROWS, BLOCK_K] (shared; the MMA's other columns are never read, so the other rows stay as
    they are), as the MMA takes it — quantized to e4m3 on the way for MODE ROW_DYNAMIC (the row's absmax /
    448, as `quant_fp8_per_token`) and ROW_STATIC (the scale at scale_ptr) — then fenced for wgmma.
    Returns the row's FP8 scale (rows already e4m3: the one at scale_ptr; 1.0 for bf16). The whole row
    is loaded at once: one memory latency before the products can start."""
    BLOCKS: gl.constexpr = act.shape[0]
    BLOCK_K: gl.constexpr = act.shape[2]
    layout: gl.constexpr = gl.SliceLayout(1, _row_layout(BLOCK_K, gl.num_warps()))
    blocks = gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    offsets = blocks[:, None] * BLOCK_K + cols[None, :]
    v = gl.load(row_ptr + offsets, mask=offsets < K_BLOCKS * BLOCK_K, other=0.0).to(gl.float32)
    if MODE == ROW_DYNAMIC:
        scale = gl.maximum(gl.max(gl.max(gl.abs(v), axis=1), axis=0) / 448.0, 1e-12)
    elif FP8:
        scale = gl.load(scale_ptr)
    else:
        scale = 1.0
    if MODE != ROW_AS_IS:
        v = gl.minimum(gl.maximum(v / scale, -448.0), 448.0)
    # row 0 of a 128-byte-swizzled [ACT_ROWS, BLOCK_K] tile is stored unswizzled: write it through a plain view
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    if _PUBLIC_REINTERPRET:
        first_rows = act.reinterpret(act.dtype, act.shape, plain).slice(0, 1, dim=1)
    else:
        first_rows = act._reinterpret(act.dtype, act.shape, plain).slice(0, 1, dim=1)
    first_rows.store(gl.expand_dims(v.to(act.dtype), 1))
    fence_async_shared()
    _partition_barrier()
    return scale


@gluon.jit
def _stream_weights(
    desc, ring, ready, empty, first_row, operand_stride, OPERANDS: gl.constexpr, K_BLOCKS: gl.constexpr
):
    """Producer: for every K block, the weight boxes [BLOCK_ROWS, BLOCK_K] at rows first_row + o ·
    operand_stride (o < OPERANDS: the gate and up rows, or the down rows) into ring slot kb % NUM_BUF,
    once the consumer has freed it. ring: [NUM_BUF · OPERANDS, BLOCK_ROWS, BLOCK_K]."""
    NUM_BUF: gl.constexpr = ring.shape[0] // OPERANDS
    BLOCK_K: gl.constexpr = ring.shape[2]
    for kb in range(K_BLOCKS):
        slot = kb % NUM_BUF
        mbarrier.wait(empty.index(slot), ((kb // NUM_BUF) & 1) ^ 1)  # a fresh barrier counts as freed once
        mbarrier.expect(ready.index(slot), OPERANDS * desc.block_type.nbytes)
        for o in gl.static_range(OPERANDS):
            row = first_row + o * operand_stride
            _tma_load(desc, [row, kb * BLOCK_K], ready.index(slot), ring.index(slot * OPERANDS + o))


@gluon.jit
def _weights_times_row(act, ring, ready, empty, OPERANDS: gl.constexpr, K_BLOCKS: gl.constexpr):
    """Consumer: accᵀ = W · rowᵀ for each ring operand over every K block (wgmma: the weight box from its
    ring slot, the activation block as the MMA's column 0), each slot freed once its products are done.
    Returns each operand's [BLOCK_ROWS] result (column 0 of its accumulator).

    bf16 products accumulate in the MMA's accumulator across K blocks. e4m3 ones do not: Hopper's FP8
    MMA adds into its accumulator with reduced precision, so each K block's products start from zero and
    are added to the fp32 sums in registers (as Triton does for `acc += tl.dot(...)` with FP8 operands,
    one K block at a time): the one-token layer measured 4.5–5.4e-3 from the reference this way (the Triton
    kernels 4.3–5.5e-3), 1.0–1.5e-2 with all 4096 columns accumulated in the MMA."""
    NUM_BUF: gl.constexpr = ring.shape[0] // OPERANDS
    INSTR_K: gl.constexpr = 256 // act.dtype.primitive_bitwidth
    FP8_BLOCKS: gl.constexpr = act.dtype.primitive_bitwidth == 8
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ACT_ROWS, INSTR_K]
    )
    zero = gl.zeros([BLOCK_ROWS, ACT_ROWS], gl.float32, layout=acc_layout)
    acc_g = zero
    acc_u = zero
    for kb in range(K_BLOCKS):
        slot = kb % NUM_BUF
        mbarrier.wait(ready.index(slot), (kb // NUM_BUF) & 1)
        row = act.index(kb).permute((1, 0))
        if FP8_BLOCKS:
            part_g = warpgroup_mma(ring.index(slot * OPERANDS), row, zero, use_acc=False, is_async=True)
            if OPERANDS == 2:
                part_u = warpgroup_mma(
                    ring.index(slot * OPERANDS + 1), row, zero, use_acc=False, is_async=True
                )
                part_g, part_u = warpgroup_mma_wait(num_outstanding=0, deps=(part_g, part_u))
                acc_u += part_u
            else:
                part_g = warpgroup_mma_wait(num_outstanding=0, deps=(part_g,))
            acc_g += part_g
        else:
            acc_g = warpgroup_mma(ring.index(slot * OPERANDS), row, acc_g, is_async=True)
            if OPERANDS == 2:
                acc_u = warpgroup_mma(ring.index(slot * OPERANDS + 1), row, acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
        mbarrier.arrive(empty.index(slot))
    first = gl.arange(0, ACT_ROWS, layout=gl.SliceLayout(0, acc_layout))[None, :] == 0
    return gl.sum(gl.where(first, acc_g, 0.0), axis=1), gl.sum(gl.where(first, acc_u, 0.0), axis=1)


@gluon.jit
def _gate_up_consumer(
    x_row_ptr,
    xs_ptr,
    ws_ptr,
    hs_ptr,
    h_row_ptr,
    smem,
    expert,
    col0,
    stride_wse,
    INTER: gl.constexpr,
    K_BLOCKS: gl.constexpr,
    A_MODE: gl.constexpr,
    FP8: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    QUANT_H: gl.constexpr,
    ACT_DTYPE: gl.constexpr,
):
    """The pair's x row in; silu(gate) · up of its BLOCK_ROWS columns out, rounded as the Triton
    epilogue rounds (to the model dtype after the scales, after silu, after the product)."""
    act, ring, ready, empty = smem
    a_scale = _activation_row(act, x_row_ptr, xs_ptr, A_MODE, FP8, K_BLOCKS)
    gate, up = _weights_times_row(act, ring, ready, empty, 2, K_BLOCKS)
    cols = col0 + gl.arange(0, BLOCK_ROWS, layout=gate.type.layout)
    if FP8:
        if W_PER_ROW:
            sg = gl.load(ws_ptr + expert * stride_wse + cols)
            su = gl.load(ws_ptr + expert * stride_wse + INTER + cols)
        else:
            sg = gl.load(ws_ptr + expert * stride_wse)
            su = sg
        gate = gate * a_scale * sg
        up = up * a_scale * su
    gate = gate.to(ACT_DTYPE).to(gl.float32)
    up = up.to(ACT_DTYPE).to(gl.float32)
    silu = (gate * (1 / (1 + gl.exp(-gate)))).to(ACT_DTYPE).to(gl.float32)
    h = (silu * up).to(ACT_DTYPE)
    if QUANT_H:  # a static FP8 scale for the down GEMM's input: the intermediate is written as e4m3
        h = gl.minimum(gl.maximum(h.to(gl.float32) / gl.load(hs_ptr), -448.0), 448.0)
        h = h.to(h_row_ptr.dtype.element_ty)
    gl.store(h_row_ptr + cols, h)


@gluon.jit
def _gate_up_producer(w_desc, smem, expert, col0, INTER: gl.constexpr, K_BLOCKS: gl.constexpr):
    ring, ready, empty = smem[1], smem[2], smem[3]
    _stream_weights(w_desc, ring, ready, empty, expert * 2 * INTER + col0, INTER, 2, K_BLOCKS)


@gluon.jit
def _gate_up_kernel(
    x_ptr,
    w_desc,
    h_ptr,
    ids_ptr,
    xs_ptr,
    ws_ptr,
    hs_ptr,
    top_k,
    stride_xm,
    stride_hm,
    stride_wse,
    HIDDEN: gl.constexpr,
    INTER: gl.constexpr,
    NUM_BUF: gl.constexpr,
    A_MODE: gl.constexpr,
    FP8: gl.constexpr,
    A_PER_ROW: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    QUANT_H: gl.constexpr,
    ACT_DTYPE: gl.constexpr,
    PDL: gl.constexpr,
):
    """Program (pair, column block): h[pair, cols] = silu(x·W_gateᵀ) · (x·W_upᵀ) over BLOCK_ROWS columns."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    K_BLOCKS: gl.constexpr = HIDDEN // BLOCK_K
    blocks_per_pair: gl.constexpr = INTER // BLOCK_ROWS
    pair = gl.program_id(0) // blocks_per_pair
    col0 = (gl.program_id(0) % blocks_per_pair) * BLOCK_ROWS
    if PDL:  # the top-k ids and x come from the kernels before this one
        _wait_for_inputs()
        _let_dependents_launch()
    expert = gl.load(ids_ptr + pair)
    if expert < 0:  # no expert on this rank (expert parallelism): nothing to stream, compute or write
        return
    token = pair // top_k
    x_row = x_ptr + token.to(gl.int64) * stride_xm
    xs = xs_ptr + token if A_PER_ROW else xs_ptr
    act_dtype: gl.constexpr = w_desc.dtype
    act_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ACT_ROWS, BLOCK_K], act_dtype)
    act = gl.allocate_shared_memory(act_dtype, [_pow2_at_least(K_BLOCKS), ACT_ROWS, BLOCK_K], act_layout)
    ring = gl.allocate_shared_memory(act_dtype, [NUM_BUF * 2, BLOCK_ROWS, BLOCK_K], w_desc.layout)
    ready, empty = _ring_barriers(NUM_BUF)
    smem = (act, ring, ready, empty)
    gl.warp_specialize(
        [
            (
                _gate_up_consumer,
                (
                    x_row,
                    xs,
                    ws_ptr,
                    hs_ptr,
                    h_ptr + pair.to(gl.int64) * stride_hm,
                    smem,
                    expert,
                    col0,
                    stride_wse,
                    INTER,
                    K_BLOCKS,
                    A_MODE,
                    FP8,
                    W_PER_ROW,
                    QUANT_H,
                    ACT_DTYPE,
                ),
            ),
            (_gate_up_producer, (w_desc, smem, expert, col0, INTER, K_BLOCKS)),
        ],
        [1],
        [PRODUCER_REGISTERS],
    )


@gluon.jit
def _ring_barriers(NUM_BUF: gl.constexpr):
    """Each ring slot's `ready` (the producer's copies landed) and `empty` (the consumer is done) barriers."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    return ready, empty


@gluon.jit
def _down_consumer(
    h_row_ptr,
    hs_ptr,
    ws_ptr,
    topk_w_ptr,
    out_row_ptr,
    smem,
    expert,
    col0,
    stride_wse,
    K_BLOCKS: gl.constexpr,
    A_MODE: gl.constexpr,
    FP8: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    PDL: gl.constexpr,
):
    """Waits for the gate-up's intermediate (the weights stream meanwhile), then its row in and the
    pair's weighted fp32 output of BLOCK_ROWS columns out."""
    act, ring, ready, empty = smem
    if PDL:
        _wait_for_inputs()
        _let_dependents_launch()
    h_scale = _activation_row(act, h_row_ptr, hs_ptr, A_MODE, FP8, K_BLOCKS)
    y = _weights_times_row(act, ring, ready, empty, 1, K_BLOCKS)[0]
    cols = col0 + gl.arange(0, BLOCK_ROWS, layout=y.type.layout)
    if FP8:
        y = y * h_scale
        if W_PER_ROW:
            y = y * gl.load(ws_ptr + expert * stride_wse + cols)
        else:
            y = y * gl.load(ws_ptr + expert * stride_wse)
    y = y * gl.load(topk_w_ptr)
    gl.store(out_row_ptr + cols, y)


@gluon.jit
def _down_producer(w_desc, smem, expert, col0, HIDDEN: gl.constexpr, K_BLOCKS: gl.constexpr):
    ring, ready, empty = smem[1], smem[2], smem[3]
    _stream_weights(w_desc, ring, ready, empty, expert * HIDDEN + col0, 0, 1, K_BLOCKS)


@gluon.jit
def _down_kernel(
    h_ptr,
    w_desc,
    out_ptr,
    ids_ptr,
    hs_ptr,
    ws_ptr,
    topk_w_ptr,
    stride_hm,
    stride_om,
    stride_wse,
    HIDDEN: gl.constexpr,
    INTER: gl.constexpr,
    NUM_BUF: gl.constexpr,
    A_MODE: gl.constexpr,
    FP8: gl.constexpr,
    A_PER_ROW: gl.constexpr,
    W_PER_ROW: gl.constexpr,
    PDL: gl.constexpr,
):
    """Program (pair, column block): per_pair[pair, cols] = (h·W_downᵀ)[cols] · the pair's routing weight.
    The expert id is read before waiting for the gate-up: the router's top-k ids were final before the
    gate-up started, and this kernel starts only once all of the gate-up's programs have."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    K_BLOCKS: gl.constexpr = INTER // BLOCK_K
    blocks_per_pair: gl.constexpr = HIDDEN // BLOCK_ROWS
    pair = gl.program_id(0) // blocks_per_pair
    col0 = (gl.program_id(0) % blocks_per_pair) * BLOCK_ROWS
    expert = gl.load(ids_ptr + pair, volatile=True)
    if expert < 0:  # no expert on this rank: no weights streamed, no row written (the combine skips it)
        return
    hs = hs_ptr + pair if A_PER_ROW else hs_ptr
    act_dtype: gl.constexpr = w_desc.dtype
    act_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ACT_ROWS, BLOCK_K], act_dtype)
    act = gl.allocate_shared_memory(act_dtype, [_pow2_at_least(K_BLOCKS), ACT_ROWS, BLOCK_K], act_layout)
    ring = gl.allocate_shared_memory(act_dtype, [NUM_BUF, BLOCK_ROWS, BLOCK_K], w_desc.layout)
    ready, empty = _ring_barriers(NUM_BUF)
    smem = (act, ring, ready, empty)
    gl.warp_specialize(
        [
            (
                _down_consumer,
                (
                    h_ptr + pair.to(gl.int64) * stride_hm,
                    hs,
                    ws_ptr,
                    topk_w_ptr + pair,
                    out_ptr + pair.to(gl.int64) * stride_om,
                    smem,
                    expert,
                    col0,
                    stride_wse,
                    K_BLOCKS,
                    A_MODE,
                    FP8,
                    W_PER_ROW,
                    PDL,
                ),
            ),
            (_down_producer, (w_desc, smem, expert, col0, HIDDEN, K_BLOCKS)),
        ],
        [1],
        [PRODUCER_REGISTERS],
    )


def _box_k(dtype: torch.dtype) -> int:
    return BOX_BYTES // dtype.itemsize


def _row_bytes(width: int, box_k: int) -> int:
    """Shared memory of an activation row: [K blocks rounded up to a power of two, ACT_ROWS, 128 bytes]."""
    return _pow2_at_least(width // box_k) * ACT_ROWS.value * BOX_BYTES


def gate_up_slots(w13: Tensor) -> int:
    """Ring slots of the gate-up kernel (one program per SM): what SHARED_MEMORY_BUDGET holds after the
    activation row, in gate + up box pairs."""
    return (SHARED_MEMORY_BUDGET - _row_bytes(w13.shape[2], _box_k(w13.dtype))) // (
        2 * BLOCK_ROWS.value * BOX_BYTES
    )


def down_slots(w2: Tensor) -> int:
    """Ring slots of the down kernel (two programs per SM): what DOWN_PROGRAM_BUDGET holds after the row."""
    return (DOWN_PROGRAM_BUDGET - _row_bytes(w2.shape[2], _box_k(w2.dtype))) // (BLOCK_ROWS.value * BOX_BYTES)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}  # the model dtypes these kernels take
_WEIGHT_DTYPES = {torch.bfloat16: gl.bfloat16, FP8_DTYPE: gl.float8e4nv}


def unsupported_inputs(w13: Tensor, w2: Tensor, model_dtype: torch.dtype) -> str | None:
    """Why these kernels cannot run the layer's experts (None: they can): bf16 weights for a bf16 model
    or e4m3 weights for a bf16 / fp16 one, expert widths that tile into BLOCK_ROWS rows and 128-byte K
    boxes, at least two ring slots each. Shapes and dtypes only, so the `lower` pass asks it of a node's
    fake tensors (the Gluon variant of `hy3.fused_moe`)."""
    if w2.dtype != w13.dtype:
        return f"w13 is {w13.dtype}, w2 {w2.dtype}"
    if not (
        w13.dtype == model_dtype == torch.bfloat16 or (w13.dtype == FP8_DTYPE and model_dtype in _GL_DTYPES)
    ):
        return f"{w13.dtype} experts in a {model_dtype} model: bf16 in bf16, or e4m3 in bf16 / fp16"
    hidden, inter = w13.shape[2], w2.shape[2]
    box_k = _box_k(w13.dtype)
    if hidden % BLOCK_ROWS.value or inter % BLOCK_ROWS.value or hidden % box_k or inter % box_k:
        return f"hidden {hidden} and intermediate {inter} must be multiples of {BLOCK_ROWS.value} and {box_k}"
    if min(gate_up_slots(w13), down_slots(w2)) < 2:
        return "fewer than two weight ring slots fit in shared memory"
    return None


def unsupported_launch(w13: Tensor, w2: Tensor) -> str | None:
    """What only a launch knows (None: they can run): an sm_90 GPU and contiguously stacked weights."""
    if devices.capability(w13.device) != (9, 0):
        return "not an sm_90 GPU"
    if not (w13.is_contiguous() and w2.is_contiguous()):
        return "strided expert weights"
    return None


def _weight_descriptor(w: Tensor) -> TensorDescriptor:
    """The stacked experts' weights [E · rows, K] in [BLOCK_ROWS, 128-byte] boxes."""
    experts, rows, width = w.shape
    box = [BLOCK_ROWS.value, _box_k(w.dtype)]
    layout = gl.NVMMASharedLayout.get_default_for(box, _WEIGHT_DTYPES[w.dtype])
    return TensorDescriptor(w.view(experts * rows, width), [experts * rows, width], [width, 1], box, layout)


def routed_pairs(
    a: Tensor,
    a_scale: Tensor,
    a_mode: int,
    w13: Tensor,
    w2: Tensor,
    w13_scale: Tensor | None,
    w2_scale: Tensor | None,
    h_static_scale: Tensor | None,
    topk_ids: Tensor,
    topk_weights: Tensor,
    model_dtype: torch.dtype,
    pdl: bool,
) -> Tensor:
    """Every (token, slot) pair's expert output times its routing weight, [pairs, hidden] fp32 (the
    combine's input), by the two kernels of the module docstring (`gate_up_rows`, then `down_rows`).
    A pair of id −1 (no expert on this rank) has programs that return at once: its rows stay unwritten."""
    ids = topk_ids.to(torch.int32).contiguous().view(-1)
    h = gate_up_rows(
        a, a_scale, a_mode, w13, w13_scale, h_static_scale, ids, topk_ids.shape[1], model_dtype, pdl
    )
    return down_rows(h, w2, w2_scale, h_static_scale, ids, topk_weights, pdl)


def gate_up_rows(
    a: Tensor,
    a_scale: Tensor,
    a_mode: int,
    w13: Tensor,
    w13_scale: Tensor | None,
    h_static_scale: Tensor | None,
    ids: Tensor,
    top_k: int,
    model_dtype: torch.dtype,
    pdl: bool,
) -> Tensor:
    """silu(gate) · up of every pair (flat top-k ids `ids`), [pairs, inter]: e4m3 (h / h_static_scale)
    for FP8 weights with a static down-input scale, else model_dtype.

    a: the MoE input rows — e4m3 already (x_q, a_scale its per-token scales; a_mode ROW_AS_IS) or bf16,
    quantized on load for FP8 weights (ROW_DYNAMIC, or ROW_STATIC with a_scale the static scale)."""
    pairs = ids.numel()
    two_inter, hidden = w13.shape[1:]
    inter = two_inter // 2
    fp8 = w13.dtype == FP8_DTYPE
    quant_h = fp8 and h_static_scale is not None
    h = a.new_empty((pairs, inter), dtype=FP8_DTYPE if quant_h else model_dtype)
    dummy = a.new_empty(1, dtype=torch.float32)
    w13_s = w13_scale if w13_scale is not None else dummy
    _gate_up_kernel[(pairs * (inter // BLOCK_ROWS.value),)](
        a,
        _weight_descriptor(w13),
        h,
        ids,
        a_scale,
        w13_s,
        h_static_scale.float().reshape(1) if quant_h else dummy,
        top_k,
        a.stride(0),
        h.stride(0),
        w13_s.stride(0) if w13_scale is not None else 0,
        HIDDEN=hidden,
        INTER=inter,
        NUM_BUF=gate_up_slots(w13),
        A_MODE=a_mode,
        FP8=fp8,
        A_PER_ROW=fp8 and a_mode == ROW_AS_IS.value,
        W_PER_ROW=w13_scale is not None and w13_scale.shape[-1] > 1,
        QUANT_H=quant_h,
        ACT_DTYPE=_GL_DTYPES[model_dtype],
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return h


def down_rows(
    h: Tensor,
    w2: Tensor,
    w2_scale: Tensor | None,
    h_static_scale: Tensor | None,
    ids: Tensor,
    topk_weights: Tensor,
    pdl: bool,
) -> Tensor:
    """(h · W2ᵀ) times each pair's routing weight, [pairs, hidden] fp32. h: `gate_up_rows`' output — e4m3
    with the static scale h_static_scale, or bf16 (quantized on load with its rows' dynamic scales for FP8
    weights)."""
    pairs, inter = h.shape
    hidden = w2.shape[1]
    fp8 = w2.dtype == FP8_DTYPE
    per_pair = h.new_empty((pairs, hidden), dtype=torch.float32)
    dummy = h.new_empty(1, dtype=torch.float32)
    w2_s = w2_scale if w2_scale is not None else dummy
    quant_h = h.dtype == FP8_DTYPE
    _down_kernel[(pairs * (hidden // BLOCK_ROWS.value),)](
        h,
        _weight_descriptor(w2),
        per_pair,
        ids,
        h_static_scale.float().reshape(1) if quant_h else dummy,
        w2_s,
        topk_weights.float().contiguous().view(-1),
        h.stride(0),
        per_pair.stride(0),
        w2_s.stride(0) if w2_scale is not None else 0,
        HIDDEN=hidden,
        INTER=inter,
        NUM_BUF=down_slots(w2),
        A_MODE=(ROW_AS_IS if quant_h or not fp8 else ROW_DYNAMIC).value,
        FP8=fp8,
        A_PER_ROW=False,
        W_PER_ROW=w2_scale is not None and w2_scale.shape[-1] > 1,
        PDL=pdl,
        num_warps=4,
        maxnreg=DOWN_LAUNCH_REGISTERS,
        launch_pdl=pdl,
    )
    return per_pair
