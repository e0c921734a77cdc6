"""The program file: an FX graph as JSON (no pickle, no code execution on load).

    data = graph_to_json(gm)                         # {"format": 1, "nodes": [...], "params": {...}}
    gm = graph_from_json(data, parameters)           # parameters: fqn → tensor

Each node is {"name", "op", "target", "args", "kwargs"}. Targets are op names resolved against an
allow-list on load: `aten.*`, `hy3.*` and kernel-provider namespaces (`hy3_*`), plus `getitem`.
Arguments encode nodes as {"node": name}, tuples as {"tuple": [...]}, dtypes as {"dtype": "bfloat16"},
non-finite floats as {"float": "inf"}; everything else is a JSON scalar or list. The `params` table
records each parameter's shape and dtype so the weights can be checked against the graph.
"""

from __future__ import annotations

import keyword
import math
import operator
import re
from typing import Any

import torch
from torch import fx

import hy3c.kernels  # noqa: F401  (registers the kernel providers' ops a program may call)

FORMAT = 1
_ALLOWED_NAMESPACES = ("aten", "hy3")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARAMETER_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


class ProgramError(ValueError):
    """A program file that cannot be loaded (unknown op, bad structure); the message names the node."""


def _target_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    raise ProgramError(f"cannot serialize call target {target!r}")


def _resolve_target(name: str, node: str) -> object:
    if name == "getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3 or not (parts[0] in _ALLOWED_NAMESPACES or parts[0].startswith("hy3_")):
        raise ProgramError(f"node {node}: target '{name}' is not an allowed op")
    namespace, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        raise ProgramError(
            f"node {node}: op '{name}' is not registered (is its kernel module importable?)"
        ) from None


def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.layout, torch.memory_format, torch.device)):
        raise ProgramError(
            f"cannot serialize argument {value!r} (device- or layout-specific graphs are not portable)"
        )
    raise ProgramError(f"cannot serialize argument {value!r} of type {type(value).__name__}")


def _check_name(value: object, what: str, node: str, pattern: re.Pattern = _IDENTIFIER) -> str:
    """Names end up in the Python code FX generates for the graph: only plain identifiers pass."""
    if not isinstance(value, str) or not pattern.fullmatch(value) or keyword.iskeyword(value):
        raise ProgramError(f"node {node}: {what} {value!r} is not a plain identifier")
    return value


def _decode(value: Any, env: dict[str, fx.Node], node: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, env, node) for v in value]
    if isinstance(value, dict):
        if set(value) == {"node"}:
            if value["node"] not in env:
                raise ProgramError(f"node {node}: refers to undefined node {value['node']}")
            return env[value["node"]]
        if set(value) == {"tuple"}:
            return tuple(_decode(v, env, node) for v in value["tuple"])
        if set(value) == {"dtype"}:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ProgramError(f"node {node}: unknown dtype {value['dtype']!r}")
            return dtype
        if set(value) == {"float"}:
            return float(value["float"])
        raise ProgramError(f"node {node}: unknown argument encoding {sorted(value)}")
    return value


def graph_to_json(gm: fx.GraphModule) -> dict[str, Any]:
    nodes = []
    params = {}
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op in ("placeholder", "get_attr"):
            entry["target"] = str(node.target)
        elif node.op == "call_function":
            entry["target"] = _target_name(node.target)
        elif node.op != "output":
            raise ProgramError(f"node {node.name}: unsupported op kind {node.op}")
        entry["args"] = _encode(node.args)
        entry["kwargs"] = {k: _encode(v) for k, v in node.kwargs.items()}
        nodes.append(entry)
        if node.op == "get_attr":
            tensor = gm.get_parameter(str(node.target))
            params[str(node.target)] = {
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
            }
    return {"format": FORMAT, "nodes": nodes, "params": params}


def graph_from_json(data: dict[str, Any], parameters: dict[str, torch.Tensor]) -> fx.GraphModule:
    """Rebuild the GraphModule; `parameters` must hold every get_attr target with the recorded shape/dtype."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProgramError(
            f"program format {data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT}"
        )
    for fqn, spec in data["params"].items():
        _check_name(fqn, "parameter name", fqn, _PARAMETER_PATH)
        tensor = parameters.get(fqn)
        if tensor is None:
            raise ProgramError(f"parameter {fqn} is missing from the weights")
        if list(tensor.shape) != spec["shape"] or str(tensor.dtype).removeprefix("torch.") != spec["dtype"]:
            raise ProgramError(
                f"parameter {fqn}: weights hold {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}, "
                f"the program expects {spec['dtype']}{spec['shape']}"
            )
    root = torch.nn.Module()
    for fqn in data["params"]:
        *path, leaf = fqn.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        try:
            module.register_parameter(leaf, torch.nn.Parameter(parameters[fqn], requires_grad=False))
        except (KeyError, AttributeError) as exc:  # e.g. a name taken by a Module attribute ("training")
            raise ProgramError(f"parameter {fqn}: {exc}") from None
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for entry in data["nodes"]:
        if not isinstance(entry, dict):
            raise ProgramError(f"node entries must be objects, found {type(entry).__name__}")
        name, op = _check_name(entry.get("name"), "name", "?"), entry.get("op")
        args = _decode(entry.get("args", []), env, name)
        kwargs = {
            _check_name(k, "keyword", name): _decode(v, env, name) for k, v in entry.get("kwargs", {}).items()
        }
        if op == "placeholder":
            target = _check_name(entry.get("target"), "input name", name)
        elif op == "get_attr":
            target = _check_name(entry.get("target"), "parameter", name, _PARAMETER_PATH)
            if target not in data["params"]:
                raise ProgramError(f"node {name}: parameter {target} is not in the program's parameter table")
        elif op == "call_function":
            target = _resolve_target(entry["target"], name)
        elif op == "output":
            target = "output"
        else:
            raise ProgramError(f"node {name}: unsupported op kind {op!r}")
        env[name] = graph.create_node(op, target, tuple(args), kwargs, name=name)
    gm = fx.GraphModule(root, graph)
    gm.graph.lint()
    return gm
