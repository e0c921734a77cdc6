"""Convert a BF16 Hy3 checkpoint into a W4A8 one: the routed experts' weights int4 in groups, in
compressed-tensors' `pack-quantized` layout (W4AFP8: what vLLM's W4A8-FP8 MoE reads and AngelSlim's
Hy3 `w4afp8` preset names), everything else kept in BF16 for the compiler (`quant.weights: w4a8`
quantizes the other linear layers to FP8 and runs the experts' activations in FP8 per token).

    convert_to_w4a8("ckpt-bf16/", "ckpt-w4a8/", group_size=128, calibration=windows)

* Per expert projection (`model.layers.L.mlp.experts.E.{gate,up,down}_proj`): `weight_packed` int32
  [out, in/8], `weight_scale` fp32 [out, in/group] and `weight_shape` [out, in]
  (`hy3c.checkpoint.int4_format`); symmetric int4 values in [-8, 7], weight ≈ value · scale.
* Scales and values come from NVIDIA ModelOpt's GPTQ (`calibrator="modelopt"`, the default): its int4
  block quantizer (groups of `group_size` input columns) over each expert's gate-up and down
  projections, the Hessians from the calibration sequences, the weights updated column by column to
  absorb the rounding error — one layer in memory at a time (`layerwise`) — or round-to-nearest of
  absmax / 7 per group (`calibrator="rtn"`, no data).
* `config.json` gains the `quantization_config` block; the output directory is written atomically.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn
from tqdm import tqdm

from hy3c.checkpoint.fp8_convert import bf16_source, write_quantized_metadata
from hy3c.checkpoint.int4_format import packed_to_words
from hy3c.checkpoint.layerwise import calibrate_layerwise
from hy3c.checkpoint.loader import assemble_tensors
from hy3c.checkpoint.modelopt_calibration import import_modelopt
from hy3c.checkpoint.safetensors_io import ShardedWriter, atomic_output_dir, check_output_dir
from hy3c.checkpoint.weight_map import expected_tensors
from hy3c.config import W4AFP8_ACTIVATIONS, W4AFP8_WEIGHTS, Hy3Config, QuantizationConfig
from hy3c.logs import log_event
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.model.layers import MoE
from hy3c.ops.moe import silu_and_mul_reference
from hy3c.ops.quant import INT4_MAX, INT4_MIN, check_int4_groups, pack_int4

log = logging.getLogger("hy3c.checkpoint.w4a8_convert")

_MIN_SCALE = 1e-12
# what stays in high precision, as compressed-tensors' `ignore` (regular expressions over module names)
_IGNORED = ["lm_head", r"re:.*self_attn\..*", r"re:.*shared_mlp\..*", r"re:.*mlp\.(gate|up|down)_proj$"]
_IGNORED += [r"re:.*mlp\.router\..*", r"re:.*eh_proj$"]
EXPERT_TARGETS = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]

Calibrator = Literal["modelopt", "rtn"]


def quantization_block(group_size: int) -> dict:
    """config.json's `quantization_config` of a W4A8 checkpoint (compressed-tensors, W4AFP8)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "producer": {"name": "hy3c"},
        "config_groups": {
            "group_0": {
                "targets": EXPERT_TARGETS,
                "weights": {**W4AFP8_WEIGHTS, "group_size": group_size},
                "input_activations": dict(W4AFP8_ACTIVATIONS),
            }
        },
        "ignore": _IGNORED,
    }


def quantize_to_int4(weight: Tensor, scale: Tensor) -> Tensor:
    """int8 values in [-8, 7] of weight [out, in] against its group scales [out, in / group]."""
    group = weight.shape[-1] // scale.shape[-1]
    grouped = weight.float().unflatten(-1, (-1, group)) / scale.float().unsqueeze(-1)
    return torch.round(grouped).clamp(INT4_MIN, INT4_MAX).to(torch.int8).flatten(-2)


