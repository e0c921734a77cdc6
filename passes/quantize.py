"""quantize: W8A8 FP8 (or W4A8 experts) at compile time (docs/ARCHITECTURE.md §1.7), with the weight
conversion recorded as data.

For a BF16 checkpoint and `quant.weights: fp8`, every linear layer except lm_head (and every routed
expert stack) gets float8_e4m3fn weights with per-channel or per-tensor scales (`quant.weight_scales`)
and per-token dynamic activation quantization. The weights themselves are converted while the artifact
is packaged: the pass only retypes the parameters (meta tensors) and records, in
`gm.meta["hy3c.weight_plan"]`, how each one is produced. The router, embeddings, lm_head and norms
stay in high precision. For an FP8 checkpoint the weights are already e4m3; the pass only switches
static activation scales to dynamic ones when the recipe asks for `quant.activations: dynamic`.

`quant.weights: w4a8` quantizes the linear layers as above and the routed experts to int4: symmetric
round-to-nearest over groups of `quant.group_size` input columns, packed two per byte along the input
dimension, with an fp32 scale per group (`hy3c.ops.quant.quantize_int4_groups`); their activations stay
FP8 per token. A split of the experts' input columns (w2 under tensor parallelism) must keep whole
groups on each rank.

Before:
    %linear: bf16[s0, 8192] = aten.linear(%rms_norm, %layers.3.self_attn.qkv_proj.weight)
After:
    %quant_fp8_per_token: (f8e4m3[s0, 4096], f32[s0, 1]) = hy3.quant_fp8_per_token(%rms_norm)
    %xq = getitem(%quant_fp8_per_token, 0)      %xs = getitem(%quant_fp8_per_token, 1)
    %scaled_mm: bf16[s0, 8192] = hy3.scaled_mm(%xq, %layers.3.self_attn.qkv_proj.weight, %xs,
                                               %layers.3.self_attn.qkv_proj.weight_scale, bf16)
W4A8 experts (group 128):
    %moe_experts: bf16[s0, 4096] = hy3.moe_experts(%x, %w, %ids, %...experts.w13: bf16[192, 3072, 4096],
                                                   %...experts.w2: bf16[192, 4096, 1536], None, None, None, None)
After:
    %moe_experts: bf16[s0, 4096] = hy3.moe_experts(%x, %w, %ids, %...experts.w13: u8[192, 3072, 2048],
        %...experts.w2: u8[192, 4096, 768], %...experts.w13_scale: f32[192, 3072, 32],
        %...experts.w2_scale: f32[192, 4096, 12], None, None)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from hy3c.ops.quant import FP8_DTYPE, check_int4_groups
from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import (
    add_attr,
    attr_tensor,
    copy_meta,
    fake_mode_of,
    infer_val,
    layer_of,
    set_attr,
)
from hy3c.passes.registry import register_pass
from hy3c.passes.shard_plan import shard_plan
from hy3c.passes.weight_plan import weight_plan

aten, hy3 = torch.ops.aten, torch.ops.hy3
_HIGH_PRECISION = ("lm_head.weight",)


@register_pass
class Quantize(Pass):
    name = "quantize"
    stage = Stage.QUANT

    def gate(self, ctx: CompileCtx, config: PassConfig) -> str | None:
        if (
            ctx.quant.activations == "static"
            and ctx.quant.weights in ("fp8", "w4a8")
            and not ctx.checkpoint_static_scales
        ):
            raise ValueError(
                "quant.activations=static needs an FP8 checkpoint with input_scale tensors; this checkpoint has "
                "none (use --set quant.activations=dynamic, or convert it with `hy3c convert-fp8`)"
            )
        if ctx.quant.weights == "none":
            return "quant.weights is none"
        if ctx.checkpoint_fp8 and not (ctx.quant.activations == "dynamic" and ctx.checkpoint_static_scales):
            return "the checkpoint's weights are already FP8 with the activation scheme the recipe asks for"
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        self._gm, self._fake = gm, fake_mode_of(gm)
        self._granularity = ctx.quant.weight_scales
        self._group = ctx.quant.group_size
        dynamic = ctx.quant.activations == "dynamic"
        convert = not ctx.checkpoint_fp8  # an FP8 checkpoint decides itself which layers stay BF16
        int4_experts = ctx.quant.weights == "w4a8"
        sites = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            experts_dtype = (
                attr_tensor(gm, node.args[3]).dtype if node.target is hy3.moe_experts.default else None
            )
            if int4_experts and experts_dtype == FP8_DTYPE:
                raise ValueError(
                    "quant.weights=w4a8: this checkpoint's experts are FP8; the compiler makes int4 experts "
                    "from a BF16 checkpoint (or reads a W4A8 one)"
                )
            if convert and node.target is aten.linear.default and self._quantizable(node.args[1]):
                sites.append(self._quantize_linear(node))
            elif convert and int4_experts and experts_dtype not in (None, torch.uint8):
                sites.append(self._quantize_experts_int4(node))
            elif convert and experts_dtype not in (None, FP8_DTYPE, torch.uint8):
                sites.append(self._quantize_experts(node))
            elif dynamic and node.target is hy3.quant_fp8.default:
                sites.append(self._static_to_dynamic(node))
            elif dynamic and node.target is hy3.moe_experts.default and node.args[7] is not None:
                node.args = (*node.args[:7], None, None)
                sites.append(
                    Site(node=node.name, layer=layer_of(node), detail="expert activations: static -> dynamic")
                )
        return sites

    def _quantizable(self, weight: object) -> bool:
        return (
            isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target not in _HIGH_PRECISION
        )

    def _retype(self, weight: fx.Node, scale_shape: tuple[int, ...], scale_fqn: str) -> fx.Node:
        retyped = torch.empty(attr_tensor(self._gm, weight).shape, dtype=FP8_DTYPE, device="meta")
        set_attr(self._gm, str(weight.target), retyped)
        weight.meta["val"] = self._fake.from_tensor(retyped, static_shapes=True)
        scale = add_attr(
            self._gm, scale_fqn, torch.empty(scale_shape, dtype=torch.float32, device="meta"), self._fake
        )
        weight_plan(self._gm)[str(weight.target)] = {
            "kind": "fp8",
            "scale": scale_fqn,
            "granularity": self._granularity,
        }
        return scale

    def _quantize_linear(self, node: fx.Node) -> Site:
        graph = node.graph
        x, weight = node.args[0], node.args[1]
        out_features = weight.meta["val"].shape[0]
        module = str(weight.target).rsplit(".", 1)[0]
        scale_shape = (out_features,) if self._granularity == "channel" else (1,)
        scale = self._retype(weight, scale_shape, f"{module}.weight_scale")
        with graph.inserting_before(node):
            quant = graph.call_function(hy3.quant_fp8_per_token.default, (x,))
            xq = graph.call_function(operator.getitem, (quant, 0))
            xs = graph.call_function(operator.getitem, (quant, 1))
            mm = graph.call_function(hy3.scaled_mm.default, (xq, weight, xs, scale, node.meta["val"].dtype))
        for new in (quant, xq, xs, mm):
            copy_meta(node, new)
            infer_val(new, self._fake)
        node.replace_all_uses_with(mm)
        graph.erase_node(node)
        return Site(
            node=node.name,
            layer=layer_of(node),
            detail=f"{module}: fp8 per-{self._granularity} weights, per-token activations",
        )

    def _quantize_experts(self, node: fx.Node) -> Site:
        w13, w2 = node.args[3], node.args[4]
        module = str(w13.target).rsplit(".", 1)[0]
        scales = []
        for weight, leaf in ((w13, "w13_scale"), (w2, "w2_scale")):
            experts, rows, _ = weight.meta["val"].shape
            shape = (experts, rows) if self._granularity == "channel" else (experts, 1)
            scales.append(self._retype(weight, shape, f"{module}.{leaf}"))
        node.args = (*node.args[:5], scales[0], scales[1], None, None)
        return Site(
            node=node.name,
            layer=layer_of(node),
            detail=f"{module}: fp8 per-{self._granularity} expert weights",
        )

    def _quantize_experts_int4(self, node: fx.Node) -> Site:
        w13, w2 = node.args[3], node.args[4]
        module = str(w13.target).rsplit(".", 1)[0]
        shards = shard_plan(self._gm)
        scales = []
        for weight, leaf in ((w13, "w13_scale"), (w2, "w2_scale")):
            fqn, scale_fqn = str(weight.target), f"{module}.{leaf}"
            experts, rows, columns = weight.meta["val"].shape
            check_int4_groups(fqn, columns, self._group)  # this rank's columns: whole groups on each
            packed = torch.empty((experts, rows, columns // 2), dtype=torch.uint8, device="meta")
            set_attr(self._gm, fqn, packed)
            weight.meta["val"] = self._fake.from_tensor(packed, static_shapes=True)
            group_scales = torch.empty(
                (experts, rows, columns // self._group), dtype=torch.float32, device="meta"
            )
            scales.append(add_attr(self._gm, scale_fqn, group_scales, self._fake))
            spec = shards.get(fqn)
            whole = list(spec["global_shape"]) if spec else [experts, rows, columns]
            weight_plan(self._gm)[fqn] = {
                "kind": "w4a8",
                "scale": scale_fqn,
                "group": self._group,
                "shape": whole,
            }
            if spec is not None:  # the packed tensor and its scales are cut as the whole weight was
                spec["global_shape"] = [*whole[:2], whole[2] // 2]
                shards[scale_fqn] = {**spec, "global_shape": [*whole[:2], whole[2] // self._group]}
        node.args = (*node.args[:5], scales[0], scales[1], *node.args[7:])
        return Site(
            node=node.name,
            layer=layer_of(node),
            detail=f"{module}: int4 expert weights (groups of {self._group}), fp8 activations",
        )

    def _static_to_dynamic(self, node: fx.Node) -> Site:
        graph = node.graph
        with graph.inserting_before(node):
            quant = graph.call_function(hy3.quant_fp8_per_token.default, (node.args[0],))
            xq = graph.call_function(operator.getitem, (quant, 0))
            xs = graph.call_function(operator.getitem, (quant, 1))
        for new in (quant, xq, xs):
            copy_meta(node, new)
            infer_val(new, self._fake)
        for user in list(node.users):
            if user.target is hy3.scaled_mm.default:
                user.args = (xq, user.args[1], xs, *user.args[3:])
        node.replace_all_uses_with(xq)
        graph.erase_node(node)
        return Site(node=node.name, layer=layer_of(node), detail="activations: static -> dynamic per-token")
