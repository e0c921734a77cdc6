import pytest

from hy3c.serve.engine.kv_pages import OutOfPages, PagePool
from hy3c.serve.engine.scheduler import Scheduler, Sequence


def test_prefix_pages_are_published_matched_and_evicted_lru():
    pool = PagePool(9, page_size=4)
    tokens = list(range(1, 15))  # 3 full pages + 2 tokens
    pages = pool.allocate(4)
    pool.publish(tokens, pages, computed=14)
    pool.release(pages)
    assert pool.num_free == 8  # published pages stay matchable but are evictable
    hit = pool.match_prefix([*tokens, 99])
    assert hit == pages[:3]
    assert pool.match_prefix(tokens[:4]) == []  # at least one token must be computed
    pool.release(hit)
    other = pool.allocate(8)  # needs every page: the cached ones are evicted, oldest first
    assert set(other) == set(range(1, 9)) and 0 not in other
    assert pool.match_prefix([*tokens, 99]) == []


def test_divergent_suffix_matches_only_the_common_pages():
    pool = PagePool(16, page_size=2)
    a = [5, 6, 7, 8, 9, 10]
    pages = pool.allocate(3)
    pool.publish(a, pages, computed=6)
    pool.release(pages)
    assert pool.match_prefix([5, 6, 7, 8, 1, 2, 3]) == pages[:2]


def test_double_release_and_pool_exhaustion_are_errors():
    pool = PagePool(3, page_size=4)
    pages = pool.allocate(2)
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.release(pages)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(pages[:1])


