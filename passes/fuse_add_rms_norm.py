"""fuse_add_rms_norm: residual add + RMSNorm → one `hy3.add_rms_norm` (L2).

Matches 2 sites per decoder layer minus the first layer's input norm, plus the final norm (= 2L for L
layers): every `rms_norm(x + y)` whose sum also feeds the residual stream.

Before:
    %add: bf16[s0, 4096] = aten.add(%embedding, %linear_1)                       # layers.0
    %rms_norm_1: bf16[s0, 4096] = hy3.rms_norm(%add, %layers.0.post_attention_layernorm.weight, 1e-05)
    %linear_2 = aten.linear(%rms_norm_1, ...)          ...          %add_1 = aten.add(%add, %linear_3)
After:
    %add_rms_norm: (bf16[s0, 4096], bf16[s0, 4096]) = hy3.add_rms_norm(%embedding, %linear_1, %layers.0.post_attention_layernorm.weight, 1e-05)
    %normed = getitem(%add_rms_norm, 0)        %residual = getitem(%add_rms_norm, 1)
    %linear_2 = aten.linear(%normed, ...)      ...      %add_1 = aten.add(%residual, %linear_3)
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg, Match

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of
from hy3c.passes.patterns import PatternRewriter
from hy3c.passes.registry import register_pass

aten, hy3 = torch.ops.aten, torch.ops.hy3

ADD_THEN_NORM = CallFunction(
    hy3.rms_norm.default,
    CallFunction(aten.add.Tensor, KeywordArg("x"), KeywordArg("residual"), _users=MULTIPLE),
    KeywordArg("weight"),
    KeywordArg("eps"),
)


def _same_shape_and_dtype(match: Match) -> str | None:
    x, residual = match.kwargs["x"], match.kwargs["residual"]
    if not (isinstance(x, fx.Node) and isinstance(residual, fx.Node)):
        return "an operand of the add is not a tensor"
    xv, rv = x.meta.get("val"), residual.meta.get("val")
    if xv is None or rv is None or xv.shape != rv.shape or xv.dtype != rv.dtype:
        return "the add broadcasts or mixes dtypes"
    return None


@register_pass
class FuseAddRmsNorm(Pass):
    name = "fuse_add_rms_norm"
    stage = Stage.FUSE

    def rewriter(self, ctx: CompileCtx) -> PatternRewriter:
        rewriter = PatternRewriter(self.name)
        rewriter.register(
            ADD_THEN_NORM, {"eps": ctx.model.rms_norm_eps}, self._rewrite, _same_shape_and_dtype
        )
        return rewriter

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        self._fake_mode = fake_mode_of(gm)
        return self.rewriter(ctx).apply(gm)

    def _rewrite(self, match: Match, graph: fx.Graph) -> Site:
        # read operands from the live graph: an earlier rewrite may have replaced a matched input node
        norm = match.output_node()
        add = norm.args[0]
        x, residual = add.args
        with graph.inserting_after(add):
            fused = graph.call_function(hy3.add_rms_norm.default, (x, residual, *norm.args[1:]))
        with graph.inserting_after(fused):
            normed = graph.call_function(operator.getitem, (fused, 0))
        with graph.inserting_after(normed):
            total = graph.call_function(operator.getitem, (fused, 1))
        for new in (fused, normed, total):
            copy_meta(norm, new)
            infer_val(new, self._fake_mode)
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        graph.erase_node(norm)
        graph.erase_node(add)
        return Site(node=norm.name, layer=layer_of(norm), detail=f"{add.name} + {norm.name}")
