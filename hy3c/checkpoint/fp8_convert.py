"""Convert a BF16 Hy3 checkpoint into the FP8 "W8A8C8" hub format (docs/ARCHITECTURE.md §1.7).

    convert_to_fp8("ckpt-bf16/", "ckpt-fp8/", activation_scheme="static", layout="angelslim")

Two layouts of the same quantization (`layout`), both read back by `load_model`:
* `angelslim` (default): what AngelSlim's vLLM-oriented FP8 tool writes, as tencent/Hy3-FP8 ships:
  scales of shape [1], `quantization_config` `{quant_method: fp8, ...}`, KV scales in
  `kv_cache_scales.safetensors`.
* `modelopt`: NVIDIA ModelOpt's HF export (what vLLM and SGLang load as `quantization=modelopt`):
  scalar scales, each layer's `self_attn.k_proj.k_scale` / `v_proj.v_scale` in the shards,
  `quantization_config` `{quant_method: modelopt, quant_algo: FP8, kv_cache_scheme, ignore}` and the
  same in `hf_quant_config.json`. Static activations only (ModelOpt's `FP8` is static).

* Weights of every attention / dense / shared / expert projection (and the MTP eh_proj) become
  float8_e4m3fn with a per-tensor `weight_scale` = absmax / 448, one per checkpoint tensor, as
  AngelSlim's vLLM-oriented FP8 tool writes them. Embeddings, lm_head, the router, expert bias and norms
  stay in high precision.
* `activation_scheme="static"` calibrates per-tensor `input_scale`s (absmax / 448) by running the model
  over calibration tokens; q/k/v share their fused module's scale, gate/up likewise, experts share one
  scale per layer for their inputs and one for their intermediate activations.
* KV ("C8") scales of post-norm, post-RoPE K and of V per layer go to `kv_cache_scales.safetensors`.
* `config.json` gains the `quantization_config` block; the output directory is written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hy3c.checkpoint.layerwise import absmax_hooks, calibrate_layerwise, fp8_ranges
from hy3c.checkpoint.loader import CheckpointLayout, assemble_tensors, inspect_checkpoint
from hy3c.checkpoint.safetensors_io import ShardedWriter, atomic_output_dir, check_output_dir
from hy3c.checkpoint.weight_map import Placement, expected_tensors, kv_scale_tensors
from hy3c.config import MODELOPT_FP8_KV, Hy3Config, QuantizationConfig
from hy3c.logs import log_event
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.model.hy3 import Hy3ForCausalLM, allocate_kv_cache
from hy3c.model.layers import Experts, Linear
from hy3c.ops.quant import FP8_MAX, quantize_fp8

log = logging.getLogger("hy3c.checkpoint.fp8_convert")

_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
_MIN_SCALE = 1e-8


def fp8_module_paths(model: Hy3ForCausalLM) -> frozenset[str]:
    """Linear layers and expert stacks that the W8A8 format quantizes (not lm_head)."""
    return frozenset(
        name
        for name, mod in model.named_modules()
        if (isinstance(mod, Linear) and name != "lm_head") or isinstance(mod, Experts)
    )


def _abs_max(x: torch.Tensor) -> float:
    return float(x.detach().abs().max()) if x.numel() else 0.0


def calibration_passes(
    model: Hy3ForCausalLM, token_batches: list[list[int]], page_size: int = 16
) -> dict[str, float]:
    """Run the model (and its MTP layers, on the tokens after next) over each calibration sequence;
    returns the absmax of every KV layer's K and V (`kv.<layer>.k|v`: post-norm, post-RoPE K as the
    cache stores it), which no module hook sees."""
    stats: dict[str, float] = defaultdict(float)
    device = model.embed_tokens.weight.device
    with torch.no_grad():
        for ids in tqdm(token_batches, desc="calibrating", unit="seq", disable=None):
            pages = list(range(-(-len(ids) // page_size)))
            kv = allocate_kv_cache(model.config, len(pages), page_size, model.dtype, device)
            batch = build_step_batch([SeqChunk(ids, 0, pages, "all")], page_size, device)
            _, hidden = model(*batch.model_args(kv))
            if len(model.mtp) and len(ids) > 1:
                mtp_batch = build_step_batch([SeqChunk(ids[1:], 0, pages, "none")], page_size, device)
                model.mtp_forward(
                    mtp_batch.input_ids,
                    mtp_batch.positions,
                    hidden[:-1],
                    kv,
                    mtp_batch.page_table,
                    mtp_batch.seq_lens,
                    mtp_batch.query_start_loc,
                    mtp_batch.slot_mapping,
                    mtp_batch.logits_indices,
                )
            for layer in range(model.config.num_kv_layers):
                for which, kind in enumerate("kv"):
                    key = f"kv.{layer}.{kind}"
                    stats[key] = max(stats[key], _abs_max(kv[layer, which]))
    return dict(stats)


def calibrate(model: Hy3ForCausalLM, token_batches: list[list[int]], page_size: int = 16) -> dict[str, float]:
    """absmax of every quantized module's input (experts: `<path>.a13` and `<path>.a2`) and of every KV
    layer's K and V (`kv.<layer>.k|v`), over the calibration sequences, by forward hooks on the whole
    model in memory: the reference the layer-by-layer calibration (`layerwise`) is tested against."""
    stats: defaultdict[str, float] = defaultdict(float)
    with absmax_hooks(model, "", stats):
        kv = calibration_passes(model, token_batches, page_size)
    return {**stats, **kv}


def _scale(absmax: float, scalar: bool = False) -> torch.Tensor:
    """The per-tensor FP8 scale of `absmax`: shape [1], or a 0-d tensor with `scalar`."""
    value = max(absmax / FP8_MAX, _MIN_SCALE)
    return torch.tensor(value if scalar else [value], dtype=torch.float32)


def _input_scale_key(target: str) -> str:
    """Calibration key of the module whose input a checkpoint `input_scale` describes."""
    module, leaf = target.rsplit(".", 1)
    if leaf in ("w13", "a13_scale", "w13_scale"):
        return f"{module}.a13"
    if leaf in ("w2", "a2_scale", "w2_scale"):
        return f"{module}.a2"
    return module


Layout = Literal["angelslim", "modelopt"]
# what ModelOpt's export leaves in high precision, as its `ignore` / `exclude_modules` wildcards
_MODELOPT_IGNORED = ["lm_head", "model.embed_tokens", "*.mlp.router.gate"]


def _quantization_block(layout: Layout, activation_scheme: str) -> dict:
    """config.json's `quantization_config` of the layout."""
    if layout == "angelslim":
        return {
            "quant_method": "fp8",
            "activation_scheme": activation_scheme,
            "ignored_layers": ["lm_head", "model.embed_tokens"],
            "kv_cache_scheme": "static",
        }
    static = {**MODELOPT_FP8_KV, "dynamic": False, "strategy": "tensor"}
    return {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "producer": {"name": "hy3c"},
        "config_groups": {
            "group_0": {"weights": static, "input_activations": static, "targets": ["Linear"]},
        },
        "kv_cache_scheme": static,
        "ignore": _MODELOPT_IGNORED,
    }


