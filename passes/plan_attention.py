"""plan_attention: build the attention work plan once per step and hand it to every attention node.

Inserts one `hy3.attention_plan` (KV tiles and query blocks of the step, computed on the device from
seq_lens and query_start_loc) and rewrites each `hy3.attention` into `hy3.paged_attention`, which takes
the plan. Sites: one per attention node (one per layer).

Before:
    %attention: bf16[s0, 64, 128] = hy3.attention(%q, %kv_cache, %kv_scales, 3, %page_table, %seq_lens, %query_start_loc, 0.088)
After:
    %attention_plan: i32[2, s1 + 1] = hy3.attention_plan(%seq_lens, %query_start_loc, 256, 16)     (once)
    %paged_attention: bf16[s0, 64, 128] = hy3.paged_attention(%q, %kv_cache, %kv_scales, 3, %page_table,
                                                              %seq_lens, %query_start_loc, 0.088, %attention_plan)
"""

from __future__ import annotations

import torch
from torch import fx

from hy3c.kernels.attention.plan import KV_TILE, prefill_q_block
from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of
from hy3c.passes.registry import register_pass

hy3 = torch.ops.hy3


@register_pass
class PlanAttention(Pass):
    name = "plan_attention"
    stage = Stage.FUSE

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph = gm.graph
        fake = fake_mode_of(gm)
        attentions = [n for n in graph.nodes if n.target is hy3.attention.default]
        if not attentions:
            return []
        inputs = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        group = ctx.heads_per_rank // ctx.kv_heads_per_rank  # q heads per KV head, on one rank
        with graph.inserting_before(attentions[0]):
            plan = graph.call_function(
                hy3.attention_plan.default,
                (inputs["seq_lens"], inputs["query_start_loc"], KV_TILE, prefill_q_block(group)),
            )
        infer_val(plan, fake)
        sites = []
        for node in attentions:
            with graph.inserting_before(node):
                paged = graph.call_function(hy3.paged_attention.default, (*node.args, plan))
            copy_meta(node, paged)
            infer_val(paged, fake)
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
            sites.append(Site(node=node.name, layer=layer_of(node), detail=f"layer {node.args[3]}"))
        return sites
