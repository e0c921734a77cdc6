"""A step's model inputs built with host work that does not grow with the context.

`build_step_batch` (hy3c.model.batch) writes every request's whole page table on the host each step:
at 128K tokens and page size 64 that is 2048 cells per request per step, packed and copied again. A
`StepInputs` keeps the page table on the step's device instead — a row per request (its owner: any
hashable the engine names it by, e.g. its `Sequence`) that lives as long as the request — and per
step writes only the cells of pages appended since the owner's last step. The host work of `build` is
then O(tokens fed + pages added + requests); the batch's page table is the batch's rows of the
persistent table, gathered on the device (`index_select`, one kernel), as wide as the batch's longest
page list: the same [B, max_pages] int32 tensor `build_step_batch` gives, so the model, the CUDA-graph
runner (`DecodeGraphs`) and the rank broadcast (`pack_batch`) take it unchanged.

    inputs = StepInputs(page_size, device, rows=max_num_seqs, pages=ceil(max_model_len / page_size))
    batch = inputs.build(chunks, [w.seq for w in work])   # each step, instead of build_step_batch
    inputs.write_decode(chunks, seqs, feed, graph_inputs, block)  # a decode step a sampled graph replays
    inputs.drop(seq)                                       # a request left: its row is free again

A request's pages are read from its chunk: the list may grow by appending (the scheduler's `_grow`);
a different list object, a shorter one, or one whose last known page changed (pages replaced: a
preemption, a readmission over the prefix cache) makes its row written again from scratch. The table
grows (doubling) when more requests or longer page lists come than it has room for.

On CUDA the step's host values go up through pinned memory without blocking (`pin_memory`: torch's
caching host allocator, which keeps a block until the copy that reads it is done), so building step
N+1 does not wait for step N on the device: a copy from pageable memory with `non_blocking=False`
synchronizes the stream first. Elsewhere the host tensors are the batch.

`cells_written` counts the page-table cells `build` wrote, in all (instrumentation: a decode step
writes at most one per request, whatever the context).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from hy3c.model.batch import SeqChunk, StepBatch, aligned, token_inputs
from hy3c.runtime.cuda_graphs import DecodeInputs


@dataclass
class _Row:
    """A request's row of the table and what of its pages the row holds: the first `written` entries
    of `pages` (the list object the last chunk carried), the last of them `last`."""

    index: int
    pages: Sequence[int]
    written: int = 0
    last: int | None = None


class StepInputs:
    """A persistent page table (one row per live request) and the step-input builder over it."""

    def __init__(self, page_size: int, device: torch.device | str, rows: int = 8, pages: int = 64) -> None:
        if page_size < 1 or rows < 1 or pages < 1:
            raise ValueError(
                f"StepInputs: page_size ({page_size}), rows ({rows}) and pages ({pages}) must be ≥ 1"
            )
        self.page_size = page_size
        self.device = torch.device(device)
        self.table = torch.zeros(rows, pages, dtype=torch.int32, device=self.device)
        self._rows: dict[Hashable, _Row] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # lowest first
        self.cells_written = 0

    @property
    def num_requests(self) -> int:
        """Requests holding a row."""
        return len(self._rows)

    def row_of(self, owner: Hashable) -> int | None:
        """The table row of a request (None if it holds none)."""
        row = self._rows.get(owner)
        return None if row is None else row.index

    def drop(self, owner: Hashable) -> None:
        """The request left (finished, aborted, failed): its row is cleared and free for another. A
        request that holds no row is ignored."""
        row = self._rows.pop(owner, None)
        if row is None:
            return
        if row.written:
            self.table[row.index, : row.written].zero_()
        self._free_rows.append(row.index)

    def build(
        self,
        chunks: list[SeqChunk],
        owners: Sequence[Hashable],
        feed: Sequence[tuple[int, int]] = (),
    ) -> StepBatch:
        """The step's batch for `chunks`, chunk r being request `owners[r]`'s (equal, value for value,
        to `build_step_batch(chunks, page_size, device)`). A request seen for the first time gets a row.
        `feed`: (token index, draw row) of the tokens the previous step's draws fill in, uploaded with
        the rest as the batch's `feed_index` ([2, F]; None when empty)."""
        if len(owners) != len(chunks):
            raise ValueError(f"StepInputs.build: {len(chunks)} chunks but {len(owners)} owners")
        inputs = token_inputs(chunks, self.page_size)
        width = max((len(c.pages) for c in chunks), default=1) or 1
        rows, cells, values = self._rows_and_cells(chunks, owners)
        t, b, s, u, f = len(inputs.ids), len(rows), len(inputs.logits_rows), len(cells), len(feed)
        # int64: ids | positions | slots | logits rows | cells | feed; int32: lengths | starts | rows | values;
        # every segment 16-byte aligned (Triton compiles a kernel variant per pointer alignment class)
        tt, ss = aligned(t, 2), aligned(s, 2)
        gap = [0] * (tt - t)
        wide = [*inputs.ids, *gap, *inputs.positions, *gap, *inputs.slots, *gap, *inputs.logits_rows]
        wide.extend([0] * (ss - s))
        wide.extend(cells)
        wide.extend(target for target, _ in feed)
        wide.extend(source for _, source in feed)
        bb, starts = aligned(b, 4), aligned(b + 1, 4)
        narrow = [*inputs.seq_lens, *[0] * (bb - b), *inputs.starts, *[0] * (starts - b - 1), *rows]
        narrow.extend([0] * (bb - b))
        narrow.extend(values)
        wide_d = self._upload(np.array(wide, np.int64))
        narrow_d = self._upload(np.array(narrow, np.int32))
        token_block, logits_indices, cells_d, feed_d = wide_d.split_with_sizes([3 * tt, ss, u, 2 * f])
        seq_lens, query_start_loc, rows_d, values_d = narrow_d.split_with_sizes([bb, starts, bb, u])
        if u:
            self.table.view(-1).index_copy_(0, cells_d, values_d)
        token_rows = token_block.view(3, tt)[:, :t]
        input_ids, positions, slot_mapping = token_rows.unbind(0)
        return StepBatch(
            input_ids=input_ids,
            positions=positions,
            page_table=self.table[:, :width].index_select(0, rows_d[:b]),
            seq_lens=seq_lens[:b],
            query_start_loc=query_start_loc[: b + 1],
            slot_mapping=slot_mapping,
            logits_indices=logits_indices[:s],
            logits_owner=inputs.owners,
            token_rows=token_rows,
            feed_index=feed_d.view(2, f) if f else None,
        )

    def write_decode(
        self,
        chunks: list[SeqChunk],
        owners: Sequence[Hashable],
        feed: Sequence[tuple[int, int]],
        graph_inputs: DecodeInputs,
        block: Tensor,
    ) -> None:
        """`build` for a decode step that a sampled decode graph replays (one token per request, each
        its logits row): the same values written into the graphs' `graph_inputs` — one copy — rather
        than a batch (`hy3c.runtime.cuda_graphs.DecodeInputs`; the replay gathers its page-table rows
        from `table`: `DecodeGraphs.replay_written`). `feed`: (token index, draw row) as for `build`, the draw rows being rows of
        `graph_inputs.drawn`; `block`: the sampler's parameter block."""
        if len(owners) != len(chunks) or any(len(c.tokens) != 1 or c.logits != "last" for c in chunks):
            raise ValueError("StepInputs.write_decode: one token and its logits row per request")
        inputs = token_inputs(chunks, self.page_size)
        rows, cells, values = self._rows_and_cells(chunks, owners)
        if cells:  # a request's pages grew (every page_size steps of a decode)
            cells_d = self._upload(np.array(cells, np.int64))
            self.table.view(-1).index_copy_(0, cells_d, self._upload(np.array(values, np.int32)))
        fed = [-1] * len(chunks)
        for target, source in feed:
            fed[target] = source
        graph_inputs.write(inputs.ids, inputs.positions, inputs.slots, fed, inputs.seq_lens, rows, block)

    def _rows_and_cells(
        self, chunks: list[SeqChunk], owners: Sequence[Hashable]
    ) -> tuple[list[int], list[int], list[int]]:
        """Each request's table row (a new request gets one), and the cells of the pages added since
        its last step (flat indices into the table) with their values; the host's record of what each
        row holds moves on."""
        if len(set(owners)) != len(owners):
            raise ValueError("StepInputs: a request appears twice in one step's owners")
        width = max((len(c.pages) for c in chunks), default=1) or 1
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], width)
        columns = self.table.shape[1]
        rows: list[int] = []
        cells: list[int] = []
        values: list[int] = []
        for owner, chunk in zip(owners, chunks):
            pages = chunk.pages
            row = self._sync(owner, pages)
            rows.append(row.index)
            if row.written < len(pages):
                base = row.index * columns
                cells.extend(range(base + row.written, base + len(pages)))
                values.extend(pages[row.written :])
                row.written, row.last = len(pages), pages[-1]
        self.cells_written += len(cells)
        return rows, cells, values

    def _sync(self, owner: Hashable, pages: Sequence[int]) -> _Row:
        """The request's row, made ready to take its pages from `row.written` on: a new request gets a
        free row; pages replaced since its last step clear the row (all of them are written again)."""
        row = self._rows.get(owner)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.table.shape[0], self.table.shape[1])
            row = self._rows[owner] = _Row(self._free_rows.pop(), pages)
        elif (
            row.pages is not pages
            or len(pages) < row.written
            or (row.written and pages[row.written - 1] != row.last)
        ):
            if row.written:
                self.table[row.index, : row.written].zero_()
            row.pages, row.written, row.last = pages, 0, None
        return row

    def _grow(self, rows: int, width: int) -> None:
        """A larger table: at least `rows` rows and `width` pages, the page count doubled as needed; rare,
        O(table) when it happens."""
        have_rows, have_pages = self.table.shape
        pages = have_pages
        while pages < width:
            pages *= 2
        table = torch.zeros(max(rows, have_rows), pages, dtype=torch.int32, device=self.device)
        table[:have_rows, :have_pages].copy_(self.table)
        self.table = table
        self._free_rows = list(range(table.shape[0] - 1, have_rows - 1, -1)) + self._free_rows

    def _upload(self, values: np.ndarray) -> Tensor:
        """The host values as a tensor on the device: through pinned memory without blocking on CUDA."""
        host = torch.from_numpy(values)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)
