"""Write the artifact's weights: stream checkpoint tensors, apply the passes' weight plan, write shards.

Each graph parameter is assembled from the checkpoint one at a time (`hy3c.checkpoint.loader.assemble_tensors`);
weights listed in the quantize pass's plan are converted to FP8 with their scales; everything else is
cast to the dtype the graph expects. Peak memory is one parameter plus one pending shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import fx
from tqdm import tqdm

from hy3c.checkpoint.loader import CheckpointLayout, assemble_tensors
from hy3c.checkpoint.safetensors_io import ShardedWriter
from hy3c.ops.quant import quantize_weight, split_router_weight
from hy3c.passes.weight_plan import weight_plan
from hy3c.program.manifest import files_sha256

WEIGHTS_DIR = "weights"
WEIGHT_NAMES = ("rank0.safetensors.index.json", "rank0.safetensors")


def derive_weights(
    gm: fx.GraphModule,
    sources: Callable[[dict[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]],
    source_dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of gm, one source tensor at a time, as the passes' weight plan says: FP8 weights
    quantized with their scales, router weights split into bf16 halves, the rest cast to the graph dtype.

    `sources(shapes)` yields (fqn, tensor) for the requested source shapes (fqn → meta tensor)."""
    params = dict(gm.named_parameters())
    plan = weight_plan(gm)
    fp8 = {fqn: e for fqn, e in plan.items() if e["kind"] == "fp8"}
    splits = {e["source"]: (fqn, e["lo"]) for fqn, e in plan.items() if e["kind"] == "router_split"}
    derived = {e["scale"] for e in fp8.values()} | {name for pair in splits.values() for name in pair}
    shapes = {
        fqn: torch.empty(p.shape, dtype=source_dtype if fqn in fp8 else p.dtype, device="meta")
        for fqn, p in params.items()
        if fqn not in derived
    }
    for fqn, tensor in sources(shapes):
        if fqn in fp8:
            quantized, scale = quantize_weight(tensor, fp8[fqn]["granularity"])
            yield fqn, quantized
            yield fp8[fqn]["scale"], scale.to(params[fp8[fqn]["scale"]].dtype)
        else:
            yield fqn, tensor.to(params[fqn].dtype)
        if fqn in splits:
            yield from zip(splits[fqn], split_router_weight(tensor.float()))


def write_weights(
    gm: fx.GraphModule,
    layout: CheckpointLayout,
    checkpoint: Path,
    source_dtype: torch.dtype,
    out: Path,
    max_shard_bytes: int = 4 << 30,
    progress: bool | None = None,
) -> list[dict[str, object]]:
    """Write every parameter of gm into out/weights/; returns [{name, bytes, sha256}] per file."""
    directory = out / WEIGHTS_DIR
    directory.mkdir(parents=True)
    writer = ShardedWriter(directory, max_shard_bytes, names=WEIGHT_NAMES)
    disable = None if progress is None else not progress
    with tqdm(
        total=len(dict(gm.named_parameters())), desc="packaging weights", unit="tensor", disable=disable
    ) as bar:
        for fqn, tensor in derive_weights(
            gm, lambda shapes: assemble_tensors(layout, shapes, checkpoint), source_dtype
        ):
            writer.add(fqn, tensor)
            del tensor
            bar.update(1)
    paths = [directory / name for name in writer.close()]
    return [
        {"name": f"{WEIGHTS_DIR}/{path.name}", "bytes": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, files_sha256(paths))
    ]
