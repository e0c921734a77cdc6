"""`hy3_triton::all_reduce_add_rms_norm(x, residual, weight, eps, group, group_size)` implements
`hy3::all_reduce_add_rms_norm` — total = all_reduce(x) + residual, normed = rms_norm(total) — as one
Triton kernel over peer-to-peer buffers (`hy3c.kernels.collectives.symmetric`; never NVLink multicast).

Each program owns rows; every rank launches the same grid, and program p of one rank only waits for
program p of the others (per-program barriers through the signal pads: a release store into each
peer's slot, an acquire wait on its own), so no rank waits for a whole grid of another.

* **one-shot** (rows ≤ the table's threshold, `config.one_shot_max_tokens`): stage this rank's x into
  its buffer, barrier, then each rank reads every rank's rows, sums them in rank order (fp32, so all
  ranks compute the same bits), adds the residual, normalises and writes its whole output; a last
  barrier, so no rank overwrites its buffer in the next call while a peer still reads it.
* **two-shot** (more rows): the rows fall into `world` chunks; stage, barrier; rank r reduces chunk r
  over every rank's buffer, adds the residual, normalises it (its outputs) and writes its totals back
  into its own buffer; barrier; each rank reads the other chunks' totals from their ranks and
  normalises them itself (the same arithmetic on the same totals: the same bits, for half the bytes of
  gathering both outputs); a last barrier. Program p stages exactly the rows program p reduces on
  every rank, so per-program barriers suffice.

Rounding follows the references: the reduced sum rounded once to the input dtype, the residual add in
fp32 rounded to it, statistics in fp32 (as `hy3_triton::add_rms_norm`). The residual is the
replicated residual stream (the same on every rank, as tensor parallelism keeps it). A barrier that
waits longer than `BARRIER_TIMEOUT_S` for a peer traps (the CUDA context fails and the step with it)
instead of hanging. CUDA-graph safe: no host syncs, and the buffers are allocated on the first eager
call and reused; a call that cannot run the kernel — no symmetric memory for the group (not CUDA,
multicast not off, a failed rendezvous, a first call inside a graph capture), more rows than the
buffer holds — runs the reference (NCCL), logged once per reason (`hy3c.kernels.devices`).

The kernel's peers are int64 tensors of addresses (`symmetric.Peers`), so tests run it under the
interpreter over ordinary tensors standing for the ranks: one phase at a time without barriers
(`phase=`), or whole in one process per rank. Its timing, thresholds and the run on several GPUs are
measured in the multi-GPU issue; until then the thresholds are untuned defaults.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels import devices
from hy3c.kernels.collectives import config
from hy3c.kernels.collectives.symmetric import RESERVED_CHANNELS, Peers, group_peers
from hy3c.kernels.pdl import pdl_launch, wait_for_inputs
from hy3c.kernels.registry import PDL, Provider, register_provider
from hy3c.ops.collectives import all_reduce_add_rms_norm_reference, process_group

MAX_ROW = 16384  # a row held in one program's registers (as the RMSNorm kernel)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BARRIER_TIMEOUT_S = 300  # as the runtime's collective timeout: a dead peer fails the step, never hangs it
ALL_PHASES = -1
STAGE, REDUCE, GATHER = 0, 1, 2  # the phases (`phase=`: one alone, without barriers, for tests)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _barrier(
    pads_ptr,
    rank,
    channel: tl.constexpr,
    WORLD: tl.constexpr,
    PROGRAMS: tl.constexpr,
    RESERVED: tl.constexpr,
    TIMEOUT_NS: tl.constexpr,
):
    """Program p of this rank meets program p of every other rank: each of this program's stores issued
    before is visible to them after, and theirs to us. Slot (channel, p, src) of rank dst's pad is set
    by src (release, system scope) and reset by dst's wait (acquire), so the pads end each call zero."""
    tl.debug_barrier()  # every thread's stores issued before the release below
    slots = RESERVED + (channel * PROGRAMS + tl.program_id(0)) * WORLD
    for peer in tl.static_range(WORLD):
        if peer != rank:
            pad = tl.load(pads_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(pad + slots + rank, 1, sem="release", scope="sys")
    own = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != rank:
            if TIMEOUT_NS > 0:
                start = _globaltimer()
                while tl.atomic_cas(own + slots + peer, 1, 0, sem="acquire", scope="sys") != 1:
                    if _globaltimer() - start > TIMEOUT_NS:
                        _trap()
            else:  # the interpreter: no inline assembly
                while tl.atomic_cas(own + slots + peer, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
    tl.debug_barrier()  # no thread reads a peer's rows before the waits above


@triton.jit
def _norm_store(total, w_ptr, out_row, sum_row, c, ok, cols, eps):
    """A row's residual sum (in the activations' dtype) → sum_row, its RMSNorm → out_row."""
    tl.store(sum_row + c, total, mask=ok)
    xf = total.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / cols + eps)
    normed = (xf * inv).to(total.dtype).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + c, (w * normed).to(out_row.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["rank", "rows"])
def _all_reduce_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    bufs_ptr,  # int64 [WORLD]: each rank's buffer ([capacity, cols], x's dtype), in rank order
    pads_ptr,  # int64 [WORLD]: each rank's signal pad (int32 slots)
    rank,
    rows,
    cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    WORLD: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    PHASE: tl.constexpr,  # -1: all phases with their barriers; 0, 1, 2: that phase alone (tests)
    PROGRAMS: tl.constexpr,  # programs the pads have slots for (the grid is at most this)
    RESERVED: tl.constexpr,  # pad slots before the barriers' (torch's own channels)
    TIMEOUT_NS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    c = tl.arange(0, BLOCK)
    ok = c < cols
    dtype = x_ptr.dtype.element_ty  # the buffers hold x's dtype; every buffer is 16-byte aligned (Peers)
    ALL: tl.constexpr = PHASE < 0
    CHUNKS: tl.constexpr = WORLD if TWO_SHOT else 1
    chunk = tl.cdiv(rows, WORLD) if TWO_SHOT else rows  # rows one rank reduces (the last chunk may be short)
    own = tl.multiple_of(tl.load(bufs_ptr + rank).to(tl.pointer_type(dtype)), 16)
    if ALL or PHASE == 0:  # stage x: the rows program pid reduces, on whichever rank reduces them
        for k in tl.static_range(CHUNKS):
            for j in range(pid, chunk, step):
                row = (k * chunk + j).to(tl.int64)
                if row < rows:
                    x = tl.load(x_ptr + row * stride_x + c, mask=ok)
                    tl.store(own + row * cols + c, x, mask=ok)
    if ALL:
        _barrier(pads_ptr, rank, 0, WORLD, PROGRAMS, RESERVED, TIMEOUT_NS)
    if ALL or PHASE == 1:  # reduce this rank's rows (all of them one-shot) over every rank's buffer
        first = rank * chunk if TWO_SHOT else 0
        for j in range(pid, chunk, step):
            row = (first + j).to(tl.int64)
            if row < rows:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for s in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
                    peer = tl.multiple_of(tl.load(bufs_ptr + s).to(tl.pointer_type(dtype)), 16)
                    part = tl.load(peer + row * cols + c, mask=ok, other=0.0, volatile=True)
                    acc += part.to(tl.float32)
                residual = tl.load(res_ptr + row * stride_r + c, mask=ok, other=0.0).to(tl.float32)
                total = (acc.to(dtype).to(tl.float32) + residual).to(dtype)
                _norm_store(
                    total, w_ptr, out_ptr + row * stride_o, sum_ptr + row * stride_s, c, ok, cols, eps
                )
                if TWO_SHOT:  # for the other ranks to gather
                    tl.store(own + row * cols + c, total, mask=ok)
    if TWO_SHOT:
        if ALL:
            _barrier(pads_ptr, rank, 1, WORLD, PROGRAMS, RESERVED, TIMEOUT_NS)
        if ALL or PHASE == 2:  # gather the other chunks' totals from the ranks that reduced them
            for k in tl.static_range(WORLD):
                if k != rank:
                    peer = tl.multiple_of(tl.load(bufs_ptr + k).to(tl.pointer_type(dtype)), 16)
                    for j in range(pid, chunk, step):
                        row = (k * chunk + j).to(tl.int64)
                        if row < rows:
                            total = tl.load(peer + row * cols + c, mask=ok, other=0.0, volatile=True)
                            _norm_store(
                                total,
                                w_ptr,
                                out_ptr + row * stride_o,
                                sum_ptr + row * stride_s,
                                c,
                                ok,
                                cols,
                                eps,
                            )
    if ALL:  # no rank overwrites its buffer (next call) while another still reads it
        _barrier(pads_ptr, rank, 2, WORLD, PROGRAMS, RESERVED, TIMEOUT_NS)


def num_warps(block: int) -> int:
    """Warps of a program holding a row of `block` elements (as the RMSNorm kernel's: 512 each, ≤ 16)."""
    return max(min(block // 512, 16), 1)


def _rows(t: Tensor) -> Tensor:
    """t as [rows, cols] with unit stride along cols (a copy only when the last dim is strided)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


def launch(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    peers: Peers,
    two_shot: bool,
    *,
    phase: int = ALL_PHASES,
    out: tuple[Tensor, Tensor] | None = None,
    pdl: bool = True,
) -> tuple[Tensor, Tensor]:
    """→ (normed, total) of this rank (`peers.rank`), one-shot or two-shot. `phase` runs one phase
    alone without barriers (tests: every rank's phase 0, then every rank's phase 1, …), into `out`
    when given (the outputs a phase leaves half written)."""
    cols = x.shape[-1]
    if cols > MAX_ROW or cols != peers.hidden or x.dtype != peers.dtype:
        raise ValueError(
            f"rows of {cols} {x.dtype} elements do not fit buffers of {peers.hidden} {peers.dtype}"
        )
    x2, res2 = _rows(x), _rows(residual)
    rows = x2.shape[0]
    if rows > peers.capacity:
        raise ValueError(f"{rows} rows exceed the buffers' {peers.capacity}")
    if out is None:
        out = (
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
        )
    normed, total = out
    if rows:
        world = peers.world_size
        work = triton.cdiv(rows, world) if two_shot else rows
        block = triton.next_power_of_2(cols)
        normed2, total2 = normed.view(-1, cols), total.view(-1, cols)
        _all_reduce_add_rms_norm_kernel[(max(1, min(work, peers.programs)),)](
            x2,
            res2,
            weight,
            normed2,
            total2,
            peers.buffers,
            peers.pads,
            peers.rank,
            rows,
            cols,
            eps,
            x2.stride(0),
            res2.stride(0),
            normed2.stride(0),
            total2.stride(0),
            WORLD=world,
            TWO_SHOT=two_shot,
            PHASE=phase,
            PROGRAMS=peers.programs,
            RESERVED=RESERVED_CHANNELS * world,
            TIMEOUT_NS=BARRIER_TIMEOUT_S * 10**9 if x.device.type == "cuda" else 0,
            BLOCK=block,
            num_warps=num_warps(block),
            **pdl_launch(x.device, pdl),
        )
    return normed, total


def _peers_or_reason(x: Tensor, residual: Tensor, pg) -> Peers | str:
    """The group's buffers when this call can run the kernel, else why not."""
    if (
        x.dtype not in DTYPES
        or x.shape[-1] > MAX_ROW
        or residual.shape != x.shape
        or residual.dtype != x.dtype
    ):
        return f"{x.dtype} rows of {x.shape[-1]} (kernel: {MAX_ROW} of bf16, fp16, fp32, a residual alike)"
    peers = group_peers(pg, x.shape[-1], x.dtype, x.device)
    if isinstance(peers, Peers) and x.numel() // x.shape[-1] > peers.capacity:
        return f"more rows than the symmetric buffers hold ({peers.capacity}, config.BUFFER_TOKENS)"
    return peers


@torch.library.custom_op("hy3_triton::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_size: int, *, pdl: bool = True
) -> tuple[Tensor, Tensor]:
    pg = process_group("all_reduce_add_rms_norm", group, group_size)
    peers = None if pg is None else _peers_or_reason(x, residual, pg)
    if not isinstance(peers, Peers):
        if peers is not None:
            devices.fall_back("all_reduce_add_rms_norm", x.device, peers, "ran the reference (NCCL)")
        return all_reduce_add_rms_norm_reference(x, residual, weight, eps, group, group_size)
    rows = x.numel() // x.shape[-1]
    key = config.gpu_key(devices.gpu_name(x.device))
    two_shot = rows > config.one_shot_max_tokens(key, peers.world_size)
    return launch(x, residual, weight, eps, peers, two_shot, pdl=pdl)


@all_reduce_add_rms_norm.register_fake
def _(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, group: int, group_size: int, *, pdl: bool = True
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _supports(node) -> str | None:
    x, residual = (node.args[i].meta.get("val") for i in (0, 1))
    if x is None or residual is None:
        return None
    if x.shape != residual.shape or x.dtype != residual.dtype:
        return "x and residual differ in shape or dtype"
    if x.dtype not in DTYPES:
        return f"{x.dtype} activations (the kernel: bf16, fp16, fp32)"
    if isinstance(x.shape[-1], int) and x.shape[-1] > MAX_ROW:
        return f"rows longer than {MAX_ROW}"
    return None


register_provider(
    Provider(
        "triton",
        "all_reduce_add_rms_norm",
        torch.ops.hy3_triton.all_reduce_add_rms_norm.default,
        frozenset({"cuda"}),
        supports=_supports,
        variants=(PDL,),
        config_table=config.table_for,
    )
)
