"""Checks of a program (the graph of `program/step.json`) before anything of it runs.

    kind = check_call(node_name, target, args, kwargs, kinds)          # while the graph is rebuilt
    check_shapes(graph, params, config, dtype, kv_dtype)                # once it is complete

A program file is untrusted input: its call targets are already restricted to the ops the compiler
emits (`hy3c.program.allowlist`); these checks make sure the ops are called the way the compiler
calls them, so that no kernel is handed arguments it would misread:

* **arguments against the op's schema** (`check_call`): tensor arguments are graph nodes that produce
  one tensor (or None where the schema says optional), ints are ints within int64, floats numbers,
  bools bools, lists hold the right kinds, dtypes come from `op_allowlist.DTYPES`; no unknown,
  repeated or missing arguments. Multi-output results are read with `getitem` at an index they have.
* **the hy3 ops' contracts** (`check_shapes`): the kernels index memory with their arguments and trust
  them, so each hy3 op (and each provider's version of it) has a contract: shapes that agree with one
  another (weights as wide as the activations, heads × head_dim as wide as the packed projection, ...),
  `layer` within the KV cache, top-k within the experts; the KV cache, positions, slot mapping, page
  table, sequence lengths and query starts are the step's own inputs, never computed values; an
  attention plan comes from `attention_plan` and expert ids from a router over no more experts than
  the expert weights hold. The collectives' group arguments are within bounds and their shapes divide
  as they split them; expert parallelism's `local_experts` takes a router's ids over exactly num_local ×
  group_size experts and gives ids over num_local, which may be −1 ("no local expert"): only the ops
  of `_TAKE_NO_EXPERT` take those (the experts' references and the MoE kernels that skip −1), never
  an op that would index memory with the id.
* **the ATen gathers' indices** (`check_shapes`, `GATHER_CONTRACTS`): an op that reads rows at index
  values gathers with the step input the compiler gives it, whose values the engine bounds, from a
  table that has those rows: `aten.embedding` the `input_ids` (token ids, within the vocabulary) from
  a table of `vocab_size` rows, `aten.index_select` the `logits_indices` (within the step's tokens)
  from the token rows. Any other index (the positions, say) could read past the table at run time.
* **shapes through the whole graph** (`check_shapes`): every node runs on meta tensors (the ops' meta
  and fake kernels, as FakeTensor propagation does, without its per-op overhead) from the recorded
  parameter shapes and the step inputs, built from the model config, of two steps in which every
  dynamic size differs (so shapes that agree at one size only are refused); the outputs must be the
  fp32 logits [rows, vocab] and the hidden states [tokens, hidden] in the model dtype. Int arguments
  of the hy3 ops are constants of the program, never sizes read from a step's inputs.

Every refusal is a `ProgramError` naming the node; an exception none of the checks foresaw (a graph
crafted to trip torch itself) is one too (`unexpected`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import fx

from hy3c.config import Hy3Config
from hy3c.ops.collectives import MAX_GROUP_SIZE, MAX_GROUPS
from hy3c.program.allowlist import DTYPES, GETITEM, op_name

# the step function's calling convention: hy3c.compiler.trace traces exactly these, loading checks them
STEP_INPUTS = (
    "input_ids",
    "positions",
    "kv_cache",
    "page_table",
    "seq_lens",
    "query_start_loc",
    "slot_mapping",
    "logits_indices",
)
STEP_OUTPUTS = ("logits", "hidden")
# the MTP (draft) program's: the step's, with the previous hidden state of every token after positions
MTP_INPUTS = (*STEP_INPUTS[:2], "hidden_prev", *STEP_INPUTS[2:])


class StepSizes(NamedTuple):
    """The dynamic sizes of one step's inputs."""

    tokens: int
    seqs: int
    max_pages: int
    kv_pages: int
    page_size: int
    logits_rows: int


# Representative steps: within each, all sizes differ (a confused dimension shows); between the two,
# every size changes (a program whose shapes agree only at one size, e.g. rows of a constant tensor
# standing in for the token rows, is refused).
STEP_SIZES = (StepSizes(11, 3, 5, 17, 16, 7), StepSizes(13, 2, 6, 19, 32, 5))