def _hf_quant_config() -> dict:
    """ModelOpt's `hf_quant_config.json` (the block older readers take instead of config.json's)."""
    return {
        "producer": {"name": "hy3c"},
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": _MODELOPT_IGNORED,
        },
    }


def bf16_source(
    source_dir: Path, command: str, with_mtp: bool, ignore_unexpected: tuple[str, ...] | list[str]
) -> CheckpointLayout:
    """The layout of a conversion's BF16 checkpoint (without its MTP layers unless `with_mtp`); a
    quantized one is an error naming `command`."""
    source = inspect_checkpoint(source_dir, with_mtp, ignore_unexpected)
    if source.quant.fp8_modules or source.quant.int4_experts:
        kind = "an FP8" if source.quant.fp8_modules else "a W4A8"
        raise ValueError(f"{source_dir}: already {kind} checkpoint; {command} takes a BF16 one")
    if with_mtp:
        return source
    config = source.config.model_copy(update={"num_nextn_predict_layers": 0})
    return dataclasses.replace(source, config=config)


def write_quantized_metadata(out: Path, source_dir: Path, config: Hy3Config, block: dict) -> None:
    """A quantized checkpoint's files besides its tensors: the source's tokenizer and generation files,
    and its config.json with the `quantization_config` block."""
    for name in _COPIED_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out / name)
    data = config.to_json_dict()
    data["quantization_config"] = block
    (out / "config.json").write_text(json.dumps(data, indent=2))


