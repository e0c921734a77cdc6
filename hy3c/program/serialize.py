"""The program file: an FX graph as JSON (no pickle, no code execution on load).

    data = graph_to_json(gm)                          # {"format": 1, "nodes": [...], "params": {...}}
    program = read_program(data)                      # rebuilt, every target and argument checked
    program.check_shapes(config, dtype, kv_dtype)     # shapes and the hy3 ops' contracts, on meta tensors
    gm = program.bind(parameters)                     # parameters: fqn → tensor of the recorded shape

Each node is {"name", "op", "target", "args", "kwargs"}. A call's target is an op name looked up in
`hy3c.program.allowlist` (the ops the compiler emits; the writer refuses any other), plus `getitem`.
Arguments encode nodes as {"node": name}, tuples as {"tuple": [...]}, dtypes as {"dtype": "bfloat16"},
non-finite floats as {"float": "inf"}; everything else is a JSON scalar or list. The `params` table
records each parameter's shape and dtype so the weights can be checked against the graph.

A program file is untrusted: names must be plain identifiers (they end up in the Python code FX
generates), the inputs are the step's eight inputs in order, arguments nest at most `MAX_NESTING`
containers deep, parameter shapes are bounded (`MAX_DIMS`, `MAX_NUMEL`) before any tensor is made of
them, each call's arguments must fit its op's schema (`hy3c.program.check`), and any other
structure is a `ProgramError` naming the node. Reading, checking and binding turn any exception they
did not foresee into a `ProgramError` naming the node or parameter at hand (`program_check.unexpected`),
so a crafted program cannot surface as a bare RecursionError or RuntimeError.
"""

from __future__ import annotations

import keyword
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import hy3c.kernels  # noqa: F401  (registers the hy3 ops and the kernel providers' ops a program may call)
from hy3c.config import Hy3Config
from hy3c.program.allowlist import (
    DTYPES,
    PARAMETER_DTYPES,
    OpNotRegisteredError,
    is_allowed,
    op_name,
    resolve_op,
)
from hy3c.program.check import (
    MTP_INPUTS,
    STEP_INPUTS,
    TENSOR,
    Kind,
    ProgramError,
    check_call,
    check_shapes,
    shown,
    unexpected,
)

FORMAT = 1
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PARAMETER_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_NODE_KEYS = {"name", "op", "target", "args", "kwargs"}
_NON_FINITE = {"inf", "-inf", "nan"}
MAX_NESTING = 4  # containers in a node's arguments: the compiler writes 2 (the args tuple, a shape list)
MAX_DIMS = 8  # a parameter's dims (the compiler writes at most 3: stacked expert weights)
MAX_NUMEL = 2**40  # a parameter's elements (the full model's largest, the stacked experts: 2.4e9)

__all__ = ["FORMAT", "MTP_INPUTS", "Program", "ProgramError", "graph_to_json", "read_program"]


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


def graph_to_json(gm: fx.GraphModule) -> dict[str, Any]:
    """The program file's content; refuses a call target the loader would not accept."""
    nodes = []
    params = {}
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op in ("placeholder", "get_attr"):
            entry["target"] = str(node.target)
        elif node.op == "call_function":
            if not is_allowed(node.target):
                raise ProgramError(
                    f"node {node.name}: {op_name(node.target) or node.target!r} is not in the ops a program "
                    "may call (add it to hy3c/compiler/op_allowlist.py if the compiler now emits it)"
                )
            entry["target"] = op_name(node.target)
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


def _check_name(value: object, what: str, node: str, pattern: re.Pattern = _IDENTIFIER) -> str:
    """Names end up in the Python code FX generates for the graph: only plain identifiers pass."""
    if not isinstance(value, str) or not pattern.fullmatch(value) or keyword.iskeyword(value):
        raise ProgramError(f"node {node}: {what} {shown(value)} is not a plain identifier")
    return value


