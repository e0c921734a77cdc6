"""CUDA graphs for decode-shaped steps: a fixed number of tokens per request, captured per batch size.

    graphs = DecodeGraphs.capture(fn, gm, kv_cache, batch_sizes=[1, 2, 4, 8], max_pages=2048)
    out = graphs.run(batch, kv_cache)          # None when the batch is not one the graphs cover

One `DecodeGraphs` covers one program callable at `query_len` tokens per request and `rows_per_request`
logits rows per request: plain decode (1, 1), a speculative verify step of the step program (K+1, K+1:
every token's logits), the draft program over the verified tokens (K+1, 1: the row of each request is a
device-side index, copied in per replay) or its recursion (1, 1). `extra_widths` lists the widths of
extra [tokens, width] inputs (the draft program's `hidden_prev`), passed after the positions. Each graph
is captured over static input buffers at a padded batch size. A smaller batch is padded up: padding
requests get token 0 at position 0, slot -1 (the KV store skips them), sequence length `query_len` over
page 0, logits rows at their own tokens, and are cut from the outputs (they are reset only when a
smaller batch follows a larger one). Staging a batch built by `build_step_batch` takes three copies for
the token inputs (ids, positions and slots share one). Capture is refused — with the reason, so the
caller runs the step normally — when the program calls an op whose provider is not CUDA-graph safe
(it syncs with the host). The attention of q > 1 tokens per request is the prefill kernel, whose grid
depends on shapes only and whose plan is computed on the device, so those steps capture too.

Decode graphs with a sampler (plain decode that draws its next tokens in the replay) read their inputs
from one `DecodeInputs` shared by every batch size, which the serving engine fills with one
host-to-device copy per step (`DecodeInputs.write`, then `DecodeGraphs.replay_written`): see that class.
Off CUDA (tests), `capture(..., graphs=False)` keeps the same static buffers and runs the same body
uncaptured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, fx

from hy3c.kernels.registry import provider_by_target
from hy3c.logs import log_event
from hy3c.model.batch import StepBatch
from hy3c.ops.sample import SAMPLING_BLOCK_ROWS, SKIP_DRAW

log = logging.getLogger("hy3c.runtime.cuda_graphs")


def capture_blockers(gm: fx.GraphModule) -> list[str]:
    """Names of the ops in gm whose provider cannot be captured in a CUDA graph."""
    blockers = set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            provider = provider_by_target(node.target)
            if provider is not None and not provider.cuda_graph_safe:
                blockers.add(f"{provider.name}:{provider.op}")
    return sorted(blockers)


@dataclass
class _Padding:
    """From which request on a set of static buffers holds padding values (all of them at capture);
    shared by the graphs that share their buffers."""

    from_row: int = 0


@dataclass
class _Graph:
    size: int
    graph: torch.cuda.CUDAGraph | None  # None: uncaptured (`body` runs each time)
    body: Callable[[], tuple[Tensor, ...]]
    # input_ids, positions, page_table, seq_lens, query_start_loc, slot_mapping, logits_indices, and
    # token_rows: the [3, tokens] storage of input_ids / positions / slot_mapping (one copy stages them)
    inputs: tuple[Tensor, ...]
    extras: tuple[Tensor, ...]  # the extra [tokens, width] inputs (hidden_prev)
    outputs: tuple[Tensor, ...]  # logits rows, hidden; with a sampler, then its tokens and [rows, 2] draws
    padding: _Padding

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self.outputs = self.body()


class DecodeInputs:
    """The inputs of the sampled decode graphs, every batch size's, in one device buffer that one
    host-to-device copy fills.

    Staged from a `StepBatch`, a decode step puts a string of small device operations before its
    replay: the page-table rows gathered, the tokens still in flight fed in, the token inputs, lengths
    and the sampler's parameters copied into the graph's buffers — launches the GPU waits on between
    two graphs. Here the graphs read one persistent buffer of `size` request columns:

        int64 [4, size]   token ids the host knows, positions, KV slots, and `feed`: the row of the
                          previous step's draws (`drawn`) that is this token (−1: the host's id)
        int32 [2, size]   sequence lengths, and the rows of the engine's page table to gather
        int32 [5, width]  the sampler's parameter block (`hy3c.ops.sample.block_columns`)

    The host writes a step into a pinned mirror of it (two mirrors, used in turn: the copy of one may
    still be queued while the next step is written) and one copy moves the whole mirror; the graph
    feeds the in-flight tokens itself, from `drawn`, where every sampled decode graph leaves its draws.
    The page-table rows are gathered into the graphs' table by one kernel before the replay (the
    engine's table is a tensor the host may replace when it grows). Columns past the batch hold
    padding values (token 0 at position 0, slot −1, length 1, feed −1, no draw), in the mirrors and on
    the device alike.
    """

    WIDE, NARROW = 4, 2  # int64 rows (ids, positions, slots, feed); int32 rows (lengths, table rows)

    def __init__(self, size: int, max_pages: int, device: torch.device) -> None:
        size += -size % 4  # every row 16-byte aligned
        self.size = self.width = size
        ints = self.NARROW * size + SAMPLING_BLOCK_ROWS * size  # int32 values, an even count
        words = self.WIDE * size + ints // 2
        self.box = torch.zeros(words, dtype=torch.int64, device=device)
        self.wide, self.lengths, self.rows, self.sampling = self._views(self.box)
        self.page_table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
        self.query_starts = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(size, dtype=torch.int64, device=device)
        self.drawn = torch.zeros(size, dtype=torch.int64, device=device)  # the last sampled graph's tokens
        self.padding = _Padding()
        self.feeding = False  # some column's feed may be ≥ 0 (a written step fed tokens in flight)
        pinned = device.type == "cuda"
        self._mirrors = [torch.zeros(words, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._mirror_rows = [0, 0]  # columns of each mirror holding a step's values (the rest: padding)
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each mirror's last copy, queued
        self._next = 0
        for buffer in (self.box, *self._mirrors):
            self._pad(buffer, 0, size)

    def _views(self, buffer: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(wide [4, size], lengths [size], table rows [size], sampling [5, width]) over a buffer."""
        s = self.size
        narrow = buffer[self.WIDE * s :].view(torch.int32)
        wide = buffer[: self.WIDE * s].view(self.WIDE, s)
        return wide, narrow[:s], narrow[s : 2 * s], narrow[2 * s :].view(SAMPLING_BLOCK_ROWS, self.width)

    def _pad(self, buffer: Tensor, start: int, end: int) -> None:
        """Padding values in columns start..end of a buffer (the device box or a mirror)."""
        wide, lengths, rows, sampling = self._views(buffer)
        wide[:2, start:end].zero_()
        wide[2:, start:end].fill_(-1)
        lengths[start:end].fill_(1)
        rows[start:end].zero_()
        sampling[:, start:end].zero_()
        sampling[3, start:end].fill_(SKIP_DRAW)

    def write(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        feed: Sequence[int],
        lengths: Sequence[int],
        rows: Sequence[int],
        block: Tensor,
    ) -> None:
        """A decode step of len(ids) requests (one token each) into the device buffer: the values into
        the next pinned mirror, then one copy of it, without blocking. `feed[r]`: the row of `drawn`
        that is request r's token (−1: `ids[r]`); `rows[r]`: its page-table row; `block`: the sampler's
        [5, width] parameter block (`hy3c.serve.engine.sampler.sampling_block`)."""
        b = len(ids)
        if not 0 < b <= self.size or block.shape != self.sampling.shape:
            raise ValueError(
                f"DecodeInputs.write: {b} requests and a block of {list(block.shape)} for {self.size}"
                f" columns and a block of {list(self.sampling.shape)}"
            )
        turn = self._next
        self._next ^= 1
        copied = self._copied[turn]
        if copied is not None:  # done long since in steady decode (two steps ago): no wait
            copied.synchronize()
        mirror = self._mirrors[turn]
        wide, length_row, table_rows, sampling = self._views(mirror)
        if b < self._mirror_rows[turn]:
            self._pad(mirror, b, self._mirror_rows[turn])
        self._mirror_rows[turn] = b
        wide.numpy()[:, :b] = np.array([ids, positions, slots, feed], dtype=np.int64)
        length_row.numpy()[:b] = lengths
        table_rows.numpy()[:b] = rows
        sampling.copy_(block)
        self.box.copy_(mirror, non_blocking=True)
        if self.box.is_cuda:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        if b < self.padding.from_row:  # the copy padded the columns past b; the graphs' table too
            self.page_table[b : self.padding.from_row].zero_()
        self.padding.from_row = b
        self.feeding = True

    def gather_pages(self, b: int, table: Tensor) -> None:
        """The page-table rows of the written step's b requests from the engine's `table` ([rows,
        pages] int32, at least as many pages as the graphs take) into the graphs' table: one kernel."""
        width = self.page_table.shape[1]
        if table.shape[1] < width:
            raise ValueError(f"DecodeInputs: a page table of {table.shape[1]} pages for graphs of {width}")
        torch.index_select(table[:, :width], 0, self.rows[:b], out=self.page_table[:b])

    def stage(self, b: int) -> None:
        """Ready the device buffer for a `StepBatch`'s decode step of b requests, which the caller copies
        into its first b columns: no tokens fed from `drawn`, padding past them."""
        if self.feeding:
            self.wide[3, :b].fill_(-1)
        if b < self.padding.from_row:
            self._pad(self.box, b, self.padding.from_row)
            self.page_table[b : self.padding.from_row].zero_()
        self.feeding = False
        self.padding.from_row = b