def rtn_scales(weight: Tensor, group: int) -> Tensor:
    """Round-to-nearest group scales: absmax / 7 of each group of `group` input columns."""
    return (weight.float().unflatten(-1, (-1, group)).abs().amax(-1) / INT4_MAX).clamp_min(_MIN_SCALE)


class _LinearExperts(nn.Module):
    """One MoE layer's experts as per-expert `nn.Linear`s (gate-up and down): what ModelOpt's GPTQ
    quantizes as it quantizes any linear layer. The same routed computation as `Experts`."""

    def __init__(self, w13: Tensor, w2: Tensor) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(_linear(w) for w in w13)
        self.down = nn.ModuleList(_linear(w) for w in w2)

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in topk_ids.unique().tolist():
            rows, slots = (topk_ids == e).nonzero(as_tuple=True)
            hidden = silu_and_mul_reference(self.gate_up[e](x[rows]))
            out.index_add_(0, rows, self.down[e](hidden).float() * topk_weights[rows, slots, None])
        return out.to(x.dtype)


def _linear(weight: Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    layer.weight.requires_grad_(False)
    return layer


def _gptq_recipe(group: int) -> dict:
    """ModelOpt's int4 block quantizer on the experts' weights alone (activations stay unquantized while
    the Hessians are collected; hy3c runs them in FP8 per token), calibrated by GPTQ."""
    weights = {"num_bits": 4, "block_sizes": {-1: group, "type": "static"}}
    return {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*experts.*weight_quantizer", "cfg": weights, "enable": True},
        ],
        "algorithm": {"method": "gptq"},
    }


Projections = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]  # w13s, their scales, w2s, theirs


def gptq_block(
    block: nn.Module, prefix: str, run: Callable[[nn.Module], None], group: int
) -> dict[str, Projections]:
    """Per expert stack of `block` (a decoder or MTP layer; `<prefix>.mlp.experts`): every expert's
    GPTQ-updated gate-up and down weights and their group scales, from ModelOpt's GPTQ over `run` (every
    calibration window through a copy of the block); `block` itself is left as it was."""
    working = copy.deepcopy(block)
    stacks: dict[str, _LinearExperts] = {}
    for name, module in working.named_modules():
        if isinstance(module, MoE):
            path = ".".join(part for part in (prefix, name, "experts") if part)
            module.experts = stacks.setdefault(path, _LinearExperts(module.experts.w13, module.experts.w2))
    if not stacks:
        return {}
    mtq = import_modelopt()
    with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints its progress
        mtq.quantize(working, _gptq_recipe(group), run)
    out = {}
    for path, stack in stacks.items():
        parts = []
        for layers in (stack.gate_up, stack.down):
            weights = [layer.weight.detach().float() for layer in layers]
            parts += [weights, [_block_scales(layer, w) for layer, w in zip(layers, weights)]]
        out[path] = (parts[0], parts[1], parts[2], parts[3])
    return out


def _block_scales(layer: nn.Module, weight: Tensor) -> Tensor:
    """A GPTQ-quantized linear's group scales [out, in / group]: its block quantizer's amax / 7."""
    return (layer.weight_quantizer.amax.float().reshape(weight.shape[0], -1) / INT4_MAX).clamp_min(_MIN_SCALE)


