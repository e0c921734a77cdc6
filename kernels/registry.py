"""Kernel providers: which implementation runs each hy3 op (DESIGN §3).

Every `torch.ops.hy3.*` op has the `torch` provider (its own pure-torch reference, any device).
Kernel modules register faster providers with `register_provider`; the `lower` pass picks, per graph
node, the first provider in the recipe's priority list that supports the target device and the node,
rewrites the node's target to the provider's op and records the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

import hy3c.ops  # noqa: F401
from hy3c.ops import L1_OPS, L2_OPS


@dataclass(frozen=True)
class Provider:
    name: str
    op: str  # hy3 op name, e.g. "attention"
    target: torch._ops.OpOverload  # what the node calls once lowered
    devices: frozenset[str]  # device types it runs on ("cpu", "cuda")
    cuda_graph_safe: bool = True  # no host syncs / data-dependent host control flow
    supports: Callable[[Node], str | None] = field(default=lambda node: None)  # None = ok, else why not


# Provider families hy3c knows; a recipe may list one before its kernels exist for every op.
PROVIDER_NAMES = ("triton", "cublas", "torch")

_PROVIDERS: dict[str, list[Provider]] = {}


def register_provider(provider: Provider) -> None:
    if provider.name not in PROVIDER_NAMES:
        raise ValueError(f"unknown provider family {provider.name!r}; add it to PROVIDER_NAMES")
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
for _op in (*L1_OPS, *L2_OPS):
    register_provider(
        Provider(
            name="torch",
            op=_op,
            target=getattr(torch.ops.hy3, _op).default,
            devices=frozenset({"cpu", "cuda"}),
            cuda_graph_safe=_op not in _HOST_SYNCING,
        )
    )
