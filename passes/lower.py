"""lower: choose a kernel provider and its variants for every hy3 op node; record the choices
(docs/ARCHITECTURE.md §4).

For each `hy3.*` node, the first provider in `priority` that runs on the target device and accepts the
node (its `supports` check) wins; the node's target becomes that provider's op. Providers named in
`priority` that do not exist for an op are skipped. Families the install cannot use
(`CompileCtx.unavailable_providers`, e.g. no Triton) are skipped too, and every node lowered past one
counts as a fallback.

Then each variant of the chosen provider (`hy3c.kernels.registry.Variant`: `pdl`, programmatic dependent
launch; `gluon`, the Gluon kernels of paged attention's prefill and the one-token FusedMoE) becomes a
keyword argument of the node: on where the config asks for it (`on`, or `auto` for a target whose
architecture runs it: sm_90 for h20 and h200) and the variant accepts the node (bf16 KV for the Gluon
prefill, say); a debugging override set while compiling (`HY3C_PDL`, `HY3C_GLUON`, in
`CompileCtx.variant_overrides`) replaces the config. A provider with tuned launch-config tables names
the one the target's GPUs run. Each site's detail says all of it; the summary maps op → provider →
count, op → fallbacks, family → reason, variant → its rule and the ops it is on and off for (with the
reasons), and op → config table.

Before:  %attention: bf16[s0, 64, 128] = hy3.paged_attention(%q, %kv_cache, ...)
After:   %attention: bf16[s0, 64, 128] = hy3_triton.paged_attention(%q, %kv_cache, ..., gluon=True, pdl=True)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

from pydantic import Field, field_validator
from torch import fx

from hy3c.kernels.overrides import VARIANTS
from hy3c.kernels.registry import (
    PROVIDER_NAMES,
    VARIANT_NAMES,
    Provider,
    Target,
    provider_by_target,
    providers_for,
)
from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import layer_of
from hy3c.passes.registry import register_pass

Switch = Literal["auto", "on", "off"]


class LowerConfig(PassConfig):
    priority: list[str] = Field(default_factory=lambda: ["torch"], min_length=1)
    # kernel variants: auto = on for targets whose architecture runs them
    pdl: Switch = "auto"
    gluon: Switch = "auto"

    @field_validator("pdl", "gluon", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        """YAML reads a bare on / off as true / false."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


@register_pass
class Lower(Pass):
    name = "lower"
    stage = Stage.LOWER
    Config = LowerConfig

    def __init__(self) -> None:
        self._table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._fallbacks: dict[str, int] = defaultdict(int)
        self._unavailable: dict[str, str] = {}
        self._rules: dict[str, str] = {}
        self._variants_on: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._variants_off: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(int))
        )
        self._config_tables: dict[str, str] = {}

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
        switches = _switches(ctx, config)
        target = Target(ctx.target, ctx.arch, ctx.kv_dtype)
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
            op = f"hy3.{current.op}"
            self._table[op][chosen.name] += 1
            if fell_back:
                self._fallbacks[op] += 1
            detail = f"{op} -> {chosen.name}" + self._lower_variants(node, op, chosen, target, switches)
            if reasons:
                detail += f" (skipped {'; '.join(reasons)})"
            sites.append(Site(node=node.name, layer=layer_of(node), detail=detail))
        return sites

    def _lower_variants(
        self,
        node: fx.Node,
        op: str,
        provider: Provider,
        target: Target,
        switches: dict[str, tuple[str, str]],
    ) -> str:
        """Set the node's variant arguments; the detail's bracket: what is on, off (and why), the table."""
        parts = []
        for variant in provider.variants:
            mode, rule = switches[variant.name]
            self._rules[variant.name] = rule
            if mode == "auto" and target.arch not in variant.archs:
                why_not: str | None = f"target {target.name} is not {'/'.join(sorted(variant.archs))}"
            else:
                why_not = rule if mode == "off" else variant.supports(node, target)
            node.update_kwarg(variant.name, why_not is None)
            if why_not is None:
                self._variants_on[variant.name][op] += 1
                parts.append(variant.name)
            else:
                self._variants_off[variant.name][op][why_not] += 1
                parts.append(f"{variant.name} off: {why_not}")
        if provider.config_table is not None:
            self._config_tables[op] = provider.config_table(target.name)
            parts.append(f"configs: {self._config_tables[op]}")
        return f" [{'; '.join(parts)}]" if parts else ""

    def summary(self) -> dict[str, Any]:
        variants = {
            name: {
                "rule": rule,
                "on": dict(sorted(self._variants_on[name].items())),
                "off": {op: dict(why) for op, why in sorted(self._variants_off[name].items())},
            }
            for name, rule in sorted(self._rules.items())
        }
        return {
            "providers": {op: dict(choices) for op, choices in sorted(self._table.items())},
            "fallbacks": dict(sorted(self._fallbacks.items())),
            "unavailable": self._unavailable,
            "variants": variants,
            "config_tables": dict(sorted(self._config_tables.items())),
        }


def _switches(ctx: CompileCtx, config: LowerConfig) -> dict[str, tuple[str, str]]:
    """variant → (auto | on | off, the rule as the report states it): a compile-time override, else the
    config."""
    overrides = {VARIANTS[variable]: (variable, on) for variable, on in ctx.variant_overrides}
    switches = {}
    for name in VARIANT_NAMES:
        if name in overrides:
            variable, on = overrides[name]
            switches[name] = ("on" if on else "off", f"{variable}={int(on)} at compile time")
            continue
        mode = getattr(config, name)
        if mode == "auto":
            rule = (
                f"auto: on where the target's architecture runs it (target {ctx.target}: {ctx.arch or 'cpu'})"
            )
        else:
            rule = f"{mode} (passes.lower.{name})"
        switches[name] = (mode, rule)
    return switches
