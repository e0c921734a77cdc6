"""Chunked-prefill attention over a bf16 paged KV cache for Hopper, written in Gluon (Triton's
explicit-layout language): the warp-specialized FlashAttention-3 schedule that Triton 3.6's pipeliner
does not emit for `prefill` (a producer warp ahead of the consumers, the softmax beside the
products, below).

One program = one query block (`plan`'s row 1: 16 tokens × the 8 heads of a GQA group = 128
rows) × one KV head, in the same grid order as `prefill` (not persistent; its 180 KB of
shared memory keep one program resident per SM), three roles:

    producer (1 warp, 24 registers): for each key block j, wait until both consumers have freed K_j's
        ring slot (j % NUM_BUF) and TMA-copy K_j into it, then the same for V_j (BLOCK_N / 64 page
        slices each)
    consumer 0 and 1 (a warpgroup each, 64 query rows, 240 registers), per key block j:
        issue S_{j+1} = Q·K_{j+1}ᵀ; O *= α_j; issue O += P_j·V_j     (async wgmma, back to back)
        wait for S_{j+1}; free K_{j+1}'s slot
        softmax of S_{j+1} → P_{j+1}, α_{j+1}                          (runs under P_j·V_j)
        wait for P_j·V_j; free V_j's slot

The two consumers synchronise only through the ring's mbarriers, so one's softmax runs beside the
other's products. Key blocks that cross the causal diagonal (and the last, partial one) are masked;
V rows past the sequence in the last block are zeroed in shared memory by consumer 0 (consumer 1 waits
for it) before P·V, since a page's unused slots may hold anything (NaN × 0 = NaN).

Requires an sm_90 GPU, bf16 q and cache, head_dim 128, a page size that is a multiple of 64 and 128
query rows per program (`unsupported_inputs`, `unsupported_launch`); `prefill.prefill_attention` runs
the Triton kernel elsewhere, and where the program chose it (`gluon=False`). Launched without
programmatic dependent launch (it waits for the kernel before it; prefill runs for milliseconds). Gluon kernels cannot run under TRITON_INTERPRET: the CPU tests compile this one
for sm_90 and fail if ptxas serializes its products (tests/kernels/sm90_compile.py); the GPU tests check
it against the reference. It also compiles the same with Triton 3.7.1, 3.8.0 and 3.9.0 (checked by hand,
not in CI).
"""

from __future__ import annotations

import torch
import triton
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
from hy3c.kernels.attention.blocks import BATCH_ARGS, LOG2E, query_block, search_iterations
from hy3c.kernels.attention.config import LaunchConfig

PAGE_BOX = 64  # keys per bulk copy (one page slice)
# names that changed between Triton releases: a barrier over the calling partition's warps
# (`thread_barrier` in 3.6, `barrier` from 3.7) and the TMA load (`async_copy_global_to_shared` until 3.8,
# `async_load` from 3.8; the old name is gone in 3.9)
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
CONSUMER_REGISTERS = 240  # per consumer thread (setmaxnreg)
PRODUCER_REGISTERS = 24
# registers per thread at launch: three warpgroups (two consumers, the producer's) share the SM's 64K
LAUNCH_REGISTERS = (2 * CONSUMER_REGISTERS + PRODUCER_REGISTERS) // 3
SHARED_MEMORY_BUDGET = 200 * 1024  # Q, the K/V ring; the rest of the 227 KB goes to the compiler's scratch


# the Triton prefill kernel's tile → request lookup, compiled as Gluon (scalar code: no layouts)
_query_block = gluon.jit(query_block.fn)


