"""Whole speculative decode steps in one CUDA graph per batch size: verify, accept, draft, pack.

    steps = SpecDecodeSteps.capture(step_fn, draft_fn, kv_cache, batch_sizes=[1, 2, 4], max_pages=2048,
                                    k=2, page_size=64, rule=rule)
    packed = steps.run(batch, chained_from=None, params=None)   # [b, 1 + (K+1) + K] int64, on the device

A steady speculative decode step feeds every request its last token and its K drafts (K + 1 tokens
at positions start..start+K) and, uncaptured, costs some two hundred small launches around the
verify and draft graphs: the host, not the GPU, then sets the pace. This module captures all of it:

1. (chained steps only) the inputs corrected from the previous step's outputs, which this graph left
   in `packed`: each request feeds its last emitted token and its K new drafts, and its positions,
   sequence length and slots move back by the drafts the previous step rejected (the host planned
   them at full acceptance, before reading it);
2. the step program at q = K + 1, every token a logits row;
3. the acceptance by the engine's `rule` (`StepRule.verify`: greedy equality, the forced benchmark
   mode's coin, or the rejection rule of sampled requests, whose parameters and seeds the step reads
   from its static block `params`, one copy per step): each request's accepted count and emitted
   tokens — its accepted drafts then the correction or bonus, as
   `hy3c.serve.engine.spec_decode.verify` emits them;
4. the MTP program over the K + 1 positions (each position's successor: the emitted token there, 0
   past them, as the uncaptured draft pass feeds it), its row at each request's last accepted
   position drafting d'_1 (`StepRule.draft`), then K − 1 recursive passes of one token per request
   at positions start + accepted + depth (KV slots from the page table, which the caller filled
   for them);
5. `packed` ← [accepted count, emitted tokens (−1 after), next drafts] per request.

Only requests without logprobs, penalties, logit bias or grammars qualify (the engine checks;
anything else runs uncaptured). Padding requests (a smaller batch than captured) feed token 0 at
position 0 with slot −1 (no KV written, `DecodeGraphs`' convention) and are never corrected. Off CUDA
(tests), `capture(..., graphs=False)` keeps the same static buffers and runs the same body uncaptured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from hy3c.logs import log_event
from hy3c.model.batch import StepBatch

log = logging.getLogger("hy3c.runtime.spec_graphs")


class StepRule(Protocol):
    """How a captured step accepts drafts and drafts the next ones: device work only (it is captured).
    `params`: the step's static int64 block of `param_rows` rows, one column per request (what the
    rule needs per request beyond the tokens; `block` fills it on the host)."""

    param_rows: int

    def verify(self, logits: Tensor, fed: Tensor, real: Tensor, params: Tensor) -> tuple[Tensor, Tensor]:
        """The fp32 logits [b·(K+1), V] of each request's fed tokens `fed` [b, K+1] (its last token,
        then K drafts; `real` [b]: False in padding) → (accepted drafts [b] int64, emitted [b, K+1]
        int64: the accepted drafts, then the correction or bonus, −1 after)."""
        ...

    def draft(self, logits: Tensor, depth: int, params: Tensor) -> Tensor:
        """Draft `depth` (0 .. K − 1) of each request from the MTP pass's logits [b, V] → int64 [b]."""
        ...

    def padding_block(self, size: int) -> Tensor:
        """The host block of `size` padding columns: what the static block holds before a step
        writes one (the capture's warm-up runs on it)."""
        ...


# a program run uncaptured: the step program's eight inputs or the draft program's nine → (logits, hidden)
Program = Callable[..., tuple[Tensor, Tensor]]


@dataclass
class _Step:
    size: int
    graph: torch.cuda.CUDAGraph | None  # None: uncaptured (`body` runs each time)
    body: Callable[[], None]
    token_rows: Tensor  # [3, size * q]: input ids, positions, slots (one copy stages them)
    page_table: Tensor  # int32 [size, max_pages]
    seq_lens: Tensor  # int32 [size]
    chained: Tensor  # int64 [1]: 1 = correct the inputs from `packed` first
    packed: Tensor  # int64 [size, 1 + q + K]: the outputs, and a chained step's inputs
    params: Tensor  # int64 [rule.param_rows, size]: the rule's per-request block
    padded_from: int = 0