class DecodeGraphs:
    """The graphs of one program at `query_len` tokens and `rows_per_request` logits rows per request."""

    def __init__(
        self,
        graphs: dict[int, _Graph],
        kv_cache: Tensor,
        max_pages: int,
        query_len: int = 1,
        rows_per_request: int = 1,
        inputs: DecodeInputs | None = None,
    ) -> None:
        self.graphs = graphs
        # the sampled decode graphs' shared inputs, with the sampler's [5, width] int32 parameter block
        self.inputs = inputs
        self.sampling = None if inputs is None else inputs.sampling
        self._draws_skipped = False  # the block's rows say SKIP_DRAW (set by `run`, cleared by a draw)
        self.kv_cache = kv_cache
        self.max_pages = max_pages
        self.query_len = query_len
        self.rows_per_request = rows_per_request
        self.sizes = sorted(graphs)

    @property
    def captured(self) -> bool:
        """Whether the graphs are CUDA graphs (else bodies run uncaptured: `capture(graphs=False)`)."""
        return all(g.graph is not None for g in self.graphs.values())

    @classmethod
    def capture(
        cls,
        fn: Callable[..., tuple[Tensor, Tensor]],
        gm: fx.GraphModule,
        kv_cache: Tensor,
        batch_sizes: list[int],
        max_pages: int,
        query_len: int = 1,
        rows_per_request: int = 1,
        extra_widths: tuple[int, ...] = (),
        extra_dtype: torch.dtype | None = None,
        pool: object | None = None,
        sampler: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
        graphs: bool = True,
    ) -> DecodeGraphs | str:
        """Capture one graph per batch size; returns the reason instead when capture is impossible.
        `pool`: a graph memory pool to share with other captures (one is made by default). `sampler`
        (one token and logits row per request only): captured behind the program, `sampler(logits,
        block)` → (tokens int64, [rows, 2] float64 draws) with `block` a static [5, width] int32
        parameter block (`hy3c.ops.sample.block_columns`; width: the largest batch size padded to a
        multiple of 4), so `run_sampled` and `replay_written` draw the next tokens in the replay; such
        graphs read `DecodeInputs`. `graphs=False` (off CUDA: tests) builds the same buffers and
        bodies uncaptured."""
        if graphs and kv_cache.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if query_len < 1 or rows_per_request not in (1, query_len):
            return (
                f"query_len {query_len} with {rows_per_request} logits rows per request is not a graph shape"
            )
        if sampler is not None and (query_len != 1 or extra_widths):
            return "a sampler is captured with one token, one logits row and no extra inputs per request only"
        blockers = capture_blockers(gm) if graphs else []
        if blockers:
            return f"ops without a CUDA-graph-safe provider: {', '.join(blockers)}"
        device = kv_cache.device
        if graphs:
            pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        q = query_len
        captured = {}
        shared = None if sampler is None else DecodeInputs(max(batch_sizes), max_pages, device)
        for size in sorted(batch_sizes, reverse=True):  # largest first: smaller graphs reuse its pool
            if shared is not None:
                static, body, padding = _sampled_body(fn, kv_cache, shared, size, sampler)
                extras: tuple[Tensor, ...] = ()
            else:
                static, extras, body = _plain_body(fn, kv_cache, size, max_pages, q, rows_per_request,
                                                   extra_widths, extra_dtype)  # fmt: skip
                padding = _Padding()
            graph = None
            if graphs:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream), torch.no_grad():
                    for _ in range(2):
                        body()
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                    outputs = body()
            else:
                with torch.no_grad():
                    outputs = body()
            captured[size] = _Graph(size, graph, body, static, extras, outputs, padding)
        log_event(
            log,
            "cuda_graphs_captured" if graphs else "decode_steps_built",
            sizes=",".join(map(str, sorted(captured))),
            max_pages=max_pages,
            query_len=q,
            rows_per_request=rows_per_request,
            sampled=sampler is not None,
        )
        return cls(captured, kv_cache, max_pages, q, rows_per_request, shared)

    def fits(self, batch: StepBatch, kv_cache: Tensor, query_len: int | None = None) -> bool:
        """Whether a graph covers the batch: every request with `query_len` tokens (the caller's word
        for it; without it, one token per request, or every token a logits row owned request by
        request as the host-side `logits_owner` shows), the logits rows as captured, the page table
        no wider than captured."""
        b = batch.seq_lens.shape[0]
        q = self.query_len
        if kv_cache is not self.kv_cache or b > self.sizes[-1] or batch.page_table.shape[1] > self.max_pages:
            return False
        if batch.input_ids.shape[0] != b * q or batch.logits_indices.shape[0] != b * self.rows_per_request:
            return False
        if query_len is not None:
            return query_len == q
        if q == 1:
            return True
        owners = batch.logits_owner
        return self.rows_per_request == q and len(owners) == b * q and owners == _owners(b, q)

    def run(
        self,
        batch: StepBatch,
        kv_cache: Tensor,
        extras: tuple[Tensor, ...] = (),
        query_len: int | None = None,
    ) -> tuple[Tensor, Tensor] | None:
        """Replay the graph covering the batch (its extra inputs `extras`); None when none does. A graph
        with a sampler replays without its draws (every row SKIP_DRAW): the caller samples the logits
        itself, and the last draw's parameters (top-p, say) would cost it a full draw."""
        g = self._stage(batch, kv_cache, extras, query_len)
        if g is None:
            return None
        if self.sampling is not None and not self._draws_skipped:
            self.sampling[3].fill_(SKIP_DRAW)
            self._draws_skipped = True
        g.replay()
        rows = batch.seq_lens.shape[0] * self.rows_per_request
        return g.outputs[0][:rows], g.outputs[1][: batch.input_ids.shape[0]]

    @property
    def sampling_width(self) -> int | None:
        """The columns of the sampler's parameter block `run_sampled` takes (None: no sampler)."""
        return None if self.sampling is None else self.sampling.shape[1]

    def run_sampled(
        self, batch: StepBatch, kv_cache: Tensor, block: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """Replay the graph covering the batch and draw a token per request in it with the sampler's
        parameters `block` (a host [5, sampling_width] int32 block: one copy, without blocking when
        pinned). Returns (logits rows, hidden, tokens int64, [requests, 2] float64 draws), valid until
        the next replay at this query length; None when no graph covers the batch or none samples."""
        if self.sampling is None:
            return None
        if block.shape != self.sampling.shape:
            shapes = f"{list(block.shape)}, the graphs take {list(self.sampling.shape)}"
            raise ValueError(f"run_sampled: a parameter block of {shapes}")
        g = self._stage(batch, kv_cache, (), 1)
        if g is None:
            return None
        pinned = block.is_pinned() or self.sampling.device.type != "cuda"
        self.sampling.copy_(block if pinned else block.pin_memory(), non_blocking=True)
        return self._replay_sampled(g, batch.seq_lens.shape[0])

    def replay_written(self, b: int, table: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Replay the sampled graph for the decode step of b requests written into `self.inputs`
        (`DecodeInputs.write`), its page-table rows gathered from `table` (the engine's [rows, pages]
        int32 table): (logits rows, hidden, tokens, draws) as `run_sampled` returns them."""
        if self.inputs is None or not 0 < b <= self.sizes[-1]:
            raise ValueError(f"replay_written: no sampled graph for {b} requests")
        self.inputs.gather_pages(b, table)
        return self._replay_sampled(self.graphs[next(s for s in self.sizes if s >= b)], b)

    def _replay_sampled(self, g: _Graph, b: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        assert self.inputs is not None
        self._draws_skipped = False
        g.replay()
        return g.outputs[0][:b], g.outputs[1][:b], self.inputs.drawn[:b], g.outputs[3][:b]

    def _stage(
        self, batch: StepBatch, kv_cache: Tensor, extras: tuple[Tensor, ...], query_len: int | None
    ) -> _Graph | None:
        """Copy the batch into the static inputs of the graph that covers it; None when none does."""
        if not self.fits(batch, kv_cache, query_len):
            return None
        b = batch.seq_lens.shape[0]
        q, rows = self.query_len, self.rows_per_request
        g = self.graphs[next(s for s in self.sizes if s >= b)]
        table, lens, starts, _, indices, token_rows = g.inputs[2:]
        if self.inputs is not None:  # shared by every size: its padding is reset for all of them
            self.inputs.stage(b)
        if batch.token_rows is not None:  # ids, positions and slots in one copy
            token_rows[:, : b * q].copy_(batch.token_rows)
        else:
            for row, values in enumerate((batch.input_ids, batch.positions, batch.slot_mapping)):
                token_rows[row, : b * q].copy_(values)
        for static, values in zip(g.extras, extras):
            static[: b * q].copy_(values)
        table[:b, : batch.page_table.shape[1]].copy_(batch.page_table)
        lens[:b].copy_(batch.seq_lens)
        if q > 1:  # the requests' query starts are b*q apart when they fit; copied all the same
            starts[: b + 1].copy_(batch.query_start_loc)
        indices[: b * rows].copy_(batch.logits_indices)
        if self.inputs is None and b < g.padding.from_row:  # requests a larger batch used: padding again
            end = g.padding.from_row
            token_rows[0, b * q : end * q].zero_()
            token_rows[1, b * q : end * q].zero_()
            token_rows[2, b * q : end * q].fill_(-1)
            table[b:end].zero_()
            lens[b:end].fill_(q)
            indices[b * rows : end * rows].copy_(_padding_rows(end, q, rows, indices.device)[b * rows :])
        g.padding.from_row = b
        return g


def _plain_body(
    fn: Callable[..., tuple[Tensor, Tensor]],
    kv_cache: Tensor,
    size: int,
    max_pages: int,
    q: int,
    rows_per_request: int,
    extra_widths: tuple[int, ...],
    extra_dtype: torch.dtype | None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...], Callable[[], tuple[Tensor, ...]]]:
    """A graph's own static inputs (`_Graph.inputs`), extra inputs and body, for `size` requests of q
    tokens."""
    device = kv_cache.device
    tokens = size * q
    # rows of an even length: each starts 16-byte aligned (one kernel variant for every size)
    token_rows = torch.zeros(3, tokens + tokens % 2, dtype=torch.int64, device=device)[:, :tokens]
    token_rows[2].fill_(-1)
    static = (
        token_rows[0],
        token_rows[1],
        torch.zeros(size, max_pages, dtype=torch.int32, device=device),
        torch.full((size,), q, dtype=torch.int32, device=device),
        torch.arange(size + 1, dtype=torch.int32, device=device) * q,
        token_rows[2],
        _padding_rows(size, q, rows_per_request, device),
        token_rows,
    )
    extras = tuple(
        torch.zeros(tokens, width, dtype=extra_dtype or kv_cache.dtype, device=device)
        for width in extra_widths
    )
    args = (*static[:2], *extras, kv_cache, *static[2:7])

    def body() -> tuple[Tensor, ...]:
        return fn(*args)

    return static, extras, body


def _sampled_body(
    fn: Callable[..., tuple[Tensor, Tensor]],
    kv_cache: Tensor,
    shared: DecodeInputs,
    size: int,
    sampler: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
) -> tuple[tuple[Tensor, ...], Callable[[], tuple[Tensor, ...]], _Padding]:
    """A sampled decode graph's static inputs (views of the first `size` columns of `shared`) and
    body: the tokens in flight fed from `drawn`, the program, the draws, left in `drawn` for the next
    step."""
    ids, positions, slots, feed = (row[:size] for row in shared.wide)
    static = (
        ids,
        positions,
        shared.page_table[:size],
        shared.lengths[:size],
        shared.query_starts[: size + 1],
        slots,
        shared.logits_rows[:size],
        shared.wide[:3, :size],
    )

    def body() -> tuple[Tensor, ...]:
        fed = torch.where(feed >= 0, shared.drawn.index_select(0, feed.clamp(min=0)), ids)
        logits, hidden = fn(fed, positions, kv_cache, *static[2:7])
        tokens, draws = sampler(logits, shared.sampling)
        shared.drawn[:size].copy_(tokens)
        return logits, hidden, tokens, draws

    return static, body, shared.padding


def _padding_rows(size: int, q: int, rows: int, device: torch.device) -> Tensor:
    """The logits rows of `size` padding requests: every token (rows == q) or each request's first."""
    step = 1 if rows == q else q
    return torch.arange(size * rows, dtype=torch.int64, device=device) * step


def _owners(b: int, q: int) -> list[int]:
    """logits_owner of b requests of q tokens, each token a logits row."""
    return [r for r in range(b) for _ in range(q)]
