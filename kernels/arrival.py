"""Arrival counters: int32 device buffers for kernels whose last program to finish a unit of work
(an output tile's K splits, a token's expert rows) does the final reduction in a fixed order.

A kernel that counts with them leaves every counter it used at zero (the last arrival resets it), so one
buffer serves every such launch on the device. Buffers live as long as the process: a captured CUDA
graph keeps using the one it saw; graphs are captured after warm-up runs, which allocate outside the
capture (allocating inside a capture is refused, since the zeroing would only be recorded). One stream
at a time: two launches running concurrently on different streams would share the counters.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

COUNTERS: dict[str, list[Tensor]] = {}


def arrival_counters(device: torch.device, needed: int) -> Tensor:
    """At least `needed` zeroed int32 counters on `device`."""
    buffers = COUNTERS.setdefault(str(device), [])
    for buffer in buffers:
        if buffer.numel() >= needed:
            return buffer
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("arrival counters must be allocated by a warm-up run before CUDA-graph capture")
    buffers.append(torch.zeros(max(triton.next_power_of_2(needed), 256), dtype=torch.int32, device=device))
    return buffers[-1]
