"""Calibrate a checkpoint one block at a time, in bounded memory: what `convert-fp8` runs, so a model
larger than the machine calibrates.

    stats = calibrate_layerwise(layout, "ckpt/", windows, fp8_ranges("modelopt"))   # calibrate's keys

The model is a skeleton on the meta device. Each block — the embedding, each decoder layer, the final
norm, each MTP layer — is read from the checkpoint when its turn comes and dropped after it: peak
memory is one block's weights and what its calibration holds (ModelOpt's copy of the block; for
W4A8's GPTQ, also its Hessians and the updated weights of the block's experts), the hidden states of
every calibration window ([tokens, hidden] each) and one window's KV cache of one layer. A decoder
layer sees every window's hidden states as the whole model would hand them to it (full precision:
each layer's output is computed by the layer as loaded, not by its quantized copy), so the
statistics equal a whole-model pass's — and GPTQ compensates each layer's own rounding, not that of
the layers before it.

Per block, `calibrate_block` does the work: for FP8 (`fp8_ranges`) ModelOpt's FP8 post-training
quantization over a copy of the block (`modelopt_calibration.quantize_block`), or forward hooks taking
the same maxima (`absmax_hooks`); for W4A8, ModelOpt's GPTQ of the block's experts (`w4a8_convert`). The KV cache's K and V ranges are read from
the cache each layer fills.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from hy3c.checkpoint.loader import CheckpointLayout, assemble_tensors
from hy3c.logs import log_event
from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.model.layers import AttnMetadata, DecoderLayer, Experts, Linear
from hy3c.ops.moe import silu_and_mul_reference

log = logging.getLogger("hy3c.checkpoint.layerwise")

Calibrator = Literal["modelopt", "absmax"]
Stats = dict[str, float]
Run = Callable[[nn.Module], None]  # every calibration window through a module shaped like the block
# (block, its path in the model, run) → the block's statistics; it may also act on the block (W4A8's GPTQ)
BlockCalibration = Callable[[nn.Module, str, Run], Stats]


def _abs_max(x: Tensor) -> float:
    return float(x.detach().abs().max()) if x.numel() else 0.0


@contextlib.contextmanager
def absmax_hooks(module: nn.Module, prefix: str, stats: defaultdict[str, float]) -> Iterator[None]:
    """While open, forward hooks on `module`'s FP8 modules raise `stats` to the absmax of their inputs:
    a Linear's (`<path>`, not lm_head), an expert stack's routed tokens (`<path>.a13`) and each
    expert's SiLU(gate) · up (`<path>.a2`); paths are `prefix` + the module's name in `module`."""

    def linear_hook(name: str):
        def hook(_mod, args):
            stats[name] = max(stats[name], _abs_max(args[0]))

        return hook

    def experts_hook(name: str):
        def hook(mod: Experts, args):
            x, _, ids = args
            stats[f"{name}.a13"] = max(stats[f"{name}.a13"], _abs_max(x))
            for e in ids.unique().tolist():
                tokens = (ids == e).any(dim=-1)
                inter = silu_and_mul_reference(F.linear(x[tokens], mod.w13[e]))
                stats[f"{name}.a2"] = max(stats[f"{name}.a2"], _abs_max(inter))

        return hook

    handles = []
    for name, mod in module.named_modules():
        path = ".".join(part for part in (prefix, name) if part)
        if isinstance(mod, Linear) and path != "lm_head":
            handles.append(mod.register_forward_pre_hook(linear_hook(path)))
        elif isinstance(mod, Experts):
            handles.append(mod.register_forward_pre_hook(experts_hook(path)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fp8_ranges(calibrator: Calibrator) -> BlockCalibration:
    """The input ranges of a block's FP8 modules over one `run`: ModelOpt's FP8 post-training
    quantization of a copy of the block, or forward hooks on the block itself (`absmax`)."""
    if calibrator == "modelopt":
        from hy3c.checkpoint.modelopt_calibration import quantize_block

        return quantize_block

    def absmax(block: nn.Module, prefix: str, run: Run) -> Stats:
        stats: defaultdict[str, float] = defaultdict(float)
        with absmax_hooks(block, prefix, stats), torch.no_grad():
            run(block)
        return dict(stats)

    return absmax


class _Blocks:
    """Reads one block of the skeleton's parameters from the checkpoint at a time."""

    def __init__(self, skeleton: Hy3ForCausalLM, layout: CheckpointLayout, root: Path, device) -> None:
        self.skeleton, self.layout, self.root, self.device = skeleton, layout, root, torch.device(device)

    @contextlib.contextmanager
    def loaded(self, *paths: str) -> Iterator[None]:
        modules = [self.skeleton.get_submodule(p) for p in paths]
        for path, module in zip(paths, modules):
            module.to_empty(device=self.device)
            shapes = {f"{path}.{name}": p for name, p in module.named_parameters()}
            with torch.no_grad():
                for name, tensor in assemble_tensors(self.layout, shapes, self.root):
                    self.skeleton.get_parameter(name).copy_(tensor)
        try:
            yield
        finally:
            for module in modules:
                module.to_empty(device="meta")


