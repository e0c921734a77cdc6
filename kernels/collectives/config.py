"""When the fused all-reduce runs one-shot and when two-shot: a table keyed by the GPU (its key, as for
the FusedMoE tables: "NVIDIA H200" → h200) and the group's world size.

One-shot (every rank reads every peer's rows) moves (world − 1) × the rows into each GPU but needs one
barrier between the copy and the result; two-shot (each rank reduces 1/world of the rows, then gathers
the others' results) moves about 2 × the rows and needs two. So one-shot wins while a step's rows are
few (latency-bound) and two-shot once bandwidth dominates. Steps above `BUFFER_TOKENS` rows leave the
symmetric buffer and run the reference (NCCL), which is bandwidth-optimal there.

Every value here is an untuned default: the measurements on several GPUs are a later issue, which
replaces these numbers (and adds the GPUs it measures). A GPU without an entry gets `DEFAULT`.
"""

from __future__ import annotations

from hy3c.kernels.moe.config import device_key

# rows a step may have for the one-shot kernel (inclusive); more rows run two-shot. UNTUNED DEFAULTS.
ONE_SHOT_MAX_TOKENS: dict[str, dict[int, int]] = {
    "h200": {2: 256, 4: 128, 8: 64},
}
DEFAULT: dict[int, int] = {2: 128, 4: 64, 8: 32}  # GPUs without an entry (and other world sizes: the min)

# rows of every symmetric buffer (one per group, hidden size and dtype): 64 MiB at 4096 bf16 columns
BUFFER_TOKENS = 8192

UNTUNED = True  # the tables above are not measured yet


def one_shot_max_tokens(gpu_key: str | None, world_size: int) -> int:
    """The largest row count that runs one-shot on this GPU (by key) and world size."""
    table = ONE_SHOT_MAX_TOKENS.get(gpu_key or "", DEFAULT)
    return table.get(world_size, min(table.values()))


def gpu_key(gpu_name: str | None) -> str | None:
    """The table key of a GPU name (None for no GPU)."""
    return None if gpu_name is None else device_key(gpu_name)


def table_for(key: str) -> str:
    """What a target (a GPU key) runs, as the compile report says it."""
    rows = ONE_SHOT_MAX_TOKENS.get(key, DEFAULT)
    source = f"the {key} table" if key in ONE_SHOT_MAX_TOKENS else "the DEFAULT table"
    limits = ", ".join(f"{tokens} rows at {world} ranks" for world, tokens in sorted(rows.items()))
    return (
        f"one-shot up to {limits}, two-shot above ({source}: {'untuned defaults' if UNTUNED else 'measured'})"
    )