TENSOR, INT, NONE = "tensor", "int", "none"
_INT64 = (-(2**63), 2**63 - 1)
_ROUTERS = ("router", "topk_routing", "local_experts")  # second output: ids over the contract's E experts
_LOCAL_EXPERTS = "local_experts"  # its ids may be −1 (a token's expert held by another rank)
# the ops that take ids of −1 (`local_experts`'): the experts' torch references and the MoE kernels,
# all of which skip them (the Triton FusedMoE's alignment and pair blocks, the cuBLAS grouped GEMMs)
_TAKE_NO_EXPERT = (
    "hy3.moe_experts.default",
    "hy3.fused_moe.default",
    "hy3_triton.fused_moe.default",
    "hy3_cublas.moe_experts.default",
)
_ATTENTION_PLAN = "attention_plan"


class ProgramError(ValueError):
    """A program file that cannot be loaded (unknown op, bad structure or arguments); names the node."""


def shown(value: object, limit: int = 80) -> str:
    """A value of the program as a message shows it: its repr, cut to `limit` characters (a crafted
    value may be megabytes long or nested past what repr can recurse through)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # too deep; an int past Python's digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unexpected(where: str, exc: Exception) -> ProgramError:
    """An exception no check foresaw, raised while `where` (a node, a parameter) was processed, as the
    one-line ProgramError that loading reports: a crafted program is refused, never a crash."""
    text = str(exc).strip()
    detail = f": {text.splitlines()[0][:200]}" if text else ""
    return ProgramError(f"{where}: refused ({type(exc).__name__}{detail})")


@dataclass(frozen=True)
class Multi:
    """The kind of a node with several outputs: a tuple of `count` tensors, or a list (count None)."""

    count: int | None


Kind = str | Multi


def step_inputs(
    config: Hy3Config,
    kv_dtype: torch.dtype,
    sizes: StepSizes = STEP_SIZES[0],
    kv_heads: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Meta tensors shaped and typed like the step inputs the engine passes (a rank of a sharded
    program caches `kv_heads` heads; by default the model's)."""
    i64, i32 = torch.int64, torch.int32
    kv = (
        config.num_kv_layers,
        2,
        sizes.kv_pages,
        sizes.page_size,
        config.num_key_value_heads if kv_heads is None else kv_heads,
        config.head_dim,
    )
    shapes = (
        ((sizes.tokens,), i64),
        ((sizes.tokens,), i64),
        (kv, kv_dtype),
        ((sizes.seqs, sizes.max_pages), i32),
        ((sizes.seqs,), i32),
        ((sizes.seqs + 1,), i32),
        ((sizes.tokens,), i64),
        ((sizes.logits_rows,), i64),
    )
    return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes)


# ---- arguments against the schema ------------------------------------------------------------------


def _kind_of_returns(schema: torch._C.FunctionSchema, node: str) -> Kind:
    returns = schema.returns
    if not returns:
        return NONE
    if len(returns) > 1:
        return Multi(len(returns))
    kind = returns[0].real_type.kind()
    if kind == "TensorType":
        return TENSOR
    if kind in ("IntType", "SymIntType"):
        return INT
    if kind == "ListType" and returns[0].real_type.getElementType().kind() == "TensorType":
        return Multi(None)
    raise ProgramError(f"node {node}: op {schema.name} returns {returns[0].real_type}, which no program uses")


def _is_int(value: object) -> bool:
    return type(value) is int and _INT64[0] <= value <= _INT64[1]


def _matches(value: object, jit_type: Any, kinds: dict[fx.Node, Kind]) -> bool:
    """Whether a decoded argument fits a schema type (the real type: ScalarType, not int)."""
    kind = jit_type.kind()
    if kind == "OptionalType":
        return value is None or _matches(value, jit_type.getElementType(), kinds)
    if kind == "ListType":
        element = jit_type.getElementType()
        return isinstance(value, (list, tuple)) and all(_matches(v, element, kinds) for v in value)
    if isinstance(value, fx.Node):
        wanted = {"TensorType": TENSOR, "SymIntType": INT}.get(kind)
        return wanted is not None and kinds.get(value) == wanted
    if kind in ("IntType", "SymIntType"):
        return _is_int(value)
    if kind == "FloatType":
        return _is_int(value) or type(value) is float
    if kind == "BoolType":
        return type(value) is bool
    if kind == "NumberType":
        return _is_int(value) or type(value) in (float, bool)
    if kind == "ScalarTypeType":
        return isinstance(value, torch.dtype) and value in DTYPES.values()
    return False  # tensors must be nodes; no program passes strings, devices, layouts or generators


