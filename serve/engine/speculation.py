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

import torch
from torch import Tensor

from hy3c.model.batch import SeqChunk, StepBatch
from hy3c.serve.engine.sampler import History, SamplingParams, upload
from hy3c.serve.engine.scheduler import Sequence, Work
from hy3c.serve.engine.spec_decode import Draft, ForcedAcceptance, SpeculativeConfig, Verified, draft, verify


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


class Speculator:
    """The engine's speculative decoding (see the module docstring): K drafts per request and step."""

    def __init__(self, config: SpeculativeConfig, page_size: int) -> None:
        self.k = config.num_speculative_tokens
        self.page_size = page_size
        self.forced = None
        if config.forced_acceptance is not None:
            self.forced = ForcedAcceptance(config.forced_acceptance)
        self._probs: dict[Sequence, Tensor] = {}  # a sampled request's draft distributions [k, V]

    def accept_captured(self, drafts: Tensor, argmax: Tensor, real: Tensor) -> Tensor:
        """A captured speculative step's acceptance (`hy3c.runtime.spec_graphs`), bool [b, K]: a greedy
        draft is accepted while it equals the argmax of the row checking it, as `verify` does; in the
        forced benchmark mode, by its coin, drawn for the `real` rows only (padding rows draw none), so
        captured and uncaptured steps make the same decisions."""
        if self.forced is None:
            return drafts == argmax
        return self.forced.accepts_rows(real, drafts.shape[1])

    def forget(self, seq: Sequence) -> None:
        """The sequence left (finished, aborted, preempted): its draft distributions go."""
        self._probs.pop(seq, None)

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
        probs = None
        if any(w.seq in self._probs for w in work if w.drafts):
            vocab = logits.shape[-1]
            parts = [
                self._probs[w.seq][: w.drafts] if w.seq in self._probs else logits.new_zeros(w.drafts, vocab)
                for w in work
                if w.drafts
            ]
            probs = torch.cat(parts)
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
        tokens = verified.tokens.new_zeros(verified.tokens.shape[0], len(passes))
        tokens.index_copy_(0, verified_rows, torch.stack([p.tokens for p in passes], 1))
        depths: dict[Sequence, tuple[int, int]] = {}
        for i, item in enumerate(drafting):
            depth = len(passes) if i in deeper else 1
            seq = item.work.seq
            assert item.row is not None
            depths[seq] = (item.row, depth)
            if all(p.probs is not None for p in passes[:depth]):
                self._probs[seq] = torch.stack([p.probs[i] for p in passes[:depth]])
            else:
                self._probs.pop(seq, None)
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
