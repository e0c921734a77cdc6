"""fuse_moe: router → top-k → experts → + shared expert, as `router_gemm` + `topk_routing` + `fused_moe`.

One site per MoE layer, with or without expert parallelism. The fp32 router weight is kept (small-batch
GEMM) and split at packaging into two bf16 parts for the dual-BF16 router GEMM
(`gm.meta["hy3c.weight_plan"]`, kind `router_split`).

Before:
    %router: (f32[s0, 192], i32[s0, 192]) = hy3.router(%x, %layers.3.mlp.router.weight, %layers.3.mlp.expert_bias, 8, 2.826)
    %moe_experts: bf16[s0, 4096] = hy3.moe_experts(%x, getitem(%router, 0), getitem(%router, 1), %layers.3.mlp.experts.w13, ...)
    %linear_7: bf16[s0, 4096] = aten.linear(%silu_and_mul, %layers.3.mlp.shared_mlp.down_proj.weight)   (shared expert)
    %add_3: bf16[s0, 4096] = aten.add(%moe_experts, %linear_7)
After:
    %router_gemm: f32[s0, 192] = hy3.router_gemm(%x, %layers.3.mlp.router.weight, %...router.weight_hi, %...router.weight_lo)
    %topk_routing: (f32[s0, 8], i32[s0, 8]) = hy3.topk_routing(%router_gemm, %layers.3.mlp.expert_bias, 8, 2.826)
    %fused_moe: bf16[s0, 4096] = hy3.fused_moe(%x, getitem(%topk_routing, 0), getitem(%topk_routing, 1), %...w13, ..., %linear_7)

Expert parallelism (`shard_ep`): `hy3.local_experts` sits between the router and the experts (this
rank's expert ids, −1 for the others', which every `fused_moe` provider skips) and stays between
`topk_routing` and `fused_moe`. Where the routed output goes straight into the add (tp > 1: the TP
all-reduce after the add sums the ranks' parts) the shared expert is folded in as above. Where a
collective combines the ranks' routed parts before the add (tp = 1: `hy3.all_reduce`; attention data
parallelism: `hy3.reduce_scatter` of the gathered tokens' parts) the shared expert must be added once,
after it: `fused_moe` takes no shared output and the collective and the add stay.

Before (ep = 2, tp = 1, tiny config: 8 experts, 4 per rank):
    %router = hy3.router(%x, %layers.1.mlp.router.weight, %layers.1.mlp.expert_bias, 2, 2.826)
    %local_experts = hy3.local_experts(getitem(%router, 0), getitem(%router, 1), 4, 1, 2)
    %moe_experts = hy3.moe_experts(%x, getitem(%local_experts, 0), getitem(%local_experts, 1), %w13, %w2, ...)
    %all_reduce = hy3.all_reduce(%moe_experts, 1, 2)
    %add_3 = aten.add(%all_reduce, %linear_7)
After:
    %router_gemm = hy3.router_gemm(%x, %layers.1.mlp.router.weight, %...router.weight_hi, %...router.weight_lo)
    %topk_routing = hy3.topk_routing(%router_gemm, %layers.1.mlp.expert_bias, 2, 2.826)
    %local_experts = hy3.local_experts(getitem(%topk_routing, 0), getitem(%topk_routing, 1), 4, 1, 2)
    %fused_moe = hy3.fused_moe(%x, getitem(%local_experts, 0), getitem(%local_experts, 1), %w13, %w2, ..., None)
    %all_reduce = hy3.all_reduce(%fused_moe, 1, 2)
    %add_3 = aten.add(%all_reduce, %linear_7)
(tp = 2 + ep = 2: the same up to `local_experts`, then `fused_moe(..., %linear_7)` in place of the add.)
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match, PatternExpr

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
_LOCAL = CallFunction(  # expert parallelism: the router's top-k as this rank's experts
    hy3.local_experts.default,
    CallFunction(operator.getitem, _ROUTER, 0),
    CallFunction(operator.getitem, _ROUTER, 1),
    KeywordArg("num_local"),
    KeywordArg("ep_group"),
    KeywordArg("ep_size"),
    _users=2,
)


def _experts(routing: PatternExpr) -> PatternExpr:
    """hy3.moe_experts over the (weights, ids) outputs of `routing` (the router, or local_experts)."""
    return CallFunction(
        hy3.moe_experts.default,
        KeywordArg("x"),
        CallFunction(operator.getitem, routing, 0),
        CallFunction(operator.getitem, routing, 1),
        KeywordArg("w13"),
        KeywordArg("w2"),
        KeywordArg("w13_scale"),
        KeywordArg("w2_scale"),
        KeywordArg("a13_scale"),
        KeywordArg("a2_scale"),
    )


def _plus_shared(routed: PatternExpr) -> PatternExpr:
    return CallFunction(aten.add.Tensor, routed, KeywordArg("shared"))


ROUTED_PLUS_SHARED = _plus_shared(_experts(_ROUTER))
LOCAL_ROUTED_PLUS_SHARED = _plus_shared(_experts(_LOCAL))  # ep with tp > 1: the TP all-reduce follows
LOCAL_ROUTED_COMBINED_PLUS_SHARED = (  # ep with tp = 1, and ep with attention data parallelism
    _plus_shared(
        CallFunction(hy3.all_reduce.default, _experts(_LOCAL), KeywordArg("group"), KeywordArg("size"))
    ),
    _plus_shared(
        CallFunction(
            hy3.reduce_scatter.default,
            _experts(_LOCAL),
            KeywordArg("dim"),
            KeywordArg("group"),
            KeywordArg("size"),
        )
    ),
)


@register_pass
class FuseMoe(Pass):
    name = "fuse_moe"
    stage = Stage.FUSE

    def rewriter(self, ctx: CompileCtx) -> PatternRewriter:
        c = ctx.model
        literals = {"top_k": c.num_experts_per_tok, "scale": c.router_scaling_factor}
        rewriter = PatternRewriter(self.name)
        for pattern in (ROUTED_PLUS_SHARED, LOCAL_ROUTED_PLUS_SHARED, *LOCAL_ROUTED_COMBINED_PLUS_SHARED):
            rewriter.register(pattern, literals, self._rewrite, self._check)
        return rewriter

    @staticmethod
    def _check(match: Match) -> str | None:
        router_w = match.kwargs["router_w"]
        if not (isinstance(router_w, fx.Node) and router_w.op == "get_attr"):
            return "the router weight is not a parameter"
        if _experts_of(match.output_node()) is not match.output_node().args[0]:
            return None  # a collective between: the shared output is not folded, only added as before
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
        experts = _experts_of(add)
        folds_shared = experts is add.args[0]
        routed_weights, routed_ids = experts.args[1:3]
        local = routed_weights.args[0] if routed_weights.args[0].target is hy3.local_experts.default else None
        router_outputs = tuple(local.args[:2]) if local is not None else (routed_weights, routed_ids)
        router = router_outputs[0].args[0]
        x, router_w, bias, top_k, scale = router.args
        module = str(router_w.target).rsplit(".", 1)[0]
        parts = self._router_split(router_w, module)
        with graph.inserting_before(router):
            logits = graph.call_function(hy3.router_gemm.default, (x, router_w, *parts))
            routing = graph.call_function(hy3.topk_routing.default, (logits, bias, top_k, scale))
            weights = graph.call_function(operator.getitem, (routing, 0))
            ids = graph.call_function(operator.getitem, (routing, 1))
        if local is not None:  # local_experts stays: now over topk_routing's outputs
            local.update_arg(0, weights)
            local.update_arg(1, ids)
        else:
            routed_weights, routed_ids = weights, ids
        shared = add.args[1] if folds_shared else None
        with graph.inserting_before(add if folds_shared else experts):
            fused = graph.call_function(
                hy3.fused_moe.default,
                (experts.args[0], routed_weights, routed_ids, *experts.args[3:], shared),
            )
        for new in (logits, routing, weights, ids, fused):
            copy_meta(router if new is not fused else experts, new)
            infer_val(new, self._fake)
        (add if folds_shared else experts).replace_all_uses_with(fused)
        dead = (add, experts) if folds_shared else (experts,)
        for node in (*dead, *router_outputs, router):
            graph.erase_node(node)
        steps = (
            ["router_gemm", "topk_routing"] + (["local_experts"] if local is not None else []) + ["fused_moe"]
        )
        if not folds_shared:  # the collective that combines the ranks' parts, then the shared expert's add
            steps.append(f"{add.args[0].target.overloadpacket.__name__} + add")
        return Site(node=experts.name, layer=layer_of(experts), detail=f"{module}: {' + '.join(steps)}")

    def _router_split(self, router_w: fx.Node, module: str) -> list[fx.Node]:
        """The two bf16 parts of the fp32 router weight, as new parameters the packager fills."""
        shape = attr_tensor(self._gm, router_w).shape
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
        return parts


def _experts_of(add: fx.Node) -> fx.Node:
    """The hy3.moe_experts node of a matched add: its first input, or that input's (the collective's)."""
    routed = add.args[0]
    return routed if routed.target is hy3.moe_experts.default else routed.args[0]