def bind_arguments(
    schema: torch._C.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Argument name → value as a call binds them (schema defaults filled in); ValueError on a call
    the op would not accept: too many positional arguments, an unknown, repeated or missing one."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise ValueError(f"{len(args)} positional arguments, the op takes {len(positional)}")
    bound = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in schema.arguments}
    for key, value in kwargs.items():
        if key not in names:
            raise ValueError(f"unexpected keyword argument '{key}'")
        if key in bound:
            raise ValueError(f"argument '{key}' given twice")
        bound[key] = value
    for arg in schema.arguments:
        if arg.name not in bound:
            if not arg.has_default_value():
                raise ValueError(f"missing argument '{arg.name}'")
            bound[arg.name] = arg.default_value
    return bound


def check_call(
    node: str, target: object, args: tuple[Any, ...], kwargs: dict[str, Any], kinds: dict[fx.Node, Kind]
) -> Kind:
    """Check one call's arguments (kinds: what each earlier node produces); return this node's kind."""
    name = op_name(target)
    if name == GETITEM:
        source, index = args if len(args) == 2 and not kwargs else (None, None)
        kind = kinds.get(source) if isinstance(source, fx.Node) else None
        if not isinstance(kind, Multi) or not _is_int(index):
            raise ProgramError(
                f"node {node}: getitem needs (a multi-output node, an index), got {shown(args)}"
            )
        if index < 0 or (kind.count is not None and index >= kind.count):
            raise ProgramError(f"node {node}: getitem index {index} is outside node {source.name}'s outputs")
        return TENSOR
    schema = target._schema
    try:
        bound = bind_arguments(schema, args, kwargs)
    except ValueError as exc:
        raise ProgramError(f"node {node} ({name}): {exc}") from None
    given = {a.name for a in schema.arguments[: len(args)]} | set(kwargs)
    for arg in schema.arguments:
        if arg.name in given and not _matches(bound[arg.name], arg.real_type, kinds):
            raise ProgramError(
                f"node {node} ({name}): argument '{arg.name}' must be {arg.real_type}, "
                f"got {_describe(bound[arg.name], kinds)}"
            )
    return _kind_of_returns(schema, node)


def _describe(value: object, kinds: dict[fx.Node, Kind]) -> str:
    if isinstance(value, fx.Node):
        kind = kinds.get(value)
        if isinstance(kind, Multi):
            kind = "a list of tensors" if kind.count is None else f"{kind.count} outputs"
        return f"node {value.name} ({kind})"
    return f"{shown(value)} ({type(value).__name__})"


# ---- the hy3 ops' contracts -------------------------------------------------------------------------


@dataclass
class _Env:
    """What the contracts know beyond one call: the step's token count, the vocabulary size and the
    routers' expert counts."""

    tokens: int
    vocab: int
    routers: dict[fx.Node, int] = field(default_factory=dict)  # router node → experts it chooses from
    expert_ids: dict[fx.Node, int] = field(default_factory=dict)  # its ids output → the same count
    no_expert: set[fx.Node] = field(default_factory=set)  # routers and ids that may hold −1 (local_experts)
    group_sizes: dict[int, int] = field(default_factory=dict)  # a collective's group id → its size


class _Broken(ValueError):
    """A contract violation (the message says which argument)."""


