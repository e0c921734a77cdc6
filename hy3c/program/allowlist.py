"""The ops a hy3c program may call: the one list that loading resolves a program's targets against.

    target = resolve_op("aten.reshape.default")      # the OpOverload, or None for any unlisted name

A program file (`program/step.json`) names each call target as `namespace.op.overload`. A name is looked
up in `ALLOWED_OPS` by exact string comparison; only a listed name becomes an op, and the op is found
from the listed string, never from the program's text by attribute lookups. So no other overload, no
attribute path (`aten.__class__.__init__`) and no file, storage or I/O op (`aten.from_file`,
`aten.save`, `aten.set_`) can be called by a program, whatever it says.

The list is what the compiler emits, written out: the ATen ops of the traced Hy3 step (torch.export's
ATen IR) that the passes keep, every op of the hy3 dialect that the model or a pass emits
(`hy3c.ops`), the kernel providers' ops that the `lower` pass picks (`hy3c.kernels`: `hy3_triton`,
`hy3_cublas`), and the collectives of sharded programs (`COLLECTIVES`, `hy3c.ops.collectives`). A
Triton op's variant arguments (`pdl`, `gluon`: bools `lower` sets) choose among the kernels of that op, and each kernel checks at launch that it can run the inputs (else the op's plain
Triton kernel runs), so no value of theirs reaches memory the op would not touch. The compiler refuses to write a program calling anything else (so a new op is added here
in the same change that emits it), and `tests/compiler/test_artifact_security.py` checks that compiling
the shipped recipes emits exactly these ops — all but the collectives, which no shipped recipe emits
until one shards the model (`tests/compiler/test_collective_programs.py` checks and runs a sharded
program of them), and their kernel providers (`SHARDED_KERNELS`: tests/kernels/test_collective_kernels.py
compiles sharded programs that call them) — and that none of them touches files or storages.

This module imports only torch: the runtime loads programs without the compiler's passes or Inductor.
The hy3 and provider ops resolve once their modules are imported (`import hy3c.kernels`).
"""

from __future__ import annotations

import operator
from functools import cache

import torch

# the collectives (hy3c.ops.collectives, `hy3c.ops.COLLECTIVE_OPS`): only sharded programs call them
COLLECTIVES: tuple[str, ...] = (
    "hy3.all_gather.default",
    "hy3.all_reduce.default",
    "hy3.all_reduce_add_rms_norm.default",
    "hy3.all_to_all.default",
    "hy3.local_experts.default",
    "hy3.reduce_scatter.default",
    "hy3.shard_tokens.default",
    "hy3.gemm_reduce_scatter.default",
    "hy3.allgather_gemm.default",
)

# the collectives' kernel providers (hy3c.kernels.collectives) that `lower` picks on CUDA: only sharded
# programs call them either (each is listed in its family's section below too)
SHARDED_KERNELS: tuple[str, ...] = (
    "hy3_triton.all_reduce_add_rms_norm.default",
    "hy3_cublas.allgather_gemm.default",
    "hy3_cublas.gemm_reduce_scatter.default",
)

