"""Zeroed int32 arrival counters for "the last program to arrive finishes the tile" reductions.

A kernel that uses them (the router's split-K sum, FusedMoE's combine inside the down GEMM) has each
program store its partial result, then `tl.debug_barrier()` and one `atomic_add(counter, 1,
sem="acq_rel")`; the program that sees the count reach its target reads every partial (`.cg` loads,
from L2), finishes the tile in a fixed order — deterministic, unlike atomic adds of the values — and
sets the counter back to zero. So every counter is zero between launches and one buffer per device
serves them all.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

_COUNTERS: dict[str, list[Tensor]] = {}


def arrival_counters(device: torch.device, needed: int) -> Tensor:
    """At least `needed` zeroed int32 counters on `device`.

    Buffers live as long as the process (a captured CUDA graph keeps using the one it saw; graphs are
    captured after warm-up runs, which allocate outside the capture; allocating inside a capture is
    refused, since the zeroing would only be recorded). One stream at a time: two launches running
    concurrently on different streams would share the counters.
    """
    buffers = _COUNTERS.setdefault(str(device), [])
    for buffer in buffers:
        if buffer.numel() >= needed:
            return buffer
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("arrival counters must be allocated by a warm-up run before CUDA-graph capture")
    buffers.append(torch.zeros(max(triton.next_power_of_2(needed), 256), dtype=torch.int32, device=device))
    return buffers[-1]


def all_counters_zero() -> bool:
    """Whether every counter of every buffer is back at zero (tests)."""
    return all(int(buffer.abs().sum()) == 0 for buffers in _COUNTERS.values() for buffer in buffers)