def _windows(windows: list[list[int]], page_size: int, device, logits: str = "all") -> list[StepBatch]:
    """One prefill step per window, over pages 0, 1, … of its own cache."""
    return [
        build_step_batch(
            [SeqChunk(ids, 0, list(range(-(-len(ids) // page_size))), logits)], page_size, device
        )
        for ids in windows
    ]


def _meta(batch: StepBatch) -> AttnMetadata:
    return AttnMetadata(
        batch.positions, batch.slot_mapping, batch.page_table, batch.seq_lens, batch.query_start_loc
    )


def calibrate_layerwise(
    layout: CheckpointLayout,
    root: str | Path,
    windows: list[list[int]],
    calibrate_block: BlockCalibration,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    page_size: int = 16,
) -> Stats:
    """What `calibrate_block` finds in each decoder and MTP layer (`fp8_ranges`: the absmax of every FP8
    module's input, experts `<path>.a13`, `<path>.a2`), and the absmax of every KV layer's K and V
    (`kv.<layer>.k|v`), over the calibration windows, one block in memory at a time (the module
    docstring); the MTP layers run on the tokens after next, as the model's MTP step does."""
    config = layout.config
    dtype = dtype or getattr(torch, config.dtype)
    skeleton = Hy3ForCausalLM(config, dtype=dtype, device="meta", quant=layout.quant)
    blocks = _Blocks(skeleton, layout, Path(root), device)
    batches = _windows(windows, page_size, device)
    kv_scales = torch.ones(1, 2, device=device)
    started = time.monotonic()
    stats: Stats = {}
    with blocks.loaded("embed_tokens"), torch.no_grad():
        states = [F.embedding(b.input_ids, skeleton.embed_tokens.weight) for b in batches]
    layers = list(enumerate(skeleton.layers))
    common = (page_size, calibrate_block, stats, kv_scales)
    for index, layer in tqdm(layers, desc="calibrating layers", unit="layer", disable=None):
        with blocks.loaded(f"layers.{index}"):
            inputs = [(x,) for x in states]
            states = _calibrate_block(layer, layer, f"layers.{index}", index, inputs, batches, *common)
    if len(skeleton.mtp):
        with blocks.loaded("norm"), torch.no_grad():
            hidden = [skeleton.norm(x) for x in states]
        # the MTP step's inputs: each window's tokens after next, beside the hidden states before them
        mtp_batches = _windows([ids[1:] for ids in windows], page_size, device, logits="none")
        with blocks.loaded("embed_tokens"), torch.no_grad():
            embedded = [
                F.embedding(b.input_ids, skeleton.embed_tokens.weight).masked_fill(
                    (b.positions == 0)[:, None], 0
                )
                for b in mtp_batches
            ]
        inputs = [(e, h[:-1]) for e, h in zip(embedded, hidden)]
        for depth, mtp in enumerate(skeleton.mtp):
            with blocks.loaded(f"mtp.{depth}"):
                kv_layer = config.num_hidden_layers + depth
                _calibrate_block(mtp, mtp.layer, f"mtp.{depth}", kv_layer, inputs, mtp_batches, *common)
    log_event(
        log,
        "layerwise_calibrated",
        layers=len(layers) + len(skeleton.mtp),
        windows=len(windows),
        modules=len(stats),
        seconds=round(time.monotonic() - started, 2),
    )
    return stats


def _one_layer_cache(layer: DecoderLayer, batch: StepBatch, page_size: int, like: Tensor) -> Tensor:
    """A zeroed KV cache of one layer for one window's pages (the layer addresses it as layer 0)."""
    attention = layer.self_attn
    shape = (1, 2, batch.page_table.shape[1], page_size, attention.num_kv_heads, attention.head_dim)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _calibrate_block(
    block: nn.Module,
    layer: DecoderLayer,
    prefix: str,
    kv_layer: int,
    inputs: list[tuple[Tensor, ...]],
    batches: list[StepBatch],
    page_size: int,
    calibrate_block: BlockCalibration,
    stats: Stats,
    kv_scales: Tensor,
) -> list[Tensor]:
    """One block (a decoder layer, or an MTP layer around one): its modules' ranges over every window and
    its decoder layer's K / V ranges; the block's outputs per window, computed by the block as loaded.
    `inputs[w]` are the block's tensor inputs before (meta, KV cache, KV scales)."""
    layer.self_attn.kv_layer = 0  # the skeleton's own layer: it addresses a one-layer cache

    def run(copy: nn.Module) -> None:
        for args, batch in zip(inputs, batches):
            copy(*args, _meta(batch), _one_layer_cache(layer, batch, page_size, args[0]), kv_scales)

    stats.update(calibrate_block(block, prefix, run))
    outputs = []
    with torch.no_grad():
        for args, batch in zip(inputs, batches):
            kv = _one_layer_cache(layer, batch, page_size, args[0])
            outputs.append(block(*args, _meta(batch), kv, kv_scales))
            for which, kind in enumerate("kv"):
                key = f"kv.{kv_layer}.{kind}"
                stats[key] = max(stats.get(key, 0.0), _abs_max(kv[0, which]))
    return outputs
