"""What a launch asks about the GPU it runs on: its compute capability (PDL needs 9.0, the Gluon kernels
are sm_90's) and its name (tuned config tables are per GPU model), and the log of launches that cannot
run the variant their program chose — an artifact compiled for an H200 target started on another GPU
— once per kernel and reason.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from hy3c.logs import log_event

log = logging.getLogger("hy3c.kernels")

_reported: set[tuple[str, str]] = set()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@cache
def _name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None for other devices (the CPU interpreter)."""
    return _capability(_index(device)) if device.type == "cuda" else None


def gpu_name(device: torch.device) -> str | None:
    """A CUDA device's name as the driver reports it ("NVIDIA H200"); None for other devices."""
    return _name(_index(device)) if device.type == "cuda" else None


def num_sms(device: torch.device) -> int:
    """A CUDA device's streaming multiprocessors (a persistent kernel's programs)."""
    return _num_sms(_index(device))


def fall_back(kernel: str, device: torch.device, reason: str, effect: str) -> None:
    """Log, once per kernel and reason, a launch on `device` that runs something other than what its
    program chose (a CPU launch — the interpreter in tests — is not reported)."""
    if device.type != "cuda" or (kernel, reason) in _reported:
        return
    _reported.add((kernel, reason))
    log_event(
        log,
        "kernel_variant_fallback",
        level=logging.WARNING,
        kernel=kernel,
        device=gpu_name(device),
        reason=reason,
        effect=effect,
    )