class _Contract:
    """One call's bound arguments (values and nodes) and the sizes its shape patterns have bound."""

    def __init__(self, values: dict[str, Any], nodes: dict[str, Any], env: _Env, op: str = "") -> None:
        self.values, self.nodes, self.env, self.op = values, nodes, env, op
        self.sizes: dict[str, int] = {}

    def __getitem__(self, symbol: str) -> int:
        return self.sizes[symbol]

    def shape(self, arg: str, pattern: str | list[int], dtype: torch.dtype | None = None) -> None:
        """Match a tensor argument's shape: "T H" binds T and H (or checks them, once bound), "*"
        matches any leading dims, digits are sizes; a list is the exact shape."""
        value = self.values[arg]
        if not isinstance(value, torch.Tensor):
            raise _Broken(f"argument '{arg}' must be a tensor")
        shape = list(value.shape)
        sizes = dict(self.sizes)  # bound only if the whole pattern matches
        if isinstance(pattern, list):
            ok = shape == pattern
        else:
            dims = pattern.split()
            leading = dims[0] == "*"
            dims = dims[1:] if leading else dims
            ok = len(shape) >= len(dims) if leading else len(shape) == len(dims)
            for dim, size in zip(dims, shape[len(shape) - len(dims) :]) if ok else ():
                expected = int(dim) if dim.isdigit() else sizes.setdefault(dim, size)
                ok = ok and size == expected
        if not ok:
            bound = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
            raise _Broken(f"argument '{arg}' has shape {shape}, expected [{pattern}] ({bound})")
        self.sizes = sizes
        if dtype is not None and value.dtype != dtype:
            raise _Broken(f"argument '{arg}' is {value.dtype}, expected {dtype}")

    def optional(self, arg: str, *patterns: str | list[int], dtype: torch.dtype | None = None) -> bool:
        """Like `shape` for an optional tensor matching one of `patterns`; False when it is None."""
        if self.values[arg] is None:
            return False
        for pattern in patterns[:-1]:
            try:
                self.shape(arg, pattern, dtype)
                return True
            except _Broken:
                pass
        self.shape(arg, patterns[-1], dtype)
        return True

    def integer(self, arg: str, low: int, high: int) -> None:
        """An int argument within [low, high)."""
        value = self.values[arg]
        if not low <= value < high:
            raise _Broken(f"argument '{arg}' is {value}, outside [{low}, {high})")

    def tokens(self) -> None:
        """Bind T to the step's token count (ops that index rows by the step's metadata)."""
        self.sizes["T"] = self.env.tokens

    def step_input(self, arg: str, name: str) -> None:
        """An index argument must be the step input `name` itself (values the engine bounds)."""
        value = self.nodes[arg]
        if not _is_step_input(value, name):
            got = value.name if isinstance(value, fx.Node) else shown(value)
            raise _Broken(f"argument '{arg}' must be the step input {name}, not {got}")

    def kv(self) -> None:
        """The KV cache, its scales and the layer an attention op reads or writes."""
        self.shape("kv_cache", "L 2 N P Hkv D")
        self.shape("kv_scales", "L 2", torch.float32)
        self.integer("layer", 0, self["L"])

    def batch(self) -> None:
        """The step's batch metadata of attention ops: [B, pages], [B], [B + 1]."""
        self.shape("seq_lens", "B")
        self.shape("query_start_loc", [self["B"] + 1])

    def routed(self) -> None:
        """Routed experts: x, the router's top-k (ids from a router over at most E experts), weights."""
        self.shape("x", "T H")
        self.shape("topk_weights", "T K", torch.float32)
        self.shape("topk_ids", "T K", torch.int32)
        if self.values["w13"].dtype == torch.uint8:
            self._int4_experts()
        else:
            self._experts()
        experts = self.env.expert_ids.get(self.nodes["topk_ids"])
        if experts is None or experts > self["E"]:
            raise _Broken(f"topk_ids must be the ids of a router over at most {self['E']} experts")
        if self.nodes["topk_ids"] in self.env.no_expert and self.op not in _TAKE_NO_EXPERT:
            raise _Broken(f"topk_ids may be -1 (local_experts), which {self.op} does not take")
        self.optional("a13_scale", "1", dtype=torch.float32)
        self.optional("a2_scale", "1", dtype=torch.float32)

    def _experts(self) -> None:
        """bf16 or FP8 experts (FP8 with per-tensor or per-channel scales)."""
        fp8 = self.values["w13"].dtype == torch.float8_e4m3fn
        if self.values["w2"].dtype != self.values["w13"].dtype:
            raise _Broken(f"w13 is {self.values['w13'].dtype} but w2 {self.values['w2'].dtype}")
        self.shape("w13", "E I2 H")
        self.shape("w2", "E H I")
        if self["I2"] != 2 * self["I"]:
            raise _Broken(f"w13 has {self['I2']} rows per expert, expected 2 × {self['I']}")
        if fp8 != (self.values["w13_scale"] is not None) or fp8 != (self.values["w2_scale"] is not None):
            raise _Broken("FP8 expert weights need their scales (and bf16 ones none)")
        self.optional("w13_scale", "E I2", "E 1", dtype=torch.float32)
        self.optional("w2_scale", "E H", "E 1", dtype=torch.float32)

    def _int4_experts(self) -> None:
        """W4A8 experts: int4 packed two per byte along the input columns, a scale per group of them."""
        self.shape("w13", "E I2 Hp", torch.uint8)
        self.shape("w2", "E H Ip", torch.uint8)
        if self["H"] != 2 * self["Hp"] or self["I2"] != 4 * self["Ip"]:
            raise _Broken(
                f"packed int4 experts of {self['H']} columns and {self['I2']} gate-up rows do not fit"
            )
        self.shape("w13_scale", "E I2 Gh", torch.float32)
        self.shape("w2_scale", "E H Gi", torch.float32)
        group = self["H"] // self["Gh"]
        if self["Gh"] * group != self["H"] or self["Gi"] * group != self["I2"] // 2 or group & (group - 1):
            raise _Broken(f"group scales of {self['Gh']} and {self['Gi']} columns do not fit one group size")