def _decode(value: Any, env: dict[str, fx.Node], node: str, depth: int = 0) -> Any:
    """An argument's value from its JSON encoding; `depth` counts the lists and tuples around it."""
    container = isinstance(value, list) or (isinstance(value, dict) and set(value) == {"tuple"})
    if container and depth >= MAX_NESTING:
        raise ProgramError(f"node {node}: arguments nested more than {MAX_NESTING} lists or tuples deep")
    if isinstance(value, list):
        return [_decode(v, env, node, depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"node"}:
        if not isinstance(value["node"], str) or value["node"] not in env:
            raise ProgramError(f"node {node}: refers to undefined node {shown(value['node'])}")
        return env[value["node"]]
    if set(value) == {"tuple"} and isinstance(value["tuple"], list):
        return tuple(_decode(v, env, node, depth + 1) for v in value["tuple"])
    if set(value) == {"dtype"}:
        if not isinstance(value["dtype"], str) or value["dtype"] not in DTYPES:
            raise ProgramError(f"node {node}: dtype {shown(value['dtype'])} is not one of {sorted(DTYPES)}")
        return DTYPES[value["dtype"]]
    if set(value) == {"float"}:
        if not isinstance(value["float"], str) or value["float"] not in _NON_FINITE:
            raise ProgramError(f"node {node}: {shown(value['float'])} is not a non-finite float")
        return float(value["float"])
    raise ProgramError(f"node {node}: unknown argument encoding {shown(sorted(value))}")


def _param_table(data: dict[str, Any]) -> dict[str, tuple[list[int], torch.dtype]]:
    table = data.get("params")
    if not isinstance(table, dict):
        raise ProgramError("the program has no parameter table")
    params = {}
    for fqn, spec in table.items():
        _check_name(fqn, "parameter name", fqn, _PARAMETER_PATH)
        shape = spec.get("shape") if isinstance(spec, dict) else None
        dtype = spec.get("dtype") if isinstance(spec, dict) else None
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d <= MAX_NUMEL for d in shape)
        ):
            raise ProgramError(
                f"parameter {fqn}: shape {shown(shape)} is not a list of at most {MAX_DIMS} sizes "
                f"in [0, {MAX_NUMEL}]"
            )
        if math.prod(shape) > MAX_NUMEL:
            raise ProgramError(f"parameter {fqn}: shape {shape} has more than {MAX_NUMEL} elements")
        if not isinstance(dtype, str) or dtype not in PARAMETER_DTYPES:
            raise ProgramError(
                f"parameter {fqn}: dtype {shown(dtype)} is not one of {sorted(PARAMETER_DTYPES)}"
            )
        params[fqn] = (shape, PARAMETER_DTYPES[dtype])
    return params


def _module_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module holding each tensor as a frozen parameter at its dotted path."""
    root = torch.nn.Module()
    for fqn, tensor in tensors.items():
        *path, leaf = fqn.split(".")
        module = root
        try:
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        except (KeyError, AttributeError, TypeError) as exc:  # e.g. a name taken by an attribute ("training")
            raise ProgramError(f"parameter {fqn}: {exc}") from None
    return root


@dataclass
class Program:
    """A program rebuilt from its file and checked node by node; not yet bound to weights."""

    graph: fx.Graph
    params: dict[str, tuple[list[int], torch.dtype]]  # fqn → recorded (shape, dtype)
    inputs: tuple[str, ...] = STEP_INPUTS  # the calling convention (MTP_INPUTS for the draft program)

    def check_shapes(
        self,
        config: Hy3Config,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        kv_heads: int | None = None,
        token_multiple: int = 1,
    ) -> None:
        """Run the graph on meta tensors: shapes, the hy3 ops' contracts, the outputs (program_check)."""
        check_shapes(self.graph, self.params, config, dtype, kv_dtype, kv_heads, token_multiple, self.inputs)

    def bind(self, parameters: dict[str, torch.Tensor]) -> fx.GraphModule:
        """The runnable GraphModule; `parameters` must hold every parameter with its recorded shape/dtype."""
        for fqn, (shape, dtype) in self.params.items():
            tensor = parameters.get(fqn)
            if tensor is None:
                raise ProgramError(f"parameter {fqn} is missing from the weights")
            if list(tensor.shape) != shape or tensor.dtype != dtype:
                raise ProgramError(
                    f"parameter {fqn}: weights hold {str(tensor.dtype).removeprefix('torch.')}"
                    f"{list(tensor.shape)}, the program expects {str(dtype).removeprefix('torch.')}{shape}"
                )
        try:  # FX generates and compiles the graph's Python code here
            gm = fx.GraphModule(_module_tree({fqn: parameters[fqn] for fqn in self.params}), self.graph)
            gm.graph.lint()
        except ProgramError:
            raise
        except Exception as exc:
            raise unexpected("the program's graph module", exc) from None
        return gm


