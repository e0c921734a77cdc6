"""fuse_act_quant: the FP8 quantization of a SwiGLU output, folded into the activation's kernel.

With FP8 activations the down projection of every dense MLP and shared expert reads an FP8 copy of
`silu_and_mul`'s output, made by its own op. When the activation's output has no other reader, one
`hy3.silu_and_mul_quant` writes the FP8 rows and their scales directly (one launch and one bf16 round
trip fewer). Sites: one per dense MLP or shared expert (one per layer for Hy3).

Before:
    %silu_and_mul: bf16[s0, 1536] = hy3.silu_and_mul(%scaled_mm_2)
    %quant: (f8e4m3[s0, 1536], f32[s0, 1]) = hy3.quant_fp8_per_token(%silu_and_mul)    (or hy3.quant_fp8(%silu_and_mul, %input_scale))
    %scaled_mm_3 = hy3.scaled_mm(getitem(%quant, 0), %layers.3.mlp.shared_mlp.down_proj.weight, getitem(%quant, 1), ...)
After:
    %silu_and_mul_quant: (f8e4m3[s0, 1536], f32[s0, 1]) = hy3.silu_and_mul_quant(%scaled_mm_2, None)   (or %input_scale)
    %scaled_mm_3 = hy3.scaled_mm(getitem(%silu_and_mul_quant, 0), ..., getitem(%silu_and_mul_quant, 1), ...)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, fp8_quant_reader, infer_val, layer_of
from hy3c.passes.registry import register_pass

hy3 = torch.ops.hy3


@register_pass
class FuseActQuant(Pass):
    name = "fuse_act_quant"
    stage = Stage.FUSE

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph, fake = gm.graph, fake_mode_of(gm)
        sites = []
        for act in [n for n in graph.nodes if n.target is hy3.silu_and_mul.default]:
            reader = fp8_quant_reader(act, act) if len(act.users) == 1 else None
            if reader is None:
                continue  # no FP8 reader, or the bf16 activation is read elsewhere too: keep it
            quant, scale = reader
            static = scale is not None
            with graph.inserting_before(act):
                fused = graph.call_function(hy3.silu_and_mul_quant.default, (act.args[0], scale))
            copy_meta(act, fused)
            infer_val(fused, fake)
            if static:
                with graph.inserting_after(fused):
                    q = graph.call_function(operator.getitem, (fused, 0))
                copy_meta(act, q)
                infer_val(q, fake)
                quant.replace_all_uses_with(q)
            else:
                quant.replace_all_uses_with(fused)
            graph.erase_node(quant)
            graph.erase_node(act)
            kind = "static" if static else "per-token"
            sites.append(Site(node=act.name, layer=layer_of(act), detail=f"{kind} FP8 of the SwiGLU rows"))
        return sites
