"""shard_sp: sequence parallelism over the TP ranks (TPSP, for prefill): the residual stream on token shards.

After `shard_tp` each branch ends in an all-reduce whose result every TP rank adds to the same residual
rows. With `parallel.sp` each rank keeps only its 1/tp of the step's tokens between the branches: the
embedding's rows are cut (`hy3.shard_tokens`), each branch's all-reduce becomes a reduce-scatter (the
same bytes on the wire, half the latency of reduce + broadcast), the residual adds and the norms run on
token shards (1/tp of their work and memory), and each norm's output is all-gathered for the column
GEMMs that follow it (and, in a MoE layer, for the router and the routed experts: the router runs on
the gathered tokens). The final norm's rows are gathered for the logits and the hidden-state output.
A step's token count must be a multiple of tp (`ParallelSpec.token_multiple`): the engine pads the
step with tokens that write no KV (slot −1) and are never read.

Gated by the compile context's token range: `min_tokens` (default 1) is the smallest step the program
is built for from which SP pays; below it the all-reduce layout is kept. Sites: one per norm on the
residual stream (2 per decoder layer and the final norm: 2L + 1) plus the embedding's cut.

Before (tp = 2):
    %linear_1 = aten.linear(%reshape_3, %layers.0.self_attn.o_proj.weight)
    %all_reduce = hy3.all_reduce(%linear_1, 0, 2)
    %add = aten.add(%embedding, %all_reduce)                                   # [T, 64]
    %rms_norm_1 = hy3.rms_norm(%add, %layers.0.post_attention_layernorm.weight, 1e-05)
    %linear_2 = aten.linear(%rms_norm_1, %layers.0.mlp.gate_up_proj.weight)
After:
    %shard_tokens = hy3.shard_tokens(%embedding, 0, 2)                         # [T/2, 64]
    %reduce_scatter = hy3.reduce_scatter(%linear_1, 0, 0, 2)                   # [T/2, 64]
    %add = aten.add(%shard_tokens, %reduce_scatter)
    %rms_norm_1 = hy3.rms_norm(%add, %layers.0.post_attention_layernorm.weight, 1e-05)
    %all_gather = hy3.all_gather(%rms_norm_1, 0, 0, 2)                         # [T, 64]
    %linear_2 = aten.linear(%all_gather, %layers.0.mlp.gate_up_proj.weight)
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, layer_of, module_path
from hy3c.passes.registry import register_pass
from hy3c.passes.shard_tp import insert_after, propagate
from hy3c.recipe import TP_GROUP

aten, hy3 = torch.ops.aten, torch.ops.hy3
_STREAM_NORMS = ("input_layernorm", "post_attention_layernorm")


class ShardSequenceParallelConfig(PassConfig):
    min_tokens: int = Field(1, ge=1)  # programs for smaller steps keep the all-reduce layout


@register_pass
class ShardSequenceParallel(Pass):
    name = "shard_sp"
    stage = Stage.SHARD
    Config = ShardSequenceParallelConfig

    def gate(self, ctx: CompileCtx, config: ShardSequenceParallelConfig) -> str | None:
        if not ctx.parallel.sp:
            return "parallel.sp is false"
        if ctx.token_range[0] < config.min_tokens:
            return f"token_range starts at {ctx.token_range[0]} < min_tokens {config.min_tokens}"
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        tp, graph, fake = ctx.parallel.tp, gm.graph, fake_mode_of(gm)
        reduces = [n for n in graph.nodes if n.target is hy3.all_reduce.default and n.args[1] == TP_GROUP]
        if not reduces:
            raise ValueError("shard_sp needs the TP all-reduces of shard_tp: list shard_tp before it")
        (embedding,) = [n for n in graph.nodes if n.target is aten.embedding.default]
        insert_after(graph, embedding, hy3.shard_tokens.default, (TP_GROUP, tp))
        sites = [Site(node=embedding.name, detail="the embedding's rows cut to this rank's tokens")]
        for reduce in reduces:
            with graph.inserting_before(reduce):
                scatter = graph.call_function(hy3.reduce_scatter.default, (reduce.args[0], 0, TP_GROUP, tp))
            copy_meta(reduce, scatter)
            reduce.replace_all_uses_with(scatter)
            graph.erase_node(reduce)
        for norm in [n for n in graph.nodes if n.target is hy3.rms_norm.default]:
            path = module_path(norm)
            if not (path.endswith(_STREAM_NORMS) or path == "norm"):
                continue
            insert_after(graph, norm, hy3.all_gather.default, (0, TP_GROUP, tp))
            where = "the final norm" if path == "norm" else path
            sites.append(Site(node=norm.name, layer=layer_of(norm), detail=f"{where} on token shards"))
        propagate(gm, fake)
        self._summary: dict[str, Any] = {"tp": tp, "reduce_scatters": len(reduces)}
        return sites

    def summary(self) -> dict[str, Any]:
        return self._summary
