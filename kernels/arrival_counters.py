"""Zeroed int32 counters that kernels use to signal one another within a launch (arrival counters).

The router's split-K reduction counts the splits that have stored their partial sums; the one-kernel
FusedMoE counts each pair's finished gate-up tiles. Every user leaves the counters it touched at zero
before the next kernel in the stream can start (the router's last split re-zeroes its tile's counter;
FusedMoE's combine re-zeroes the pairs'), so one buffer serves every launch on the device.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

_BUFFERS: dict[str, list[Tensor]] = {}


def arrival_counters(device: torch.device, needed: int, user: str) -> Tensor:
    """At least `needed` zeroed int32 counters on `device`, for kernel `user` (named in errors).

    Buffers live as long as the process (a captured CUDA graph keeps using the one it saw; graphs are
    captured after warm-up runs, which allocate outside the capture; allocating inside a capture is refused,
    since the zeroing would only be recorded). One stream at a time: two launches running concurrently on
    different streams would share the counters.
    """
    buffers = _BUFFERS.setdefault(str(device), [])
    for buffer in buffers:
        if buffer.numel() >= needed:
            return buffer
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{user}'s arrival counters must be allocated by a warm-up run before capture")
    buffers.append(torch.zeros(max(triton.next_power_of_2(needed), 256), dtype=torch.int32, device=device))
    return buffers[-1]


def all_zero() -> bool:
    """Whether every counter of every buffer is back at zero (what each user must leave behind)."""
    return all(int(buffer.abs().sum()) == 0 for buffers in _BUFFERS.values() for buffer in buffers)
