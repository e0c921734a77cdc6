"""Write the artifact's weights: stream checkpoint tensors, apply the passes' weight and shard plans,
write each rank's files.

Each graph parameter is assembled whole from the checkpoint one at a time
(`hy3c.checkpoint.loader.assemble_tensors`); weights listed in the quantize pass's plan are converted to
FP8 (or int4 experts) with their scales (computed over the whole tensor, so every rank's slice carries the scales a
single-rank program would use); everything else is cast to the dtype the graph expects. Then every
rank gets its slice as the shard plan says (`hy3c.passes.shard_plan`), or the whole tensor where the
parameter is replicated, into `weights/rank{r}*.safetensors`. Peak memory is one parameter plus one
pending shard per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import fx
from tqdm import tqdm

from hy3c.checkpoint.loader import CheckpointLayout, assemble_tensors
from hy3c.checkpoint.safetensors_io import ShardedWriter
from hy3c.ops.quant import quantize_int4_groups, quantize_weight, split_router_weight
from hy3c.passes.shard_plan import cut, derived_spec, shard_plan
from hy3c.passes.weight_plan import weight_plan
from hy3c.program.manifest import files_sha256
from hy3c.recipe import ParallelSpec

WEIGHTS_DIR = "weights"


def weight_names(rank: int) -> tuple[str, str]:
    """The index and single-file names of one rank's weights."""
    return f"rank{rank}.safetensors.index.json", f"rank{rank}.safetensors"


