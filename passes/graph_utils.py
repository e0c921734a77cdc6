"""Small FX helpers shared by passes, the manager and `hy3c inspect`."""

from __future__ import annotations

import contextlib
import operator
import re
from collections import Counter

import torch
from torch import fx

import hy3c.ops  # noqa: F401  (registers the hy3 ops named below)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def op_name(target: object) -> str:
    """'hy3.rms_norm', 'aten.linear', 'getitem', ... for a call_function target."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}"
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def op_histogram(gm: fx.GraphModule) -> dict[str, int]:
    counts = Counter(op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return dict(sorted(counts.items()))


def histogram_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = sorted(set(before) | set(after))
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def module_path(node: fx.Node) -> str:
    """The innermost nn.Module path a traced node came from ('' if unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def layer_of(node: fx.Node) -> int | None:
    """Index of the main decoder layer a node belongs to, or None (embedding, final norm, head)."""
    path = str(node.target) if node.op == "get_attr" else module_path(node)
    match = _LAYER.search(path)
    return int(match.group(1)) if match else None


def copy_meta(src: fx.Node, dst: fx.Node) -> None:
    """Give a node created by a pass the provenance (module stack) of the node it replaces."""
    for key in ("nn_module_stack", "stack_trace"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def fake_mode_of(gm: fx.GraphModule):
    """The FakeTensorMode of the traced graph's meta values (None if the graph has none)."""
    for node in gm.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def infer_val(node: fx.Node, fake_mode) -> None:
    """Set node.meta['val'] by running the target's fake implementation on its inputs' vals."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def set_attr(gm: fx.GraphModule, fqn: str, tensor: torch.Tensor) -> None:
    """Register (or replace) parameter `fqn` of gm; passes use meta tensors (weights are filled later)."""
    owner_path, _, leaf = fqn.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if hasattr(owner, leaf):
        delattr(owner, leaf)
    owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))


def add_attr(gm: fx.GraphModule, fqn: str, tensor: torch.Tensor, fake_mode) -> fx.Node:
    """`set_attr`, then a get_attr node for it among the other get_attr nodes at the top of the graph."""
    set_attr(gm, fqn, tensor)
    first = next(n for n in gm.graph.nodes if n.op not in ("placeholder",))
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(fqn)
    node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True) if fake_mode is not None else tensor
    return node


def attr_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The parameter/buffer a get_attr node reads, or None."""
    if node.op != "get_attr":
        return None
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


_FP8_QUANTS = (torch.ops.hy3.quant_fp8_per_token.default, torch.ops.hy3.quant_fp8.default)


def fp8_quant_reader(value: fx.Node, anchor: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """The FP8 quantization of `value` [T, K] for a GEMM (`quant_fp8_per_token(value)` or
    `quant_fp8(value, scale)`) that a fused op inserted before `anchor` can take over: (quant node,
    static scale or None). None if there is none, value is not 2-D, or its static scale is computed after
    `anchor` (the fused op could not read it)."""
    if getattr(value.meta.get("val"), "ndim", 0) != 2:
        return None
    quant = next((u for u in value.users if u.target in _FP8_QUANTS and u.args[0] is value), None)
    if quant is None:
        return None
    scale = quant.args[1] if quant.target is torch.ops.hy3.quant_fp8.default else None
    if isinstance(scale, fx.Node):
        order = {node: i for i, node in enumerate(value.graph.nodes)}
        if order[scale] > order[anchor]:
            return None
    return quant, scale
