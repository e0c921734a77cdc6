"""The attention work plan, built once per step from the batch metadata and shared by every layer.

    plan = hy3.attention_plan(seq_lens, query_start_loc, KV_TILE, prefill_q_block(group))  # int32 [2, B + 1]

Row 0 is the exclusive prefix sum of each request's KV tiles (KV_TILE tokens each): the global order of
all the step's KV tiles. Decode attention splits that order into `num_ctas` equal contiguous ranges —
every CTA gets ceil(tiles / CTAs) tiles or fewer, whatever the mix of sequence lengths — and each range
is cut into segments at request boundaries. Row 1 is the prefix sum of each request's query blocks
(`prefill_q_block(group)` tokens) for the prefill kernel's grid. Everything is computed on the device (no host sync), so
CUDA graphs capture it.

`decode_segments` is the same schedule as a pure Python function (used by tests and benchmarks): for
every (CTA, request) pair it lists the tile range the CTA computes and the partial-result slot it
writes (`cta + request`, unique because segments move monotonically through (CTA, request) space).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_TILE = 256
PREFILL_ROWS = 128  # query rows (tokens × heads of one KV group) per prefill program


def prefill_q_block(group: int, rows: int = PREFILL_ROWS) -> int:
    """Query tokens per prefill block for a GQA group size (the plan's row 1 must use the same)."""
    return max(rows // group, 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Segment:
    cta: int
    request: int
    first_tile: int  # global tile index
    last_tile: int  # exclusive
    slot: int  # partial-result slot: cta + request


def tile_starts(seq_lens: list[int], tile: int = KV_TILE) -> list[int]:
    starts = [0]
    for length in seq_lens:
        starts.append(starts[-1] + cdiv(length, tile))
    return starts


def tiles_per_cta(total_tiles: int, num_ctas: int, min_tiles: int = 1, min_ctas: int = 1) -> int:
    """Each CTA's quota: an equal share of the tiles over num_ctas — or, where that share is below
    min_tiles, up to min_tiles, leaving CTAs idle rather than cutting long requests into many short
    ranges; but at most the equal share over min_ctas CTAs (rounded up: with few tiles, as few as about
    half of min_ctas CTAs get work — the rule as measured on the H200)."""
    return max(cdiv(total_tiles, num_ctas), min(min_tiles, cdiv(total_tiles, min_ctas)), 1)


def decode_segments(
    seq_lens: list[int], num_ctas: int, tile: int = KV_TILE, min_tiles: int = 1, min_ctas: int = 1
) -> list[Segment]:
    """The dynamic split-KV schedule: contiguous equal tile ranges per CTA, cut at request boundaries."""
    starts = tile_starts(seq_lens, tile)
    quota = tiles_per_cta(starts[-1], num_ctas, min_tiles, min_ctas)
    segments = []
    for cta in range(num_ctas):
        t, end = cta * quota, min((cta + 1) * quota, starts[-1])
        while t < end:
            request = max(r for r in range(len(seq_lens)) if starts[r] <= t)
            seg_end = min(end, starts[request + 1])
            segments.append(Segment(cta, request, t, seg_end, cta + request))
            t = seg_end
    return segments


def combine_slots(
    seq_lens: list[int],
    request: int,
    num_ctas: int,
    tile: int = KV_TILE,
    min_tiles: int = 1,
    min_ctas: int = 1,
) -> list[int]:
    """The partial-result slots the combine kernel reads for one request (in tile order)."""
    starts = tile_starts(seq_lens, tile)
    quota = tiles_per_cta(starts[-1], num_ctas, min_tiles, min_ctas)
    first, last = starts[request], starts[request + 1]
    if first == last:
        return []
    return [cta + request for cta in range(first // quota, (last - 1) // quota + 1)]
