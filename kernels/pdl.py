"""Programmatic dependent launch (PDL): a step's Triton kernels launch while the kernel before them ends.

Without it, every kernel boundary of a decode step leaves the GPU idle for the launch of the next grid
(BENCHMARKS.md has the A/B on a decode step's CUDA graph). On Hopper a kernel
launched with the PDL attribute may start before its predecessor in the stream has finished: its CTAs
are placed on free SMs and block in `griddepcontrol.wait` until the predecessor has completed and its
writes are visible. CUDA-graph capture keeps the attribute as a programmatic edge.

Rules for a kernel that takes part (a `PDL: tl.constexpr` parameter, launched with `**pdl_launch(...)`):
  * it calls `wait_for_inputs(PDL)` before its first global load *or store* (a buffer it writes may
    still be read by the predecessor);
  * `wait_for_inputs` then lets the kernel's own successor launch early. The successor's CTAs can only
    take resources left over once all of this kernel's CTAs are resident, so an early trigger never
    takes SMs from the kernel itself.
Waiting is transitive: a kernel's predecessor itself waited for everything before it.

`HY3C_PDL=0` launches without PDL (for A/B measurements); CPUs and GPUs before compute capability 9.0
never use it (the interpreter ignores the launch option, and `PDL` is False there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The `PDL` constexpr and Triton's `launch_pdl` option for a launch on `device`."""
    on = (
        device.type == "cuda"
        and os.environ.get("HY3C_PDL", "1") != "0"
        and _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())
    )
    return {"PDL": on, "launch_pdl": on}


@contextmanager
def launch_switch(variable: str, on: bool) -> Iterator[None]:
    """A switch read at kernel launch (HY3C_PDL; HY3C_GLUON: the Gluon kernels) set to on/off inside the
    block and restored after it (for A/B measurements: launches and CUDA-graph captures inside take it)."""
    previous = os.environ.get(variable)
    os.environ[variable] = "1" if on else "0"
    try:
        yield
    finally:
        os.environ.pop(variable, None)
        if previous is not None:
            os.environ[variable] = previous


def pdl_env(on: bool) -> AbstractContextManager[None]:
    """HY3C_PDL set to on/off inside the block and restored after it (`launch_switch`)."""
    return launch_switch("HY3C_PDL", on)