def read_program(data: object, input_names: tuple[str, ...] = STEP_INPUTS) -> Program:
    """Rebuild and check a program file's graph (see the module docstring); no op runs. `input_names`:
    the inputs the program must take, in order (the step's, or `MTP_INPUTS` for the draft program)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ProgramError(f"program format {shown(found)}, expected {FORMAT}")
    where = "the program's parameter table"
    try:
        params = _param_table(data)
        _module_tree({fqn: torch.empty(0, device="meta") for fqn in params})  # the names can be registered
        entries = data.get("nodes")
        if not isinstance(entries, list):
            raise ProgramError("the program has no node list")
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        kinds: dict[fx.Node, Kind] = {}
        inputs: list[str] = []
        for index, entry in enumerate(entries):
            where = _label(entry, index)
            _add_node(entry, graph, env, kinds, inputs, params, input_names)
        if not env or next(reversed(env.values())).op != "output":
            raise ProgramError("the program has no output node")
        where = "the program's graph"
        graph.lint()
    except ProgramError:
        raise
    except Exception as exc:  # anything the checks did not foresee: still a refusal naming the node
        raise unexpected(where, exc) from None
    return Program(graph, params, input_names)


def _label(entry: object, index: int) -> str:
    """How messages name a node entry: by its name once that is an identifier, else by its position."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if isinstance(name, str) and _IDENTIFIER.fullmatch(name):
        return f"node {name}"
    return f"node #{index}"


def _add_node(
    entry: object,
    graph: fx.Graph,
    env: dict[str, fx.Node],
    kinds: dict[fx.Node, Kind],
    inputs: list[str],
    params: dict[str, Any],
    input_names: tuple[str, ...] = STEP_INPUTS,
) -> None:
    """Check one node entry against the nodes before it and add it to `graph` (`env`: name → node,
    `kinds`: what each node produces, `inputs`: the program inputs read so far, of `input_names`)."""
    if not isinstance(entry, dict) or not set(entry) <= _NODE_KEYS:
        raise ProgramError(
            f"node entries must be objects with keys {sorted(_NODE_KEYS)}, found {shown(entry)}"
        )
    name, op = _check_name(entry.get("name"), "name", "?"), entry.get("op")
    if name in env:
        raise ProgramError(f"node {name}: defined twice")
    if env and next(reversed(env.values())).op == "output":
        raise ProgramError(f"node {name}: comes after the output node")
    target = _target(entry, name, params)  # before any argument is read
    args = _decode(entry.get("args", {"tuple": []}), env, name)
    raw_kwargs = entry.get("kwargs", {})
    if not isinstance(args, tuple) or not isinstance(raw_kwargs, dict):
        raise ProgramError(f"node {name}: args must be a tuple and kwargs an object")
    kwargs = {_check_name(k, "keyword", name): _decode(v, env, name, 1) for k, v in raw_kwargs.items()}
    kind: Kind | None = TENSOR if op in ("placeholder", "get_attr") else None
    if op == "placeholder":
        if len(inputs) >= len(input_names) or target != input_names[len(inputs)] or args or kwargs:
            raise ProgramError(f"node {name}: the program's inputs must be {', '.join(input_names)}")
        inputs.append(target)
    elif len(inputs) != len(input_names):
        raise ProgramError(f"node {name}: the program's inputs must be {', '.join(input_names)}")
    if op == "get_attr" and (args or kwargs):
        raise ProgramError(f"node {name}: a parameter node takes no arguments")
    if op == "call_function":
        kind = check_call(name, target, args, kwargs, kinds)
    elif op == "output":
        _check_output(name, args, kwargs, kinds)
    env[name] = graph.create_node(op, target, args, kwargs, name=name)
    if kind is not None:
        kinds[env[name]] = kind


def _target(entry: dict[str, Any], node: str, params: dict[str, Any]) -> object:
    """A node's target by its kind: a step input name, a parameter of the table, an allowed op."""
    op = entry.get("op")
    if op == "placeholder":
        return _check_name(entry.get("target"), "input name", node)
    if op == "get_attr":
        target = _check_name(entry.get("target"), "parameter", node, _PARAMETER_PATH)
        if target not in params:
            raise ProgramError(f"node {node}: parameter {target} is not in the program's parameter table")
        return target
    if op == "call_function":
        return _resolve(entry.get("target"), node)
    if op == "output":
        return "output"
    raise ProgramError(f"node {node}: unsupported op kind {shown(op)}")


def _resolve(name: object, node: str) -> object:
    """The op a call target names: exact lookup in the allow-list, nothing else."""
    try:
        target = resolve_op(name)
    except OpNotRegisteredError:
        raise ProgramError(
            f"node {node}: op '{name}' is not registered here (are its kernels installed, e.g. triton?)"
        ) from None
    if target is None:
        raise ProgramError(f"node {node}: target {shown(name)} is not an op hy3c programs may call")
    return target


def _check_output(
    node: str, args: tuple[Any, ...], kwargs: dict[str, Any], kinds: dict[fx.Node, Kind]
) -> None:
    outputs = args[0] if len(args) == 1 and not kwargs else None
    if not (
        isinstance(outputs, tuple)
        and len(outputs) == 2
        and all(isinstance(v, fx.Node) and kinds.get(v) == TENSOR for v in outputs)
    ):
        raise ProgramError(f"node {node}: the program must return two tensors (logits, hidden)")
