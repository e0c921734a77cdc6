"""Continuous batching with chunked prefill under a token budget, prefix reuse and preemption.

Every step, `schedule()` decides which tokens each sequence feeds:
1. running sequences first, in arrival order: a decode feeds 1 token, an unfinished prefill its next
   chunk; each gets the pages its new tokens need — when the pool is exhausted, the most recently
   admitted other sequence is preempted (its pages freed, its tokens — prompt and output so far — put
   back at the front of the queue to be recomputed, which yields the same continuation);
2. then waiting sequences, while the budget, `max_num_seqs` and free pages allow: the longest published
   prefix is reused (`PagePool.match_prefix`), the rest is prefilled in chunks. A waiting sequence
   whose prefix continues into a page that a running one is writing (planned, not yet published)
   waits for it, so concurrent requests with one prefix compute it once — also under overlapped
   scheduling, where the chunk that writes it is still in flight when the next step is planned.
   With KV tiers, the prefix continues in host memory (L2) and the store (L3): a sequence whose
   pages are still being loaded from L2 joins the step at once when the load is no larger than the
   step's token budget (the step waits for it on the device), else waits while the others step
   (`KVTiers.loading`).
A step is a list of `Work` items (one per sequence) that the engine turns into a `StepBatch`.

Overlapped scheduling: the engine plans and launches step N+1 before it reads step N's sampled tokens.
A sequence whose token is still on the device (`in_flight`) is planned as if the host had it — its
next step feeds that token (`Work.from_device`; the engine copies it on the device) — unless that
token brings it to its length limit (then it ends when read, and nothing is planned). A stop token
is only seen when read, so a stopped sequence may have one more step launched, whose result the
engine drops. A preempted sequence with a token in flight waits until the host has it. What may be
published is what collected steps wrote (`settled`, `publish`), never a position whose token the
host has not read: a preemption (`epoch`) voids the work planned before it.

With attention data parallelism (an artifact's `parallel.dp_attention` = D > 1) the engine uses a
`DataParallelScheduler`: one `Scheduler` and one page pool (and prefix cache) per DP rank, since each
rank's KV cache holds only its own requests. A new request goes to the rank with the fewest requests
(then the fewest tokens, then the lowest rank) and stays there for its life (`Sequence.dp_rank`; a
preempted one waits on its rank). Every step each rank's scheduler plans its own batch under the full
`max_num_batched_tokens` and `max_num_seqs`: the budgets are per rank (a rank's step runs on its own
device; only the MoE sees all ranks' tokens at once).

The scheduler owns the sequences' state and their pages in the prefix cache: the engine reports what a
step did through its methods — `advance` (the step's tokens are in the KV cache), `append_token` (a
sampled token joins its sequence), `stop_scoring` (every prompt position's logits are in), `publish`
(the step's full pages become matchable), `finish` (a sequence ends: its pages are published, then
released) and `remove` (abort or error: released unpublished) — and never writes into a `Sequence` or
the pool itself.

A sequence that scores its prompt (`score_prompt`: prompt logprobs) needs the logits of every prompt
position, so it takes nothing from the prefix cache (cached pages skip those positions; vLLM does the
same) and its prompt chunks ask for all their rows (`Work.all_logits`); the rows of such chunks are at
most PROMPT_LOGITS_ROWS per step, which bounds the step's fp32 logits ([rows, vocab]: 247 MB at
Hy3's 120832 entries). A longer prompt is scored over several steps, like any chunked prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hy3c.serve.engine.kv_pages import OutOfPages, PagePool, extend_page_keys

if TYPE_CHECKING:
    from hy3c.serve.engine.kv_tiers import KVTiers

PROMPT_LOGITS_ROWS = 512  # logits rows of prompt-scoring chunks per step


@dataclass(eq=False)  # identity: two requests with the same tokens are different sequences
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + generated
    num_prompt: int
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    cached_tokens: int = 0  # prefix-cache hit at first admission (reported in usage)
    page_keys: list[bytes] = field(default_factory=list)  # chained keys of its full pages so far
    admitted: bool = False
    finished: bool = False
    score_prompt: bool = False  # every prompt position's logits are wanted (cleared once they are in)
    dp_rank: int = 0  # the attention-DP rank whose KV cache holds it (DataParallelScheduler)
    limit: int = 1 << 62  # len(tokens) at which it ends by length (prompt + max_tokens, or max_model_len)
    in_flight: int = 0  # tokens sampled by a launched step that the host has not read yet
    settled: int = 0  # tokens whose KV was written by steps the engine collected (what may be published)
    epoch: int = 0  # counts preemptions: work planned before one no longer describes its KV
    drafts: list[int] = field(default_factory=list)  # MTP draft tokens its next decode step verifies
    published: int = 0  # its pages the prefix cache has looked at (publishing resumes there)
    writing: int = 0  # its pages below this index were entered in the scheduler's `_writing`
    probed: int = 0  # while waiting: the page where `_waits_for_writer` last found the cache's end

    @property
    def pending(self) -> int:
        return len(self.tokens) + self.in_flight - self.computed

    @property
    def known(self) -> int:
        """Tokens the host has, plus the in-flight ones (what the next step may feed)."""
        return len(self.tokens) + self.in_flight


@dataclass
class Work:
    seq: Sequence
    start: int  # position of the first fed token
    count: int  # tokens fed this step
    wants_logits: bool  # the chunk reaches the end of the sequence: sample its next token
    all_logits: bool = False  # a prompt chunk of a `score_prompt` sequence: the logits of every row
    from_device: bool = False  # its last fed token is the in-flight one: the engine feeds it on the device
    epoch: int = 0  # the sequence's epoch when planned
    drafts: int = 0  # draft tokens fed after its last token (speculative decoding: every row's logits)

    @property
    def end(self) -> int:
        return self.start + self.count


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        speculative: bool = False,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 0,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # decodes' protection from long prompts: a prefill chunk takes at most this many tokens a step
        # (0: the budget), and at most this many requests prefill in one step (0: any number)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        # speculative decoding: decodes feed their drafts, and a prefix hit gives up its last page (the
        # MTP layer's KV at a page's last position depends on the next page's first token)
        self.speculative = speculative
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.tiers: KVTiers | None = None  # L2 / L3 below the pool: a prefix continues there
        self.num_preemptions = 0
        # called with each sequence preempted (the engine lets go of what it kept for its next step)
        self.on_preempt: Callable[[Sequence], None] | None = None
        # keys of the full pages running sequences' planned steps write and have not published yet
        self._writing: dict[bytes, Sequence] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Drop a sequence wherever it is and free its pages (abort, error, or finished)."""
        for seq in list(self.running):
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._free(seq)
                return seq
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._free(seq)
                return seq
        return None

    def advance(self, work: list[Work], sampling: list[Sequence] = ()) -> None:
        """After a step was launched: the tokens each item fed are (being) written into the KV cache, and
        each sequence in `sampling` has one token drawn on the device that the host reads later."""
        for w in work:
            w.seq.computed = w.end
        for seq in sampling:
            seq.in_flight += 1

    def accept(self, w: Work, accepted: int) -> None:
        """A verified decode step kept `accepted` of its drafts: the KV of the rejected ones is rolled
        back (their slots are rewritten by later steps) and the drafts are spent."""
        w.seq.computed = w.start + 1 + accepted
        w.count = 1 + accepted  # its KV past the accepted drafts is not final: never settled or published
        w.seq.drafts = []

    def set_drafts(self, seq: Sequence, drafts: list[int]) -> None:
        """The drafts its next decode step verifies (fed after its last token)."""
        seq.drafts = drafts

    def reserve(self, seq: Sequence, tokens: int) -> bool:
        """Pages for its first `tokens` positions (the MTP layer's recursive drafting writes past the
        last token); False when the pool cannot give them."""
        return self._grow(seq, tokens)

    def settle(self, work: list[Work]) -> None:
        """After a launched step's results were collected: the KV it wrote is final (publishable) for
        the sequences not preempted since."""
        for w in work:
            if w.epoch == w.seq.epoch:
                w.seq.settled = max(w.seq.settled, w.end)

    def append_token(self, seq: Sequence, token: int | None) -> None:
        """The host read a token drawn for the sequence: it joins it (the next step feeds it), or — None,
        a stop token — it does not."""
        seq.in_flight = max(0, seq.in_flight - 1)
        if token is not None:
            seq.tokens.append(token)

    def stop_scoring(self, seq: Sequence) -> None:
        """Every prompt position's logits are in: later chunks ask for their last row only, and a
        recompute after a preemption may reuse the prefix cache."""
        seq.score_prompt = False

    def publish(self, work: list[Work]) -> None:
        """After a step's results were collected: the full pages its unfinished, not preempted sequences
        wrote become matchable (never a page with a position whose token the host does not have)."""
        for w in work:
            if not w.seq.finished and w.epoch == w.seq.epoch:
                self._publish(w.seq, min(w.end, len(w.seq.tokens)))

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: its computed full pages are published (a later request with the same
        prefix reuses them), then it leaves the schedule and its pages are released."""
        seq.finished = True
        self._publish(seq)
        self.remove(seq.request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every published page no sequence holds; returns how many were dropped."""
        return self.pool.reset_prefix_cache()

    def _publish(self, seq: Sequence, upto: int | None = None) -> None:
        """Publish its full pages below `upto` tokens (by default what collected steps wrote), looking
        only at the pages that filled since the last time: host work per step independent of the
        context."""
        upto = min(seq.settled, len(seq.tokens)) if upto is None else upto
        before = seq.published
        seq.published = self.pool.publish(seq.tokens, seq.pages, upto, seq.page_keys, since=seq.published)
        self._written(seq, seq.page_keys[before : seq.published])

    def _note_writing(self, seq: Sequence, end: int) -> None:
        """A planned step writes the sequence's KV below `end` tokens: its full pages there that are
        not published yet are being written (`_waits_for_writer`)."""
        full = min(end, len(seq.tokens)) // self.pool.page_size
        if full <= seq.writing:
            return
        keys = extend_page_keys(seq.page_keys, seq.tokens, self.pool.page_size, self.pool.namespace, full)
        for key in keys[max(seq.writing, seq.published) : full]:
            self._writing.setdefault(key, seq)
        seq.writing = full

    def _written(self, seq: Sequence, keys: list[bytes]) -> None:
        for key in keys:
            if self._writing.get(key) is seq:
                del self._writing[key]

    def _waits_for_writer(self, seq: Sequence) -> bool:
        """Whether the first page of the waiting sequence's prompt that the prefix cache lacks is one a
        running sequence is writing: then it is admitted once that page is published. Each call scans
        on from where the last one stopped (a request waiting behind a long prefix costs O(new pages)
        a step, not O(prompt)); a page evicted behind that point is missed, which costs a recompute,
        never a wrong token (admission matches the prefix anew)."""
        if not self._writing:
            return False
        full = (len(seq.tokens) - 1) // self.pool.page_size  # match_prefix's reach
        keys = extend_page_keys(seq.page_keys, seq.tokens, self.pool.page_size, self.pool.namespace, full)
        while seq.probed < full and keys[seq.probed] in self.pool.page_of:
            seq.probed += 1
        writer = self._writing.get(keys[seq.probed]) if seq.probed < full else None
        return writer is not None and writer is not seq

    def _free(self, seq: Sequence) -> None:
        self._written(seq, seq.page_keys[: seq.writing])
        seq.writing = seq.probed = 0
        self.pool.release(seq.pages)
        seq.pages = []
        seq.settled = 0
        seq.epoch += 1
        seq.drafts = []
        seq.published = 0

    def _grow(self, seq: Sequence, upto: int) -> bool:
        missing = -(-upto // self.pool.page_size) - len(seq.pages)
        if missing <= 0:
            return True
        try:
            seq.pages.extend(self.pool.allocate(missing))
            return True
        except OutOfPages:
            return False

    def _release_waiting(self, keep: Sequence | None = None) -> bool:
        """Pages held by waiting sequences (held back while their prefix loads from L2) go back to the
        pool before a running sequence is preempted or a request refused for want of pages; they stay
        published, so those sequences match them again (and wait for the load) when admitted. Whether
        any were held."""
        holders = [w for w in self.waiting if w.pages and w is not keep]
        for waiting in holders:
            self._free(waiting)
            waiting.computed = 0
        return bool(holders)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)

    def _scoring(self, seq: Sequence) -> bool:
        """Whether the sequence's next chunk is a prompt chunk whose every row's logits are wanted."""
        return seq.score_prompt and seq.computed < seq.num_prompt

    def _work(self, seq: Sequence, count: int) -> Work:
        end = seq.computed + count
        self._note_writing(seq, end)
        return Work(
            seq,
            seq.computed,
            count,
            end == seq.known,
            self._scoring(seq),
            from_device=seq.in_flight > 0 and end == seq.known,
            epoch=seq.epoch,
        )

    def _may_prefill(self, prefills: int) -> bool:
        return not self.max_num_partial_prefills or prefills < self.max_num_partial_prefills

    def _chunk(self, count: int) -> int:
        """A prefill chunk's size under the long-prefill threshold."""
        return min(count, self.long_prefill_token_threshold) if self.long_prefill_token_threshold else count

    @staticmethod
    def _draft_count(seq: Sequence, count: int, budget: int) -> int:
        """Drafts a decode step feeds after its token: as many as it has, the budget allows and its
        length limit can still use (a step emits at most drafts + 1 tokens)."""
        if not seq.drafts or count != seq.pending or seq.pending != 1:
            return 0
        return max(0, min(len(seq.drafts), budget - count, seq.limit - len(seq.tokens) - 1))

    @staticmethod
    def _ending(seq: Sequence) -> bool:
        """Its in-flight token brings it to its length limit: it ends when the host reads it, so no
        step is planned for it (under overlap the host does not wait to know that)."""
        return seq.in_flight > 0 and seq.known >= seq.limit

    def schedule(self) -> list[Work]:
        budget = self.max_num_batched_tokens
        logit_rows = PROMPT_LOGITS_ROWS
        work: list[Work] = []
        prefills = 0
        # decodes first (in arrival order), then the running prefills: a long prompt's chunk never
        # takes the budget its elders' next tokens need
        for seq in sorted(self.running, key=lambda s: s.pending > 1):
            if budget == 0:
                break
            if seq not in self.running or self._ending(seq):  # preempted by an earlier one this step
                continue
            count = min(seq.pending, budget, logit_rows if self._scoring(seq) else budget)
            if count > 1 or seq.pending > 1:  # a prefill chunk
                if not self._may_prefill(prefills):
                    continue
                count = self._chunk(count)
                prefills += 1
            if count == 0:  # scoring rows of this step used up: the next step continues it
                continue
            drafts = self._draft_count(seq, count, budget)
            count += drafts
            while not self._grow(seq, seq.computed + count):
                if self._release_waiting():
                    continue
                victims = [s for s in self.running if s is not seq and s not in {w.seq for w in work}]
                if not victims:
                    self._preempt(seq)
                    break
                self._preempt(victims[-1])
            if seq not in self.running:
                continue
            work.append(self._work(seq, count - drafts))
            work[-1].count, work[-1].drafts = count, drafts
            budget -= count
            logit_rows -= count if work[-1].all_logits else 0
        # waiting sequences whose prefix is on its way from the store or being written by a running
        # one (ids): the next may go first
        deferred: set[int] = set()
        while len(self.waiting) > len(deferred) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next(s for s in self.waiting if id(s) not in deferred)
            if seq.in_flight:  # preempted with a token in flight: it waits until the host has it
                break
            if not seq.pages:
                tiers = None if self._scoring(seq) else self.tiers
                if tiers is not None and tiers.fetching(self.pool, seq.request_id, seq.tokens, seq.page_keys):
                    deferred.add(id(seq))
                    continue
                if not self._scoring(seq) and self._waits_for_writer(seq):
                    deferred.add(id(seq))
                    continue
                seq.pages = [] if self._scoring(seq) else self.pool.match_prefix(seq.tokens, seq.page_keys)
                if tiers is not None:
                    seq.pages += tiers.extend_prefix(
                        self.pool, seq.tokens, seq.pages, seq.request_id, seq.page_keys
                    )
                if self.speculative and seq.pages:
                    self.pool.release([seq.pages.pop()])
                seq.published = len(seq.pages)
                seq.computed = len(seq.pages) * self.pool.page_size
                if not seq.admitted:
                    seq.cached_tokens = seq.computed
            # a load of up to a step's token budget joins now, the step waiting for it on the device
            # (its copy costs far less than a step); a larger one waits while others step
            loading = self.tiers.loading(seq.pages) if self.tiers is not None else 0
            if loading and work and loading * self.pool.page_size > self.max_num_batched_tokens:
                deferred.add(id(seq))
                continue
            if not self._may_prefill(prefills):
                break
            count = self._chunk(min(seq.pending, budget, logit_rows if self._scoring(seq) else budget))
            if count == 0:  # a scoring prefill waits for the next step's rows
                break
            prefills += 1
            grown = self._grow(seq, seq.computed + count)
            if not grown and self._release_waiting(keep=seq):
                grown = self._grow(seq, seq.computed + count)
            if not grown:
                self._free(seq)  # a waiting sequence holds no pages (they stay published, matchable later)
                seq.computed = 0
                if not self.running and not work:  # alone and still too large: the pool is too small
                    raise OutOfPages(
                        f"request {seq.request_id} needs more KV pages than the pool has", seq.request_id
                    )
                break
            if loading:  # admitted into this step: it waits for the copy on the device
                self.tiers.wait_loads(seq.pages)
            self.waiting.remove(seq)
            seq.admitted = True
            self.running.append(seq)
            work.append(self._work(seq, count))
            budget -= count
            logit_rows -= count if work[-1].all_logits else 0
        return work


