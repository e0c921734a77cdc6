"""cleanup: drop no-op reshapes, views and casts (same shape, dtype and strides); dead code goes too.

Before:  %linear_12: f32[s66, 512] = aten.linear(%index_select, %lm_head.weight)
         %to: f32[s66, 512] = aten.to(%linear_12, f32)          (an fp32 model: .float() is a no-op)
         return (%to, %getitem_23)
After:   return (%linear_12, %getitem_23)
"""

from __future__ import annotations

import torch
from torch import fx

from hy3c.passes.base import CompileCtx, Pass, PassConfig, Site, Stage
from hy3c.passes.graph_utils import layer_of, op_name
from hy3c.passes.registry import register_pass

aten = torch.ops.aten
_SHAPE_OPS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_CAST_OPS = {aten.to.dtype, aten._to_copy.default}


def _same_tensor_type(a: object, b: object) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
    )


@register_pass
class Cleanup(Pass):
    name = "cleanup"
    stage = Stage.CLEANUP

    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        sites = []
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _SHAPE_OPS | _CAST_OPS and node.kwargs.keys() <= {"dtype"}:
                src = node.args[0]
                if isinstance(src, fx.Node) and _same_tensor_type(src.meta.get("val"), node.meta.get("val")):
                    node.replace_all_uses_with(src)
                    sites.append(
                        Site(node=node.name, layer=layer_of(node), detail=f"no-op {op_name(node.target)}")
                    )
                    gm.graph.erase_node(node)
        return sites