def _norm(c: _Contract) -> None:
    c.shape("x", "* H")
    c.shape("weight", "H")


def _qk_norm(c: _Contract) -> None:
    c.shape("x", "T Hh D")
    c.shape("weight", "D")


def _rope(c: _Contract) -> None:
    c.shape("x", "T Hh D")
    c.shape("positions", "T")
    if c["D"] % 2:
        raise _Broken(f"head_dim {c['D']} is odd")


def _kv_store(c: _Contract) -> None:
    c.tokens()
    c.kv()
    c.shape("k", "T Hkv D")
    c.shape("v", "T Hkv D")
    c.shape("slot_mapping", "T")


def _attention(c: _Contract) -> None:
    c.tokens()
    c.kv()
    c.shape("q", "T Hq D")
    c.shape("page_table", "B M")
    c.batch()
    if c["Hq"] % c["Hkv"]:
        raise _Broken(f"{c['Hq']} query heads are not a multiple of {c['Hkv']} KV heads")


def _paged_attention(c: _Contract) -> None:
    _attention(c)
    plan = c.nodes["plan"]
    if not isinstance(plan, fx.Node) or _short_name(plan.target) != _ATTENTION_PLAN:
        raise _Broken("argument 'plan' must be an attention_plan node")
    c.shape("plan", [2, c["B"] + 1], torch.int32)


def _attention_plan(c: _Contract) -> None:
    c.batch()
    c.integer("kv_tile", 1, 1 << 20)
    c.integer("q_block", 1, 1 << 20)


def _qknorm_rope_kvstore(c: _Contract) -> None:
    c.tokens()
    c.kv()
    c.shape("qkv", "T W")
    c.shape("positions", "T")
    c.shape("slot_mapping", "T")
    c.shape("q_norm_weight", "D")
    c.shape("k_norm_weight", "D")
    c.integer("num_kv_heads", c["Hkv"], c["Hkv"] + 1)
    c.integer("num_heads", 1, 1 << 16)
    heads, dim = c.values["num_heads"], c["D"]
    if heads % c["Hkv"] or c["W"] != (heads + 2 * c["Hkv"]) * dim:
        raise _Broken(f"qkv width {c['W']} is not ({heads} + 2 × {c['Hkv']}) heads × {dim}")
    if c.values["hadamard"] and dim & (dim - 1):
        raise _Broken(f"a Hadamard rotation needs a power-of-two head_dim, not {dim}")


def _router(c: _Contract) -> None:
    c.shape("x", "T H")
    c.shape("weight", "E H")
    c.shape("bias", "E")
    c.integer("top_k", 1, c["E"] + 1)