class SpecDecodeSteps:
    """The captured speculative decode steps of one K (see the module docstring), per batch size."""

    def __init__(
        self, steps: dict[int, _Step], kv_cache: Tensor, max_pages: int, k: int, rule: StepRule
    ) -> None:
        self.steps = steps
        self.kv_cache = kv_cache
        self.max_pages = max_pages
        self.k = k
        self.rule = rule
        self.sizes = sorted(steps)
        self.captured = all(s.graph is not None for s in steps.values())

    @classmethod
    def capture(
        cls,
        step_fn: Program,
        draft_fn: Program,
        kv_cache: Tensor,
        batch_sizes: list[int],
        max_pages: int,
        k: int,
        page_size: int,
        rule: StepRule,
        graphs: bool = True,
    ) -> SpecDecodeSteps | str:
        """One step per batch size (captured in a CUDA graph unless `graphs` is False); returns the
        reason instead when capture is impossible."""
        if graphs and kv_cache.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if k < 1 or not batch_sizes:
            return f"no speculative step to capture (K {k}, batch sizes {batch_sizes})"
        device = kv_cache.device
        pool = torch.cuda.graph_pool_handle() if graphs else None
        steps = {}
        for size in sorted(batch_sizes, reverse=True):  # largest first: smaller graphs reuse its pool
            step = _build(step_fn, draft_fn, kv_cache, size, max_pages, k, page_size, rule, device)
            if graphs:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream), torch.no_grad():
                    for _ in range(2):
                        step.body()
                torch.cuda.current_stream(device).wait_stream(stream)
                step.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(step.graph, pool=pool), torch.no_grad():
                    step.body()
            steps[size] = step
        log_event(
            log, "spec_decode_graphs_captured" if graphs else "spec_decode_steps_built",
            sizes=",".join(map(str, sorted(steps))), k=k, max_pages=max_pages,
        )  # fmt: skip
        return cls(steps, kv_cache, max_pages, k, rule)

    def fits(self, batch: StepBatch, kv_cache: Tensor) -> bool:
        """Whether a step covers the batch (the caller vouches that it is a uniform decode of K drafts)."""
        b = batch.seq_lens.shape[0]
        return (
            kv_cache is self.kv_cache
            and 0 < b <= self.sizes[-1]
            and batch.input_ids.shape[0] == b * (self.k + 1)
            and batch.page_table.shape[1] <= self.max_pages
        )

    def size_for(self, requests: int) -> int:
        """The batch size of the step that runs `requests` requests (the width of its `params`)."""
        return next(size for size in self.sizes if size >= requests)

    def run(
        self, batch: StepBatch, chained_from: Tensor | None = None, params: Tensor | None = None
    ) -> Tensor | None:
        """Run the step covering the batch; `chained_from`: the previous step's packed outputs (its
        requests in the same rows) when the batch was planned at that step's full acceptance;
        `params`: the rule's block for `size_for(b)` columns, padding included (a host tensor: one
        copy; None when the rule takes none). Returns the packed outputs [b, 1 + (K+1) + K] (valid
        until the next run at this batch size), or None when no step covers the batch."""
        if not self.fits(batch, self.kv_cache):
            return None
        b, q = batch.seq_lens.shape[0], self.k + 1
        s = self.steps[self.size_for(b)]
        if self.rule.param_rows:
            if params is None or params.shape != s.params.shape:
                raise ValueError(f"SpecDecodeSteps.run: a parameter block of {list(s.params.shape)} is due")
            s.params.copy_(params, non_blocking=True)
        if batch.token_rows is not None:
            s.token_rows[:, : b * q].copy_(batch.token_rows)
        else:
            for row, values in enumerate((batch.input_ids, batch.positions, batch.slot_mapping)):
                s.token_rows[row, : b * q].copy_(values)
        s.page_table[:b, : batch.page_table.shape[1]].copy_(batch.page_table)
        s.seq_lens[:b].copy_(batch.seq_lens)
        if b < s.padded_from:  # requests an earlier, larger batch used become padding again
            end = s.padded_from
            s.token_rows[:2, b * q : end * q].zero_()
            s.token_rows[2, b * q : end * q].fill_(-1)
            s.page_table[b:end].zero_()
            s.seq_lens[b:end].fill_(q)
        s.padded_from = b
        if chained_from is not None and chained_from.data_ptr() != s.packed.data_ptr():
            s.packed[:b].copy_(chained_from)
        s.chained.fill_(int(chained_from is not None))
        if s.graph is not None:
            s.graph.replay()
        else:
            with torch.no_grad():
                s.body()
        return s.packed[:b]