def test_chunked_prefill_respects_the_token_budget():
    sched = Scheduler(PagePool(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    long, short = Sequence("a", list(range(25)), 25), Sequence("b", list(range(3)), 3)
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    assert [(w.seq.request_id, w.start, w.count, w.wants_logits) for w in step] == [("a", 0, 10, False)]
    long.computed = 10
    step = sched.schedule()
    assert [(w.seq.request_id, w.count) for w in step] == [("a", 10)]
    long.computed = 20
    step = sched.schedule()
    assert [(w.seq.request_id, w.start, w.count, w.wants_logits) for w in step] == [
        ("a", 20, 5, True),
        ("b", 0, 3, True),
    ]


def test_preemption_frees_pages_and_requeues_for_recompute():
    pool = PagePool(5, page_size=4)  # 4 usable pages
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = Sequence("a", list(range(7)), 7), Sequence("b", list(range(100, 107)), 7)
    sched.add(a)
    sched.add(b)
    assert len(sched.schedule()) == 2  # 2 pages each
    a.computed, b.computed = 7, 7
    a.tokens += [1, 2]  # a grows past its second page: no page left → b is preempted
    step = sched.schedule()
    assert [w.seq.request_id for w in step] == ["a"] and sched.num_preemptions == 1
    assert b.computed == 0 and not b.pages and sched.waiting[0] is b
    sched.remove("a")
    sched.remove("b")
    assert pool.num_free == pool.usable


def test_eviction_takes_the_tail_of_a_cached_prefix_first():
    """Released last page first: evicting one page keeps the head of the prefix matchable."""
    pool = PagePool(6, page_size=4)
    tokens = list(range(1, 18))  # 4 full pages + 1 token
    pages = pool.allocate(5)
    pool.publish(tokens, pages, computed=17)
    pool.release(pages)
    pool.allocate(2)  # the free page, then one cached page is evicted
    assert pool.match_prefix(tokens) == pages[:3]


def test_a_prompt_scoring_sequence_skips_the_prefix_cache_and_bounds_its_rows(monkeypatch):
    """A sequence that scores its prompt takes no cached pages (their positions' logits are needed),
    asks for every row of its prompt chunks, at most PROMPT_LOGITS_ROWS of them per step, and returns
    to the prefix cache and single rows once the engine clears `score_prompt`."""
    import hy3c.serve.engine.scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "PROMPT_LOGITS_ROWS", 6)
    pool = PagePool(64, page_size=4)
    tokens = list(range(1, 14))
    pages = pool.allocate(4)
    pool.publish(tokens, pages, computed=13)
    pool.release(pages)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    scoring, plain = Sequence("s", list(tokens), 13, score_prompt=True), Sequence("p", list(tokens), 13)
    sched.add(scoring)
    sched.add(plain)
    step = sched.schedule()
    assert [(w.seq.request_id, w.start, w.count, w.wants_logits, w.all_logits) for w in step] == [
        ("s", 0, 6, False, True),
        ("p", 12, 1, True, False),  # the plain one reuses the 3 cached pages
    ]
    assert scoring.cached_tokens == 0 and plain.cached_tokens == 12
    scoring.computed, plain.computed = 6, 13
    plain.tokens.append(99)
    step = sched.schedule()
    # the decode first, then the prefill chunk
    assert [(w.seq.request_id, w.count, w.all_logits) for w in step] == [("p", 1, False), ("s", 6, True)]
    scoring.computed = 12
    step = sched.schedule()
    assert [(w.seq.request_id, w.start, w.count, w.wants_logits, w.all_logits) for w in step[:1]] == [
        ("s", 12, 1, True, True)
    ]
    scoring.score_prompt = False  # the engine has every prompt position's logprob
    scoring.computed = 13
    sched._preempt(scoring)  # recomputed after a preemption: from the cache, no rows but the last
    step = sched.schedule()
    mine = next(w for w in step if w.seq is scoring)
    assert mine.start == 12 and not mine.all_logits


def test_the_scheduler_records_what_a_step_did():
    """advance → the fed tokens are computed; settle → a collected step's KV may be published;
    append_token → the next step feeds the sampled token; stop_scoring → chunks ask for their last row
    only; publish → the step's full pages are matchable; finish → the rest published, then every page
    released."""
    pool = PagePool(16, page_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    seq = Sequence("a", list(range(1, 8)), 7, score_prompt=True)
    sched.add(seq)
    work = sched.schedule()
    assert [(w.start, w.count, w.all_logits) for w in work] == [(0, 7, True)]
    sched.advance(work, [seq])
    assert seq.in_flight == 1 and seq.settled == 0
    sched.settle(work)
    sched.stop_scoring(seq)
    sched.append_token(seq, 42)
    sched.publish(work)
    assert seq.in_flight == 0 and seq.settled == 7
    assert seq.computed == 7 and seq.tokens == [*range(1, 8), 42] and not seq.score_prompt
    later = [*range(1, 8), 42, 0]  # a later request with this sequence's tokens as its prefix
    pool.release(hit := pool.match_prefix(later))
    assert hit == seq.pages[:1]  # the one full page computed so far
    work = sched.schedule()
    assert [(w.start, w.count, w.wants_logits, w.all_logits) for w in work] == [(7, 1, True, False)]
    sched.advance(work)
    sched.settle(work)
    pages = list(seq.pages)
    sched.finish(seq)
    assert seq.finished and not sched.has_work and pool.num_free == pool.usable
    assert pool.match_prefix(later) == pages  # the second page, full now, published by finish


def test_decodes_are_planned_before_long_prefills_which_are_chunked_and_few():
    """A running decode gets its token before an older request's prompt chunk takes the budget; with
    long_prefill_token_threshold a chunk takes at most that many tokens, and with
    max_num_partial_prefills at most that many requests prefill in one step."""
    pool = PagePool(256, page_size=4)
    sched = Scheduler(pool, 8, 40, long_prefill_token_threshold=16, max_num_partial_prefills=1)
    long_a, long_b = (Sequence(name, list(range(1, 200)), 199) for name in ("a", "b"))
    short = Sequence("c", [7, 8, 9], 3)
    for seq in (long_a, long_b, short):
        sched.add(seq)
    step = sched.schedule()
    assert [(w.seq.request_id, w.count) for w in step] == [("a", 16)]  # one prefill, chunked
    sched.advance(step)
    short_first = Scheduler(pool, 8, 40, long_prefill_token_threshold=16, max_num_partial_prefills=2)
    short_first.running = [long_a, short]
    short_first.add(long_b)
    short.pages, short.computed = pool.allocate(1), 2  # its prompt is in: one token to go
    step = short_first.schedule()
    assert [(w.seq.request_id, w.start, w.count) for w in step] == [("c", 2, 1), ("a", 16, 16), ("b", 0, 16)]


def test_a_request_waits_for_the_prefix_pages_a_running_one_is_writing():
    """Two requests with one 12-token prefix (3 pages), a budget of 8: the second is not admitted
    while the first's planned chunks write the prefix pages it would match (planned, not published);
    it is once they are published, and then computes only its own tokens. An abort of the writer
    ends the wait at once."""
    prefix = list(range(1, 13))
    pool = PagePool(32, page_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=8)
    first, second = Sequence("a", [*prefix, 50, 51], 14), Sequence("b", [*prefix, 60, 61], 14)
    sched.add(first)
    sched.add(second)
    work = sched.schedule()  # the first's 8-token chunk: pages 0-1 being written
    assert [(w.seq.request_id, w.count) for w in work] == [("a", 8)]
    sched.advance(work)
    work = sched.schedule()  # planned before the last step was read: its pages are not published
    assert [(w.seq.request_id, w.start, w.count) for w in work] == [("a", 8, 6)]
    sched.advance(work)
    sched.settle(work)
    sched.publish(work)
    work = sched.schedule()  # every prefix page published now: the second matches all three
    assert [(w.seq.request_id, w.start, w.count) for w in work] == [("b", 12, 2)]
    assert second.cached_tokens == 12

    pool = PagePool(32, page_size=4)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=8)
    first, second = Sequence("a", [*prefix, 50, 51], 14), Sequence("b", [*prefix, 60, 61], 14)
    sched.add(first)
    sched.add(second)
    sched.advance(sched.schedule())
    sched.remove("a")  # aborted mid-prefill: its pages freed unpublished, nothing left to wait for
    work = sched.schedule()
    assert [(w.seq.request_id, w.start, w.count) for w in work] == [("b", 0, 8)]
    assert not sched._writing.keys() - set(second.page_keys[:2])  # only the second's own pages
