"""fuse_qknorm_rope_kv: split qkv → per-head QK RMSNorm → RoPE → KV store, as one
`hy3.qknorm_rope_quant_kvstore` (L2). One site per decoder layer.

Before:
    %split_with_sizes: (bf16[s0, 8192], bf16[s0, 1024], bf16[s0, 1024]) = aten.split_with_sizes(%linear, [8192, 1024, 1024], -1)
    %reshape = aten.reshape(getitem(%split_with_sizes, 0), [%s0, 64, 128])      (same for k [.., 8, 128], v)
    %qk_norm = hy3.qk_norm(%reshape, %layers.3.self_attn.q_norm.weight, 1e-05)    (same for k)
    %rope = hy3.rope(%qk_norm, %positions, 11158840.0)                            (same for k)
    hy3.kv_store(%rope_1, %reshape_2, %kv_cache, %kv_scales, 3, %slot_mapping)
    %attention = hy3.attention(%rope, %kv_cache, ...)
After:
    %qknorm_rope_quant_kvstore: bf16[s0, 64, 128] = hy3.qknorm_rope_quant_kvstore(%linear, %positions,
        %layers.3.self_attn.q_norm.weight, %layers.3.self_attn.k_norm.weight, 1e-05, 11158840.0, %kv_cache,
        %kv_scales, 3, %slot_mapping, 64, 8, False)        (True: config `hadamard`, q and k rotated)
    %attention = hy3.attention(%qknorm_rope_quant_kvstore, %kv_cache, ...)
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.pattern_matcher import CallFunction, KeywordArg, Match

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, infer_val, layer_of
from hy3c.passes.patterns import PatternRewriter
from hy3c.passes.registry import register_pass

aten, hy3 = torch.ops.aten, torch.ops.hy3

_SPLIT = CallFunction(
    aten.split_with_sizes.default, KeywordArg("qkv"), KeywordArg("sizes"), KeywordArg("dim"), _users=3
)


def _head_view(index: int, shape: str) -> CallFunction:
    return CallFunction(
        aten.reshape.default, CallFunction(operator.getitem, _SPLIT, index), KeywordArg(shape)
    )


KV_STORE_OF_NORMED_ROPED_K = CallFunction(
    hy3.kv_store.default,
    CallFunction(
        hy3.rope.default,
        CallFunction(
            hy3.qk_norm.default, _head_view(1, "k_shape"), KeywordArg("k_weight"), KeywordArg("eps")
        ),
        KeywordArg("positions"),
        KeywordArg("theta"),
    ),
    _head_view(2, "v_shape"),
    KeywordArg("kv_cache"),
    KeywordArg("kv_scales"),
    KeywordArg("layer"),
    KeywordArg("slot_mapping"),
)


def _q_chain(split: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The (reshape, qk_norm, rope) nodes of the q head view of `split`, if it has that exact shape."""
    getitem = next((u for u in split.users if u.target is operator.getitem and u.args[1] == 0), None)
    if getitem is None or len(getitem.users) != 1:
        return None
    (reshape,) = getitem.users
    if reshape.target is not aten.reshape.default or len(reshape.users) != 1:
        return None
    (norm,) = reshape.users
    if norm.target is not hy3.qk_norm.default or len(norm.users) != 1:
        return None
    (rope,) = norm.users
    return (reshape, norm, rope) if rope.target is hy3.rope.default else None


class FuseQkNormRopeKvConfig(PassConfig):
    # rotate q and k by the same Hadamard matrix after RoPE: scores are unchanged and k's outlier channels
    # are spread before FP8 quantization (worth it for an FP8 KV cache; off by default)
    hadamard: bool = False


@register_pass
class FuseQkNormRopeKv(Pass):
    name = "fuse_qknorm_rope_kv"
    stage = Stage.FUSE
    Config = FuseQkNormRopeKvConfig

    def rewriter(self, ctx: CompileCtx) -> PatternRewriter:
        c = ctx.model
        heads, kv_heads = ctx.heads_per_rank, ctx.kv_heads_per_rank  # one rank's (shard_tp ran first)
        q_size, kv_size = heads * c.head_dim, kv_heads * c.head_dim
        self._heads = (heads, kv_heads)

        def check(match: Match) -> str | None:
            kw = match.kwargs
            if kw["dim"] not in (-1, 1):
                return f"split along dim {kw['dim']}"
            if list(kw["k_shape"][1:]) != [kv_heads, c.head_dim] or list(kw["v_shape"][1:]) != [
                kv_heads,
                c.head_dim,
            ]:
                return "k/v head views do not have the model's [kv_heads, head_dim]"
            split = match.output_node().args[0].args[0].args[0].args[0].args[0]
            chain = _q_chain(split)
            if chain is None:
                return "the q head view is not reshape → qk_norm → rope"
            reshape, norm, rope = chain
            if list(reshape.args[1][1:]) != [heads, c.head_dim]:
                return "the q head view does not have the model's [heads, head_dim]"
            if (
                norm.args[2] != c.rms_norm_eps
                or rope.args[1] is not kw["positions"]
                or rope.args[2] != c.rope_theta
            ):
                return "q norm/rope use other eps, positions or theta than k"
            return None

        rewriter = PatternRewriter(self.name)
        rewriter.register(
            KV_STORE_OF_NORMED_ROPED_K,
            {"sizes": [q_size, kv_size, kv_size], "eps": c.rms_norm_eps, "theta": c.rope_theta},
            self._rewrite,
            check,
        )
        return rewriter

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: FuseQkNormRopeKvConfig) -> list[Site]:
        self._fake, self._hadamard = fake_mode_of(gm), config.hadamard
        return self.rewriter(ctx).apply(gm)

    def _rewrite(self, match: Match, graph: fx.Graph) -> Site:
        store = match.output_node()
        kw = match.kwargs
        k_rope = store.args[0]
        split = k_rope.args[0].args[0].args[0].args[0]
        _, q_norm, q_rope = _q_chain(split)
        args = (
            kw["qkv"],
            kw["positions"],
            q_norm.args[1],
            k_rope.args[0].args[1],
            kw["eps"],
            kw["theta"],
            kw["kv_cache"],
            kw["kv_scales"],
            kw["layer"],
            kw["slot_mapping"],
            *self._heads,
            self._hadamard,
        )
        with graph.inserting_before(store):
            fused = graph.call_function(hy3.qknorm_rope_quant_kvstore.default, args)
        copy_meta(store, fused)
        infer_val(fused, self._fake)
        q_rope.replace_all_uses_with(fused)
        graph.erase_node(store)
        return Site(node=store.name, layer=layer_of(store), detail=f"layer {kw['layer']}")
