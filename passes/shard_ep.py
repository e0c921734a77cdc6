"""shard_ep: expert parallelism: the routed experts split `parallel.ep` ways over all ranks.

Rank r holds experts [r·E/ep, (r+1)·E/ep) of every MoE layer (w13, w2 and their scales cut along the
expert dim). The router stays whole on every rank; `hy3.local_experts` turns its top-k into this rank's
expert ids (−1 with weight 0 for experts elsewhere: they add nothing here), so the local experts'
output is this rank's part of the routed sum. How the parts are summed depends on where tokens live:

* tokens on every rank (tp × ep on the same ranks, or ep alone): with tp > 1 the TP all-reduce after the
  routed + shared sum adds the expert parts too (`shard_tp` put it there); with tp = 1 the routed output
  is all-reduced over the expert group before the (whole) shared expert is added;
* attention data parallelism (`parallel.dp_attention` > 1: each rank runs its own requests): the MoE
  input is all-gathered over the expert group (every rank's tokens, the same count on each: the
  engine pads the ranks' steps to one size), routed and run through the local experts, and the
  partial sums are reduce-scattered back to each rank's own tokens; the shared expert runs on them.

Sites: one per MoE layer.

Before:
    %router = hy3.router(%rms_norm_3, %layers.1.mlp.router.weight, %layers.1.mlp.expert_bias, 2, 2.826)
    %moe_experts = hy3.moe_experts(%rms_norm_3, %getitem_6, %getitem_7, %w13, %w2, None, ...)
    %add_3 = aten.add(%moe_experts, %linear_7)
After (ep = 2, tp = 1, tiny config: 8 experts):
    %router = hy3.router(%rms_norm_3, ...)
    %local_experts = hy3.local_experts(%getitem_6, %getitem_7, 4, 1, 2)
    %moe_experts = hy3.moe_experts(%rms_norm_3, %getitem_a, %getitem_b, %w13, %w2, None, ...)  # 4 experts
    %all_reduce = hy3.all_reduce(%moe_experts, 1, 2)
    %add_3 = aten.add(%all_reduce, %linear_7)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import attr_tensor, copy_meta, fake_mode_of, layer_of
from hy3c.passes.registry import register_pass
from hy3c.passes.shard_tp import insert_after, propagate, shard_param
from hy3c.recipe import EP_GROUP

hy3 = torch.ops.hy3


@register_pass
class ShardExpertParallel(Pass):
    name = "shard_ep"
    stage = Stage.SHARD

    def gate(self, ctx: CompileCtx, config: PassConfig) -> str | None:
        return "parallel.ep is 1" if ctx.parallel.ep == 1 else None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        ep, tp, dp = ctx.parallel.ep, ctx.parallel.tp, ctx.parallel.dp_attention
        local = ctx.model.num_experts // ep
        fake = fake_mode_of(gm)
        graph = gm.graph
        spec = {"kind": "split", "dim": 0, "parts": ep, "chunks": 1, "group": EP_GROUP}
        sites = []
        for experts in [n for n in graph.nodes if n.target is hy3.moe_experts.default]:
            x, weights, ids = experts.args[:3]
            for param in experts.args[3:]:
                if isinstance(param, fx.Node) and attr_tensor(gm, param).shape[0] == ctx.model.num_experts:
                    shard_param(gm, param, spec, fake)
            router = weights.args[0]
            if dp > 1:
                gathered = self._gather_tokens(graph, x, (router, experts), ep)
                x = gathered
            with graph.inserting_before(experts):
                routed = graph.call_function(hy3.local_experts.default, (weights, ids, local, EP_GROUP, ep))
                local_weights = graph.call_function(operator.getitem, (routed, 0))
                local_ids = graph.call_function(operator.getitem, (routed, 1))
            for new in (routed, local_weights, local_ids):
                copy_meta(experts, new)
            experts.update_arg(1, local_weights)
            experts.update_arg(2, local_ids)
            if dp > 1:
                insert_after(graph, experts, hy3.reduce_scatter.default, (0, EP_GROUP, ep))
                combine = "tokens all-gathered, partial sums reduce-scattered"
            elif tp == 1:
                insert_after(graph, experts, hy3.all_reduce.default, (EP_GROUP, ep))
                combine = "routed output all-reduced"
            else:
                combine = "summed by the TP all-reduce"
            sites.append(
                Site(
                    node=experts.name,
                    layer=layer_of(experts),
                    detail=f"experts {local} of {ctx.model.num_experts} per rank; {combine}",
                )
            )
        propagate(gm, fake)
        self._summary: dict[str, Any] = {"ep": ep, "experts_per_rank": local, "moe_layers": len(sites)}
        return sites

    def summary(self) -> dict[str, Any]:
        return self._summary

    @staticmethod
    def _gather_tokens(graph: fx.Graph, x: fx.Node, readers: tuple[fx.Node, ...], ep: int) -> fx.Node:
        """All ranks' MoE inputs, for the router and the routed experts (the shared expert keeps x)."""
        with graph.inserting_after(x):
            gathered = graph.call_function(hy3.all_gather.default, (x, 0, EP_GROUP, ep))
        copy_meta(readers[-1], gathered)
        for reader in readers:
            reader.replace_input_with(x, gathered)
        return gathered
