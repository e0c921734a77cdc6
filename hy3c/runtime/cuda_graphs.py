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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

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
class _Graph:
    size: int
    graph: torch.cuda.CUDAGraph
    # input_ids, positions, page_table, seq_lens, query_start_loc, slot_mapping, logits_indices, and
    # token_rows: the [3, tokens] storage of input_ids / positions / slot_mapping (one copy stages them)
    inputs: tuple[Tensor, ...]
    extras: tuple[Tensor, ...]  # the extra [tokens, width] inputs (hidden_prev)
    outputs: tuple[Tensor, ...]  # logits rows, hidden; with a sampler, then its tokens and [rows, 2] draws
    padded_from: int = 0  # requests from here on hold padding values (all of them at capture)


class DecodeGraphs:
    """The graphs of one program at `query_len` tokens and `rows_per_request` logits rows per request."""

    def __init__(
        self,
        graphs: dict[int, _Graph],
        kv_cache: Tensor,
        max_pages: int,
        query_len: int = 1,
        rows_per_request: int = 1,
        sampling: Tensor | None = None,
    ) -> None:
        self.graphs = graphs
        # the captured sampler's [5, width] int32 parameter block, shared by every batch size's graph
        self.sampling = sampling
        self._draws_skipped = False  # the block's rows say SKIP_DRAW (set by `run`, cleared by `run_sampled`)
        self.kv_cache = kv_cache
        self.max_pages = max_pages
        self.query_len = query_len
        self.rows_per_request = rows_per_request
        self.sizes = sorted(graphs)

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
    ) -> DecodeGraphs | str:
        """Capture one graph per batch size; returns the reason instead when capture is impossible.
        `pool`: a graph memory pool to share with other captures (one is made by default). `sampler`
        (one logits row per request only): captured behind the program, `sampler(logits, block)` →
        (tokens int64, [rows, 2] float64 draws) with `block` a static [5, width] int32 parameter block
        (`hy3c.ops.sample.block_columns`; width: the largest batch size padded to a multiple of 4),
        so `run_sampled` draws the next tokens in the replay."""
        if kv_cache.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if query_len < 1 or rows_per_request not in (1, query_len):
            return (
                f"query_len {query_len} with {rows_per_request} logits rows per request is not a graph shape"
            )
        if sampler is not None and rows_per_request != 1:
            return "a sampler is captured with one logits row per request only"
        blockers = capture_blockers(gm)
        if blockers:
            return f"ops without a CUDA-graph-safe provider: {', '.join(blockers)}"
        device = kv_cache.device
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        q = query_len
        graphs = {}
        sampling = None  # greedy rows until a step writes its parameters
        if sampler is not None:
            width = max(batch_sizes) + -max(batch_sizes) % 4  # every column 16-byte aligned
            sampling = torch.zeros(SAMPLING_BLOCK_ROWS, width, dtype=torch.int32, device=device)
        for size in sorted(batch_sizes, reverse=True):  # largest first: smaller graphs reuse its pool
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

            def step(args=args) -> tuple[Tensor, ...]:
                outputs = fn(*args)
                if sampler is None or sampling is None:
                    return outputs
                return (*outputs, *sampler(outputs[0], sampling))

            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):
                    step()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                outputs = step()
            graphs[size] = _Graph(size, graph, static, extras, outputs)
        log_event(
            log,
            "cuda_graphs_captured",
            sizes=",".join(map(str, sorted(graphs))),
            max_pages=max_pages,
            query_len=q,
            rows_per_request=rows_per_request,
            sampled=sampler is not None,
        )
        return cls(graphs, kv_cache, max_pages, q, rows_per_request, sampling)

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
        itself, and the last `run_sampled`'s parameters (top-p, say) would cost it a full draw."""
        g = self._stage(batch, kv_cache, extras, query_len)
        if g is None:
            return None
        if self.sampling is not None and not self._draws_skipped:
            self.sampling[3].fill_(SKIP_DRAW)
            self._draws_skipped = True
        g.graph.replay()
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
        b = batch.seq_lens.shape[0]
        self.sampling.copy_(block if block.is_pinned() else block.pin_memory(), non_blocking=True)
        self._draws_skipped = False
        g.graph.replay()
        return g.outputs[0][:b], g.outputs[1][:b], g.outputs[2][:b], g.outputs[3][:b]

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
        if b < g.padded_from:  # requests an earlier, larger batch used become padding again
            end = g.padded_from
            token_rows[0, b * q : end * q].zero_()
            token_rows[1, b * q : end * q].zero_()
            token_rows[2, b * q : end * q].fill_(-1)
            table[b:end].zero_()
            lens[b:end].fill_(q)
            indices[b * rows : end * rows].copy_(_padding_rows(end, q, rows, indices.device)[b * rows :])
        g.padded_from = b
        return g


def _padding_rows(size: int, q: int, rows: int, device: torch.device) -> Tensor:
    """The logits rows of `size` padding requests: every token (rows == q) or each request's first."""
    step = 1 if rows == q else q
    return torch.arange(size * rows, dtype=torch.int64, device=device) * step


def _owners(b: int, q: int) -> list[int]:
    """logits_owner of b requests of q tokens, each token a logits row."""
    return [r for r in range(b) for _ in range(q)]
