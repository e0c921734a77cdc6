"""shard_tp: tensor parallelism over `parallel.tp` ranks (Megatron-style column → row pairs).

Every decoder layer splits the same way: the packed q|k|v projection by heads (q heads tp ways; kv heads
tp ways, or each kv head replicated on tp / kv_heads ranks beyond that), o_proj by its input columns;
the dense MLP and the shared expert's gate|up by rows (each half split) and down by columns; the routed
experts by their intermediate width (unless `parallel.ep` splits them by expert instead); the router,
norms and embedding stay whole. Each attention and MLP branch then ends in partial sums, which one
`hy3.all_reduce` over the TP group completes before the residual add (for a MoE layer, after the routed
and shared outputs are summed: one reduce for both). lm_head is split by vocabulary rows and its logits
rows are gathered (`hy3.all_gather` along the vocabulary). The KV cache holds the local kv heads.

The parameters become one rank's shape (meta) and the shard plan records how each rank's slice is cut
(`hy3c.passes.shard_plan`). Sites: one per decoder layer and one for lm_head (L + 1).

Before (tiny config: 4 q heads, 2 kv heads of 32):
    %linear = aten.linear(%rms_norm, %layers.0.self_attn.qkv_proj.weight)          # [T, 256]
    %split_with_sizes = aten.split_with_sizes(%linear, [128, 64, 64], -1)
    %reshape = aten.reshape(%getitem, [%sym_size_int_1, 4, 32])      ...
    %reshape_3 = aten.reshape(%attention, [%sym_size_int_1, 128])
    %linear_1 = aten.linear(%reshape_3, %layers.0.self_attn.o_proj.weight)
    %add = aten.add(%embedding, %linear_1)
After (tp = 2):
    %linear = aten.linear(%rms_norm, %layers.0.self_attn.qkv_proj.weight)          # [T, 128]
    %split_with_sizes = aten.split_with_sizes(%linear, [64, 32, 32], -1)
    %reshape = aten.reshape(%getitem, [%sym_size_int_1, 2, 32])      ...
    %reshape_3 = aten.reshape(%attention, [%sym_size_int_1, 64])
    %linear_1 = aten.linear(%reshape_3, %layers.0.self_attn.o_proj.weight)         # partial sums
    %all_reduce = hy3.all_reduce(%linear_1, 0, 2)
    %add = aten.add(%embedding, %all_reduce)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import (
    attr_tensor,
    copy_meta,
    fake_mode_of,
    infer_val,
    layer_of,
    module_path,
    set_attr,
)
from hy3c.passes.registry import register_pass
from hy3c.passes.shard_plan import local_shape, shard_plan
from hy3c.recipe import TP_GROUP, local_kv_heads

aten, hy3 = torch.ops.aten, torch.ops.hy3
GEMMS = (aten.linear.default, hy3.scaled_mm.default)


def gemm_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """module path → its GEMM node (`aten.linear` or FP8 `hy3.scaled_mm`), for the step's linears."""
    return {module_path(n): n for n in gm.graph.nodes if n.op == "call_function" and n.target in GEMMS}


def shard_param(gm: fx.GraphModule, node: fx.Node, spec: dict[str, Any], fake_mode) -> None:
    """Shrink the parameter `node` reads to one rank's shape and record how ranks cut it."""
    fqn = str(node.target)
    full = attr_tensor(gm, node)
    spec = {**spec, "global_shape": list(full.shape)}
    local = torch.empty(local_shape(spec), dtype=full.dtype, device="meta")
    set_attr(gm, fqn, local)
    node.meta["val"] = fake_mode.from_tensor(local, static_shapes=True) if fake_mode is not None else local
    shard_plan(gm)[fqn] = spec


def insert_after(graph: fx.Graph, node: fx.Node, target, args_after: tuple) -> fx.Node:
    """Insert `target(node, *args_after)` right after `node` and route node's other users through it."""
    with graph.inserting_after(node):
        new = graph.call_function(target, (node, *args_after))
    copy_meta(node, new)
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new


def propagate(gm: fx.GraphModule, fake_mode) -> None:
    """Recompute every call's meta value from its (resharded) inputs, in graph order."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            infer_val(node, fake_mode)


def branch_outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The attention and MLP outputs that a decoder layer adds to its residual stream."""
    outputs = []
    for node in gm.graph.nodes:
        if node.target is not aten.add.Tensor or layer_of(node) is None:
            continue
        layer = module_path(node)
        for arg in node.args:
            if (
                isinstance(arg, fx.Node)
                and module_path(arg).startswith(f"{layer}.")
                and layer.count(".") == 1
            ):
                outputs.append(arg)
    return outputs


