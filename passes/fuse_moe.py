"""fuse_moe: router → top-k → experts → + shared expert, as `router_gemm` + `topk_routing` + `fused_moe`.

One site per MoE layer. The fp32 router weight is kept (small-batch GEMM) and split at packaging into
two bf16 parts for the dual-BF16 router GEMM (`gm.meta["hy3c.weight_plan"]`, kind `router_split`).

Before:
    %router: (f32[s0, 192], i32[s0, 192]) = hy3.router(%x, %layers.3.mlp.router.weight, %layers.3.mlp.expert_bias, 8, 2.826)
    %moe_experts: bf16[s0, 4096] = hy3.moe_experts(%x, getitem(%router, 0), getitem(%router, 1), %layers.3.mlp.experts.w13, ...)
    %linear_7: bf16[s0, 4096] = aten.linear(%silu_and_mul, %layers.3.mlp.shared_mlp.down_proj.weight)   (shared expert)
    %add_3: bf16[s0, 4096] = aten.add(%moe_experts, %linear_7)
After:
    %router_gemm: f32[s0, 192] = hy3.router_gemm(%x, %layers.3.mlp.router.weight, %...router.weight_hi, %...router.weight_lo)
    %topk_routing: (f32[s0, 8], i32[s0, 8]) = hy3.topk_routing(%router_gemm, %layers.3.mlp.expert_bias, 8, 2.826)
    %fused_moe: bf16[s0, 4096] = hy3.fused_moe(%x, getitem(%topk_routing, 0), getitem(%topk_routing, 1), %...w13, ..., %linear_7)
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import add_attr, attr_tensor, copy_meta, fake_mode_of, infer_val, layer_of
from hy3c.passes.patterns import PatternRewriter
from hy3c.passes.registry import register_pass
from hy3c.passes.weight_plan import weight_plan

aten, hy3 = torch.ops.aten, torch.ops.hy3

_ROUTER = CallFunction(
    hy3.router.default,
    KeywordArg("x"),
    KeywordArg("router_w"),
    KeywordArg("bias"),
    KeywordArg("top_k"),
    KeywordArg("scale"),
    _users=2,
)
ROUTED_PLUS_SHARED = CallFunction(
    aten.add.Tensor,
    CallFunction(
        hy3.moe_experts.default,
        KeywordArg("x"),
        CallFunction(operator.getitem, _ROUTER, 0),
        CallFunction(operator.getitem, _ROUTER, 1),
        KeywordArg("w13"),
        KeywordArg("w2"),
        KeywordArg("w13_scale"),
        KeywordArg("w2_scale"),
        KeywordArg("a13_scale"),
        KeywordArg("a2_scale"),
    ),
    KeywordArg("shared"),
)


@register_pass
class FuseMoe(Pass):
    name = "fuse_moe"
    stage = Stage.FUSE

    def rewriter(self, ctx: CompileCtx) -> PatternRewriter:
        c = ctx.model
        rewriter = PatternRewriter(self.name)
        rewriter.register(
            ROUTED_PLUS_SHARED,
            {"top_k": c.num_experts_per_tok, "scale": c.router_scaling_factor},
            self._rewrite,
            self._check,
        )
        return rewriter

    @staticmethod
    def _check(match: Match) -> str | None:
        router_w = match.kwargs["router_w"]
        if not (isinstance(router_w, fx.Node) and router_w.op == "get_attr"):
            return "the router weight is not a parameter"
        shared = match.kwargs["shared"].meta.get("val")
        x = match.kwargs["x"].meta.get("val")
        if shared is None or x is None or shared.shape != x.shape or shared.dtype != x.dtype:
            return "the shared expert's output does not match the MoE input's shape and dtype"
        return None

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        self._gm, self._fake = gm, fake_mode_of(gm)
        return self.rewriter(ctx).apply(gm)

    def _rewrite(self, match: Match, graph: fx.Graph) -> Site:
        add = match.output_node()
        experts = add.args[0]
        router = experts.args[1].args[0]
        x, router_w, bias, top_k, scale = router.args
        shape = attr_tensor(self._gm, router_w).shape
        module = str(router_w.target).rsplit(".", 1)[0]
        parts = [
            add_attr(
                self._gm,
                f"{module}.weight_{half}",
                torch.empty(shape, dtype=torch.bfloat16, device="meta"),
                self._fake,
            )
            for half in ("hi", "lo")
        ]
        weight_plan(self._gm)[f"{module}.weight_hi"] = {
            "kind": "router_split",
            "source": str(router_w.target),
            "lo": f"{module}.weight_lo",
        }
        with graph.inserting_before(router):
            logits = graph.call_function(hy3.router_gemm.default, (x, router_w, *parts))
            routing = graph.call_function(hy3.topk_routing.default, (logits, bias, top_k, scale))
            weights = graph.call_function(operator.getitem, (routing, 0))
            ids = graph.call_function(operator.getitem, (routing, 1))
        with graph.inserting_before(add):
            fused = graph.call_function(
                hy3.fused_moe.default, (x, weights, ids, *experts.args[3:], add.args[1])
            )
        for new in (logits, routing, weights, ids, fused):
            copy_meta(router if new is not fused else experts, new)
            infer_val(new, self._fake)
        add.replace_all_uses_with(fused)
        for dead in (add, experts, *experts.args[1:3], router):
            graph.erase_node(dead)
        return Site(
            node=experts.name,
            layer=layer_of(experts),
            detail=f"{module}: router_gemm + topk_routing + fused_moe",
        )
