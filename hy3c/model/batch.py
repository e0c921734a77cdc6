"""Build the flat, paged inputs of one model step from per-request chunks.

A step holds any mix of requests; each contributes a `SeqChunk`: its new tokens, the position of the
first one (= tokens already in the KV cache) and the pages that cover every position up to the last new
token. `build_step_batch` turns the chunks into the tensors `Hy3ForCausalLM.forward` takes;
`token_inputs` is its part that does not depend on the page table, which the serving engine's
persistent builder (`hy3c.serve.engine.step_inputs`) shares.
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
    # [2, F] int64 when F tokens are fed from the device (overlapped scheduling, StepInputs): row 0 the
    # token indices whose ids the previous step's draws fill in, row 1 the draw rows they take
    feed_index: Tensor | None = None

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


@dataclass
class TokenInputs:
    """A step's inputs other than the page table, as host lists: per fed token its id, position and KV
    slot; the logits rows and the request each belongs to; per request its query start (plus the end)
    and sequence length. Building them costs O(tokens fed + pages those tokens touch)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)


VECTOR_TOKENS = 64  # chunks at least this long get their positions and slots from numpy (a prefill)


def token_inputs(chunks: list[SeqChunk], page_size: int) -> TokenInputs:
    """The `TokenInputs` of the chunks; a chunk whose pages cannot hold its tokens is a ValueError
    naming the request's index."""
    out = TokenInputs()
    for r, chunk in enumerate(chunks):
        end = chunk.start + len(chunk.tokens)
        needed = -(-end // page_size)
        if len(chunk.pages) < needed:
            raise ValueError(
                f"request {r}: {len(chunk.pages)} pages cannot hold {end} tokens (page size {page_size})"
            )
        first_row = len(out.ids)
        out.ids.extend(chunk.tokens)
        if len(chunk.tokens) >= VECTOR_TOKENS:
            positions = np.arange(chunk.start, end, dtype=np.int64)
            first_page = chunk.start // page_size
            pages = np.asarray(chunk.pages[first_page:needed], dtype=np.int64)
            out.positions.extend(positions.tolist())
            out.slots.extend(
                (pages[positions // page_size - first_page] * page_size + positions % page_size).tolist()
            )
        else:
            for pos in range(chunk.start, end):
                out.positions.append(pos)
                out.slots.append(chunk.pages[pos // page_size] * page_size + pos % page_size)
        if chunk.logits == "all":
            rows = list(range(first_row, len(out.ids)))
        elif chunk.logits == "last" and chunk.tokens:
            rows = [len(out.ids) - 1]
        else:
            rows = []
        out.logits_rows.extend(rows)
        out.owners.extend([r] * len(rows))
        out.starts.append(len(out.ids))
        out.seq_lens.append(end)
    return out


def build_step_batch(chunks: list[SeqChunk], page_size: int, device: torch.device | str = "cpu") -> StepBatch:
    """The step's batch, its page table rebuilt from every chunk's pages: O(context) host work per step.
    The serving engine keeps its page table on the device instead (`hy3c.serve.engine.step_inputs`);
    this stays for one-off steps (tests, references, offline checks)."""
    inputs = token_inputs(chunks, page_size)
    max_pages = max((len(c.pages) for c in chunks), default=1) or 1
    table: list[int] = []
    for chunk in chunks:
        table.extend(chunk.pages)
        table.extend([0] * (max_pages - len(chunk.pages)))
    return _packed_batch(
        inputs.ids,
        inputs.positions,
        inputs.slots,
        inputs.logits_rows,
        table,
        max_pages,
        inputs.seq_lens,
        inputs.starts,
        inputs.owners,
        device,
    )


def aligned(n: int, elements: int) -> int:
    """n rounded up to a multiple of `elements` (so the next segment starts 16-byte aligned)."""
    return -(-n // elements) * elements


def host_tensor(values: list[int], dtype: type) -> Tensor:
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
    gap = [0] * (aligned(t, 2) - t)
    wide = host_tensor([*ids, *gap, *positions, *gap, *slots, *gap, *logits_rows], np.int64)
    lens_at = aligned(cells, 4)
    starts_at = lens_at + aligned(b, 4)
    narrow = host_tensor(
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