def _router_gemm(c: _Contract) -> None:
    c.shape("x", "T H")
    c.shape("weight", "E H", torch.float32)
    c.shape("w_hi", "E H", torch.bfloat16)
    c.shape("w_lo", "E H", torch.bfloat16)


def _topk_routing(c: _Contract) -> None:
    c.shape("logits", "T E")
    c.shape("bias", "E")
    c.integer("top_k", 1, c["E"] + 1)


def _fused_moe(c: _Contract) -> None:
    c.routed()
    c.optional("shared", "T H")
    if c.optional("x_q", "T H", dtype=torch.float8_e4m3fn) != c.optional(
        "x_q_scale", "T 1", dtype=torch.float32
    ):
        raise _Broken("x_q and x_q_scale come together")


def _silu_and_mul(c: _Contract) -> None:
    c.shape("x", "* I2")
    if c["I2"] % 2:
        raise _Broken(f"width {c['I2']} is odd")


def _silu_and_mul_quant(c: _Contract) -> None:
    c.shape("x", "T I2")
    _silu_and_mul(c)
    c.optional("scale", "1", dtype=torch.float32)


def _quant_fp8(c: _Contract) -> None:
    c.shape("x", "T K")
    c.shape("scale", "1", torch.float32)


def _quant_fp8_per_token(c: _Contract) -> None:
    c.shape("x", "T K")


def _scaled_mm(c: _Contract) -> None:
    c.shape("a", "M K", torch.float8_e4m3fn)
    c.shape("b", "N K", torch.float8_e4m3fn)
    c.optional("a_scale", "1", "M 1", dtype=torch.float32)
    c.optional("b_scale", "1", "N", dtype=torch.float32)


def _add_rms_norm(c: _Contract) -> None:
    c.shape("x", "T H")
    c.shape("residual", "T H")
    c.shape("weight", "H")


def _add_rms_norm_quant(c: _Contract) -> None:
    _add_rms_norm(c)
    c.optional("scale", "1", dtype=torch.float32)


def _group(c: _Contract) -> None:
    """A collective's group: an id the runtime binds, and its size (the fakes' shapes depend on it),
    the same at every collective over that group."""
    c.integer("group", 0, MAX_GROUPS)
    c.integer("group_size", 1, MAX_GROUP_SIZE + 1)
    group, size = c.values["group"], c.values["group_size"]
    if c.env.group_sizes.setdefault(group, size) != size:
        raise _Broken(
            f"group {group} has {c.env.group_sizes[group]} ranks at an earlier collective, not {size}"
        )


def _split_dim(c: _Contract, dim: int) -> None:
    """x splits into group_size equal chunks along `dim` (a token dim: the step pads its tokens)."""
    size, parts = c.values["x"].shape[dim], c.values["group_size"]
    if size % parts:
        raise _Broken(f"argument 'x' has {size} rows along dim {dim}, not a multiple of group_size {parts}")


def _all_reduce(c: _Contract) -> None:
    _group(c)
    c.shape("x", "*")


def _all_gather(c: _Contract) -> None:
    _group(c)
    c.shape("x", "*")
    c.integer("dim", 0, c.values["x"].dim())


def _reduce_scatter(c: _Contract) -> None:
    _all_gather(c)
    _split_dim(c, c.values["dim"])


def _all_to_all(c: _Contract) -> None:
    _group(c)
    c.shape("x", "* N")  # at least one dim: the split one is dim 0
    _split_dim(c, 0)


def _all_reduce_add_rms_norm(c: _Contract) -> None:
    _group(c)
    _add_rms_norm(c)


def _local_experts(c: _Contract) -> None:
    """A router's top-k over E = num_local × group_size experts → ids over the num_local local ones."""
    _group(c)
    c.shape("topk_weights", "T K", torch.float32)
    c.shape("topk_ids", "T K", torch.int32)
    experts = c.env.expert_ids.get(c.nodes["topk_ids"])
    if experts is None:
        raise _Broken("topk_ids must be the ids of a router")
    local, parts = c.values["num_local"], c.values["group_size"]
    c.integer("num_local", 1, experts + 1)
    if local * parts != experts:
        raise _Broken(f"num_local {local} × group_size {parts} is not the router's {experts} experts")
    c.sizes["E"] = local  # its ids output ranges over the local experts (and −1)