class DataParallelScheduler:
    """One `Scheduler` per attention-DP rank behind the `Scheduler` interface the engine uses (see the
    module docstring). `schedule()` returns every rank's work, rank 0's items first, then rank 1's, …;
    each item's `seq.dp_rank` says whose batch it joins."""

    def __init__(self, pools: list[PagePool], max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.ranks = [Scheduler(pool, max_num_seqs, max_num_batched_tokens) for pool in pools]
        self.pools = pools

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for rank in self.ranks for seq in rank.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [seq for rank in self.ranks for seq in rank.running]

    @property
    def num_preemptions(self) -> int:
        return sum(rank.num_preemptions for rank in self.ranks)

    @property
    def has_work(self) -> bool:
        return any(rank.has_work for rank in self.ranks)

    def usage(self) -> float:
        """The share of all ranks' usable pages in use."""
        return sum(pool.num_used for pool in self.pools) / sum(pool.usable for pool in self.pools)

    def pick_rank(self) -> int:
        """The rank a new request goes to: fewest requests, then fewest tokens, then the lowest."""

        def load(r: int) -> tuple[int, int, int]:
            seqs = [*self.ranks[r].running, *self.ranks[r].waiting]
            return len(seqs), sum(len(seq.tokens) for seq in seqs), r

        return min(range(len(self.ranks)), key=load)

    def add(self, seq: Sequence) -> None:
        seq.dp_rank = self.pick_rank()
        self.ranks[seq.dp_rank].add(seq)

    def remove(self, request_id: str) -> Sequence | None:
        for rank in self.ranks:
            seq = rank.remove(request_id)
            if seq is not None:
                return seq
        return None

    def advance(self, work: list[Work], sampling: list[Sequence] = ()) -> None:
        for w in work:
            self.ranks[w.seq.dp_rank].advance([w])
        for seq in sampling:
            self.ranks[seq.dp_rank].advance([], [seq])

    def settle(self, work: list[Work]) -> None:
        for w in work:
            self.ranks[w.seq.dp_rank].settle([w])

    def append_token(self, seq: Sequence, token: int | None) -> None:
        self.ranks[seq.dp_rank].append_token(seq, token)

    def stop_scoring(self, seq: Sequence) -> None:
        self.ranks[seq.dp_rank].stop_scoring(seq)

    def publish(self, work: list[Work]) -> None:
        for w in work:
            self.ranks[w.seq.dp_rank].publish([w])

    def finish(self, seq: Sequence) -> None:
        self.ranks[seq.dp_rank].finish(seq)

    def reset_prefix_cache(self) -> int:
        return sum(rank.reset_prefix_cache() for rank in self.ranks)

    def schedule(self) -> list[Work]:
        """Every rank's step, in rank order. A request too large for its rank's pool raises OutOfPages
        naming it; the work other ranks planned is planned again next step (nothing ran)."""
        return [w for rank in self.ranks for w in rank.schedule()]
