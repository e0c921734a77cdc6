"""fuse_allgather_gemm: the all-gather of token shards and the column-parallel GEMM that reads them as one
`hy3.allgather_gemm` (TPSP overlap: a provider multiplies each peer's rows as they arrive).

After `shard_sp` every norm on the residual stream is all-gathered for the GEMMs after it: the packed
q|k|v projection, the dense MLP's gate|up, a MoE layer's shared-expert gate|up (whose router and
routed experts read the same gathered rows: the fused op returns them too). Sites: 2 per decoder
layer (the final norm's gather feeds the logits rows, no GEMM); BF16/FP16 GEMMs only. `min_tokens`
as for `fuse_gemm_reduce_scatter`.

Before:
    %all_gather = hy3.all_gather(%rms_norm, 0, 0, 2)
    %linear = aten.linear(%all_gather, %layers.0.self_attn.qkv_proj.weight)
After:
    %allgather_gemm = hy3.allgather_gemm(%rms_norm, %layers.0.self_attn.qkv_proj.weight, 0, 2)
    %gathered = getitem(%allgather_gemm, 0)          %linear = getitem(%allgather_gemm, 1)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.fuse_gemm_reduce_scatter import FuseGemmCollectiveConfig, gemm_collective_gate
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of, module_path
from hy3c.passes.registry import register_pass

aten, hy3 = torch.ops.aten, torch.ops.hy3


@register_pass
class FuseAllGatherGemm(Pass):
    name = "fuse_allgather_gemm"
    stage = Stage.FUSE
    Config = FuseGemmCollectiveConfig

    def gate(self, ctx: CompileCtx, config: FuseGemmCollectiveConfig) -> str | None:
        return gemm_collective_gate(ctx, config)

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph, fake = gm.graph, fake_mode_of(gm)
        sites = []
        for gather in [n for n in graph.nodes if n.target is hy3.all_gather.default]:
            x, dim, group, size = gather.args
            gemm = next(
                (
                    u
                    for u in gather.users
                    if u.target is aten.linear.default and u.args[0] is gather and len(u.args) == 2
                ),
                None,
            )
            if dim != 0 or gemm is None:
                continue
            with graph.inserting_before(gather):
                fused = graph.call_function(hy3.allgather_gemm.default, (x, gemm.args[1], group, size))
                gathered = graph.call_function(operator.getitem, (fused, 0))
                product = graph.call_function(operator.getitem, (fused, 1))
            for new in (fused, gathered, product):
                copy_meta(gemm, new)
                infer_val(new, fake)
            gemm.replace_all_uses_with(product)
            graph.erase_node(gemm)
            gather.replace_all_uses_with(gathered)
            graph.erase_node(gather)
            sites.append(Site(node=gemm.name, layer=layer_of(gemm), detail=module_path(gemm)))
        return sites