ALLOWED_OPS: tuple[str, ...] = (
    # ATen: the traced step (embedding → layers → norm → logits rows → lm_head) and what the passes keep
    "aten.add.Tensor",  # residual adds and expert + shared-expert sums not fused
    "aten.cat.default",  # the MTP program's [enorm(embedding), hnorm(hidden_prev)]
    "aten.embedding.default",
    "aten.index_select.default",  # the logits rows
    "aten.eq.Scalar",  # the MTP program's position-0 mask
    "aten.linear.default",
    "aten.masked_fill.Scalar",  # the MTP program zeroes the embedding at position 0
    "aten.reshape.default",
    "aten.split_with_sizes.default",  # q | k | v of the packed projection, when not fused
    "aten.sym_size.int",  # the step's token count, for reshapes
    "aten.to.dtype",  # fp32 logits, fp32 MoE combine
    "aten.unsqueeze.default",  # the MTP program's position-0 mask as a column
    # the hy3 dialect (hy3c.ops), their torch references as the `torch` provider
    "hy3.add_rms_norm.default",
    "hy3.add_rms_norm_quant.default",
    "hy3.attention.default",
    "hy3.attention_plan.default",
    "hy3.fused_moe.default",
    "hy3.kv_store.default",
    "hy3.moe_experts.default",
    "hy3.paged_attention.default",
    "hy3.qk_norm.default",
    "hy3.qknorm_rope_quant_kvstore.default",
    "hy3.quant_fp8.default",
    "hy3.quant_fp8_per_token.default",
    "hy3.rms_norm.default",
    "hy3.rope.default",
    "hy3.router.default",
    "hy3.router_gemm.default",
    "hy3.scaled_mm.default",
    "hy3.silu_and_mul.default",
    "hy3.silu_and_mul_quant.default",
    "hy3.topk_routing.default",
    *COLLECTIVES,
    # Triton kernels (hy3c.kernels)
    "hy3_triton.add_rms_norm.default",
    "hy3_triton.add_rms_norm_quant.default",
    "hy3_triton.all_reduce_add_rms_norm.default",  # sharded programs only (SHARDED_KERNELS)
    "hy3_triton.attention_plan.default",
    "hy3_triton.fused_moe.default",
    "hy3_triton.paged_attention.default",
    "hy3_triton.qknorm_rope_quant_kvstore.default",
    "hy3_triton.quant_fp8.default",
    "hy3_triton.quant_fp8_per_token.default",
    "hy3_triton.rms_norm.default",
    "hy3_triton.router_gemm.default",
    "hy3_triton.silu_and_mul.default",
    "hy3_triton.silu_and_mul_quant.default",
    "hy3_triton.topk_routing.default",
    # vendor GEMMs through torch (hy3c.kernels.cublas, hy3c.kernels.collectives.micro_pipeline)
    "hy3_cublas.allgather_gemm.default",  # sharded programs only (SHARDED_KERNELS)
    "hy3_cublas.gemm_reduce_scatter.default",  # sharded programs only (SHARDED_KERNELS)
    "hy3_cublas.moe_experts.default",
    "hy3_cublas.scaled_mm.default",
)

GETITEM = "getitem"  # operator.getitem: one output of a multi-output op

# the dtypes a program argument may name (casts, GEMM output dtypes)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int32": torch.int32,
    "int64": torch.int64,
}
# the dtypes a program parameter may have: those, and uint8 (W4A8 experts' int4 weights, two per byte)
PARAMETER_DTYPES: dict[str, torch.dtype] = {**DTYPES, "uint8": torch.uint8}

_ALLOWED = frozenset(ALLOWED_OPS)


class OpNotRegisteredError(LookupError):
    """A listed op whose module is not loaded (e.g. the Triton kernels on an install without triton)."""


def op_name(target: object) -> str | None:
    """The program name of a call target (`aten.view.default`, `getitem`), or None if it has none."""
    if target is operator.getitem:
        return GETITEM
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    return None


def is_allowed(target: object) -> bool:
    """Whether a call target is one a program may hold (the compiler checks what it writes with this)."""
    name = op_name(target)
    return name == GETITEM or (name in _ALLOWED and resolve_op(name) is target)


def resolve_op(name: object) -> object | None:
    """The op a listed name stands for; None for a name that is not in `ALLOWED_OPS`.

    Raises OpNotRegisteredError for a listed op whose kernel module is not loaded."""
    if name == GETITEM:
        return operator.getitem
    if not isinstance(name, str) or name not in _ALLOWED:
        return None
    return _lookup(name)


@cache
def _lookup(name: str) -> torch._ops.OpOverload:
    """Only ever called with a member of ALLOWED_OPS (a string of this module, not of a program)."""
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        raise OpNotRegisteredError(name) from None
