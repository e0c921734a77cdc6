"""MTP speculative decoding in the engine step: verify the drafts a step fed, then draft the next ones.

A decode step of a request with drafts feeds [its last token, d_1..d_k] (`Work.drafts` = k) and asks
for every row's logits; `verify_step` accepts a prefix of the drafts (`hy3c.serve.engine.spec_decode`:
greedy exact, sampled by the rejection rule) and returns the tokens each request emits (its accepted
drafts, then the correction or bonus). Requests without drafts (a prefill's last chunk, a decode that
drafted nothing) go through the same rule with k = 0: the target's own draw.

`draft_pass` then runs the MTP program over every position the target computed this step (the
rejected ones excepted: their KV is rolled back, `Scheduler.accept`). The MTP layer at position t
consumes the embedding of the token after t and the target's hidden state at t (docs/ARCHITECTURE.md
§1.5), so its inputs are the step's fed tokens shifted by one, closed by the emitted token; its row at
the last position drafts d'_1. For K > 1 the layer is applied again, one token per request, on its own
hidden state (the target's at the new position is not computed yet), each pass at the next position.
Every position's MTP KV is written, so a prefix hit (whose last page the scheduler gives up: the KV at
a page's last position depends on the next page's first token) finds it for the pages it keeps.
Draft tokens come to the host once per step (the scheduler plans the next step's fed tokens from
them); their distributions q stay on the device until the verification that reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
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
    rollback), what it emitted (empty for a chunk that samples nothing) and its sampling."""

    work: Work
    fed: int
    emitted: list[int]
    params: SamplingParams | None  # None: it samples nothing (a prefill chunk before the last)
    generator: torch.Generator | None


class Speculator:
    """The engine's speculative decoding (see the module docstring): K drafts per request and step."""

    def __init__(self, config: SpeculativeConfig, page_size: int) -> None:
        self.k = config.num_speculative_tokens
        self.page_size = page_size
        self.forced = None
        if config.forced_acceptance is not None:
            self.forced = ForcedAcceptance(config.forced_acceptance)
        self._probs: dict[Sequence, Tensor] = {}  # a sampled request's draft distributions [k, V]

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
    ) -> Verified:
        """Accept the drafts of the sampled requests (`work[i]` is request i's item; `last_rows[i]` its
        last logits row: its k_i + 1 rows end there)."""
        counts = [w.drafts for w in work]
        rows = [r for last, k in zip(last_rows, counts) for r in range(last - k, last + 1)]
        device = logits.device
        target = logits[upload(torch.tensor(rows, dtype=torch.long), device)]
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
            target, counts, draft_tokens, probs, params, history, generators, self.forced, num_logprobs
        )

    def draft_pass(
        self,
        runner: DraftModel,
        kv_cache: Tensor,
        hidden: Tensor,
        items: list[Drafting],
        reserve: Callable[[Sequence, int], bool],
    ) -> dict[Sequence, list[int]]:
        """Run the MTP program over the step's computed positions and draft K tokens for each request
        that sampled (`reserve(seq, tokens)` asks the scheduler for the pages the recursive passes
        write; a request it refuses drafts one token). Returns each drafting sequence's drafts."""
        chunks, rows, drafting, offset = [], [], [], 0
        for item in items:
            w, seq = item.work, item.work.seq
            stream = seq.tokens + item.emitted  # (the step's tokens are not appended yet)
            successors = stream[w.start + 1 : w.start + w.count + 1]
            if successors:
                samples = item.params is not None and bool(item.emitted)
                chunks.append(SeqChunk(successors, w.start, seq.pages, "last" if samples else "none"))
                rows.extend(range(offset, offset + len(successors)))
                if samples:
                    drafting.append(item)
            offset += item.fed
        if not chunks:
            return {}
        device = hidden.device
        batch = build_step_batch(chunks, self.page_size, device)
        hidden_prev = hidden.index_select(0, upload(torch.tensor(rows, dtype=torch.long), device))
        logits, mtp_hidden = runner.draft(batch, hidden_prev, kv_cache)
        params = [item.params for item in drafting]
        generators = [item.generator for item in drafting]
        passes = [draft(logits, params, generators)]
        last = batch.logits_indices
        deeper = [i for i, item in enumerate(drafting) if self.k > 1 and self._reserve(item, reserve)]
        for depth in range(1, self.k if deeper else 1):
            previous = passes[-1]
            chunks = [
                SeqChunk(
                    [0], self._next_position(drafting[i]) + depth - 1, drafting[i].work.seq.pages, "last"
                )
                for i in deeper
            ]
            batch = build_step_batch(chunks, self.page_size, device)
            picked = upload(torch.tensor(deeper, dtype=torch.long), device)
            batch.input_ids.copy_(previous.tokens.index_select(0, picked))
            # the MTP layer's own hidden state at the previous position: the last rows of the first
            # pass's chunks, then the whole of each one-token pass
            hidden_prev = (
                mtp_hidden.index_select(0, last.index_select(0, picked)) if depth == 1 else mtp_hidden
            )
            logits, mtp_hidden = runner.draft(batch, hidden_prev, kv_cache)
            step_params = [params[i] for i in deeper]
            drawn = draft(logits, step_params, [generators[i] for i in deeper])
            passes.append(_widen(drawn, deeper, len(drafting)))
        tokens = torch.stack([p.tokens for p in passes], 1).tolist()  # [requests, passes]: one copy
        drafts: dict[Sequence, list[int]] = {}
        for i, item in enumerate(drafting):
            depth = len(passes) if i in deeper else 1
            drafts[item.work.seq] = tokens[i][:depth]
            if all(p.probs is not None for p in passes[:depth]):
                self._probs[item.work.seq] = torch.stack([p.probs[i] for p in passes[:depth]])
            else:
                self._probs.pop(item.work.seq, None)
        return drafts

    def _next_position(self, item: Drafting) -> int:
        """The position of the token the request emitted last (the first the next step feeds)."""
        return item.work.start + item.work.count

    def _reserve(self, item: Drafting, reserve: Callable[[Sequence, int], bool]) -> bool:
        return reserve(item.work.seq, self._next_position(item) + self.k - 1)


def _widen(drawn: Draft, chosen: list[int], rows: int) -> Draft:
    """A pass over some requests (`chosen`) as a pass over all `rows` (the others' rows repeat 0)."""
    index = torch.full((rows,), len(chosen), dtype=torch.long)
    index[chosen] = torch.arange(len(chosen))
    index = index.to(drawn.tokens.device)
    tokens = torch.cat([drawn.tokens, drawn.tokens.new_zeros(1)]).index_select(0, index)
    probs = None
    if drawn.probs is not None:
        probs = torch.cat([drawn.probs, drawn.probs.new_zeros(1, drawn.probs.shape[1])]).index_select(
            0, index
        )
    return Draft(tokens, probs)
