"""The peer-to-peer buffers the fused collectives' kernels read their peers through: torch symmetric
memory (`torch.distributed._symmetric_memory`), multicast off.

    peers = group_peers(pg, hidden, torch.bfloat16, x.device)   # Peers, or why the group has none

Each buffer is `symm_mem.empty((BUFFER_TOKENS, hidden))` on every rank of the group, rendezvoused once
(a collective: every rank makes the same calls, since they run the same program on the same shapes),
then cached per (group, capacity, hidden, dtype) for the life of the process: the addresses a CUDA
graph captured stay valid, and no call after the first allocates, copies from the host or
synchronizes. What a kernel gets (`Peers`) is plain device tensors of addresses, each rank's buffer
and signal pad in rank order, so a test can pass ordinary tensors of one process as the "peers"
(`local_peers`).

**No multicast.** NVLink multicast (multimem, NVLS, multicast objects) is never used: before the
first allocation `TORCH_SYMM_MEM_DISABLE_MULTICAST` is set to 1 (torch then creates no multicast
object at rendezvous), a value other than 1 refuses symmetric memory altogether, and so do a GPU that
still reports multicast support afterwards and a symmetric-memory backend other than torch's CUDA one
(NVSHMEM and NCCL windows may use NVLS). Refused or failed groups run the op's reference (NCCL).

**Signal pads.** Each rank's buffer comes with a signal pad of int32 slots its peers can write. The
kernels' barriers use slots past torch's own barrier channels (`RESERVED_CHANNELS`): channel k of
program p has slot (k · programs + p) · world + peer, `CHANNELS` channels per call. A slot is set to 1
by the peer (release) and reset to 0 by its owner's wait (acquire); every set is consumed within the
same call, so the pads are all zero between calls.

The torch API is the same in 2.11 and 2.13 (checked: `empty`, `rendezvous(tensor, group)`,
`get_buffer`, `get_signal_pad`, `get_signal_pad_size`, `get_backend`); `enable_symm_mem_for_group` is
deprecated there (rendezvous resolves the group by name) and only called on a torch that does not
mark it so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hy3c.kernels.collectives.config import BUFFER_TOKENS

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

MULTICAST_VAR = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
RESERVED_CHANNELS = 8  # torch's own barrier channels (slot channel × world + rank), left alone
CHANNELS = 3  # barriers of one kernel call: after staging, after the reduce, at the end
MAX_PROGRAMS = 64  # programs a kernel launches at most (each owns barrier slots)


@dataclass(frozen=True)
class Peers:
    """Every rank of a group as a kernel reaches it: addresses of each rank's buffer (`capacity` rows of
    `hidden` elements of `dtype`, contiguous, 16-byte aligned: the kernels' loads are vectorized on that)
    and signal pad, in group-rank order, as int64 tensors on the kernel's device; `programs`: how many
    programs the pads have barrier slots for."""

    rank: int
    world_size: int
    buffers: Tensor
    pads: Tensor
    capacity: int
    hidden: int
    dtype: torch.dtype
    programs: int
    keep: tuple[object, ...] = ()  # what owns the memory behind the addresses (kept alive with them)


def pad_programs(pad_slots: int, world_size: int) -> int:
    """Programs whose barrier slots fit a pad of `pad_slots` int32s past torch's reserved channels."""
    return max(0, min(MAX_PROGRAMS, (pad_slots - RESERVED_CHANNELS * world_size) // (CHANNELS * world_size)))


def local_peers(buffers: list[Tensor], pads: list[Tensor], rank: int) -> Peers:
    """Peers over plain tensors of this process: buffer r and pad r stand for rank r's (tests, the CPU
    interpreter). Buffers [capacity, hidden], all alike; pads int32, zero, all of one size."""
    first = buffers[0]
    world = len(buffers)
    if len(pads) != world or any(b.shape != first.shape or b.dtype != first.dtype for b in buffers):
        raise ValueError("one buffer and one pad per rank, all buffers of one shape and dtype")
    if first.dim() != 2 or not all(b.is_contiguous() for b in buffers):
        raise ValueError("buffers are contiguous [capacity, hidden] tensors")
    if any(p.dtype != torch.int32 or p.numel() != pads[0].numel() for p in pads):
        raise ValueError("signal pads are int32 tensors of one size")
    return Peers(
        rank=rank,
        world_size=world,
        buffers=_addresses(buffers, first.device),
        pads=_addresses(pads, first.device),
        capacity=first.shape[0],
        hidden=first.shape[1],
        dtype=first.dtype,
        programs=pad_programs(pads[0].numel(), world),
        keep=(*buffers, *pads),
    )


def _addresses(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The tensors' addresses as an int64 tensor on `device` (each must be 16-byte aligned)."""
    pointers = [t.data_ptr() for t in tensors]
    if any(p % 16 for p in pointers):
        raise ValueError("peer buffers and signal pads must be 16-byte aligned")
    return torch.tensor(pointers, dtype=torch.int64, device=device)


_BUFFERS: dict[tuple[str, int, int, torch.dtype], Peers] = {}
_REFUSED: dict[str, str] = {}  # group name → why it has no symmetric memory (decided once)


def multicast_refusal(device: torch.device) -> str | None:
    """None when NVLink multicast is off for symmetric memory on `device` (setting it off if nobody has
    said), else why symmetric memory may not be used."""
    value = os.environ.setdefault(MULTICAST_VAR, "1")
    if value != "1":
        return f"{MULTICAST_VAR}={value!r}: symmetric memory runs only with multicast off (1)"
    from torch._C._autograd import DeviceType
    from torch._C._distributed_c10d import _SymmetricMemory

    index = device.index if device.index is not None else torch.cuda.current_device()
    if _SymmetricMemory.has_multicast_support(DeviceType.CUDA, index):
        return f"cuda:{index} still reports multicast support with {MULTICAST_VAR}=1"
    return None


def group_peers(pg: ProcessGroup, hidden: int, dtype: torch.dtype, device: torch.device) -> Peers | str:
    """The symmetric buffer of (pg, BUFFER_TOKENS, hidden, dtype) on `device`, allocated and
    rendezvoused on the first call (on every rank of pg alike), or why there is none: not CUDA,
    multicast not off, another backend, a rendezvous that failed, or a first call inside a CUDA-graph
    capture (allocation and the host-to-device copy of the addresses cannot be captured)."""
    if device.type != "cuda":
        return f"{device.type} tensors have no symmetric memory"
    name = pg.group_name
    key = (name, BUFFER_TOKENS, hidden, dtype)
    found = _BUFFERS.get(key)
    if found is not None:
        return found
    if name in _REFUSED:
        return _REFUSED[name]
    if torch.cuda.is_current_stream_capturing():
        return "no symmetric buffer was allocated before the CUDA-graph capture (run the step eagerly first)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:  # a torch build without symmetric memory
        return _refuse(name, f"torch has no symmetric memory ({exc})")
    reason = multicast_refusal(device)
    backend = symm_mem.get_backend(device) if reason is None else None
    if backend not in (None, "CUDA"):
        reason = f"symmetric-memory backend {backend} (only the CUDA backend's P2P buffers are used)"
    if reason is not None:
        return _refuse(name, reason)
    try:
        peers = _rendezvous(symm_mem, pg, hidden, dtype, device)
    except Exception as exc:  # no P2P access between the group's GPUs, another host, …
        return _refuse(name, f"symmetric-memory rendezvous failed: {type(exc).__name__}: {exc}")
    _BUFFERS[key] = peers
    return peers


def _refuse(name: str, reason: str) -> str:
    _REFUSED[name] = reason
    return reason


def _rendezvous(symm_mem, pg: ProcessGroup, hidden: int, dtype: torch.dtype, device: torch.device) -> Peers:
    enable_on_older_torch(symm_mem, pg.group_name)
    local = symm_mem.empty((BUFFER_TOKENS, hidden), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, pg)
    world = handle.world_size
    slots = symm_mem.get_signal_pad_size() // 4
    views = [handle.get_buffer(r, (BUFFER_TOKENS, hidden), dtype) for r in range(world)]
    pads = [handle.get_signal_pad(r, (slots,), torch.int32) for r in range(world)]
    programs = pad_programs(slots, world)
    if programs < 1:
        raise RuntimeError(f"a signal pad of {slots} slots has no room for {world} ranks' barriers")
    return Peers(
        rank=handle.rank,
        world_size=world,
        buffers=_addresses(views, device),
        pads=_addresses(pads, device),
        capacity=BUFFER_TOKENS,
        hidden=hidden,
        dtype=dtype,
        programs=programs,
        keep=(local, handle, *views, *pads),
    )


def enable_on_older_torch(symm_mem, group_name: str) -> None:
    """torch before the deprecation of `enable_symm_mem_for_group` needs it before a group's first
    rendezvous; 2.11 and later resolve the group by name and warn when it is called."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None or getattr(enable, "__deprecated__", None) is not None:
        return
    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        enable(group_name)