def convert_to_fp8(
    source_dir: str | Path,
    out: str | Path,
    activation_scheme: Literal["static", "dynamic"] = "static",
    calibration: list[list[int]] | None = None,
    seed: int = 0,
    overwrite: bool = False,
    max_shard_bytes: int = 4 << 30,
    layout: Layout = "angelslim",
    calibrator: Literal["modelopt", "absmax"] = "modelopt",
    device: torch.device | str = "cpu",
    with_mtp: bool = True,
    ignore_unexpected: tuple[str, ...] | list[str] = (),
) -> Path:
    """Write the FP8 hub-format checkpoint of the BF16 checkpoint `source_dir` in `layout` (the module
    docstring), its static scales calibrated over `calibration` (token sequences; None: four of 64
    random tokens from `seed`) one block at a time (`layerwise`: ModelOpt's FP8 post-training
    quantization, or with `calibrator="absmax"` forward hooks taking the same amaxes), then the weights
    quantized one checkpoint tensor at a time: memory stays bounded by a block, not the model."""
    source_dir, out = Path(source_dir), Path(out)
    if layout == "modelopt" and activation_scheme != "static":
        raise ValueError("--layout modelopt: ModelOpt's FP8 format has static activation scales only")
    check_output_dir(out, overwrite, inputs=[source_dir])  # before calibrating
    source = bf16_source(source_dir, "convert-fp8", with_mtp, ignore_unexpected)
    config = source.config
    if calibration is None:
        gen = torch.Generator().manual_seed(seed)
        calibration = [torch.randint(0, config.vocab_size, (64,), generator=gen).tolist() for _ in range(4)]
    stats = calibrate_layerwise(source, source_dir, calibration, fp8_ranges(calibrator), device)
    skeleton = Hy3ForCausalLM(config, dtype=getattr(torch, config.dtype), device="meta")
    fp8_modules = fp8_module_paths(skeleton)
    static = activation_scheme == "static"
    block = _quantization_block(layout, activation_scheme)
    written: Hy3Config = config.model_copy(update={"quantization_config": QuantizationConfig(**block)})
    expected = expected_tensors(written, "hub", fp8_modules, static)
    scalar = layout == "modelopt"  # ModelOpt's scales are 0-d tensors, AngelSlim's [1]
    derived: dict[str, list[str]] = defaultdict(list)  # model tensor → the checkpoint names made from it
    with atomic_output_dir(out, overwrite, inputs=[source_dir]) as tmp:
        write_quantized_metadata(tmp, source_dir, config, block)
        if layout == "modelopt":
            (tmp / "hf_quant_config.json").write_text(json.dumps(_hf_quant_config(), indent=2))
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, place in expected.items():
            leaf = name.rsplit(".", 1)[1]
            if leaf == "input_scale":
                writer.add(name, _scale(stats[_input_scale_key(place.target)], scalar))
            elif leaf in ("k_scale", "v_scale"):
                writer.add(name, _scale(stats[f"kv.{place.region[0]}.{leaf[0]}"], scalar))
            else:
                derived[
                    place.target.removesuffix("_scale") if leaf == "weight_scale" else place.target
                ].append(name)
        params = dict(skeleton.named_parameters())
        shapes = {target: params[target] for target in derived}
        tensors = tqdm(
            assemble_tensors(source, shapes, source_dir),
            total=len(shapes),
            desc="writing fp8",
            unit="tensor",
            disable=None,
        )
        for target, tensor in tensors:
            for name in derived[target]:
                _write_fp8(writer, expected, name, tensor, fp8_modules, scalar)
        writer.close()
        if layout == "angelslim":
            kv = {
                name: _scale(stats[f"kv.{p.region[0]}.{'kv'[p.region[1][0]]}"])
                for name, p in kv_scale_tensors(config).items()
            }
            save_file(kv, str(tmp / "kv_cache_scales.safetensors"))
    log_event(
        log,
        "fp8_checkpoint_written",
        path=str(out),
        layout=layout,
        calibrator=calibrator,
        activation_scheme=activation_scheme,
        fp8_modules=len(fp8_modules),
        calibration_sequences=len(calibration),
    )
    return out


def _write_fp8(
    writer: ShardedWriter,
    expected: dict[str, Placement],
    name: str,
    tensor: torch.Tensor,
    fp8_modules: frozenset[str],
    scalar: bool,
) -> None:
    """One checkpoint tensor made from the whole model tensor it belongs to (its rows of a fused one, its
    expert of a stack): the FP8 weight or its per-tensor scale, or the tensor as it is."""
    leaf = name.rsplit(".", 1)[1]
    weight_name = name.removesuffix("_scale") if leaf == "weight_scale" else name
    weight = expected[weight_name]
    value = tensor[weight.index()] if weight.region else tensor
    module = weight.target.rsplit(".", 1)[0]
    if module in fp8_modules and leaf in ("weight", "weight_scale"):
        scale = _scale(_abs_max(value))
        if leaf == "weight_scale":
            writer.add(name, scale.reshape(() if scalar else (1,)))
        else:
            writer.add(name, quantize_fp8(value, scale.to(value.device)))
    else:
        writer.add(name, value.clone())