def _shard_tokens(c: _Contract) -> None:
    _group(c)
    c.shape("x", "T H")
    _split_dim(c, 0)


def _allgather_gemm(c: _Contract) -> None:
    _group(c)
    c.shape("x", "T K")
    c.shape("weight", "N K", c.values["x"].dtype)


def _gemm_reduce_scatter(c: _Contract) -> None:
    _allgather_gemm(c)
    _split_dim(c, 0)


# op name (without namespace and overload) → contract; every hy3 op and provider op in the allow-list
CONTRACTS: dict[str, Callable[[_Contract], None]] = {
    "rms_norm": _norm,
    "qk_norm": _qk_norm,
    "rope": _rope,
    "kv_store": _kv_store,
    "attention": _attention,
    "router": _router,
    "moe_experts": lambda c: c.routed(),
    "silu_and_mul": _silu_and_mul,
    "quant_fp8": _quant_fp8,
    "quant_fp8_per_token": _quant_fp8_per_token,
    "scaled_mm": _scaled_mm,
    "add_rms_norm": _add_rms_norm,
    "add_rms_norm_quant": _add_rms_norm_quant,
    "qknorm_rope_quant_kvstore": _qknorm_rope_kvstore,
    "attention_plan": _attention_plan,
    "paged_attention": _paged_attention,
    "router_gemm": _router_gemm,
    "topk_routing": _topk_routing,
    "fused_moe": _fused_moe,
    "silu_and_mul_quant": _silu_and_mul_quant,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "all_reduce_add_rms_norm": _all_reduce_add_rms_norm,
    "local_experts": _local_experts,
    "shard_tokens": _shard_tokens,
    "gemm_reduce_scatter": _gemm_reduce_scatter,
    "allgather_gemm": _allgather_gemm,
}


def _embedding(c: _Contract) -> None:
    """Token ids (bounded by the engine to the vocabulary) from a table of exactly the vocabulary's rows."""
    c.step_input("indices", "input_ids")
    c.shape("weight", "V H")
    if c["V"] != c.env.vocab:
        raise _Broken(f"argument 'weight' has {c['V']} rows, expected the vocabulary's {c.env.vocab}")


def _index_select(c: _Contract) -> None:
    """The logits rows (token rows the engine picks) from the step's [tokens, hidden] rows."""
    c.step_input("index", "logits_indices")
    c.integer("dim", 0, 1)
    c.tokens()
    c.shape("self", "T H")


# the ATen ops that read rows at the values of an index tensor → their contract (the allow-list's
# ops with an index argument: tests/compiler/test_artifact_security.py checks that each has one)
GATHER_CONTRACTS: dict[str, Callable[[_Contract], None]] = {
    "aten.embedding.default": _embedding,
    "aten.index_select.default": _index_select,
}


def _is_step_input(value: object, name: str) -> bool:
    return isinstance(value, fx.Node) and value.op == "placeholder" and value.target == name


def _short_name(target: object) -> str | None:
    """'rms_norm' for hy3.rms_norm.default and hy3_triton.rms_norm.default; None for other ops."""
    name = op_name(target)
    if name is None or not name.startswith("hy3"):
        return None
    return name.split(".")[1]


# ---- shapes through the graph ----------------------------------------------------------------------


