"""Build the flat, paged inputs of one model step from per-request chunks.

A step holds any mix of requests; each contributes a `SeqChunk`: its new tokens, the position of the
first one (= tokens already in the KV cache) and the pages that cover every position up to the last new
token. `build_step_batch` turns the chunks into the tensors `Hy3ForCausalLM.forward` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor


@dataclass
class SeqChunk:
    tokens: list[int]
    start: int
    pages: list[int]
    logits: Literal["last", "all", "none"] = "last"


@dataclass
class StepBatch:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    page_table: Tensor  # [B, max_pages] int32
    seq_lens: Tensor  # [B] int32
    query_start_loc: Tensor  # [B + 1] int32
    slot_mapping: Tensor  # [T] int64
    logits_indices: Tensor  # [S] int64
    logits_owner: list[int] = field(default_factory=list)  # request index of each logits row
    # [3, T] view over input_ids, positions and slot_mapping when they share storage (build_step_batch):
    # one copy moves all three
    token_rows: Tensor | None = None

    def model_args(self, kv_cache: Tensor) -> tuple[Tensor, ...]:
        """Positional arguments of Hy3ForCausalLM.forward."""
        return (
            self.input_ids,
            self.positions,
            kv_cache,
            self.page_table,
            self.seq_lens,
            self.query_start_loc,
            self.slot_mapping,
            self.logits_indices,
        )


def build_step_batch(chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu") -> StepBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    owners: list[int] = []
    starts = [0]
    seq_lens = []
    max_pages = max((len(c.pages) for c in chunks), default=1) or 1
    table: list[int] = []
    for r, chunk in enumerate(chunks):
        end = chunk.start + len(chunk.tokens)
        needed = -(-end // page_size)
        if len(chunk.pages) < needed:
            raise ValueError(
                f"request {r}: {len(chunk.pages)} pages cannot hold {end} tokens (page size {page_size})"
            )
        first_row = len(ids)
        ids.extend(chunk.tokens)
        for pos in range(chunk.start, end):
            positions.append(pos)
            slots.append(chunk.pages[pos // page_size] * page_size + pos % page_size)
        if chunk.logits == "all":
            rows = list(range(first_row, len(ids)))
        elif chunk.logits == "last" and chunk.tokens:
            rows = [len(ids) - 1]
        else:
            rows = []
        logits_rows.extend(rows)
        owners.extend([r] * len(rows))
        starts.append(len(ids))
        seq_lens.append(end)
        table.extend(chunk.pages)
        table.extend([0] * (max_pages - len(chunk.pages)))

    return _packed_batch(
        ids, positions, slots, logits_rows, table, max_pages, seq_lens, starts, owners, device
    )


def _aligned(n: int, elements: int) -> int:
    """n rounded up to a multiple of `elements` (so the next segment starts 16-byte aligned)."""
    return -(-n // elements) * elements


def _host_tensor(values: list[int], dtype: type) -> Tensor:
    """A CPU tensor of Python ints through numpy: 3-4x faster than torch.tensor on a list."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def _packed_batch(
    ids: list[int],
    positions: list[int],
    slots: list[int],
    logits_rows: list[int],
    table: list[int],
    max_pages: int,
    seq_lens: list[int],
    starts: list[int],
    owners: list[int],
    device: torch.device | str,
) -> StepBatch:
    """The batch as views of two tensors (int64: ids | positions | slots | logits rows; int32: page
    table | sequence lengths | query starts), so reaching the device costs two copies, not seven. Each
    segment starts 16-byte aligned (Triton compiles one kernel variant per pointer alignment class)."""
    t, b, cells = len(ids), len(seq_lens), len(table)
    gap = [0] * (_aligned(t, 2) - t)
    wide = _host_tensor([*ids, *gap, *positions, *gap, *slots, *gap, *logits_rows], np.int64)
    lens_at = _aligned(cells, 4)
    starts_at = lens_at + _aligned(b, 4)
    narrow = _host_tensor(
        [*table, *[0] * (lens_at - cells), *seq_lens, *[0] * (starts_at - lens_at - b), *starts], np.int32
    )
    wide, narrow = wide.to(device), narrow.to(device)
    token_rows = wide[: 3 * (t + len(gap))].view(3, t + len(gap))[:, :t]
    return StepBatch(
        input_ids=token_rows[0],
        positions=token_rows[1],
        page_table=narrow[:cells].view(b, max_pages),
        seq_lens=narrow[lens_at : lens_at + b],
        query_start_loc=narrow[starts_at:],
        slot_mapping=token_rows[2],
        logits_indices=wide[3 * (t + len(gap)) :],
        logits_owner=owners,
        token_rows=token_rows,
    )