@gluon.jit
def _issue_block(desc, bufs, bars, block, n_blocks, page_row_ptr, last_page, head, PAGE_SIZE: gl.constexpr):
    """Bulk copies of key block `block` (if it exists) into its ring slot, page slice by page slice;
    slices past the sequence re-read its last page (finite data, masked later)."""
    NUM_BUF: gl.constexpr = bufs.shape[0]
    BLOCK_N: gl.constexpr = bufs.shape[1]
    HEAD_DIM: gl.constexpr = bufs.shape[2]
    BOX: gl.constexpr = desc.block_type.shape[0]
    exists = block < n_blocks
    slot = block % NUM_BUF
    bar = bars.index(slot)
    buf = bufs.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes * (BLOCK_N // BOX), pred=exists)
    for part in gl.static_range(BLOCK_N // BOX):
        key = block * BLOCK_N + part * BOX
        page = gl.load(page_row_ptr + gl.minimum(key // PAGE_SIZE, last_page), mask=exists, other=0)
        row = page * PAGE_SIZE + key % PAGE_SIZE
        _tma_load(desc, [row, head * HEAD_DIM], bar, buf.slice(part * BOX, BOX), pred=exists)


@gluon.jit
def _softmax_block(s, m_i, l_i, qk_scale, key_start, key_end, position, masked):
    """Online softmax (base 2) of one block of scores: P, the rescale factor α of the running sums, and
    the new running max and sum. `masked`: keys past key_end or after the row's position are -inf."""
    if masked:
        keys = key_start + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        visible = (keys[None, :] < key_end) & (keys[None, :] <= position[:, None])
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _zero_rows_past(buf, first_key, key_end, num_warps: gl.constexpr):
    """Zero the rows of a key block's shared-memory V tile at keys >= key_end (then fence for wgmma)."""
    BLOCK_N: gl.constexpr = buf.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    tile = buf.load(layout)
    keys = first_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    tile = gl.where((keys < key_end)[:, None], tile, gl.zeros_like(tile))
    buf.store(tile)
    fence_async_shared()
    _partition_barrier()


@gluon.jit
def _consumer(
    q_ptr,
    out_ptr,
    q_smem,
    ring,
    fix_bar,
    scalars,
    strides,
    GROUP: gl.constexpr,
    Q_BLOCK: gl.constexpr,
    WG: gl.constexpr,
):
    """One warpgroup's 64 query rows (WG 0: the block's first 64, WG 1: the rest) over every key block.
    ring: the K and V slots and their ready / empty mbarriers, shared with the producer."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    block, q_start, q_len, first_position, key_end, n_full, n_blocks, head, qk_scale = scalars
    stride_qt, stride_qh, stride_ot, stride_oh = strides
    NUM_BUF: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.shape[2]
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    rows = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    token = block * Q_BLOCK + rows // GROUP
    q_head = head * GROUP + rows % GROUP
    row_ok = token < q_len
    q_offsets = (
        (q_start + token)[:, None].to(gl.int64) * stride_qt + (q_head * stride_qh)[:, None] + dims[None, :]
    )
    q_rows = q_smem.slice(WG * ROWS, ROWS)
    q_rows.store(gl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0))
    fence_async_shared()
    _partition_barrier()

    s_rows = WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    position = first_position + s_rows // GROUP
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(0))
    p, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale, 0, key_end, position, n_full == 0)
    for j in range(0, n_blocks - 1):
        nxt = j + 1
        mbarrier.wait(k_ready.index(nxt % NUM_BUF), (nxt // NUM_BUF) & 1)
        s_next = warpgroup_mma(
            q_rows, k_bufs.index(nxt % NUM_BUF).permute((1, 0)), s_zero, use_acc=False, is_async=True
        )
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        mbarrier.wait(v_ready.index(j % NUM_BUF), (j // NUM_BUF) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(j % NUM_BUF), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
        mbarrier.arrive(k_empty.index(nxt % NUM_BUF))
        p, alpha, m_i, l_i = _softmax_block(
            s, m_i, l_i, qk_scale, nxt * BLOCK_N, key_end, position, nxt >= n_full
        )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_empty.index(j % NUM_BUF))

    last = n_blocks - 1
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    v_last = v_bufs.index(last % NUM_BUF)
    mbarrier.wait(v_ready.index(last % NUM_BUF), (last // NUM_BUF) & 1)
    if key_end < n_blocks * BLOCK_N:  # warpgroup 0 zeroes the V rows past the sequence, 1 waits for it
        if WG == 0:
            _zero_rows_past(v_last, last * BLOCK_N, key_end, 4)
            mbarrier.arrive(fix_bar)
        else:
            mbarrier.wait(fix_bar, 0)
    acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(gl.bfloat16), io_layout)
    o_offsets = (
        (q_start + token)[:, None].to(gl.int64) * stride_ot + (q_head * stride_oh)[:, None] + dims[None, :]
    )
    gl.store(out_ptr + o_offsets, out, mask=row_ok[:, None])


@gluon.jit
def _producer(k_desc, v_desc, ring, n_blocks, page_row, last_page, head, PAGE_SIZE: gl.constexpr):
    """One warp: each key block's K then V copies, as soon as both warpgroups have freed the slot."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    NUM_BUF: gl.constexpr = k_bufs.shape[0]
    for j in range(0, n_blocks):
        free_phase = ((j // NUM_BUF) & 1) ^ 1  # a fresh barrier counts as freed once
        mbarrier.wait(k_empty.index(j % NUM_BUF), free_phase)
        _issue_block(k_desc, k_bufs, k_ready, j, n_blocks, page_row, last_page, head, PAGE_SIZE)
        mbarrier.wait(v_empty.index(j % NUM_BUF), free_phase)
        _issue_block(v_desc, v_bufs, v_ready, j, n_blocks, page_row, last_page, head, PAGE_SIZE)


@gluon.jit(do_not_specialize=BATCH_ARGS)
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_desc,
    v_desc,
    page_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    plan_ptr,
    num_requests,
    search_iters,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: gl.constexpr,
    Q_BLOCK: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    NUM_BUF: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    ROWS: gl.constexpr = Q_BLOCK * GROUP
    gl.static_assert(ROWS == 128, "two warpgroups of 64 query rows")
    tile = gl.program_id(0)
    head = gl.program_id(1)
    if tile >= gl.load(plan_ptr + 2 * num_requests + 1):  # past the plan's query blocks
        return
    r, block, q_start, q_len, length = _query_block(
        plan_ptr, qsl_ptr, seq_lens_ptr, tile, num_requests, search_iters
    )
    first_position = length - q_len + block * Q_BLOCK
    key_end = gl.minimum(first_position + Q_BLOCK, length)
    n_full = (first_position + 1) // BLOCK_N
    n_blocks = gl.cdiv(key_end, BLOCK_N)
    page_row = page_table_ptr + r * stride_pt
    last_page = (length - 1) // PAGE_SIZE

    smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, HEAD_DIM], smem_layout)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    fix_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(fix_bar, count=1)
    fence_async_shared()

    scalars = (block, q_start, q_len, first_position, key_end, n_full, n_blocks, head, qk_scale)
    strides = (stride_qt, stride_qh, stride_ot, stride_oh)
    ring = (k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty)
    gl.warp_specialize(
        [
            (_consumer, (q_ptr, out_ptr, q_smem, ring, fix_bar, scalars, strides, GROUP, Q_BLOCK, 0)),
            (_consumer, (q_ptr, out_ptr, q_smem, ring, fix_bar, scalars, strides, GROUP, Q_BLOCK, 1)),
            (_producer, (k_desc, v_desc, ring, n_blocks, page_row, last_page, head, PAGE_SIZE)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def kv_page_descriptors(kv_cache: Tensor, layer: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Gluon TMA descriptors of one layer's K and V pages as [pages · page_size, kv_heads · head_dim]
    with [PAGE_BOX, head_dim] boxes (one page slice of one KV head per bulk copy)."""
    layer_cache = kv_cache[layer]
    _, pages, page_size, kv_heads, head_dim = layer_cache.shape
    rows, width = pages * page_size, kv_heads * head_dim
    box = [PAGE_BOX, head_dim]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    return tuple(TensorDescriptor(layer_cache[i], [rows, width], [width, 1], box, layout) for i in (0, 1))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unsupported_inputs(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, rows: int) -> str | None:
    """Why this kernel cannot take these inputs (None: it can): bf16 q and cache, head_dim 128, 128 query
    rows (tokens × the GQA group's heads) per program. Dtypes and sizes only, so the `lower` pass asks it
    of a node (the Gluon variant of `hy3.paged_attention`)."""
    if not q_dtype == kv_dtype == torch.bfloat16:
        return f"{_name(kv_dtype)} KV cache ({_name(q_dtype)} q): bf16 only"
    if head_dim != 128:
        return f"head_dim {head_dim}: 128 only"
    if rows != 128:
        return f"{rows} query rows per block: 128 only"
    return None


def unsupported_launch(q: Tensor, kv_cache: Tensor) -> str | None:
    """What only a launch knows (None: it can run): an sm_90 GPU, pages of a multiple of 64 keys, head
    dims adjacent in q and a contiguous cache."""
    if devices.capability(q.device) != (9, 0):
        return "not an sm_90 GPU"
    if kv_cache.shape[3] % PAGE_BOX:
        return f"page size {kv_cache.shape[3]} is not a multiple of {PAGE_BOX}"
    if q.stride(2) != 1 or not kv_cache[0].is_contiguous():
        return "strided q or KV cache"
    return None


def launch_options(config: LaunchConfig) -> dict[str, int]:
    """The launch options of a warp-specialized config (num_warps of the default partition, the register
    budget the partitions share), after checking its key block and ring fit the kernel: block_n a
    multiple of the 64-key page slice (128 at most: S in registers), the ring in shared memory."""
    if config.block_n not in (PAGE_BOX, 2 * PAGE_BOX):
        raise ValueError(f"block_n {config.block_n}: the Gluon prefill takes 64 or 128 keys per block")
    ring = 2 * config.num_stages * config.block_n * 128 * 2  # K and V slots of bf16 [block_n, 128]
    if config.num_stages < 1 or 128 * 128 * 2 + ring > SHARED_MEMORY_BUDGET:
        raise ValueError(f"num_stages {config.num_stages}: the K/V ring must fit {SHARED_MEMORY_BUDGET} B")
    return {"num_warps": 4, "maxnreg": LAUNCH_REGISTERS}


def prefill_attention_gluon(
    q: Tensor,
    kv_cache: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
    plan: Tensor,
    q_block: int,
    config: LaunchConfig,
) -> Tensor:
    """Causal prefill attention (the module docstring); the inputs and output of
    `prefill.prefill_attention` for a bf16 cache. config: block_n keys per block (64 or 128)
    and num_stages ring slots (`launch_options` checks both)."""
    num_kv_heads = kv_cache.shape[4]
    num_requests = seq_lens.shape[0]
    out = torch.empty_like(q)
    k_desc, v_desc = kv_page_descriptors(kv_cache, layer)
    max_tiles = triton.cdiv(q.shape[0], q_block) + num_requests
    _prefill_kernel[(max_tiles, num_kv_heads)](
        q,
        out,
        k_desc,
        v_desc,
        page_table,
        seq_lens,
        query_start_loc,
        plan,
        num_requests,
        search_iterations(num_requests),
        sm_scale * LOG2E.value,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=q.shape[1] // num_kv_heads,
        Q_BLOCK=q_block,
        HEAD_DIM=q.shape[2],
        BLOCK_N=config.block_n,
        PAGE_SIZE=kv_cache.shape[3],
        NUM_BUF=config.num_stages,
        CONSUMER_REGS=CONSUMER_REGISTERS,
        PRODUCER_REGS=PRODUCER_REGISTERS,
        **launch_options(config),
    )
    return out