def derive_weights(
    gm: fx.GraphModule,
    sources: Callable[[dict[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]],
    source_dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of gm, one source tensor at a time, as the passes' weight plan says: FP8 weights
    quantized with their scales, router weights split into bf16 halves, the rest cast to the graph dtype.

    `sources(shapes)` yields (fqn, tensor) for the requested source shapes (fqn → meta tensor)."""
    params = dict(gm.named_parameters())
    shards = shard_plan(gm)
    plan = weight_plan(gm)
    fp8 = {fqn: e for fqn, e in plan.items() if e["kind"] == "fp8"}
    int4 = {fqn: e for fqn, e in plan.items() if e["kind"] == "w4a8"}
    splits = {e["source"]: (fqn, e["lo"]) for fqn, e in plan.items() if e["kind"] == "router_split"}
    derived = {e["scale"] for e in (*fp8.values(), *int4.values())}
    derived |= {name for pair in splits.values() for name in pair}

    def source_shape(fqn: str, param: torch.Tensor) -> torch.Tensor:
        if fqn in int4:  # packed int4: the checkpoint holds the whole unpacked weight
            return torch.empty(int4[fqn]["shape"], dtype=source_dtype, device="meta")
        shape = shards[fqn]["global_shape"] if fqn in shards else param.shape
        return torch.empty(shape, dtype=source_dtype if fqn in fp8 else param.dtype, device="meta")

    shapes = {fqn: source_shape(fqn, p) for fqn, p in params.items() if fqn not in derived}
    for fqn, tensor in sources(shapes):
        if fqn in fp8:
            quantized, scale = quantize_weight(tensor, fp8[fqn]["granularity"])
            yield fqn, quantized
            yield fp8[fqn]["scale"], scale.to(params[fp8[fqn]["scale"]].dtype)
        elif fqn in int4:
            packed, scale = quantize_int4_groups(tensor, int4[fqn]["group"])
            yield fqn, packed
            yield int4[fqn]["scale"], scale
        else:
            yield fqn, tensor.to(params[fqn].dtype)
        if fqn in splits:
            yield from zip(splits[fqn], split_router_weight(tensor.float()))


def program_parameters(gm: fx.GraphModule) -> set[str]:
    """The parameters a program needs: those its graph reads, and the checkpoint weights the weight
    plan derives others from (a router's fp32 source). The traced module also holds parameters its
    graph never reads (the step program: the MTP layer's), which are not the program's."""
    read = {str(node.target) for node in gm.graph.nodes if node.op == "get_attr"}
    return read | {e["source"] for e in weight_plan(gm).values() if "source" in e}


def merge_programs(programs: list[fx.GraphModule]) -> fx.GraphModule:
    """One module holding the parameters of every program (a name two programs share, e.g. embed_tokens
    and lm_head, once) with their weight and shard plans merged: what `derive_weights` and
    `write_weights` take, so a shared weight is derived and stored once. Refuses programs that type a
    shared parameter, or plan it, differently (they would need two tensors). Parameters no program
    reads are left out."""
    merged = fx.GraphModule(torch.nn.Module(), fx.Graph())
    seen: dict[str, torch.Tensor] = {}
    for gm in programs:
        needed = program_parameters(gm)
        for fqn, tensor in gm.named_parameters():
            if fqn not in needed:
                continue
            if fqn in seen:
                if seen[fqn].shape != tensor.shape or seen[fqn].dtype != tensor.dtype:
                    raise ValueError(f"parameter {fqn}: the programs hold it with different shapes or dtypes")
                continue
            seen[fqn] = tensor
            *path, leaf = fqn.split(".")
            module: torch.nn.Module = merged
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        for plan, merged_plan in (
            (weight_plan(gm), weight_plan(merged)),
            (shard_plan(gm), shard_plan(merged)),
        ):
            for fqn, entry in plan.items():
                if fqn not in seen:
                    continue
                if merged_plan.setdefault(fqn, entry) != entry:
                    raise ValueError(f"parameter {fqn}: the programs plan it differently")
    return merged


def rank_slices(
    gm: fx.GraphModule, parallel: ParallelSpec
) -> Callable[[str, torch.Tensor], list[torch.Tensor]]:
    """fqn, whole tensor → the tensor of each rank (the same object where it is replicated)."""
    shards = shard_plan(gm)
    sources = {e["scale"]: fqn for fqn, e in weight_plan(gm).items() if e["kind"] == "fp8"}

    def slices(fqn: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        spec = shards.get(fqn)
        if spec is None and sources.get(fqn) in shards:
            spec = derived_spec(shards[sources[fqn]], list(tensor.shape))
        if spec is None:
            return [tensor] * parallel.world_size
        return [
            cut(tensor, spec, parallel.group_rank(spec["group"], rank)) for rank in range(parallel.world_size)
        ]

    return slices


def write_weights(
    gm: fx.GraphModule,
    layout: CheckpointLayout,
    checkpoint: Path,
    source_dtype: torch.dtype,
    out: Path,
    parallel: ParallelSpec,
    max_shard_bytes: int = 4 << 30,
    progress: bool | None = None,
) -> list[dict[str, object]]:
    """Write every rank's parameters of gm into out/weights/; returns [{name, bytes, sha256, rank}] per
    file."""
    directory = out / WEIGHTS_DIR
    directory.mkdir(parents=True)
    world = parallel.world_size
    per_rank_bytes = max(max_shard_bytes // world, 1 << 28) if world > 1 else max_shard_bytes
    writers = [ShardedWriter(directory, per_rank_bytes, names=weight_names(r)) for r in range(world)]
    slices = rank_slices(gm, parallel)
    disable = None if progress is None else not progress
    with tqdm(
        total=len(dict(gm.named_parameters())), desc="packaging weights", unit="tensor", disable=disable
    ) as bar:
        for fqn, tensor in derive_weights(
            gm, lambda shapes: assemble_tensors(layout, shapes, checkpoint), source_dtype
        ):
            for writer, part in zip(writers, slices(fqn, tensor)):
                writer.add(fqn, part)
            del tensor
            bar.update(1)
    files = []
    for rank, writer in enumerate(writers):
        paths = [directory / name for name in writer.close()]
        files += [
            {
                "name": f"{WEIGHTS_DIR}/{path.name}",
                "bytes": path.stat().st_size,
                "sha256": digest,
                "rank": rank,
            }
            for path, digest in zip(paths, files_sha256(paths))
        ]
    return files
