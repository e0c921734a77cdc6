"""fuse_moe_input_quant: FusedMoE reads the FP8 rows the norm already wrote for the shared expert.

With FP8 (or W4A8) experts and per-token activation scales, `fused_moe` quantizes its input rows itself (a
launch over [T, H] before the gate-up GEMM). In Hy3 that input is the post-attention RMSNorm's
output, which `fuse_norm_quant` already quantizes per token — the same rows, the same scheme — for the
shared expert's gate-up GEMM. The experts take those rows (x_q, x_q_scale) instead: one launch and one
read of [T, H] fewer per MoE layer, the same numbers (the norm and the experts quantize with the same
expressions on each provider: Triton's kernels on CUDA, the torch references on the CPU). It must run
after `fuse_norm_quant` (before it, nothing matches). Sites: every `hy3.fused_moe` with FP8 experts,
per-token activation scales and an input that is the normed output of a per-token
`hy3.add_rms_norm_quant` (one per MoE layer, with the `h20-w8a8c8` recipe's dynamic form; none with
static scales, whose calibrated scale for the experts differs from the shared expert's).

Sharded programs: with expert parallelism alone (tp = 1) the experts still read the norm's output —
`fused_moe` over `hy3.local_experts`' ids, without the shared output, which is added after the
all-reduce of the routed parts — and the pass applies as above (one site per MoE layer). With tp > 1
the norm is fused with the TP all-reduce (`hy3.all_reduce_add_rms_norm`, which has no quantized form),
and with attention data parallelism the experts read the all-gathered rows, not the norm's: no sites
(gathering the e4m3 rows and their scales instead of the bf16 rows would be the next step there).

Before:
    %add_rms_norm_quant: (bf16[s0, 4096], bf16[s0, 4096], f8e4m3[s0, 4096], f32[s0, 1]) =
        hy3.add_rms_norm_quant(%x, %residual, %layers.3.post_attention_layernorm.weight, 1e-05, None)
    %normed, %total, %q, %q_scale = getitem(%add_rms_norm_quant, 0 … 3)
    %fused_moe = hy3.fused_moe(%normed, %weights, %ids, %w13, %w2, %w13_scale, %w2_scale, None, None, %shared)
After:
    %fused_moe = hy3.fused_moe(%normed, %weights, %ids, %w13, %w2, %w13_scale, %w2_scale, None, None, %shared,
                               %q, %q_scale)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from hy3c.ops.quant import FP8_DTYPE
from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import layer_of
from hy3c.passes.registry import register_pass

hy3 = torch.ops.hy3


def _per_token_rows_of(value: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(e4m3 rows, scales) of `value` if it is the normed output of a per-token add_rms_norm_quant whose
    FP8 outputs are already read (its getitems 2 and 3 exist), else None."""
    if value.target is not operator.getitem or value.args[1] != 0:
        return None
    norm = value.args[0]
    if norm.target is not hy3.add_rms_norm_quant.default or norm.args[4] is not None:
        return None
    parts = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
    if 2 not in parts or 3 not in parts:
        return None
    return parts[2], parts[3]


def _fp8_experts_with_token_scales(moe: fx.Node) -> bool:
    """e4m3 or W4A8 (packed int4) expert weights, and no static activation scale (per-token FP8
    activations)."""
    w13, a13_scale = moe.args[3], moe.args[7]
    return getattr(w13.meta.get("val"), "dtype", None) in (FP8_DTYPE, torch.uint8) and a13_scale is None


@register_pass
class FuseMoeInputQuant(Pass):
    name = "fuse_moe_input_quant"
    stage = Stage.FUSE

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        sites = []
        order = {node: i for i, node in enumerate(gm.graph.nodes)}  # the pass moves no node
        for moe in [n for n in gm.graph.nodes if n.target is hy3.fused_moe.default]:
            if len(moe.args) > 10 or moe.kwargs or not _fp8_experts_with_token_scales(moe):
                continue
            rows = _per_token_rows_of(moe.args[0])
            if rows is None or max(order[r] for r in rows) > order[moe]:
                continue
            moe.args = (*moe.args, *rows)
            sites.append(
                Site(node=moe.name, layer=layer_of(moe), detail=f"input rows from {rows[0].args[0].name}")
            )
        return sites
