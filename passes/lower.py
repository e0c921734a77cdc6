"""lower: choose a kernel provider for every hy3 op node and record the choice (DESIGN §3).

For each `hy3.*` node, the first provider in `priority` that runs on the target device and accepts the
node (its `supports` check) wins; the node's target becomes that provider's op. Providers named in
`priority` that do not exist for an op are skipped. Families the install cannot use
(`CompileCtx.unavailable_providers`, e.g. no Triton) are skipped too, and every node lowered past one
counts as a fallback. The summary maps op → provider → count, op → fallbacks, and family → reason.

Before:  %attention: bf16[s0, 64, 128] = hy3.attention(%rope, %kv_cache, ...)
After:   %attention: bf16[s0, 64, 128] = hy3_triton.attention(%rope, %kv_cache, ...)   (provider "triton")
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pydantic import Field
from torch import fx

from hy3c.kernels.registry import PROVIDER_NAMES, provider_by_target, providers_for
from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import layer_of
from hy3c.passes.registry import register_pass


class LowerConfig(PassConfig):
    priority: list[str] = Field(default_factory=lambda: ["torch"], min_length=1)


@register_pass
class Lower(Pass):
    name = "lower"
    stage = Stage.LOWER
    Config = LowerConfig

    def __init__(self) -> None:
        self._table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._fallbacks: dict[str, int] = defaultdict(int)
        self._unavailable: dict[str, str] = {}

    def gate(self, ctx: CompileCtx, config: LowerConfig) -> str | None:
        unknown = sorted(set(config.priority) - set(PROVIDER_NAMES))
        if unknown:
            raise ValueError(
                f"lower.priority names unknown providers {unknown}; known: {list(PROVIDER_NAMES)}"
            )
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: LowerConfig) -> list[Site]:
        unavailable = {name: why for name, why in ctx.unavailable_providers if name in config.priority}
        self._unavailable = unavailable
        sites = []
        for node in gm.graph.nodes:
            current = provider_by_target(node.target) if node.op == "call_function" else None
            if current is None:
                continue
            chosen, reasons, fell_back = None, [], False
            for name in config.priority:
                if name in unavailable:
                    reasons.append(f"{name}: {unavailable[name]}")
                    fell_back = True
                    continue
                for provider in providers_for(current.op):
                    if provider.name != name:
                        continue
                    why_not = None if ctx.device_type in provider.devices else f"not on {ctx.device_type}"
                    why_not = why_not or provider.supports(node)
                    if why_not is None:
                        chosen = provider
                        break
                    reasons.append(f"{name}: {why_not}")
                if chosen is not None:
                    break
            if chosen is None:
                raise ValueError(
                    f"no provider in {config.priority} supports node {node.name} (hy3.{current.op}): {reasons}"
                )
            node.target = chosen.target
            self._table[f"hy3.{current.op}"][chosen.name] += 1
            if fell_back:
                self._fallbacks[f"hy3.{current.op}"] += 1
            detail = f"hy3.{current.op} -> {chosen.name}" + (
                f" (skipped {'; '.join(reasons)})" if reasons else ""
            )
            sites.append(Site(node=node.name, layer=layer_of(node), detail=detail))
        return sites

    def summary(self) -> dict[str, Any]:
        return {
            "providers": {op: dict(choices) for op, choices in sorted(self._table.items())},
            "fallbacks": dict(sorted(self._fallbacks.items())),
            "unavailable": self._unavailable,
        }