def _build(
    step_fn: Program,
    draft_fn: Program,
    kv_cache: Tensor,
    size: int,
    max_pages: int,
    k: int,
    page_size: int,
    rule: StepRule,
    device: torch.device,
) -> _Step:
    """The static buffers of one batch size and the step body over them (module docstring, 1–5)."""
    q = k + 1
    tokens = size * q
    # rows of an even length: each starts 16-byte aligned (as DecodeGraphs lays them out)
    token_rows = torch.zeros(3, tokens + tokens % 2, dtype=torch.int64, device=device)[:, :tokens]
    token_rows[2].fill_(-1)
    page_table = torch.zeros(size, max_pages, dtype=torch.int32, device=device)
    seq_lens = torch.full((size,), q, dtype=torch.int32, device=device)
    query_starts = torch.arange(size + 1, dtype=torch.int32, device=device) * q
    one_starts = torch.arange(size + 1, dtype=torch.int32, device=device)
    every_row = torch.arange(tokens, dtype=torch.int64, device=device)
    request = torch.arange(size, dtype=torch.int64, device=device)
    chained = torch.zeros(1, dtype=torch.int64, device=device)
    packed = torch.zeros(size, 1 + q + k, dtype=torch.int64, device=device)
    params = rule.padding_block(size).to(device)
    ids, positions, slots = token_rows[0], token_rows[1], token_rows[2]

    def slot_of(at: Tensor, real: Tensor) -> Tensor:
        """The KV slots of positions `at` (request-major, [size] or [size * q]); −1 where not `real`."""
        page = page_table.gather(1, (at // page_size).view(size, -1)).view(-1)
        return torch.where(real, page.long() * page_size + at % page_size, -1)

    def body() -> None:
        real = slots.view(size, q)[:, 0] >= 0  # padding requests have slot −1
        # 1. a chained step: inputs from the previous step's outputs
        on = (chained > 0) & real
        counts_before = packed[:, 0].clamp(0, k)
        last = packed[:, 1 : 1 + q].gather(1, counts_before[:, None])
        fed = torch.cat([last, packed[:, 1 + q :]], 1)
        ids.copy_(torch.where(on[:, None], fed, ids.view(size, q)).view(-1))
        lag = torch.where(on, k - counts_before, 0)
        positions.sub_(lag[:, None].expand(size, q).reshape(-1))
        seq_lens.sub_(lag.to(seq_lens.dtype))
        real_tokens = real[:, None].expand(size, q).reshape(-1)
        slots.copy_(
            torch.where(on[:, None].expand(size, q).reshape(-1), slot_of(positions, real_tokens), slots)
        )
        # 2. the target over K + 1 tokens per request
        logits, hidden = step_fn(
            ids, positions, kv_cache, page_table, seq_lens, query_starts, slots, every_row
        )
        # 3. the acceptance: each request's accepted drafts, then its correction or bonus
        counts, emitted = rule.verify(logits.float(), ids.view(size, q), real, params)
        # 4. the MTP pass over the fed positions, then its recursion
        rows = request * q + counts
        draft_logits, draft_hidden = draft_fn(
            emitted.clamp(min=0).view(-1), positions, hidden, kv_cache, page_table, seq_lens,
            query_starts, slots, rows,
        )  # fmt: skip
        drafts = [rule.draft(draft_logits.float(), 0, params)]
        hidden_prev = draft_hidden.index_select(0, rows)
        start = positions.view(size, q)[:, 0]
        for depth in range(1, k):
            at = start + counts + depth
            draft_logits, hidden_prev = draft_fn(
                drafts[-1], at, hidden_prev, kv_cache, page_table, (at + 1).to(seq_lens.dtype),
                one_starts, slot_of(at, real), request,
            )  # fmt: skip
            drafts.append(rule.draft(draft_logits.float(), depth, params))
        # 5. the outputs, where the next chained step reads them
        packed.copy_(torch.cat([counts[:, None], emitted, torch.stack(drafts, 1)], 1))

    return _Step(size, None, body, token_rows, page_table, seq_lens, chained, packed, params)
