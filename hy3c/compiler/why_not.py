"""`hy3c inspect ART why-not PASS --node NODE`: why a pass did not rewrite a node.

Re-traces the artifact's model config on the meta device (same dtype and checkpoint quant layout as
recorded), replays the recipe's passes that ran before PASS, then asks PASS to explain the node: for a
pattern pass, each pattern's structural match result and literal checks; for other passes, its gate.
Node names are those of the graph dumps (tracing is deterministic).
"""

from __future__ import annotations

import torch

from hy3c.compiler.trace import trace_step
from hy3c.model.layers import QuantLayout
from hy3c.passes.base import CompileCtx
from hy3c.passes.dump import format_node
from hy3c.passes.manager import PassManager, build_pass
from hy3c.program.artifact import Artifact, ArtifactError


def why_not(art: Artifact, pass_name: str | None, node_name: str | None) -> str:
    if pass_name is None or node_name is None:
        raise ArtifactError("why-not needs a pass name and --node NODE")
    recipe = art.recipe
    spec = recipe.pass_spec(pass_name)
    if spec is None:
        raise ArtifactError(f"no pass '{pass_name}' in this artifact's recipe")
    recorded = art.manifest["source"]["quant_layout"]
    quant = QuantLayout(
        frozenset(recorded["fp8_modules"]),
        recorded["static_activations"],
        frozenset(recorded.get("int4_experts", [])),
        recorded.get("group_size", 0),
    )
    gm = trace_step(art.config, getattr(torch, recipe.dtype), quant, recipe.parallel.token_multiple)
    ctx = CompileCtx(
        model=art.config,
        parallel=recipe.parallel,
        target=recipe.target,
        device_type=recipe.device_type,
        quant=recipe.quant,
        dtype=recipe.dtype,
        token_range=recipe.token_range,
        checkpoint_static_scales=quant.static_activations,
        checkpoint_fp8=bool(quant.fp8_modules),
    )
    PassManager(recipe.passes, ctx).run(gm, stop_before=pass_name)
    node = next((n for n in gm.graph.nodes if n.name == node_name), None)
    if node is None:
        raise ArtifactError(
            f"no node '{node_name}' in the graph before pass '{pass_name}' (see `graph --after`)"
        )
    pass_, config = build_pass(spec)
    if not spec.enabled:
        return f"pass '{pass_name}' is disabled in the recipe"
    reason = pass_.gate(ctx, config)
    if reason is not None:
        return f"pass '{pass_name}' was skipped: {reason}"
    rewriter = getattr(pass_, "rewriter", None)
    if rewriter is None:
        return f"pass '{pass_name}' has no patterns; it ran over every node it handles (see `passes`)"
    return f"{format_node(node)}\n" + rewriter(ctx).explain(node)
