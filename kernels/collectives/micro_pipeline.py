"""The `cublas` providers of the sequence-parallel GEMM + collective fusions, through torch's
micro-pipeline TP ops (`torch.ops.symm_mem.*`: cuBLAS GEMMs per chunk of rows, each chunk's P2P copy
through a symmetric-memory workspace overlapping the next chunk's GEMM).

* `hy3_cublas::gemm_reduce_scatter(x, weight, group, group_size)` implements `hy3::gemm_reduce_scatter`
  — reduce_scatter(x Wᵀ, dim 0) — as `fused_matmul_reduce_scatter(x, Wᵀ, "sum", 0, group_name)`: each
  rank computes the partial product of the rows every other rank owns, and those chunks travel while
  the next one is computed;
* `hy3_cublas::allgather_gemm(x, weight, group, group_size)` implements `hy3::allgather_gemm` —
  (gathered rows, gathered Wᵀ) — as `fused_all_gather_matmul(x, [Wᵀ], 0, group_name, return_A=True)`:
  each peer's rows are multiplied as they arrive.

BF16/FP16 weights only (`supports`): an FP8 GEMM stays a `scaled_mm` with its own collective. The torch
ops take a group *name*: the bound ProcessGroup's `group_name`. Their schemas are the same in torch
2.11 and 2.13; symmetric memory needs no per-group enabling there (`enable_symm_mem_for_group` is
deprecated, called only on a torch that does not mark it so). NVLink multicast stays off: multicast is
disabled before torch's first workspace rendezvous (`symmetric.multicast_refusal`, else the reference
runs), and the all-gather asks for the gathered rows (`return_A=True`), the one form torch never runs
through multimem.

A call runs the op's reference (NCCL) instead, logged once per reason (`hy3c.kernels.devices`), when the
group has no symmetric memory (not CUDA, multicast not off, another backend) or when torch's workspace
would have to grow inside a CUDA-graph capture (it cannot; the eager warm-up steps before capture grow
it). Both are checked against the references on several GPUs in the multi-GPU issue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hy3c.kernels import devices
from hy3c.kernels.collectives.symmetric import enable_on_older_torch, multicast_refusal
from hy3c.kernels.registry import Provider, register_provider
from hy3c.ops.collectives import allgather_gemm_reference, gemm_reduce_scatter_reference, process_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

DTYPES = (torch.bfloat16, torch.float16)
_REFUSED: dict[str, str] = {}  # group name → why torch's micro-pipeline ops do not run on it


def _symm_mem(pg: ProcessGroup, x: Tensor):
    """torch's symmetric-memory module, ready for pg, or why not."""
    if x.device.type != "cuda":
        return f"{x.device.type} tensors have no symmetric memory"
    name = pg.group_name
    if name in _REFUSED:
        return _REFUSED[name]
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        _REFUSED[name] = f"torch has no symmetric memory ({exc})"
        return _REFUSED[name]
    reason = multicast_refusal(x.device)
    backend = symm_mem.get_backend(x.device) if reason is None else None
    if backend not in (None, "CUDA"):
        reason = f"symmetric-memory backend {backend} (only the CUDA backend's P2P buffers are used)"
    if reason is not None:
        _REFUSED[name] = reason
        return reason
    enable_on_older_torch(symm_mem, name)
    return symm_mem


def _workspace_refusal(symm_mem, name: str, nbytes: int) -> str | None:
    """Why the op cannot run inside the capture going on, if it would have to grow torch's workspace for
    the group (torch raises then); None outside a capture, or where this torch keeps no such table."""
    if not torch.cuda.is_current_stream_capturing():
        return None
    table = getattr(symm_mem, "_group_name_to_workspace_tensor", None)
    if table is None:
        return None
    workspace = table.get(name)
    size = 0 if workspace is None else workspace.numel() * workspace.element_size()
    if size >= nbytes:
        return None
    return (
        "torch's symmetric-memory workspace is smaller than the captured step needs (warm up eagerly first)"
    )


def _ready(op: str, x: Tensor, weight: Tensor, pg: ProcessGroup, nbytes: int):
    """The symmetric-memory module when the fused op can run, else None (the reason logged once)."""
    symm_mem = None
    if x.dim() != 2 or x.dtype not in DTYPES or weight.dtype != x.dtype:
        reason = f"{x.dtype} x of {x.dim()} dims, {weight.dtype} weight (fused: 2-d bf16 or fp16 alike)"
    else:
        symm_mem = _symm_mem(pg, x)
        if isinstance(symm_mem, str):
            reason, symm_mem = symm_mem, None
        else:
            reason = _workspace_refusal(symm_mem, pg.group_name, nbytes)
    if reason is not None:
        devices.fall_back(op, x.device, reason, "ran the reference (NCCL)")
        return None
    return symm_mem


@torch.library.custom_op("hy3_cublas::gemm_reduce_scatter", mutates_args=())
def gemm_reduce_scatter(x: Tensor, weight: Tensor, group: int, group_size: int) -> Tensor:
    pg = process_group("gemm_reduce_scatter", group, group_size)
    if pg is None:
        return gemm_reduce_scatter_reference(x, weight, group, group_size)
    # torch's workspace: two chunks of the output, [rows / world, N] each
    nbytes = 2 * (x.shape[0] // group_size) * weight.shape[0] * x.element_size()
    if _ready("gemm_reduce_scatter", x, weight, pg, nbytes) is None:
        return gemm_reduce_scatter_reference(x, weight, group, group_size)
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), weight.t(), "sum", 0, pg.group_name)
    return out.contiguous()


@gemm_reduce_scatter.register_fake
def _(x: Tensor, weight: Tensor, group: int, group_size: int) -> Tensor:
    return torch.ops.hy3.gemm_reduce_scatter.default(x, weight, group, group_size)


@torch.library.custom_op("hy3_cublas::allgather_gemm", mutates_args=())
def allgather_gemm(x: Tensor, weight: Tensor, group: int, group_size: int) -> tuple[Tensor, Tensor]:
    pg = process_group("allgather_gemm", group, group_size)
    if pg is None:
        return allgather_gemm_reference(x, weight, group, group_size)
    nbytes = x.numel() * x.element_size()  # torch's workspace: this rank's rows
    if _ready("allgather_gemm", x, weight, pg, nbytes) is None:
        return allgather_gemm_reference(x, weight, group, group_size)
    gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(
        x.contiguous(), [weight.t()], 0, pg.group_name, return_A=True
    )
    return gathered.contiguous(), out.contiguous()


@allgather_gemm.register_fake
def _(x: Tensor, weight: Tensor, group: int, group_size: int) -> tuple[Tensor, Tensor]:
    return torch.ops.hy3.allgather_gemm.default(x, weight, group, group_size)


def _supports(node) -> str | None:
    x, weight = (node.args[i].meta.get("val") for i in (0, 1))
    if x is None or weight is None:
        return None
    if weight.dtype not in DTYPES or x.dtype != weight.dtype:
        return f"{x.dtype} x, {weight.dtype} weight (fused: bf16 or fp16 alike; FP8 GEMMs keep the reference)"
    if x.dim() != 2:
        return f"x of {x.dim()} dims (fused: [T, K])"
    return None


for _op, _target in (
    ("gemm_reduce_scatter", torch.ops.hy3_cublas.gemm_reduce_scatter.default),
    ("allgather_gemm", torch.ops.hy3_cublas.allgather_gemm.default),
):
    register_provider(Provider("cublas", _op, _target, frozenset({"cuda"}), supports=_supports))
