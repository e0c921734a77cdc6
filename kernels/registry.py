"""Kernel providers: which implementation runs each hy3 op (docs/ARCHITECTURE.md §4).

Every `torch.ops.hy3.*` op has the `torch` provider (its own pure-torch reference, any device).
Kernel modules register faster providers with `register_provider`; the `lower` pass picks, per graph
node, the first provider in the recipe's priority list that supports the target device and the node,
rewrites the node's target to the provider's op and records the choice.

A provider may also have variants: compile-time choices of how its kernels run, each a bool keyword
argument of its op (`pdl`: programmatic dependent launch; `gluon`: the Gluon kernels where the op has
them). `lower` sets every variant argument of the nodes it lowers, from the recipe (`lower`'s config
field of the same name: auto, on, off), the target's architecture and the variant's own check of the
node, and records each choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

import hy3c.ops  # noqa: F401
from hy3c.ops import COLLECTIVE_OPS, L1_OPS, L2_OPS


@dataclass(frozen=True)
class Target:
    """What a variant's check knows of the compile target beyond the graph: its name (a GPU key: h200,
    h20), its GPU architecture, and the KV cache's dtype (the traced cache placeholder has the model's)."""

    name: str
    arch: str | None
    kv_dtype: torch.dtype


@dataclass(frozen=True)
class Variant:
    """A compile-time choice of a provider's kernels: the op's bool keyword argument `name`, on by default
    (`auto`) for targets of an architecture in `archs`, where `supports` accepts the node."""

    name: str  # one of VARIANT_NAMES: the op's argument and `lower`'s config field
    archs: frozenset[str]  # target architectures whose GPUs run it ("sm_90")
    # None = the node can take it, else why not
    supports: Callable[[Node, Target], str | None] = field(default=lambda node, target: None)


@dataclass(frozen=True)
class Provider:
    name: str
    op: str  # hy3 op name, e.g. "attention"
    target: torch._ops.OpOverload  # what the node calls once lowered
    devices: frozenset[str]  # device types it runs on ("cpu", "cuda")
    cuda_graph_safe: bool = True  # no host syncs / data-dependent host control flow
    supports: Callable[[Node], str | None] = field(default=lambda node: None)  # None = ok, else why not
    variants: tuple[Variant, ...] = ()
    # target (a GPU key: h200, h20) → the tuned launch-config table its GPUs run, for the compile report
    config_table: Callable[[str], str] | None = None


# Provider families hy3c knows; a recipe may list one before its kernels exist for every op.
PROVIDER_NAMES = ("triton", "cublas", "torch")
VARIANT_NAMES = ("pdl", "gluon")
HOPPER = frozenset({"sm_90"})
# programmatic dependent launch, which every Triton kernel of the step takes part in (`hy3c.kernels.pdl`)
PDL = Variant("pdl", HOPPER)

_PROVIDERS: dict[str, list[Provider]] = {}


def register_provider(provider: Provider) -> None:
    if provider.name not in PROVIDER_NAMES:
        raise ValueError(f"unknown provider family {provider.name!r}; add it to PROVIDER_NAMES")
    unknown = [v.name for v in provider.variants if v.name not in VARIANT_NAMES]
    if unknown:
        raise ValueError(f"unknown variants {unknown} of hy3.{provider.op}; add them to VARIANT_NAMES")
    existing = _PROVIDERS.setdefault(provider.op, [])
    if any(p.name == provider.name for p in existing):
        raise ValueError(f"provider {provider.name!r} for hy3.{provider.op} registered twice")
    existing.append(provider)


def providers_for(op: str) -> list[Provider]:
    return list(_PROVIDERS.get(op, []))


def provider_by_target(target: object) -> Provider | None:
    for providers in _PROVIDERS.values():
        for p in providers:
            if p.target is target:
                return p
    return None


# The torch references: every op, every device. Ops whose reference loops over requests or experts on
# the host (.tolist() / .unique()) cannot be captured in a CUDA graph.
_HOST_SYNCING = {
    "attention",
    "paged_attention",
    "moe_experts",
    "fused_moe",
    "kv_store",
    "qknorm_rope_quant_kvstore",
    "sample",
}
for _op in (*L1_OPS, *L2_OPS, *COLLECTIVE_OPS):  # the collectives' reference: torch.distributed
    register_provider(
        Provider(
            name="torch",
            op=_op,
            target=getattr(torch.ops.hy3, _op).default,
            devices=frozenset({"cpu", "cuda"}),
            cuda_graph_safe=_op not in _HOST_SYNCING,
        )
    )
