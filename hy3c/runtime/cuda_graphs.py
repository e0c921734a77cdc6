"""CUDA graphs for decode steps (one token per request), captured per batch size of the recipe.

    graphs = DecodeGraphs.capture(step_fn, gm, kv_cache, batch_sizes=[1, 2, 4, 8], max_pages=2048)
    out = graphs.run(batch)          # None when the batch is not a decode batch the graphs cover

Each graph is captured over static input buffers at a padded batch size. A smaller batch is padded up:
padding rows get token 0, slot -1 (the KV store skips them), sequence length 1 over page 0 and are cut
from the outputs (they are reset only when a smaller batch follows a larger one). Staging a batch built
by `build_step_batch` takes three copies (token ids, positions and slots share one). Capture is refused — with the reason, so the caller runs the step normally — when
the program calls an op whose provider is not CUDA-graph safe (it syncs with the host).
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
    # token_rows: the [3, size] storage of input_ids / positions / slot_mapping (one copy stages them)
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, Tensor]
    padded_from: int = 0  # rows from here on hold padding values (all rows at capture)


class DecodeGraphs:
    def __init__(self, graphs: dict[int, _Graph], kv_cache: Tensor, max_pages: int) -> None:
        self.graphs = graphs
        self.kv_cache = kv_cache
        self.max_pages = max_pages
        self.sizes = sorted(graphs)

    @classmethod
    def capture(
        cls,
        fn: Callable[..., tuple[Tensor, Tensor]],
        gm: fx.GraphModule,
        kv_cache: Tensor,
        batch_sizes: list[int],
        max_pages: int,
    ) -> DecodeGraphs | str:
        """Capture one graph per batch size; returns the reason instead when capture is impossible."""
        if kv_cache.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        blockers = capture_blockers(gm)
        if blockers:
            return f"ops without a CUDA-graph-safe provider: {', '.join(blockers)}"
        device = kv_cache.device
        pool = torch.cuda.graph_pool_handle()
        graphs = {}
        for size in sorted(batch_sizes, reverse=True):  # largest first: smaller graphs reuse its pool
            # rows of an even length: each starts 16-byte aligned (one kernel variant for every size)
            token_rows = torch.zeros(3, size + size % 2, dtype=torch.int64, device=device)[:, :size]
            token_rows[2].fill_(-1)
            static = (
                token_rows[0],
                token_rows[1],
                torch.zeros(size, max_pages, dtype=torch.int32, device=device),
                torch.ones(size, dtype=torch.int32, device=device),
                torch.arange(size + 1, dtype=torch.int32, device=device),
                token_rows[2],
                torch.arange(size, dtype=torch.int64, device=device),
                token_rows,
            )
            args = (*static[:2], kv_cache, *static[2:7])
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):
                    fn(*args)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                outputs = fn(*args)
            graphs[size] = _Graph(size, graph, static, outputs)
        log_event(log, "cuda_graphs_captured", sizes=",".join(map(str, sorted(graphs))), max_pages=max_pages)
        return cls(graphs, kv_cache, max_pages)

    def fits(self, batch: StepBatch, kv_cache: Tensor) -> bool:
        b = batch.seq_lens.shape[0]
        return (
            kv_cache is self.kv_cache
            and batch.input_ids.shape[0] == b
            and b <= self.sizes[-1]
            and batch.logits_indices.shape[0] == b
            and batch.page_table.shape[1] <= self.max_pages
        )

    def run(self, batch: StepBatch, kv_cache: Tensor) -> tuple[Tensor, Tensor] | None:
        if not self.fits(batch, kv_cache):
            return None
        b = batch.seq_lens.shape[0]
        g = self.graphs[next(s for s in self.sizes if s >= b)]
        token_rows, table, lens = g.inputs[7], g.inputs[2], g.inputs[3]
        if batch.token_rows is not None:  # ids, positions and slots in one copy
            token_rows[:, :b].copy_(batch.token_rows)
        else:
            for row, values in enumerate((batch.input_ids, batch.positions, batch.slot_mapping)):
                token_rows[row, :b].copy_(values)
        table[:b, : batch.page_table.shape[1]].copy_(batch.page_table)
        lens[:b].copy_(batch.seq_lens)
        if b < g.padded_from:  # rows an earlier, larger batch used become padding again
            end = g.padded_from
            token_rows[0, b:end].zero_()
            token_rows[2, b:end].fill_(-1)
            table[b:end].zero_()
            lens[b:end].fill_(1)
        g.padded_from = b
        g.graph.replay()
        return g.outputs[0][:b], g.outputs[1][:b]