def check_shapes(
    graph: fx.Graph,
    params: dict[str, tuple[list[int], torch.dtype]],
    config: Hy3Config,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    kv_heads: int | None = None,
    token_multiple: int = 1,
    input_names: tuple[str, ...] = STEP_INPUTS,
) -> None:
    """Run the graph on meta tensors (parameters as recorded, the step inputs of each of `STEP_SIZES`),
    checking each hy3 op's and ATen gather's contract first; the outputs must be the logits and hidden
    states. `input_names` is the program's calling convention (`MTP_INPUTS` for the draft program:
    `hidden_prev` is [tokens, hidden] in the model dtype)."""
    where = "the step inputs (from model_config)"
    try:
        with torch.no_grad():
            for sizes in STEP_SIZES:
                # a sequence-parallel program splits the step's tokens: the engine pads them to a multiple
                sizes = sizes._replace(tokens=sizes.tokens * token_multiple)
                inputs = dict(zip(STEP_INPUTS, step_inputs(config, kv_dtype, sizes, kv_heads)))
                if "hidden_prev" in input_names:
                    shape = (sizes.tokens, config.hidden_size)
                    inputs["hidden_prev"] = torch.empty(shape, dtype=dtype, device="meta")
                env = _Env(tokens=sizes.tokens, vocab=config.vocab_size)
                values: dict[fx.Node, Any] = {}
                for node in graph.nodes:
                    where = f"node {node.name}"
                    if node.op == "placeholder":
                        values[node] = inputs[node.target]
                    elif node.op == "get_attr":
                        shape, param_dtype = params[node.target]
                        values[node] = torch.empty(shape, dtype=param_dtype, device="meta")
                    elif node.op == "call_function":
                        values[node] = _run_node(node, values, env)
                    else:
                        _check_outputs(node, values, config, dtype, sizes)
    except ProgramError:
        raise
    except Exception as exc:  # anything the checks did not foresee: still a refusal naming the node
        raise unexpected(where, exc) from None


def _run_node(node: fx.Node, values: dict[fx.Node, Any], env: _Env) -> Any:
    name = op_name(node.target)
    args = fx.node.map_arg(node.args, values.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
    short = _short_name(node.target)
    try:
        if short is not None:
            contract = _contract(node, args, kwargs, env, CONTRACTS[short])
            if short in _ROUTERS:
                env.routers[node] = contract["E"]
                if short == _LOCAL_EXPERTS:
                    env.no_expert.add(node)
        elif name in GATHER_CONTRACTS:
            _contract(node, args, kwargs, env, GATHER_CONTRACTS[name])
        elif name == GETITEM and node.args[0] in env.routers and node.args[1] == 1:
            env.expert_ids[node] = env.routers[node.args[0]]
            if node.args[0] in env.no_expert:
                env.no_expert.add(node)
        return node.target(*args, **kwargs)
    except _Broken as exc:
        raise ProgramError(f"node {node.name} ({name}): {exc}") from None
    except Exception as exc:  # any op's own shape or dtype check: the program is refused
        message = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
        raise ProgramError(f"node {node.name} ({name}): inconsistent arguments ({message})") from None


def _contract(
    node: fx.Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    env: _Env,
    check: Callable[[_Contract], None],
) -> _Contract:
    """Check a call of a hy3 op or an ATen gather: step inputs passed as themselves, int arguments
    constants, then the op's contract `check`."""
    schema = node.target._schema
    nodes = bind_arguments(schema, node.args, dict(node.kwargs))
    for arg in STEP_INPUTS:
        if arg in nodes and not _is_step_input(nodes[arg], arg):
            raise _Broken(f"argument '{arg}' must be the step input {arg}, not a computed value")
    for arg in schema.arguments:  # a size read from an input varies per step: the check would not hold
        if "Tensor" not in str(arg.real_type) and isinstance(nodes[arg.name], fx.Node):
            raise _Broken(f"argument '{arg.name}' must be a constant, not node {nodes[arg.name].name}")
    contract = _Contract(bind_arguments(schema, args, kwargs), nodes, env, op_name(node.target) or "")
    check(contract)
    return contract


def _check_outputs(
    node: fx.Node, values: dict[fx.Node, Any], config: Hy3Config, dtype: torch.dtype, sizes: StepSizes
) -> None:
    outputs = node.args[0] if len(node.args) == 1 and not node.kwargs else None
    if not isinstance(outputs, tuple) or len(outputs) != len(STEP_OUTPUTS):
        raise ProgramError(f"node {node.name}: the program must return {STEP_OUTPUTS}")
    expected = {
        "logits": ([sizes.logits_rows, config.vocab_size], torch.float32),
        "hidden": ([sizes.tokens, config.hidden_size], dtype),
    }
    for name, value in zip(STEP_OUTPUTS, outputs):
        tensor = values.get(value) if isinstance(value, fx.Node) else None
        shape, want = expected[name]
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != shape or tensor.dtype != want:
            got = f"{tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else repr(value)
            raise ProgramError(f"node {node.name}: output {name} is {got}, expected {want}{shape}")