@register_pass
class ShardTensorParallel(Pass):
    name = "shard_tp"
    stage = Stage.SHARD

    def gate(self, ctx: CompileCtx, config: PassConfig) -> str | None:
        return "parallel.tp is 1" if ctx.parallel.tp == 1 else None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        c, tp = ctx.model, ctx.parallel.tp
        fake = fake_mode_of(gm)
        graph = gm.graph
        gemms = gemm_nodes(gm)
        heads = {"heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim}
        q_local = c.num_attention_heads // tp
        kv_local = local_kv_heads(c.num_key_value_heads, tp)
        split = {"kind": "split", "parts": tp, "chunks": 1, "group": TP_GROUP}
        rows, cols = {**split, "dim": 0}, {**split, "dim": 1}
        done: dict[int, list[str]] = {}

        def shard_gemm(path: str, spec: dict[str, Any]) -> None:
            gemm = gemms[path]
            shard_param(gm, gemm.args[1], spec, fake)
            scale = gemm.args[3] if gemm.target is hy3.scaled_mm.default else None
            if isinstance(scale, fx.Node) and spec.get("dim", 0) == 0 and attr_tensor(gm, scale).numel() > 1:
                shard_param(gm, scale, spec, fake)  # an FP8 checkpoint's per-channel scale: cut as its rows

        for path, gemm in gemms.items():
            layer = layer_of(gemm)
            if path.endswith(".self_attn.qkv_proj"):
                shard_gemm(path, {"kind": "heads", **heads, "parts": tp, "group": TP_GROUP})
                self._local_heads(gemm, q_local, kv_local, c.head_dim)
                done.setdefault(layer, []).append(f"heads {q_local}+{kv_local}kv")
            elif path.endswith(".self_attn.o_proj"):
                shard_gemm(path, cols)
            elif path.endswith("gate_up_proj"):
                shard_gemm(path, {**rows, "chunks": 2})
            elif path.endswith("down_proj"):
                shard_gemm(path, cols)
        for node in list(graph.nodes):
            if node.target is hy3.attention.default:
                self._local_width(node, q_local * c.head_dim)
            if node.target is hy3.moe_experts.default and ctx.parallel.ep == 1:
                w13, w2, w13_scale, w2_scale = node.args[3:7]
                int4 = attr_tensor(gm, w2).dtype == torch.uint8
                if int4:
                    self._check_whole_groups(gm, w2, w2_scale, ctx.parallel.tp)
                shard_param(gm, w13, {**split, "dim": 1, "chunks": 2}, fake)
                shard_param(gm, w2, {**split, "dim": 2}, fake)
                if isinstance(w13_scale, fx.Node) and attr_tensor(gm, w13_scale).shape[1] > 1:
                    shard_param(gm, w13_scale, {**split, "dim": 1, "chunks": 2}, fake)
                if int4:  # W4A8: w2's group scales follow its columns
                    shard_param(gm, w2_scale, {**split, "dim": 2}, fake)
                done.setdefault(layer_of(node), []).append("experts by width")
        kv_cache = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "kv_cache")
        value = kv_cache.meta["val"]
        with fake:
            kv_cache.meta["val"] = value.new_empty((*value.shape[:4], kv_local, value.shape[5]))
        reduces = 0
        for branch in branch_outputs(gm):
            insert_after(graph, branch, hy3.all_reduce.default, (TP_GROUP, tp))
            reduces += 1
        head = gemms["lm_head"]
        shard_param(gm, head.args[1], rows, fake)
        insert_after(graph, head, hy3.all_gather.default, (1, TP_GROUP, tp))
        propagate(gm, fake)
        sites = [
            Site(node=f"layers.{layer}", layer=layer, detail=f"tp={tp}: {', '.join(parts)}, 2 all_reduce")
            for layer, parts in sorted(done.items())
            if layer is not None
        ]
        sites.append(Site(node="lm_head", detail=f"vocab rows / {tp}, logits gathered"))
        self._summary = {"tp": tp, "q_heads": q_local, "kv_heads": kv_local, "all_reduce": reduces}
        return sites

    def summary(self) -> dict[str, Any]:
        return self._summary

    @staticmethod
    def _local_heads(gemm: fx.Node, q_local: int, kv_local: int, head_dim: int) -> None:
        """The q|k|v split sizes and head views after the projection, for the local heads."""
        (split,) = [u for u in gemm.users if u.target is aten.split_with_sizes.default]
        split.update_arg(1, [q_local * head_dim, kv_local * head_dim, kv_local * head_dim])
        for item in list(split.users):
            if item.target is not operator.getitem:
                continue
            count = q_local if item.args[1] == 0 else kv_local
            for view in list(item.users):
                if view.target is aten.reshape.default:
                    tokens, _, dim = view.args[1]
                    view.update_arg(1, [tokens, count, dim])

    @staticmethod
    def _check_whole_groups(gm: fx.GraphModule, w2: fx.Node, w2_scale: fx.Node, tp: int) -> None:
        """Each rank's columns of a W4A8 w2 (its share of the expert width) must be whole scale groups."""
        columns = 2 * attr_tensor(gm, w2).shape[2]
        groups = attr_tensor(gm, w2_scale).shape[2]
        if groups % tp:
            raise ValueError(
                f"{w2.target}: W4A8 experts of width {columns} in {groups} scale groups cannot be split "
                f"{tp} ways by width (whole groups per rank); use parallel.ep for the experts"
            )

    @staticmethod
    def _local_width(attention: fx.Node, width: int) -> None:
        """The [T, heads × head_dim] view of the attention output that o_proj reads."""
        for view in list(attention.users):
            if view.target is aten.reshape.default:
                view.update_arg(1, [view.args[1][0], width])