def convert_to_w4a8(
    source_dir: str | Path,
    out: str | Path,
    group_size: int = 128,
    calibration: list[list[int]] | None = None,
    calibrator: Calibrator = "modelopt",
    overwrite: bool = False,
    max_shard_bytes: int = 4 << 30,
    device: torch.device | str = "cpu",
    with_mtp: bool = True,
    ignore_unexpected: tuple[str, ...] | list[str] = (),
) -> Path:
    """Write the W4A8 checkpoint of the BF16 checkpoint `source_dir` (the module docstring), one block in
    memory at a time: with `calibrator="modelopt"` each layer's experts are GPTQ-calibrated over
    `calibration` (token sequences) as `layerwise` hands the layer its inputs, and written at once; then
    every other tensor (and, round-to-nearest, every expert) is streamed from the checkpoint."""
    source_dir, out = Path(source_dir), Path(out)
    check_output_dir(out, overwrite, inputs=[source_dir])
    source = bf16_source(source_dir, "convert-w4a8", with_mtp, ignore_unexpected)
    config = source.config
    for dim, what in (
        (config.hidden_size, "hidden_size"),
        (config.moe_intermediate_size, "moe_intermediate_size"),
    ):
        check_int4_groups(what, dim, group_size)
        if dim % 8:
            raise ValueError(f"{what} {dim}: compressed-tensors packs 8 int4 columns per int32 word")
    if calibrator == "modelopt" and not calibration:
        raise ValueError("calibrator modelopt (GPTQ) needs calibration sequences")
    skeleton = Hy3ForCausalLM(config, dtype=getattr(torch, config.dtype), device="meta")
    int4 = frozenset(
        f"{name}.experts" for name, module in skeleton.named_modules() if isinstance(module, MoE)
    )
    block = quantization_block(group_size)
    written: Hy3Config = config.model_copy(update={"quantization_config": QuantizationConfig(**block)})
    expected = expected_tensors(written, "hub", int4_experts=int4, group_size=group_size)
    derived: dict[str, list[str]] = defaultdict(list)  # model tensor → the checkpoint names made from it
    with atomic_output_dir(out, overwrite, inputs=[source_dir]) as tmp:
        write_quantized_metadata(tmp, source_dir, config, block)
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, place in expected.items():
            if place.mode == "shape":
                writer.add(name, torch.tensor(place.values, dtype=torch.int64))
            else:
                derived[place.target.removesuffix("_scale")].append(name)
        calibrated: set[str] = set()
        if calibrator == "modelopt":

            def calibrate_experts(layer: nn.Module, prefix: str, run: Callable[[nn.Module], None]) -> dict:
                for stack, projections in gptq_block(layer, prefix, run, group_size).items():
                    for which, weights, scales in (("w13", *projections[:2]), ("w2", *projections[2:])):
                        for name in derived[f"{stack}.{which}"]:
                            _write_int4(writer, name, expected[name], weights, scales)
                    calibrated.add(stack)
                return {}

            calibrate_layerwise(source, source_dir, calibration, calibrate_experts, device)
        params = dict(skeleton.named_parameters())
        shapes = {t: params[t] for t in derived if t.rsplit(".", 1)[0] not in calibrated}
        stream = assemble_tensors(source, shapes, source_dir)
        for target, tensor in tqdm(
            stream, total=len(shapes), desc="writing w4a8", unit="tensor", disable=None
        ):
            for name in derived[target]:
                place = expected[name]
                if target.rsplit(".", 1)[0] in int4:  # round-to-nearest
                    weights = [w.float() for w in tensor]
                    _write_int4(writer, name, place, weights, [rtn_scales(w, group_size) for w in weights])
                else:
                    writer.add(name, (tensor[place.index()] if place.region else tensor).clone())
        writer.close()
    log_event(
        log,
        "w4a8_checkpoint_written",
        path=str(out),
        calibrator=calibrator,
        group_size=group_size,
        expert_stacks=len(int4),
        calibration_sequences=len(calibration or []),
    )
    return out


def _write_int4(writer: ShardedWriter, name: str, place, weights: list[Tensor], scales: list[Tensor]) -> None:
    """One expert projection's packed words or group scales (a gate, up or down block of an expert of
    w13 / w2, at the placement's region), from every expert's weight and scales."""
    expert = place.region[0]
    rows = slice(*place.region[1]) if len(place.region) > 1 else slice(None)
    weight, scale = weights[expert][rows], scales[expert][rows]
    if place.mode == "int4":
        writer.add(name, packed_to_words(pack_int4(quantize_to_int4(weight, scale))))
    else:
        writer.add(name, scale.contiguous())
