"""MTP speculative decoding in the engine step: verify the drafts a step fed, then draft the next ones.

A decode step of a request with drafts feeds [its last token, d_1..d_k] (`Work.drafts` = k) and asks
for every row's logits; `verify_step` accepts a prefix of the drafts (`hy3c.serve.engine.spec_decode`:
greedy exact, sampled by the rejection rule) and returns the tokens each request emits (its accepted
drafts, then the correction or bonus). Requests without drafts (a prefill's last chunk, a decode that
drafted nothing) go through the same rule with k = 0: the target's own draw.

`draft_pass` then runs the MTP program over every position the target computed this step, before
the host knows what was accepted: the MTP layer at position t consumes the embedding of the token
after t and the target's hidden state at t (docs/ARCHITECTURE.md §1.5), so its inputs are the step's
fed tokens shifted by one — the successors the host knows (prompt tokens) uploaded, the emitted ones
taken from the verification on the device — and its row at each request's last accepted position
(a device-side index) drafts d'_1. Positions past the accepted drafts get KV that the next step
rewrites before anything reads it. For K > 1 the layer is applied again, one token per request, on
its own hidden state, each pass at the next position: planned on the host at the largest acceptance
and shifted back on the device (positions, sequence lengths, slots) by the drafts rejected. Every
accepted position's MTP KV is written, so a prefix hit (whose last page the scheduler gives up: the KV
at a page's last position depends on the next page's first token) finds it for the pages it keeps.
The step's acceptance, emitted tokens and next drafts come to the host in one copy; the draft
distributions q stay on the device until the verification that reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from hy3c.model.batch import SeqChunk, StepBatch
from hy3c.serve.engine.sampler import History, SamplingParams, upload
from hy3c.serve.engine.scheduler import Sequence, Work
from hy3c.serve.engine.spec_decode import (
    FINAL_DRAW,
    Draft,
    ForcedAcceptance,
    RowColumns,
    SpeculativeConfig,
    Verified,
    draft,
    draw_drafts,
    residual_draw,
    row_distribution,
    seeded_uniforms,
    verify,
)


class DraftModel(Protocol):
    """What drafts: a compiled artifact's `Runner` with its MTP program, or the eager model."""

    num_draft_layers: int

    def draft(self, batch: StepBatch, hidden_prev: Tensor, kv_cache: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass
class Drafting:
    """One request of the step as the MTP pass sees it: its work item, the tokens it fed (before any
    rollback), its row in the step's `Verified` (None: it samples nothing, a prefill chunk before the
    last) and its sampling."""

    work: Work
    fed: int
    row: int | None
    params: SamplingParams | None
    generator: torch.Generator | None


@dataclass
class Drafted:
    """A step's drafts on the device: `tokens` int64 [R, passes] in the rows of the step's `Verified`
    (rows that drafted nothing hold 0) and, per drafting sequence, its row and how many of its
    columns are drafts."""

    tokens: Tensor
    depth: dict[Sequence, tuple[int, int]]  # sequence → (row, drafts)


class DraftProbs:
    """The distributions q that sampled requests' drafts were drawn from, kept on the device until the
    verification that checks those drafts: one [K, V] fp32 row per request (its slot, held until the
    request leaves or is preempted), written by the drafting passes — uncaptured, or inside a captured
    speculative step, which holds this tensor. Row ZERO stays zero (the q a request without one
    reads: its drafts were greedy, and the rule never reads it); row SCRATCH takes writes that nothing
    reads (a captured step's padding and greedy rows). Allocated at the first write or `reserve`,
    grown by doubling (a captured step is refused once its tensor was replaced)."""

    ZERO, SCRATCH = 0, 1

    def __init__(self, k: int) -> None:
        self.k = k
        self.probs: Tensor | None = None  # [rows, K, V] fp32
        self._slots: dict[object, int] = {}
        self._free: list[int] = []

    def reserve(self, requests: int, vocab: int, device: torch.device | str) -> None:
        """Room for `requests` requests' rows besides ZERO and SCRATCH (before a step captures it)."""
        self._grow(requests + 2, vocab, torch.device(device))

    def find(self, owner: object) -> int | None:
        return self._slots.get(owner)

    def slot(self, owner: object, vocab: int, device: torch.device) -> int:
        """The request's row, given on first sight."""
        slot = self._slots.get(owner)
        if slot is None:
            if not self._free:
                rows = 0 if self.probs is None else self.probs.shape[0]
                self._grow(max(8, 2 * rows), vocab, device)
            slot = self._slots[owner] = self._free.pop()
        return slot

    def drop(self, owner: object) -> None:
        slot = self._slots.pop(owner, None)
        if slot is not None:
            self._free.append(slot)

    def write(self, depth: int, slots: list[int], q: Tensor, rows: list[int]) -> None:
        """q's `rows` ([n, V] of them) as the distributions of draft `depth` of the requests in `slots`:
        one copy on the device."""
        assert self.probs is not None
        index = upload(torch.tensor([*slots, *rows], dtype=torch.long), q.device)
        self.probs[:, depth].index_copy_(0, index[: len(slots)], q.index_select(0, index[len(slots) :]))

    def rows_of(self, drafted: list[tuple[object, int]], device: torch.device) -> Tensor | None:
        """The q of each (request, drafts) pair's drafts, request-major ([sum drafts, V], as `verify`
        reads them; a request without a slot reads zeros), or None when none has a slot."""
        slots = [self._slots.get(owner) for owner, _ in drafted]
        if self.probs is None or all(slot is None for slot in slots):
            return None
        index = [
            (self.ZERO if slot is None else slot) * self.k + j
            for slot, (_, count) in zip(slots, drafted)
            for j in range(count)
        ]
        flat = self.probs.view(-1, self.probs.shape[-1])
        return flat.index_select(0, upload(torch.tensor(index, dtype=torch.long), device))

    def _grow(self, rows: int, vocab: int, device: torch.device) -> None:
        have = 0 if self.probs is None else self.probs.shape[0]
        if rows <= have:
            return
        probs = torch.zeros(rows, self.k, vocab, dtype=torch.float32, device=device)
        if self.probs is not None:
            probs[:have].copy_(self.probs)
        self.probs = probs
        reserved = {self.ZERO, self.SCRATCH}
        self._free = [r for r in range(rows - 1, have - 1, -1) if r not in reserved] + self._free


class CapturedRule:
    """How a captured speculative step (`hy3c.runtime.spec_graphs`) accepts drafts and drafts the next
    ones — the rules `verify` and `draft` apply to the same requests, so the two paths emit the same
    tokens. Without `probs`: greedy (a draft is accepted while it equals the argmax of the row
    checking it; the drafts are the MTP rows' argmax), or in the forced benchmark mode its coin,
    drawn for the real rows only (padding rows draw none). With `probs` (`DraftProbs`, the tensor
    the step was captured with): a batch with sampled requests — each request's sampling parameters,
    seeds and draft-distribution slot ride in the step's int64 block (`block`: rows `PARAMS`), and
    sampled rows follow the rejection rule (`spec_decode.verify`), their drafts drawn from q
    (`spec_decode.draw_drafts`), whose rows it writes to their slots; greedy rows as above."""

    # the parameter block's rows (fp32 values as their bits); the draft seeds follow, one per depth
    PARAMS = ("top_k", "slot", "greedy", "temperature", "min_p", "top_p", "verify_seed")

    def __init__(self, k: int, forced: ForcedAcceptance | None, probs: DraftProbs | None) -> None:
        self.k = k
        self.forced = forced
        self.probs = probs
        self.tensor = None if probs is None else probs.probs  # the one captured
        self.param_rows = 0 if probs is None else len(self.PARAMS) + k

    @property
    def current(self) -> bool:
        """Whether the draft distributions still live in the tensor the step was captured with."""
        return self.probs is None or self.probs.probs is self.tensor

    def block(
        self,
        params: list[SamplingParams],
        slots: list[int],
        seeds: list[list[int]],
        size: int,
    ) -> Tensor:
        """The host block of `size` columns for requests with `params`, draft-distribution `slots` and
        per-step `seeds` ([the verification's, then one per draft depth], drawn in that order as the
        uncaptured path draws them); padding columns are greedy, slot SCRATCH. Pinned on CUDA hosts."""
        block = np.zeros((self.param_rows, size), dtype=np.int64)
        if not self.param_rows:  # greedy or forced: no parameters
            return torch.from_numpy(block)
        floats = np.ones((3, size), dtype=np.float32)  # temperature, min_p, top_p of padding: 1, -, 1
        floats[1] = 0.0
        block[1] = DraftProbs.SCRATCH
        block[2] = 1
        n = len(params)
        if n:
            block[0, :n] = [p.top_k for p in params]
            block[1, :n] = slots
            block[2, :n] = [int(p.greedy) for p in params]
            floats[:, :n] = [
                [p.temperature or 1.0 for p in params],
                [p.min_p for p in params],
                [p.top_p for p in params],
            ]
            block[6:, :n] = np.array(seeds, dtype=np.int64).T
        block[3:6] = floats.view(np.int32)
        host = torch.from_numpy(block)
        return host.pin_memory() if torch.cuda.is_available() else host

    def padding_block(self, size: int) -> Tensor:
        """`block` of `size` padding columns (greedy, slot SCRATCH): a captured step's block before
        its first run."""
        return self.block([], [], [], size)

    def row_columns(self, params: Tensor, repeat: int = 1) -> RowColumns:
        """The block's parameter columns, each request's repeated `repeat` times."""
        rows = params if repeat == 1 else params.repeat_interleave(repeat, dim=1)
        floats = rows[3:6].to(torch.int32).view(torch.float32)
        return RowColumns(rows[2] > 0, floats[0], floats[1], rows[0], floats[2], filtered=True)

    def verify(self, logits: Tensor, fed: Tensor, real: Tensor, params: Tensor) -> tuple[Tensor, Tensor]:
        size, q = fed.shape
        k = q - 1
        argmax = logits.argmax(-1).view(size, q)
        drafts = fed[:, 1:]
        column = torch.arange(q, device=fed.device)
        if self.probs is None:  # greedy, or the forced mode's coin: every emitted token a row's argmax
            accepted = drafts == argmax[:, :k] if self.forced is None else self.forced.accepts_rows(real, k)
            counts = accepted.long().cumprod(1).sum(1)
            return counts, torch.where(column[None, :] <= counts[:, None], argmax, -1)
        columns = self.row_columns(params, q)
        logprobs = torch.log_softmax(logits / columns.temperature[:, None], -1)
        vocab = logits.shape[-1]
        target = row_distribution(logprobs, columns).view(size, q, vocab)
        uniforms = seeded_uniforms(params[6][:, None], torch.where(column < k, column, FINAL_DRAW)[None, :])
        drawn_from = self.probs.probs.index_select(0, params[1])  # [size, K, V]: the drafts' q
        p_d = target[:, :k].gather(2, drafts[..., None])[..., 0]
        q_d = drawn_from.gather(2, drafts[..., None])[..., 0]
        greedy = params[2] > 0
        accepted = torch.where(greedy[:, None], drafts == argmax[:, :k], uniforms[:, :k] * q_d < p_d)
        counts = (accepted & real[:, None]).long().cumprod(1).sum(1)
        at = counts[:, None, None].expand(size, 1, vocab)
        rejected_q = drawn_from.gather(1, at.clamp(max=k - 1))[:, 0]
        drawn = residual_draw(target.gather(1, at)[:, 0], rejected_q, counts < k, uniforms[:, k])
        final = torch.where(greedy, argmax.gather(1, counts[:, None])[:, 0], drawn)
        accepted_part = torch.cat([drafts, drafts.new_zeros(size, 1)], 1)
        emitted = torch.where(
            column[None, :] < counts[:, None],
            accepted_part,
            torch.where(column[None, :] == counts[:, None], final[:, None], -1),
        )
        return counts, emitted

    def draft(self, logits: Tensor, depth: int, params: Tensor) -> Tensor:
        if self.probs is None:
            return logits.argmax(-1)
        assert self.probs.probs is not None
        seeds = params[len(self.PARAMS) + depth]
        tokens, q = draw_drafts(logits, self.row_columns(params), seeded_uniforms(seeds, 0))
        self.probs.probs[:, depth].index_copy_(0, params[1], q)  # greedy and padding rows: SCRATCH
        return tokens


class Speculator:
    """The engine's speculative decoding (see the module docstring): K drafts per request and step."""

    def __init__(self, config: SpeculativeConfig, page_size: int) -> None:
        self.k = config.num_speculative_tokens
        self.page_size = page_size
        self.forced = None
        if config.forced_acceptance is not None:
            self.forced = ForcedAcceptance(config.forced_acceptance)
        self.probs = DraftProbs(self.k)  # sampled requests' draft distributions, by slot

    def captured_rule(self, sampled: bool = False) -> CapturedRule:
        """The rule a captured speculative step accepts and drafts by (`CapturedRule`); `sampled`: the
        one for batches with sampled requests, whose draft distributions it keeps in `self.probs`."""
        return CapturedRule(self.k, self.forced, self.probs if sampled and self.forced is None else None)

    def forget(self, seq: Sequence) -> None:
        """The sequence left (finished, aborted, preempted): its draft distributions go."""
        self.probs.drop(seq)

    def verify_step(
        self,
        logits: Tensor,
        last_rows: list[int],
        work: list[Work],
        params: list[SamplingParams],
        history: list[History],
        generators: list[torch.Generator | None],
        num_logprobs: int | None,
        draft_tokens: Tensor | None = None,
        allowed: Tensor | None = None,
    ) -> Verified:
        """Accept the drafts of the sampled requests (`work[i]` is request i's item; `last_rows[i]` its
        last logits row: its k_i + 1 rows end there). `draft_tokens`: the drafts on the device
        (request-major), when the host has not read them yet (a step planned from one in flight).
        `allowed`: the grammar masks of those rows (`spec_decode.verify`)."""
        counts = [w.drafts for w in work]
        rows = [r for last, k in zip(last_rows, counts) for r in range(last - k, last + 1)]
        device = logits.device
        target = logits[upload(torch.tensor(rows, dtype=torch.long), device)]
        if draft_tokens is None:
            tokens = [t for w in work for t in w.seq.drafts[: w.drafts]]
            draft_tokens = upload(torch.tensor(tokens, dtype=torch.long), device)
        probs = self.probs.rows_of([(w.seq, w.drafts) for w in work if w.drafts], device)
        return verify(
            target,
            counts,
            draft_tokens,
            probs,
            params,
            history,
            generators,
            self.forced,
            num_logprobs,
            allowed,
        )

    def draft_pass(
        self,
        runner: DraftModel,
        kv_cache: Tensor,
        batch: StepBatch,
        hidden: Tensor,
        items: list[Drafting],
        verified: Verified,
        reserve: Callable[[Sequence, int], bool],
        build: Callable[[list[SeqChunk], list[Sequence]], StepBatch],
        lag: Tensor | None = None,
    ) -> Drafted:
        """Run the MTP program over every position the verify step `batch` fed and draft K tokens for
        each request that sampled, without reading the acceptance on the host.

        The first pass reuses the verify batch's positions, slots and page table: the successor of a
        fed position is the next prompt token where the host knows it, else the step's emitted token
        there (`verified.tokens`, filled in on the device; −1 past the emitted ones reads as 0), and a
        request's logits row is the position of its last emitted token's predecessor (its first
        device-side row plus its accepted count). Positions past the accepted drafts get KV that later
        steps overwrite before any read. A uniform decode step (every request K + 1 tokens) replays the
        draft graph at q = K + 1. For K > 1 the recursive passes (one token per request) are planned
        on the host at the largest acceptance and corrected on the device: positions, sequence lengths
        and slots shifted back by the drafts rejected (`reserve(seq, tokens)` asks the scheduler for
        the pages they may write; a request it refuses drafts one token). `lag` (int64, a row per
        verified request): how far the host planned this step's positions past the true ones (a step
        planned before the previous one's acceptance was read), subtracted there too."""
        width = verified.tokens.shape[1]
        ids: list[int] = []
        fill: tuple[list[int], list[int]] = ([], [])  # fed token index ← flat index into verified.tokens
        first_rows: list[int] = []  # per drafting item: its row before the accepted count is added
        drafting: list[Drafting] = []
        offset = 0
        for item in items:
            w, seq = item.work, item.work.seq
            known = seq.tokens[w.start + 1 : w.start + item.fed + 1]
            ids.extend(known)
            ids.extend([0] * (item.fed - len(known)))
            if item.row is not None:
                for i in range(len(known), item.fed):
                    fill[0].append(offset + i)
                    fill[1].append(item.row * width + i - len(known))
                first_rows.append(offset + len(known))
                drafting.append(item)
            offset += item.fed
        nothing = Drafted(verified.tokens.new_zeros(verified.tokens.shape[0], 0), {})
        if not ids:
            return nothing
        device = hidden.device
        rows = [item.row for item in drafting]
        # a step of prompt chunks that sample nothing still writes their MTP KV (one logits row, unread)
        first_rows = first_rows or [0]
        packed = upload(
            torch.tensor([*ids, *fill[0], *fill[1], *first_rows, *rows], dtype=torch.long), device
        )
        input_ids, fill_at, fill_from, first, verified_rows = packed.split_with_sizes(
            [len(ids), len(fill[0]), len(fill[1]), len(first_rows), len(drafting)]
        )
        if fill[0]:
            input_ids.index_copy_(
                0, fill_at, verified.tokens.clamp(min=0).view(-1).index_select(0, fill_from)
            )
        accepted = verified.counts.index_select(0, verified_rows) if drafting else torch.zeros_like(first)
        mtp = StepBatch(
            input_ids=input_ids,
            positions=batch.positions,
            page_table=batch.page_table,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            slot_mapping=batch.slot_mapping,
            logits_indices=first + accepted,
            logits_owner=list(range(len(first_rows))),
        )
        q = self.k + 1
        uniform = len(drafting) == len(items) and all(item.fed == q for item in items)
        logits, mtp_hidden = runner.draft(mtp, hidden, kv_cache, q if uniform else None)
        if not drafting:
            return nothing
        params = [item.params for item in drafting]
        generators = [item.generator for item in drafting]
        passes = [draft(logits, params, generators)]
        written = [(0, list(range(len(drafting))), passes[0].probs)]  # (depth, drafting items, their q)
        deeper = [i for i, item in enumerate(drafting) if self.k > 1 and self._reserve(item, reserve)]
        if deeper:
            picked = upload(torch.tensor(deeper, dtype=torch.long), device)
            # planned at the largest acceptance (all of a request's device-side successors but the
            # last accepted); shifted back on the device by the drafts rejected
            most = [self._device_columns(drafting[i]) - 1 for i in deeper]
            shift = upload(torch.tensor(most, dtype=torch.long), device) - accepted.index_select(0, picked)
            if lag is not None:
                shift = shift + lag.index_select(0, verified_rows.index_select(0, picked))
            # the MTP layer's own hidden state at the first pass's rows, then each pass's own
            hidden_prev = mtp_hidden.index_select(0, mtp.logits_indices.index_select(0, picked))
        for depth in range(1, self.k if deeper else 1):
            chunks = [
                SeqChunk(
                    [0],
                    self._first_position(drafting[i]) + most[n] + depth,
                    drafting[i].work.seq.pages,
                    "last",
                )
                for n, i in enumerate(deeper)
            ]
            step = build(chunks, [drafting[i].work.seq for i in deeper])
            step.input_ids.copy_(passes[-1].tokens.index_select(0, picked))
            step.positions.sub_(shift)
            step.seq_lens.sub_(shift.to(step.seq_lens.dtype))
            page = step.page_table.gather(1, (step.positions // self.page_size)[:, None])[:, 0]
            step.slot_mapping.copy_(page.long() * self.page_size + step.positions % self.page_size)
            logits, hidden_prev = runner.draft(step, hidden_prev, kv_cache)
            drawn = draft(logits, [params[i] for i in deeper], [generators[i] for i in deeper])
            passes.append(_widen(drawn, deeper, len(drafting)))
            written.append((depth, deeper, drawn.probs))
        tokens = verified.tokens.new_zeros(verified.tokens.shape[0], len(passes))
        tokens.index_copy_(0, verified_rows, torch.stack([p.tokens for p in passes], 1))
        depths: dict[Sequence, tuple[int, int]] = {}
        slots: dict[int, int] = {}  # drafting item → its row of `self.probs`, for the sampled ones
        for i, item in enumerate(drafting):
            seq = item.work.seq
            assert item.row is not None and item.params is not None
            depths[seq] = (item.row, len(passes) if i in deeper else 1)
            if item.params.greedy:
                self.probs.drop(seq)
            else:
                slots[i] = self.probs.slot(seq, logits.shape[-1], device)
        for depth, items, q in written:  # each pass's q of its sampled requests, one copy a pass
            kept = [(slots[i], row) for row, i in enumerate(items) if i in slots]
            if kept and q is not None:
                self.probs.write(depth, [slot for slot, _ in kept], q, [row for _, row in kept])
        return Drafted(tokens, depths)

    def _known(self, item: Drafting) -> int:
        """How many of the request's fed positions have a successor the host knows (prompt tokens)."""
        w = item.work
        return len(w.seq.tokens[w.start + 1 : w.start + item.fed + 1])

    def _device_columns(self, item: Drafting) -> int:
        """The fed positions whose successor is an emitted token (read from `verified.tokens`)."""
        return item.fed - self._known(item)

    def _first_position(self, item: Drafting) -> int:
        """The position of the request's first fed token whose successor the host does not know."""
        return item.work.start + self._known(item)

    def _reserve(self, item: Drafting, reserve: Callable[[Sequence, int], bool]) -> bool:
        """Pages for the recursive passes at the largest acceptance: they write up to position
        start + fed + K − 2."""
        return reserve(item.work.seq, item.work.start + item.fed + self.k - 1)


def _widen(drawn: Draft, chosen: list[int], rows: int) -> Draft:
    """A pass over some requests (`chosen`) as a pass over all `rows` (the others' rows repeat 0)."""
    index = torch.full((rows,), len(chosen), dtype=torch.long)
    index[chosen] = torch.arange(len(chosen))
    index = upload(index, drawn.tokens.device)  # pinned, without waiting for the device
    tokens = torch.cat([drawn.tokens, drawn.tokens.new_zeros(1)]).index_select(0, index)
    probs = None
    if drawn.probs is not None:
        probs = torch.cat([drawn.probs, drawn.probs.new_zeros(1, drawn.probs.shape[1])]).index_select(
            0, index
        )
    return Draft(tokens, probs)
