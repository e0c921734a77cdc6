"""PagePool.publish from a cursor (`since`): the same prefix cache as the full walk from page 0 every
step, a duplicate page published when the other page is evicted, and per step only the new full pages
looked at (counted in `pages_walked`, not timed)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from hy3c.serve.engine.kv_pages import OutOfPages, PagePool, extend_page_keys, page_keys


class WalkingPool(PagePool):
    """The pool before cursors: every publish walks the request's pages from the first; a page whose
    content another page publishes is skipped, and published by a later walk once that page is gone."""

    def publish(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        computed: int,
        keys: list[bytes] | None = None,
        since: int = 0,
    ) -> int:
        full = min(computed // self.page_size, len(pages))
        keys = extend_page_keys([] if keys is None else keys, tokens, self.page_size, self.namespace, full)
        self.pages_walked += full
        for page, key in zip(pages[:full], keys):
            if page not in self.key_of and key not in self.page_of:
                self.key_of[page] = key
                self.page_of[key] = page
        return full

    def _unpublish(self, page: int) -> None:
        del self.page_of[self.key_of.pop(page)]


@dataclass
class Req:
    tokens: list[int]
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    cursor: int = 0
    keys: list[bytes] = field(default_factory=list)
    waiting: bool = True


class Traffic:
    """Scheduler-like use of one pool: admit over the prefix cache, grow and feed, publish after each
    step (from the request's cursor), finish (publish, release), abort or preempt (release)."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.reqs: dict[int, Req] = {}
        self.content: dict[int, bytes] = {}  # page → key of the KV last written into it

    def admit(self, rid: int) -> None:
        req = self.reqs[rid]
        req.pages = self.pool.match_prefix(req.tokens)
        req.computed = len(req.pages) * self.pool.page_size
        req.cursor, req.waiting = len(req.pages), False

    def feed(self, rid: int, count: int) -> bool:
        """Feed `count` more tokens (fewer at the end); False when the pool has no pages for them."""
        req, size = self.reqs[rid], self.pool.page_size
        end = min(req.computed + count, len(req.tokens))
        try:
            req.pages.extend(self.pool.allocate(-(-end // size) - len(req.pages)))
        except OutOfPages:
            return False
        keys = page_keys(req.tokens, size, self.pool.namespace, end // size)
        for i in range(req.computed // size, end // size):
            self.content[req.pages[i]] = keys[i]
        req.computed = end
        req.cursor = self.pool.publish(req.tokens, req.pages, req.computed, req.keys, req.cursor)
        return True

    def release(self, rid: int, publish: bool) -> None:
        req = self.reqs[rid]
        if publish:
            self.pool.publish(req.tokens, req.pages, req.computed, req.keys, req.cursor)
        self.pool.release(req.pages)
        req.pages, req.computed, req.cursor, req.waiting = [], 0, 0, True

    def check(self) -> None:
        """Nothing published is stale, and nothing a walk from page 0 would publish is missing."""
        for page, key in self.pool.key_of.items():
            assert self.content[page] == key, f"page {page} published under another content's key"
        for req in self.reqs.values():
            for key in page_keys(req.tokens, self.pool.page_size, self.pool.namespace, req.cursor):
                assert key in self.pool.page_of


def drive(sims: list[Traffic], seed: int, steps: int, prompts: int = 4) -> None:
    """The same random traffic through each pool (decisions from the first one's state): requests
    share prefixes or whole prompts (duplicate pages), finish, abort and are preempted."""
    rng = random.Random(seed)
    size = sims[0].pool.page_size
    bases = [[rng.randrange(1, 50) for _ in range(5 * size)] for _ in range(prompts)]
    rid = max(sims[0].reqs, default=0)
    for _ in range(steps):
        lead = sims[0]
        if len(lead.reqs) < 6 and rng.random() < 0.4:
            base = rng.choice(bases)
            cut = rng.choice([len(base), len(base), rng.randrange(1, len(base))])
            tokens = base[:cut] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 3 * size))]
            for _ in range(rng.choice([1, 1, 2, 3])):  # n > 1: the same prompt admitted together
                rid += 1
                for sim in sims:
                    sim.reqs[rid] = Req(list(tokens))
        for r in sorted(lead.reqs):  # a step admits before anything it feeds is published
            if lead.reqs[r].waiting:
                for sim in sims:
                    sim.admit(r)
        for r in sorted(lead.reqs):
            if r not in lead.reqs:
                continue
            req = lead.reqs[r]
            if req.waiting:  # preempted earlier in this step
                continue
            choice = rng.random()
            if choice < 0.05:
                for sim in sims:
                    sim.release(r, publish=False)
                    del sim.reqs[r]
            elif choice < 0.1:
                for sim in sims:
                    sim.release(r, publish=False)  # preempted: readmitted next step
            elif req.computed == len(req.tokens) or choice < 0.2:  # done, or a stop token
                for sim in sims:
                    sim.release(r, publish=True)
                    del sim.reqs[r]
            else:
                count = rng.choice([1, 1, 1, rng.randrange(2, 2 * size + 2)])
                fed = [sim.feed(r, count) for sim in sims]
                assert len(set(fed)) == 1
                if not fed[0]:
                    for sim in sims:
                        sim.release(r, publish=False)
        for sim in sims:
            sim.check()


@pytest.mark.parametrize("seed", range(8))
def test_publishing_from_the_cursor_equals_walking_from_the_first_page(seed):
    """Without evictions (a pool larger than the traffic) the two pools stay identical, page for page."""
    cursor, walking = PagePool(4000, 4), WalkingPool(4000, 4)
    rng, sims = random.Random(seed), [Traffic(cursor), Traffic(walking)]
    for _ in range(5):  # new prompts each round, over the cache the earlier rounds left
        drive(sims, rng.randrange(1 << 30), steps=60)
        assert cursor.key_of == walking.key_of and cursor.page_of == walking.page_of
        assert cursor._free == walking._free and list(cursor._cached_lru) == list(walking._cached_lru)
    assert cursor.pages_walked < walking.pages_walked / 2


@pytest.mark.parametrize("seed", range(8))
def test_under_eviction_nothing_stale_is_published_and_nothing_is_missed(seed):
    drive([Traffic(PagePool(16, 2))], seed, steps=300)  # pages evicted while their duplicates run


def test_a_duplicate_page_is_published_when_the_other_is_evicted():
    pool = PagePool(7, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    first, second = pool.allocate(3), pool.allocate(3)  # the same prompt twice, no cache hit
    cursor = pool.publish(prompt, first, 4)
    assert pool.publish(prompt, second, 4, since=0) == 2  # both its full pages duplicate first's
    assert set(pool.key_of) == set(first[:2])
    pool.release(first)  # the first request ends: its pages stay cached, evictable
    assert cursor == 2
    pool.allocate(pool.num_free)  # memory pressure evicts them: second's pages take their keys at once
    assert set(pool.key_of) == set(second[:2])
    assert pool.match_prefix(prompt) == second[:2]


def test_an_understudy_released_is_not_published_later():
    pool = PagePool(7, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    first, second = pool.allocate(3), pool.allocate(3)
    pool.publish(prompt, first, 4)
    pool.publish(prompt, second, 4)
    pool.release(second)  # aborted: its pages go back to the free list, for other content
    pool.release(first)
    assert pool.reset_prefix_cache() == 2
    assert pool.key_of == {} and pool.page_of == {}


def test_a_decode_step_walks_only_the_pages_it_completes():
    """A 64K-token request of 4096 pages: a publish after each decode step looks at one page when the
    step filled one, else none; walking from page 0 would look at 4096 each step."""
    size, context = 16, 65536
    pool = PagePool(4200, size)
    tokens = list(range(context))
    pages = pool.allocate(context // size)
    keys: list[bytes] = []
    cursor = pool.publish(tokens, pages, context, keys)
    walked = []
    for _ in range(3 * size):
        tokens.append(7)
        if len(tokens) % size == 1:
            pages.extend(pool.allocate(1))
        before = pool.pages_walked
        cursor = pool.publish(tokens, pages, len(tokens), keys, cursor)
        walked.append(pool.pages_walked - before)
    assert walked == [int((context + s + 1) % size == 0) for s in range(3 * size)]
    assert cursor == len(tokens) // size


def test_a_cursor_outside_the_pages_is_an_error():
    pool = PagePool(4, 2)
    with pytest.raises(ValueError, match=r"since \(3\) must be within the request's 1 pages"):
        pool.publish([1, 2], [1], 2, since=3)
