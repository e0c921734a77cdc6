"""Readable graph dumps (`graphs/NN_<pass>.txt`, `hy3c inspect ART graph`).

One line per node, in the form the pass docstrings use:

    %add_rms_norm_1: (bf16[s0, 64], bf16[s0, 64]) = hy3.add_rms_norm(%linear_1, %embedding, %layers.0.post_attention_layernorm.weight, 1e-05)  # layers.0
"""

from __future__ import annotations

import torch
from torch import fx

from hy3c.passes.graph_utils import layer_of, op_name

_SHORT = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "f8e4m3",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


def _describe_val(val: object) -> str:
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(d) for d in val.shape)
        return f"{_SHORT.get(val.dtype, str(val.dtype))}[{dims}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_describe_val(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.target}" if a.op == "get_attr" else f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return _SHORT.get(a, str(a))
    return repr(a)


def format_node(node: fx.Node) -> str:
    val = _describe_val(node.meta.get("val"))
    typed = f"%{node.name}: {val}" if val else f"%{node.name}"
    if node.op == "placeholder":
        return f"{typed} = input"
    if node.op == "get_attr":
        return f"{typed} = param {node.target}"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    layer = layer_of(node)
    where = f"  # layers.{layer}" if layer is not None else ""
    return f"{typed} = {op_name(node.target)}({', '.join(args)}){where}"


def format_graph(gm: fx.GraphModule, layer: int | None = None) -> str:
    """The dump of every node (get_attr nodes inline as %name), optionally only those of one layer."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if layer is not None and layer_of(node) != layer:
            continue
        lines.append(format_node(node))
    return "\n".join(lines) + "\n"
