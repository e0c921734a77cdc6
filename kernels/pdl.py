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

Whether a kernel takes part is the program's choice (each kernel op's `pdl` argument, decided by the
`lower` pass; `HY3C_PDL` overrides it, `hy3c.kernels.overrides`). CPUs and GPUs before compute
capability 9.0 never use it (the interpreter ignores the launch option, and `PDL` is False there): a
program compiled for a Hopper target that runs on an older GPU launches without it, logged once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hy3c.kernels import devices, overrides


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has finished, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch(device: torch.device, pdl: bool) -> dict[str, bool]:
    """The `PDL` constexpr and Triton's `launch_pdl` option for a launch on `device` of a kernel whose
    program asks for PDL or not (`pdl`)."""
    on = overrides.variant(overrides.PDL, pdl) and device.type == "cuda"
    if on and devices.capability(device) < (9, 0):
        devices.fall_back("pdl", device, "compute capability below 9.0", "launched without PDL")
        on = False
    return {"PDL": on, "launch_pdl": on}
