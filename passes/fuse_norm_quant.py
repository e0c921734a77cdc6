"""fuse_norm_quant: the FP8 quantization of an add+RMSNorm output, folded into the norm.

With FP8 activations every GEMM input is quantized by its own op. Where that input is the output of a
residual add + RMSNorm (the attention's qkv projection; the shared expert's or dense MLP's gate-up),
the norm's kernel already holds the row: it writes the FP8 row and its scale in the same pass (one
launch and one read of the row fewer). Sites: every `hy3.add_rms_norm` whose normed output feeds a
`hy3.quant_fp8_per_token` or `hy3.quant_fp8` (2 per layer, minus the first layer's input norm, which
has no residual add).

Before:
    %add_rms_norm: (bf16[s0, 4096], bf16[s0, 4096]) = hy3.add_rms_norm(%x, %residual, %layers.3.input_layernorm.weight, 1e-05)
    %normed = getitem(%add_rms_norm, 0)          %total = getitem(%add_rms_norm, 1)
    %quant: (f8e4m3[s0, 4096], f32[s0, 1]) = hy3.quant_fp8_per_token(%normed)     (or hy3.quant_fp8(%normed, %input_scale))
    %scaled_mm = hy3.scaled_mm(getitem(%quant, 0), %layers.3.self_attn.qkv_proj.weight, getitem(%quant, 1), ...)
After:
    %add_rms_norm_quant: (bf16[s0, 4096], bf16[s0, 4096], f8e4m3[s0, 4096], f32[s0, 1]) =
        hy3.add_rms_norm_quant(%x, %residual, %layers.3.input_layernorm.weight, 1e-05, None)   (or %input_scale)
    %normed, %total, %q, %q_scale = getitem(%add_rms_norm_quant, 0 … 3)
    %scaled_mm = hy3.scaled_mm(%q, %layers.3.self_attn.qkv_proj.weight, %q_scale, ...)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import copy_meta, fake_mode_of, fp8_quant_reader, infer_val, layer_of
from hy3c.passes.registry import register_pass

hy3 = torch.ops.hy3


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


@register_pass
class FuseNormQuant(Pass):
    name = "fuse_norm_quant"
    stage = Stage.FUSE

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        graph, fake = gm.graph, fake_mode_of(gm)
        sites = []
        for norm in [n for n in graph.nodes if n.target is hy3.add_rms_norm.default]:
            outputs = _getitems(norm)
            reader = fp8_quant_reader(outputs[0], norm) if 0 in outputs else None
            if reader is None:
                continue
            quant, scale = reader
            static = scale is not None
            with graph.inserting_before(norm):
                fused = graph.call_function(hy3.add_rms_norm_quant.default, (*norm.args, scale))
            copy_meta(norm, fused)
            infer_val(fused, fake)
            with graph.inserting_after(fused):
                parts = [graph.call_function(operator.getitem, (fused, i)) for i in reversed(range(4))][::-1]
            for part in parts:
                copy_meta(norm, part)
                infer_val(part, fake)
            for index, old in outputs.items():
                old.replace_all_uses_with(parts[index])
                graph.erase_node(old)
            if static:
                quant.replace_all_uses_with(parts[2])
            else:
                for index, old in _getitems(quant).items():
                    old.replace_all_uses_with(parts[2 + index])
                    graph.erase_node(old)
            graph.erase_node(quant)
            graph.erase_node(norm)
            kind = "static" if static else "per-token"
            sites.append(Site(node=norm.name, layer=layer_of(norm), detail=f"{kind} FP8 of the normed rows"))
        return sites
