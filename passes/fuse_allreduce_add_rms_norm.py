"""fuse_allreduce_add_rms_norm: TP all-reduce → residual add → RMSNorm as one `hy3.all_reduce_add_rms_norm`.

After `shard_tp` every attention and MLP branch (for a MoE layer: the routed + shared sum) ends in a
`hy3.all_reduce`, and `fuse_add_rms_norm` has made its residual add and the next norm one
`hy3.add_rms_norm`. This pass folds the reduce into that op, so a provider can run the norm in the
epilogue of the all-reduce (one pass over the activations, no round trip of the reduced sum through
memory). The fused op's reference is the composition of the two, so the graph computes what it did.

Matches 2 sites per decoder layer (L layers: 2L; the first layer's input norm reads the embedding,
the final norm the last layer's MLP branch), for a program sharded with tp > 1 (0 sites otherwise).
`max_tokens` gates it off for programs compiled only for steps larger than that (the fused kernel
pays for small token counts; thresholds come from measurements).

Before:
    %all_reduce = hy3.all_reduce(%linear_1, 0, 2)
    %add_rms_norm = hy3.add_rms_norm(%embedding, %all_reduce, %layers.0.post_attention_layernorm.weight, 1e-05)
After:
    %all_reduce_add_rms_norm = hy3.all_reduce_add_rms_norm(%linear_1, %embedding,
                                   %layers.0.post_attention_layernorm.weight, 1e-05, 0, 2)
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of
from hy3c.passes.registry import register_pass

hy3 = torch.ops.hy3


class FuseAllReduceAddRmsNormConfig(PassConfig):
    max_tokens: int | None = Field(None, ge=1)  # skip when every step of the program is larger


@register_pass
class FuseAllReduceAddRmsNorm(Pass):
    name = "fuse_allreduce_add_rms_norm"
    stage = Stage.FUSE
    Config = FuseAllReduceAddRmsNormConfig

    def gate(self, ctx: CompileCtx, config: FuseAllReduceAddRmsNormConfig) -> str | None:
        if ctx.parallel.tp == 1:
            return "parallel.tp is 1 (no TP all-reduce before a residual add)"
        if ctx.parallel.sp:
            return "parallel.sp: the TP all-reduces are reduce-scatters (fuse_gemm_reduce_scatter)"
        if config.max_tokens is not None and ctx.token_range[0] > config.max_tokens:
            return f"token_range starts at {ctx.token_range[0]} > max_tokens {config.max_tokens}"
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph, fake = gm.graph, fake_mode_of(gm)
        sites = []
        for norm in [n for n in graph.nodes if n.target is hy3.add_rms_norm.default]:
            x, residual, weight, eps = norm.args
            reduce = next((a for a in (x, residual) if _sole_reduce_of(a, norm)), None)
            if reduce is None:
                continue
            other = residual if reduce is x else x
            partial, group, size = reduce.args
            with graph.inserting_before(norm):
                fused = graph.call_function(
                    hy3.all_reduce_add_rms_norm.default, (partial, other, weight, eps, group, size)
                )
            copy_meta(norm, fused)
            infer_val(fused, fake)
            norm.replace_all_uses_with(fused)
            graph.erase_node(norm)
            graph.erase_node(reduce)
            sites.append(Site(node=norm.name, layer=layer_of(norm), detail=f"group {group} of {size}"))
        return sites


def _sole_reduce_of(value: object, user: fx.Node) -> bool:
    return (
        isinstance(value, fx.Node) and value.target is hy3.all_reduce.default and list(value.users) == [user]
    )
