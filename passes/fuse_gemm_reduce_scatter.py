"""fuse_gemm_reduce_scatter: a row-parallel GEMM and the reduce-scatter of its rows as one
`hy3.gemm_reduce_scatter` (TPSP overlap: a provider sends finished tiles while later ones compute).

After `shard_sp` each attention branch ends in o_proj → reduce-scatter, and each dense MLP in
down_proj → reduce-scatter (a MoE layer's reduce-scatter reads the routed + shared sum, no GEMM: not
matched). Sites: one per decoder layer plus one per dense layer; BF16/FP16 GEMMs only (an FP8
`scaled_mm` keeps its separate reduce-scatter). `min_tokens` keeps it off for programs compiled for
steps smaller than that (the overlap pays on large prefill steps; thresholds come from measurements).

Before:
    %linear_1 = aten.linear(%reshape_3, %layers.0.self_attn.o_proj.weight)
    %reduce_scatter = hy3.reduce_scatter(%linear_1, 0, 0, 2)
After:
    %gemm_reduce_scatter = hy3.gemm_reduce_scatter(%reshape_3, %layers.0.self_attn.o_proj.weight, 0, 2)
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of, module_path
from hy3c.passes.registry import register_pass

aten, hy3 = torch.ops.aten, torch.ops.hy3


class FuseGemmCollectiveConfig(PassConfig):
    min_tokens: int = Field(1, ge=1)  # programs whose smallest step is below this keep the two ops


def gemm_collective_gate(ctx: CompileCtx, config: FuseGemmCollectiveConfig) -> str | None:
    """Shared by both GEMM + collective fusions: they only exist under sequence parallelism."""
    if not ctx.parallel.sp:
        return "parallel.sp is false (no token-sharded collectives next to GEMMs)"
    if ctx.token_range[0] < config.min_tokens:
        return f"token_range starts at {ctx.token_range[0]} < min_tokens {config.min_tokens}"
    return None


@register_pass
class FuseGemmReduceScatter(Pass):
    name = "fuse_gemm_reduce_scatter"
    stage = Stage.FUSE
    Config = FuseGemmCollectiveConfig

    def gate(self, ctx: CompileCtx, config: FuseGemmCollectiveConfig) -> str | None:
        return gemm_collective_gate(ctx, config)

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph, fake = gm.graph, fake_mode_of(gm)
        sites = []
        for scatter in [n for n in graph.nodes if n.target is hy3.reduce_scatter.default]:
            gemm, dim, group, size = scatter.args
            if (
                dim != 0
                or gemm.target is not aten.linear.default
                or len(gemm.users) != 1
                or len(gemm.args) != 2
            ):
                continue
            with graph.inserting_before(scatter):
                fused = graph.call_function(hy3.gemm_reduce_scatter.default, (*gemm.args, group, size))
            copy_meta(scatter, fused)
            infer_val(fused, fake)
            scatter.replace_all_uses_with(fused)
            graph.erase_node(scatter)
            graph.erase_node(gemm)
            sites.append(Site(node=gemm.name, layer=layer_of(gemm), detail=module_path(gemm)))
        return sites
