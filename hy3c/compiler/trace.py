"""Trace the Hy3 step function into an FX graph (torch.export, non-strict, meta device).

    gm = trace_step(config, torch.bfloat16, quant_layout)

The model is built on the meta device (no weight memory: the full 80-layer config traces on a laptop)
and exported with the token count, batch size, page-table width, KV page count and number of logits
rows dynamic. The exported graph is then *unlifted*: parameters become `get_attr` nodes of a plain
`GraphModule` (holding meta tensors), so passes can retype or add weights, and the user inputs are the
eight step inputs of `Hy3ForCausalLM.forward`. `trace_mtp` traces `Hy3ForCausalLM.mtp_forward` (the MTP
layer of one depth, the draft program) the same way: its inputs are the step inputs with `hidden_prev`
(the previous hidden state of every token, [tokens, hidden]) after `positions`, its parameter names
those of the model (embed_tokens and lm_head shared with the step program). Every node keeps its FakeTensor `meta["val"]` and its
`nn_module_stack`. Export's `_assert_tensor_metadata` checks are dropped: they pin the meta device the
graph was traced on.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.export import Dim

from hy3c.config import Hy3Config
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.model.layers import NO_QUANT, QuantLayout


def example_step_inputs(
    config: Hy3Config, dtype: torch.dtype, device: str = "meta", token_multiple: int = 1
) -> tuple[torch.Tensor, ...]:
    """Inputs with every dynamic dim distinct and >= 2 (so none is specialized while tracing); the token
    count a multiple of `token_multiple` (a sequence-parallel program's steps are)."""
    tokens, seqs, pages, logits, kv_pages = 11 * token_multiple, 3, 5, 3, 17
    i64, i32 = torch.int64, torch.int32
    kv_shape = (config.num_kv_layers, 2, kv_pages, 16, config.num_key_value_heads, config.head_dim)
    return (
        torch.zeros(tokens, dtype=i64, device=device),
        torch.zeros(tokens, dtype=i64, device=device),
        torch.zeros(kv_shape, dtype=dtype, device=device),
        torch.zeros(seqs, pages, dtype=i32, device=device),
        torch.zeros(seqs, dtype=i32, device=device),
        torch.zeros(seqs + 1, dtype=i32, device=device),
        torch.zeros(tokens, dtype=i64, device=device),
        torch.zeros(logits, dtype=i64, device=device),
    )


def example_mtp_inputs(
    config: Hy3Config, dtype: torch.dtype, device: str = "meta", token_multiple: int = 1
) -> tuple[torch.Tensor, ...]:
    """The step's example inputs with `hidden_prev` [tokens, hidden] inserted after the positions."""
    step = example_step_inputs(config, dtype, device, token_multiple)
    hidden_prev = torch.zeros(step[0].shape[0], config.hidden_size, dtype=dtype, device=device)
    return (*step[:2], hidden_prev, *step[2:])


def _dynamic_shapes() -> tuple[dict[int, object], ...]:
    tokens = Dim("num_tokens", min=1, max=1 << 22)
    seqs = Dim("num_seqs", min=1, max=1 << 16)
    pages = Dim("max_pages", min=1, max=1 << 20)
    kv_pages = Dim("kv_pages", min=1, max=1 << 26)
    page = Dim("page_size", min=1, max=1 << 12)
    logits = Dim("num_logits", min=1, max=1 << 22)
    return (
        {0: tokens},
        {0: tokens},
        {2: kv_pages, 3: page},
        {0: seqs, 1: pages},
        {0: seqs},
        {0: seqs + 1},
        {0: tokens},
        {0: logits},
    )


def unlift(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """Turn lifted parameter/buffer placeholders into get_attr nodes of a plain GraphModule."""
    sig = ep.graph_signature
    owner_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    root = torch.nn.Module()
    for fqn, tensor in ep.state_dict.items():
        *path, leaf = fqn.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    graph = ep.graph_module.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in owner_of:
            with graph.inserting_before(first_op):
                attr = graph.create_node("get_attr", owner_of[node.name])
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
    for node in list(graph.nodes):  # tracing-time checks that pin the meta device
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    gm = fx.GraphModule(root, graph)
    gm.graph.eliminate_dead_code()  # unused parameters (e.g. the MTP layer's, which the step does not call)
    gm.recompile()
    return gm


def trace_step(
    config: Hy3Config, dtype: torch.dtype, quant: QuantLayout = NO_QUANT, token_multiple: int = 1
) -> fx.GraphModule:
    model = Hy3ForCausalLM(config, dtype=dtype, device="meta", quant=quant)
    inputs = example_step_inputs(config, dtype, token_multiple=token_multiple)
    with torch.no_grad():
        ep = torch.export.export(model, inputs, dynamic_shapes=_dynamic_shapes(), strict=False)
    return unlift(ep)


class _MTPStep(torch.nn.Module):
    """`mtp_forward` of one depth as a module's forward (what export traces); the model is a submodule
    named `model`, so parameter names come out as `model.<fqn>` and are renamed back by `trace_mtp`."""

    def __init__(self, model: Hy3ForCausalLM, depth: int) -> None:
        super().__init__()
        self.model = model
        self.depth = depth

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_prev: torch.Tensor,
        kv_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_mapping: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.mtp_forward(
            input_ids,
            positions,
            hidden_prev,
            kv_cache,
            page_table,
            seq_lens,
            query_start_loc,
            slot_mapping,
            logits_indices,
            self.depth,
        )


def trace_mtp(
    config: Hy3Config,
    dtype: torch.dtype,
    quant: QuantLayout = NO_QUANT,
    token_multiple: int = 1,
    depth: int = 0,
) -> fx.GraphModule:
    """The MTP layer of `depth` as a program (see the module docstring); its parameters keep the model's
    names, so a weight the step program also reads (embed_tokens, lm_head) is one tensor of both."""
    model = Hy3ForCausalLM(config, dtype=dtype, device="meta", quant=quant)
    inputs = example_mtp_inputs(config, dtype, token_multiple=token_multiple)
    step_shapes = _dynamic_shapes()
    shapes = (*step_shapes[:2], {0: step_shapes[0][0]}, *step_shapes[2:])
    with torch.no_grad():
        ep = torch.export.export(_MTPStep(model, depth), inputs, dynamic_shapes=shapes, strict=False)
    gm = unlift(ep)
    return _strip_prefix(gm, "model.")


def _strip_prefix(gm: fx.GraphModule, prefix: str) -> fx.GraphModule:
    """gm with `prefix` dropped from every parameter name (its get_attr nodes retargeted)."""
    root = torch.nn.Module()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            tensor = gm.get_parameter(node.target)
            node.target = node.target.removeprefix(prefix)
            *path, leaf = node.target.split(".")
            module = root
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, tensor)
    out = fx.GraphModule(root, gm.graph)
    out.meta.update(gm.meta)
    return out
