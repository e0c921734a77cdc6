"""KV tiers below the page pool (`serve/engine/kv_tiers.py`): L2 host blocks and the file store (L3).

A prompt evicted from a small GPU pool comes back from L2 (cached tokens, same greedy output as without
tiers); a new engine on the same file store (a restart) finds it in L3; corrupt or truncated page files
are rejected and recomputed; a failing store degrades to L1 + L2 and resumes after a probe; no page or
host block is left held."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.kv_file_store import FileStore
from hy3c.serve.engine.kv_tiers import TierConfig
from hy3c.serve.engine.sampler import SamplingParams

PAGE = 4
PROMPT = [(11 * i + 5) % 90 + 3 for i in range(41)]  # 10 full pages and one token


def _engine(model, tokenizer, tiers: TierConfig | None, num_pages: int = 24) -> Engine:
    config = EngineConfig(
        num_pages=num_pages,
        page_size=PAGE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=80,
        kv_tiers=tiers,
    )
    return Engine(model, tokenizer, config)


def _generate(engine: Engine, prompt: list[int], name: str, tokens: int = 6) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one request run alone."""
    outputs: list[StepOutput] = []
    engine.submit(
        GenerationRequest(name, prompt, SamplingParams(temperature=0.0), tokens, ignore_eos=True),
        outputs.append,
    )
    engine.run_until_done()
    return [t for o in outputs for t in o.token_ids], outputs[-1].cached_tokens


def _evict(engine: Engine, rounds: int = 3) -> None:
    """Fill the small pool with other prompts so that PROMPT's published pages are evicted."""
    for r in range(rounds):
        _generate(engine, [(7 * i + 13 * r) % 80 + 2 for i in range(41)], f"filler-{r}")


def _no_leaks(engine: Engine) -> None:
    assert engine.pool.num_free == engine.pool.usable, "GPU pages leaked"
    if engine.tiers is not None:
        engine.tiers.flush()
        assert engine.tiers.blocks_busy == 0, "host blocks left held"


def _config(tmp_path=None, **overrides) -> TierConfig:
    store = None if tmp_path is None else f"file:{tmp_path}"
    return TierConfig(host_gib=0.001, store=store, namespace=b"test-artifact", **overrides)


def test_an_evicted_prefix_comes_back_from_host_memory(model, tokenizer):
    plain = _engine(model, tokenizer, None)
    expected, _ = _generate(plain, PROMPT, "a")
    _evict(plain)
    again, cached = _generate(plain, PROMPT, "b")
    assert again == expected and cached == 0  # L1 alone lost it

    engine = _engine(model, tokenizer, _config())
    first, cached = _generate(engine, PROMPT, "a")
    assert first == expected and cached == 0
    _evict(engine)
    assert engine.pool.match_prefix(PROMPT) == []  # gone from L1 …
    again, cached = _generate(engine, PROMPT, "b")
    assert again == expected and cached == 40  # … back from L2: every full page
    assert engine.tiers.stats.l2_hits == 10 and engine.tiers.stats.l3_queries == 0
    _no_leaks(engine)


def test_a_prompt_is_hashed_once_per_admission_across_the_tiers(model, tokenizer, tmp_path, monkeypatch):
    """The L1 match, the L2 lookup, the store read's lookup and the L1 publish of loaded pages share the
    request's page keys: each of its pages is hashed once (a 32K-token prompt hashed three times cost
    ~4 ms of the engine thread per admission on the H100: bench/LOG.md)."""
    import hashlib

    from hy3c.serve.engine import kv_pages

    engine = _engine(model, tokenizer, _config(tmp_path))
    _generate(engine, PROMPT, "a")
    _evict(engine)
    hashed = []

    class Counting:
        @staticmethod
        def blake2b(*args, **kwargs):
            hashed.append(1)
            return hashlib.blake2b(*args, **kwargs)

    monkeypatch.setattr(kv_pages, "hashlib", Counting)
    tokens, cached = _generate(engine, PROMPT, "b")
    assert cached == 40 and engine.tiers.stats.l2_hits == 10  # back from L2
    # its 10 prompt pages, then the pages its 6 output tokens fill (publish at the end)
    assert len(hashed) == (len(PROMPT) + len(tokens) - 1) // PAGE
    _no_leaks(engine)


class _SlowCopy:
    """A device copy's event that reports done only after `polls` queries (the CPU has no streams)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


@pytest.mark.parametrize("case", ["alone", "beside", "beside, a load over the budget"])
def test_a_load_from_host_memory_joins_at_once_unless_larger_than_a_step(model, tokenizer, monkeypatch, case):
    """An L2 hit's pages are copied on the side stream without a wait. Alone, or beside a running
    request with a load no larger than the step's token budget, the request is admitted at once and
    the step waits on the device; with a larger load it is held back while the running one keeps
    stepping (it joins once the copy is done). Same greedy tokens either way, nothing held."""
    from hy3c.serve.engine import kv_tiers

    plain = _engine(model, tokenizer, None, num_pages=40)
    expected, _ = _generate(plain, PROMPT, "ref")
    other_prompt = [(5 * i + 1) % 70 + 4 for i in range(9)]
    other_expected, _ = _generate(plain, other_prompt, "ref-other")

    engine = _engine(model, tokenizer, _config())
    _generate(engine, PROMPT, "a")
    _evict(engine)
    held_back = case == "beside, a load over the budget"
    if held_back:  # the 40 tokens loaded are more than a step takes
        engine.scheduler.max_num_batched_tokens = 32
    load, copies, waits = kv_tiers.KVTiers._load, [], []

    def slow_load(self, pages, blocks):
        load(self, pages, blocks)
        copies.append(_SlowCopy(polls=3))
        return copies[-1]

    monkeypatch.setattr(kv_tiers.KVTiers, "_load", slow_load)
    monkeypatch.setattr(kv_tiers.KVTiers, "_device_wait", lambda self, event: waits.append(event))
    steps: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recorded():
        work = schedule()
        steps.append({w.seq.request_id for w in work})
        return work

    engine.scheduler.schedule = recorded
    outputs: dict[str, list[StepOutput]] = {"b": [], "other": []}
    if case != "alone":
        engine.submit(
            GenerationRequest("other", other_prompt, SamplingParams(temperature=0.0), 6, ignore_eos=True),
            outputs["other"].append,
        )
        engine._iterate()  # the other request runs
    engine.submit(
        GenerationRequest("b", PROMPT, SamplingParams(temperature=0.0), 6, ignore_eos=True),
        outputs["b"].append,
    )
    engine.run_until_done()
    assert [t for o in outputs["b"] for t in o.token_ids] == expected and outputs["b"][-1].cached_tokens == 40
    assert len(copies) == 1
    if case != "alone":
        assert [t for o in outputs["other"] for t in o.token_ids] == other_expected
    if not held_back:
        joined = next(i for i, ids in enumerate(steps) if "b" in ids)
        assert waits == copies and joined == (0 if case == "alone" else 1)  # at once, the device waits
    else:
        joined = next(i for i, ids in enumerate(steps) if "b" in ids)
        assert joined >= 3 and all("other" in ids for ids in steps[1:joined])  # it stepped meanwhile
        assert waits == [] and copies[0].polls < 0
    _no_leaks(engine)


def test_a_request_held_back_by_its_load_gives_its_pages_to_a_running_one(model, tokenizer, monkeypatch):
    """A long L2 hit can take every free page and then wait for its copy: a running request that needs
    a page meanwhile gets the waiting one's pages back (they stay published; it matches them again),
    rather than being preempted or refused as too large for the pool. Both finish with the tokens
    they give alone."""
    from hy3c.serve.engine import kv_tiers

    running_prompt = [(5 * i + 1) % 70 + 4 for i in range(47)]  # 12 pages of the 23, then 20 tokens more
    plain = _engine(model, tokenizer, None)
    expected = {"r": _generate(plain, running_prompt, "r", 20)[0], "b": _generate(plain, PROMPT, "b")[0]}

    engine = _engine(model, tokenizer, _config())
    _generate(engine, PROMPT, "a")
    _evict(engine)
    engine.scheduler.max_num_batched_tokens = 32  # the 40 tokens loaded are more than a step: held back
    load = kv_tiers.KVTiers._load
    monkeypatch.setattr(
        kv_tiers.KVTiers, "_load", lambda self, pages, blocks: load(self, pages, blocks) or _SlowCopy(12)
    )
    monkeypatch.setattr(kv_tiers.KVTiers, "_device_wait", lambda self, event: None)
    outputs: dict[str, list[StepOutput]] = {"r": [], "b": []}
    engine.submit(
        GenerationRequest("r", running_prompt, SamplingParams(temperature=0.0), 20, ignore_eos=True),
        outputs["r"].append,
    )
    engine._iterate()
    engine.submit(
        GenerationRequest("b", PROMPT, SamplingParams(temperature=0.0), 6, ignore_eos=True),
        outputs["b"].append,
    )
    engine.run_until_done()
    assert {name: [t for o in outs for t in o.token_ids] for name, outs in outputs.items()} == expected
    assert engine.scheduler.num_preemptions == 0 and outputs["b"][-1].cached_tokens == 40
    _no_leaks(engine)


def test_a_restart_on_the_same_file_store_reuses_the_prefix(model, tokenizer, tmp_path):
    first = _engine(model, tokenizer, _config(tmp_path))
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.flush()
    assert first.tiers.stats.l3_stored >= 10
    _no_leaks(first)
    first.tiers.close()

    restarted = _engine(model, tokenizer, _config(tmp_path))
    tokens, cached = _generate(restarted, PROMPT, "a")
    assert tokens == expected and cached == 40
    assert restarted.tiers.stats.l3_hits == 10
    _no_leaks(restarted)

    other = _engine(
        model, tokenizer, TierConfig(host_gib=0.001, store=f"file:{tmp_path}", namespace=b"other")
    )
    tokens, cached = _generate(other, PROMPT, "a")  # another artifact's cache key: never read
    assert tokens == expected and cached == 0


def _plans(engine: Engine) -> tuple[list[int], list[int]]:
    """(each schedule's number of work items, each store read's number of pages), recorded as the engine
    runs."""
    plans: list[int] = []
    reads: list[int] = []
    schedule, read_run = engine.scheduler.schedule, engine.tiers._read_run

    def counted_schedule():
        work = schedule()
        plans.append(len(work))
        return work

    def counted_read(keys):
        reads.append(len(keys))
        return read_run(keys)

    engine.scheduler.schedule, engine.tiers._read_run = counted_schedule, counted_read
    return plans, reads


def test_a_prompt_the_file_store_lacks_starts_in_the_first_step(model, tokenizer, tmp_path):
    """The file store is asked on the engine's thread (one stat) whether it holds a new prompt's first
    page beyond L1 and L2: a prompt it lacks is admitted by the first schedule, with no read; after a
    restart the prompt's pages are there, so it waits for their read and starts from them."""
    first = _engine(model, tokenizer, _config(tmp_path))
    plans, reads = _plans(first)
    expected, cached = _generate(first, PROMPT, "a")
    assert cached == 0 and plans[0] == 1 and reads == []
    assert first.tiers.stats.l3_queries == 1 and first.tiers.stats.l3_hits == 0
    first.tiers.close()

    restarted = _engine(model, tokenizer, _config(tmp_path))
    plans, reads = _plans(restarted)
    tokens, cached = _generate(restarted, PROMPT, "a")
    assert tokens == expected and cached == 40
    assert plans[0] == 0 and reads == [10]
    _no_leaks(restarted)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_page_files_are_recomputed(model, tokenizer, tmp_path, damage):
    first = _engine(model, tokenizer, _config(tmp_path))
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.close()
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) >= 10
    for path in files:
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-1] ^= 0xFF
        else:
            del data[-7:]
        path.write_bytes(bytes(data))
    restarted = _engine(model, tokenizer, _config(tmp_path))
    tokens, cached = _generate(restarted, PROMPT, "a")
    assert tokens == expected and cached == 0
    assert restarted.tiers.stats.l3_hits == 0
    restarted.tiers.flush()
    _no_leaks(restarted)


def test_the_file_store_is_bounded_and_keeps_its_pages_across_instances(tmp_path):
    payload = bytes(range(256)) * 4
    store = FileStore(tmp_path, b"ns", max_bytes=3 * (len(payload) + 64))
    for i in range(5):
        store.put(bytes([i]) * 16, payload)
    assert store.bytes <= store.max_bytes
    assert store.get(bytes([0]) * 16, len(payload)) is None  # the oldest went
    assert store.get(bytes([4]) * 16, len(payload)) == payload
    reopened = FileStore(tmp_path, b"ns", max_bytes=store.max_bytes)
    assert reopened.get(bytes([4]) * 16, len(payload)) == payload
    assert reopened.get(bytes([4]) * 16, len(payload) + 1) is None  # another page layout: rejected
    assert FileStore(tmp_path, b"other", store.max_bytes).get(bytes([4]) * 16, len(payload)) is None
    assert not list(tmp_path.glob("*/*.tmp*"))


class _Flaky:
    """A store that fails every call while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.pages: dict[bytes, bytes] = {}

    def _check(self) -> None:
        if self.down:
            raise OSError("store unreachable")

    def get(self, key, length):
        self._check()
        return self.pages.get(key)

    def put(self, key, payload):
        self._check()
        self.pages[key] = bytes(payload)  # a view of an L2 block: a store keeps a copy

    def contains(self, key):
        self._check()
        return key in self.pages

    def probe(self):
        self._check()

    def close(self):
        self.down = True


class _FlakyLocal(_Flaky):
    """`_Flaky` asked on the engine's thread (`local_lookup`): a failing lookup must still count."""

    local_lookup = True


@pytest.mark.parametrize("flaky_store", [_Flaky, _FlakyLocal])
def test_a_failing_store_degrades_to_host_memory_and_resumes(model, tokenizer, tmp_path, flaky_store):
    engine = _engine(model, tokenizer, _config(tmp_path, failures_to_degrade=3, probe_seconds=0.05))
    flaky = flaky_store()
    engine.tiers.store = flaky
    expected, _ = _generate(_engine(model, tokenizer, None), PROMPT, "ref")
    tokens, _ = _generate(engine, PROMPT, "a")
    engine.tiers.flush()
    assert tokens == expected
    assert engine.tiers.degraded and engine.tiers.stats.l3_failures >= 3
    flaky.down = False
    deadline = time.monotonic() + 5
    while engine.tiers.degraded and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.tiers.degraded  # the probe saw it back
    _evict(engine)
    tokens, cached = _generate(engine, PROMPT, "b")
    assert tokens == expected and cached == 40  # L2 served it throughout
    _no_leaks(engine)


class _Hanging(_Flaky):
    """A store whose calls hang far past the timeout (a master that stopped answering mid-load)."""

    def __init__(self, pages: dict[bytes, bytes]) -> None:
        super().__init__()
        self.down, self.pages = False, pages

    def get(self, key, length):
        time.sleep(3.0)
        return self.pages.get(key)

    def put(self, key, payload):
        time.sleep(3.0)
        super().put(key, payload)


def test_a_store_that_hangs_mid_load_costs_one_timeout_and_the_prefix_is_recomputed(
    model, tokenizer, tmp_path
):
    """Reads that never come back: each request waits one timeout, recomputes its prefix (the output
    of an engine without tiers), and after `failures_to_degrade` failures the store is skipped."""
    prompts = [[(11 * i + 7 * r) % 90 + 3 for i in range(41)] for r in range(3)]
    plain = _engine(model, tokenizer, None)
    expected = [_generate(plain, prompt, f"ref{r}")[0] for r, prompt in enumerate(prompts)]
    engine = _engine(
        model, tokenizer, _config(tmp_path, store_timeout=0.2, failures_to_degrade=2, probe_seconds=60)
    )
    engine.tiers.store = _Hanging({})
    for r, prompt in enumerate(prompts):
        started = time.monotonic()
        tokens, cached = _generate(engine, prompt, f"a{r}")
        assert tokens == expected[r] and cached == 0
        assert time.monotonic() - started < 2.0
    assert engine.tiers.degraded and engine.tiers.stats.l3_failures >= 2
    _no_leaks(engine)


def test_the_engine_loop_counts_its_idle_turns_as_empty_or_held(model, tokenizer, tmp_path):
    """On the engine thread: a request whose admission waits for a store read that hangs is `held`
    (about the read's timeout), an engine with no request `empty`."""
    engine = _engine(
        model, tokenizer, _config(tmp_path, store_timeout=0.3, failures_to_degrade=5, probe_seconds=60)
    )
    engine.tiers.store = _Hanging({})
    done = threading.Event()
    engine.start()
    try:
        time.sleep(0.2)
        engine.submit(
            GenerationRequest("r", PROMPT, SamplingParams(temperature=0.0), 4, ignore_eos=True),
            lambda out: done.set() if out.finished else None,
        )
        assert done.wait(10)
    finally:
        engine.stop()
    held = engine.metrics.sample("hy3c:engine_idle_seconds_total", state="held")
    empty = engine.metrics.sample("hy3c:engine_idle_seconds_total", state="empty")
    assert 0.25 <= held < 1.0, held
    assert empty >= 0.15, empty
    _no_leaks(engine)


class _SlowWriter(_Flaky):
    """A store whose writes wait for `go` (far past the timeout), then keep a copy of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.go = threading.Event()

    def put(self, key, payload):
        self.go.wait(10)
        super().put(key, payload)


def test_a_write_past_its_timeout_keeps_its_host_blocks_until_it_ends(model, tokenizer, tmp_path):
    """The writer hands the store views of the L2 blocks: when a write outlives its timeout the
    failure is counted at once, but its blocks stay held (never reused under the running write)
    until it ends, and the pages it then stores equal their blocks."""
    engine = _engine(model, tokenizer, _config(tmp_path, store_timeout=0.2, failures_to_degrade=100))
    store = _SlowWriter()
    engine.tiers.store = store
    _generate(engine, PROMPT, "a")
    engine.tiers.commit_saves()
    deadline = time.monotonic() + 5
    while engine.tiers._writes.qsize() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # the last batch taken has met its timeout too
    assert engine.tiers.stats.l3_failures >= 1 and not engine.tiers._writes.qsize()
    assert engine.tiers.blocks_busy > 0  # held by the writes still running
    store.go.set()
    engine.tiers.flush(timeout=10)
    assert engine.tiers.blocks_busy == 0 and store.pages
    tiers = engine.tiers
    for key, payload in store.pages.items():
        block = tiers._block_of[key]
        assert payload == tiers.host[block].view(-1).view(torch.uint8).numpy().tobytes()
    _no_leaks(engine)


def test_concurrent_requests_share_one_load_from_the_store(model, tokenizer, tmp_path):
    """After a restart, three requests with one prompt submitted together: the store is read once,
    the pages loaded once into the GPU pool, and all three start from the cached prefix."""
    first = _engine(model, tokenizer, _config(tmp_path))
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.close()
    restarted = _engine(model, tokenizer, _config(tmp_path))
    outputs: dict[str, list[StepOutput]] = {f"c{i}": [] for i in range(3)}
    for name, sink in outputs.items():
        request = GenerationRequest(name, PROMPT, SamplingParams(temperature=0.0), 6, ignore_eos=True)
        restarted.submit(request, sink.append)
    restarted.run_until_done()
    for outs in outputs.values():
        assert [t for o in outs for t in o.token_ids] == expected and outs[-1].cached_tokens == 40
    assert (
        restarted.tiers.stats.l3_hits == 10
        and restarted.tiers.stats.loaded_bytes == 10 * restarted.tiers.page_bytes
    )
    _no_leaks(restarted)


def test_a_store_run_longer_than_host_memory_loads_what_fits(model, tokenizer, tmp_path):
    """L2 of 4 blocks, a 10-page prefix in the store: the read is cut to 4 pages (it must not evict its
    own first pages), which load; the rest is recomputed."""
    first = _engine(model, tokenizer, _config(tmp_path))
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.close()
    small = TierConfig(
        host_gib=4.5 * first.tiers.page_bytes / 2**30, store=f"file:{tmp_path}", namespace=b"test-artifact"
    )
    engine = _engine(model, tokenizer, small)
    assert engine.tiers.num_blocks == 4
    tokens, cached = _generate(engine, PROMPT, "a")
    assert tokens == expected and cached == 16 and engine.tiers.stats.l3_hits == 4
    _no_leaks(engine)


def test_tiers_are_refused_with_several_ranks(model, tokenizer, monkeypatch):
    monkeypatch.setattr(model, "world_size", 2, raising=False)
    with pytest.raises(ValueError, match="--kv-host-gib: not supported with several ranks"):
        _engine(model, tokenizer, _config())


class _Broken(_Flaky):
    """A backend that raises something unexpected (not an OSError) on every write."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def contains(self, key):
        raise TypeError("a binding bug")


def test_an_unexpected_store_error_is_a_failure_and_the_writer_lives_on(model, tokenizer, tmp_path):
    engine = _engine(model, tokenizer, _config(tmp_path, failures_to_degrade=100))
    engine.tiers.store = _Broken()
    expected, _ = _generate(_engine(model, tokenizer, None), PROMPT, "ref")
    tokens, _ = _generate(engine, PROMPT, "a")
    engine.tiers.flush(timeout=10)
    failures = engine.tiers.stats.l3_failures
    assert tokens == expected and failures >= 1
    _generate(engine, [(3 * i + 1) % 90 + 3 for i in range(41)], "b")
    engine.tiers.flush(timeout=10)
    assert engine.tiers.stats.l3_failures > failures  # the writer lived on to fail again
    _no_leaks(engine)  # every queued block released


class _ZeroCopy:
    """A store moving pages straight between L2 blocks and itself (as Mooncake's registered buffer
    does); `delay` makes its reads slow."""

    def __init__(self, delay: float = 0.0) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.delay = delay

    def attach(self, host):
        self.host = host

    def put_blocks(self, keys, blocks):
        for key, block in zip(keys, blocks):
            self.pages[key] = self.host[block].view(-1).view(torch.uint8).numpy().tobytes()

    def get_blocks(self, keys, blocks):
        time.sleep(self.delay)
        found = 0
        for key, block in zip(keys, blocks):
            if key not in self.pages:
                break
            self.host[block].view(-1).view(torch.uint8).copy_(
                torch.frombuffer(bytearray(self.pages[key]), dtype=torch.uint8)
            )
            found += 1
        return found

    def probe(self):
        pass

    def close(self):
        pass


def test_zero_copy_stores_and_late_reads_give_their_blocks_back(model, tokenizer, tmp_path):
    """A zero-copy store: a restarted engine reads the prefix straight into L2 blocks; a read that
    outlives the timeout keeps its blocks until it ends, then they return (none leaked, none adopted)."""
    expected, _ = _generate(_engine(model, tokenizer, None), PROMPT, "ref")
    store = _ZeroCopy()
    first = _engine(model, tokenizer, _config(tmp_path))
    first.tiers.store, first.tiers.zero_copy = store, True
    store.attach(first.tiers.host)
    _generate(first, PROMPT, "a")
    first.tiers.flush()
    assert len(store.pages) >= 10
    second = _engine(model, tokenizer, _config(tmp_path, store_timeout=5.0))
    second.tiers.store, second.tiers.zero_copy = store, True
    store.attach(second.tiers.host)
    tokens, cached = _generate(second, PROMPT, "a")
    assert tokens == expected and cached == 40 and second.tiers.stats.l3_hits == 10
    _no_leaks(second)

    store.delay = 0.6
    late = _engine(model, tokenizer, _config(tmp_path, store_timeout=0.1, failures_to_degrade=10))
    late.tiers.store, late.tiers.zero_copy = store, True
    store.attach(late.tiers.host)
    tokens, cached = _generate(late, PROMPT, "a")
    assert tokens == expected and cached == 0  # the read came too late: recomputed
    assert late.tiers.blocks_busy > 0  # … and its blocks wait for it
    time.sleep(0.8)
    late.tiers._reap()
    assert late.tiers.stats.l3_hits == 0
    _no_leaks(late)


class _SlowHits(_ZeroCopy):
    """Reads of pages it has take `delay`; a miss answers at once."""

    def get_blocks(self, keys, blocks):
        if keys and keys[0] in self.pages:
            time.sleep(self.delay)
        return super().get_blocks(keys, blocks)


def test_a_request_waiting_for_the_store_lets_later_ones_start(model, tokenizer, tmp_path):
    """A's prefix is being read from a slow store; B, behind it, has nothing there: B is admitted and
    answers first, then A starts from its cached prefix."""
    store = _SlowHits()
    first = _engine(model, tokenizer, _config(tmp_path))
    first.tiers.store, first.tiers.zero_copy = store, True
    store.attach(first.tiers.host)
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.flush()
    store.delay = 0.5
    engine = _engine(model, tokenizer, _config(tmp_path, store_timeout=5.0))
    engine.tiers.store, engine.tiers.zero_copy = store, True
    store.attach(engine.tiers.host)
    firsts: dict[str, float] = {}
    outputs: dict[str, list[StepOutput]] = {"a": [], "b": []}
    other = [(5 * i + 2) % 90 + 3 for i in range(9)]
    for name, prompt in (("a", PROMPT), ("b", other)):

        def emit(out: StepOutput, name=name) -> None:
            firsts.setdefault(name, time.monotonic())
            outputs[name].append(out)

        engine.submit(
            GenerationRequest(name, prompt, SamplingParams(temperature=0.0), 6, ignore_eos=True), emit
        )
    engine.run_until_done()
    assert firsts["b"] < firsts["a"]
    assert [t for o in outputs["a"] for t in o.token_ids] == expected and outputs["a"][-1].cached_tokens == 40
    _no_leaks(engine)


def test_pages_evicted_from_the_gpu_and_from_host_memory_come_back_from_the_store(model, tokenizer, tmp_path):
    """One engine, a GPU pool and an L2 both too small for the working set: PROMPT's pages leave L1,
    then L2, and its next request reads them from the file store — same greedy output."""
    expected, _ = _generate(_engine(model, tokenizer, None), PROMPT, "ref")
    probe = _engine(model, tokenizer, _config())
    page_bytes = probe.tiers.page_bytes
    probe.tiers.close()
    tiers = TierConfig(
        host_gib=12.5 * page_bytes / 2**30, store=f"file:{tmp_path}", namespace=b"test-artifact"
    )
    engine = _engine(model, tokenizer, tiers)
    assert engine.tiers.num_blocks == 12
    first, _ = _generate(engine, PROMPT, "a")
    engine.tiers.flush()
    _evict(engine)  # 30 filler pages: through L1, and through the 12 L2 blocks
    engine.tiers.flush()
    assert engine.tiers.stats.l2_evicted > 0
    again, cached = _generate(engine, PROMPT, "b")
    assert first == again == expected and cached == 40
    assert engine.tiers.stats.l3_hits == 10
    _no_leaks(engine)


@pytest.mark.parametrize(
    "dtype, head_size, width",
    [
        (torch.float32, 8, torch.int64),
        (torch.bfloat16, 8, torch.int64),
        (torch.float8_e4m3fn, 8, torch.int64),
        (torch.float8_e4m3fn, 6, torch.int16),
        (torch.float8_e4m3fn, 3, torch.uint8),
    ],
)
def test_loads_scatter_runs_of_blocks_into_their_pages_in_bounded_rounds(
    monkeypatch, dtype, head_size, width
):
    """`_load` copies runs of consecutive L2 blocks in one piece and scatters each round into its L1
    pages: every page gets exactly its block, untouched pages keep theirs, across round boundaries
    (FP8 caches too, which torch's `index_copy_` does not take directly), moving the widest integers
    that tile a head's bytes."""
    from hy3c.serve.engine import kv_tiers

    # layers, K / V, pages, page size, KV heads, head size
    cache = torch.randn(3, 2, 16, PAGE, 2, head_size).to(dtype)
    assert kv_tiers._words(cache).dtype == width
    tiers = kv_tiers.KVTiers(cache, _config())
    tiers.host.copy_(torch.randn(tiers.host.shape).to(dtype))
    page_bytes = cache[:, :, 0].numel() * cache.element_size()
    monkeypatch.setattr(kv_tiers, "_STAGING_BYTES", 3 * page_bytes)  # rounds of three pages
    pages, blocks = [9, 2, 3, 14, 0, 7, 5], [4, 5, 6, 1, 10, 11, 2]
    before = cache.clone()
    tiers._load(pages, blocks)
    as_bytes = cache.view(torch.uint8)
    for page, block in zip(pages, blocks):
        assert torch.equal(as_bytes[:, :, page], tiers.host[block].view(torch.uint8))
    others = [p for p in range(16) if p not in pages]
    assert torch.equal(as_bytes[:, :, others], before.view(torch.uint8)[:, :, others])


@pytest.mark.parametrize(
    "dtype, head_size", [(torch.float32, 8), (torch.float8_e4m3fn, 8), (torch.float8_e4m3fn, 6)]
)
def test_saves_gather_published_pages_into_their_blocks_once_per_commit(monkeypatch, dtype, head_size):
    """`published` only takes a block; `commit_saves` copies every page published since into its block
    (runs of consecutive blocks and lone ones, across round boundaries); a page handed out again
    (`reusing`) is saved before, so its old KV is what L2 keeps; held blocks are all let go."""
    from hy3c.serve.engine import kv_tiers
    from hy3c.serve.engine.kv_pages import page_keys

    cache = torch.randn(3, 2, 16, PAGE, 2, head_size).to(dtype)
    tiers = kv_tiers.KVTiers(cache, _config())
    page_bytes = cache[:, :, 0].numel() * cache.element_size()
    monkeypatch.setattr(kv_tiers, "_STAGING_BYTES", 3 * page_bytes)  # rounds of three pages
    tiers._free = [5, 9, 8, 7, 1, 2, 3, 0]  # handed out from the end: 0, 3, 2, 1, 7, 8, 9, 5
    keys = page_keys(list(range(8 * PAGE + 1)), PAGE, b"", 8)
    pages = [4, 11, 2, 6, 13, 0, 9, 15]
    for page, key in zip(pages[:6], keys[:6]):
        tiers.published(page, key)
    assert tiers.blocks_busy == 6  # held until copied
    saved = cache.clone()
    tiers.reusing([pages[0]])  # page 4 is about to be rewritten: the pending saves go first
    cache[:, :, pages[0]] = torch.zeros_like(cache[:, :, pages[0]])
    for page, key in zip(pages[6:], keys[6:]):
        tiers.published(page, key)
    tiers.commit_saves()
    assert tiers.blocks_busy == 0 and tiers.stats.l2_stored == 8
    for page, key in zip(pages, keys):
        block = tiers._block_of[key]
        assert torch.equal(tiers.host[block].view(torch.uint8), saved[:, :, page].view(torch.uint8))


class _SlowStore:
    """A store whose every write takes `seconds` (a disk slower than the pages come): what it holds."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.pages: dict[bytes, bytes] = {}

    def get(self, key: bytes, length: int):
        return self.pages.get(key)

    def put(self, key: bytes, payload) -> None:
        time.sleep(self.seconds)
        self.pages[key] = bytes(payload)

    def contains(self, key: bytes) -> bool:
        return key in self.pages

    def probe(self) -> None:
        pass

    def close(self) -> None:
        pass


def _slow_tiers(monkeypatch, blocks: int, seconds: float, write_queue: int):
    from hy3c.serve.engine import kv_tiers

    store = _SlowStore(seconds)
    monkeypatch.setattr(kv_tiers, "open_store", lambda spec, namespace, max_bytes, blocks: store)
    cache = torch.randn(2, 2, 24, PAGE, 2, 8)
    page_bytes = cache[:, :, 0].numel() * cache.element_size()
    config = TierConfig(host_gib=blocks * page_bytes / 2**30, store="slow:", write_queue=write_queue)
    return kv_tiers.KVTiers(cache, config), store, cache


def test_a_burst_faster_than_the_store_is_written_back_from_host_memory(monkeypatch):
    """Twelve pages published at once to a writer that takes two at a time: none is dropped — the rest
    wait in L2, unwritten, and the writer takes them as it frees up, with no further step (before, a
    full queue dropped ten of them)."""
    from hy3c.serve.engine.kv_pages import page_keys

    tiers, store, cache = _slow_tiers(monkeypatch, blocks=16, seconds=0.01, write_queue=2)
    keys = page_keys(list(range(12 * PAGE + 1)), PAGE, b"", 12)
    for page, key in enumerate(keys, start=1):
        tiers.published(page, key)
    tiers.commit_saves()
    deadline = time.monotonic() + 10
    while len(store.pages) < 12 and time.monotonic() < deadline:  # the writer tops its queue up itself
        time.sleep(0.01)
    assert len(store.pages) == 12
    tiers.flush()
    assert tiers.stats.l3_dropped == 0 and tiers.stats.l3_stored == 12 and tiers.blocks_busy == 0
    for page, key in enumerate(keys, start=1):
        assert store.pages[key] == cache[:, :, page].contiguous().view(torch.uint8).numpy().tobytes()
    tiers.close()


def test_an_unwritten_page_evicted_from_host_memory_is_dropped_never_written_wrong(monkeypatch):
    """L2 of four blocks, a writer one page at a time: pages published two per step evict unwritten
    ones; each is counted as dropped, and every page the store holds has its own page's bytes."""
    from hy3c.serve.engine.kv_pages import page_keys

    tiers, store, cache = _slow_tiers(monkeypatch, blocks=4, seconds=0.03, write_queue=1)
    keys = page_keys(list(range(12 * PAGE + 1)), PAGE, b"", 12)
    for at in range(0, 12, 2):
        for page, key in zip(range(at + 1, at + 3), keys[at : at + 2]):
            tiers.published(page, key)
        tiers.commit_saves()
    tiers.flush()
    assert tiers.stats.l3_dropped > 0 and tiers.stats.l3_stored + tiers.stats.l3_dropped == 12
    assert tiers.blocks_busy == 0 and len(store.pages) == tiers.stats.l3_stored
    for page, key in enumerate(keys, start=1):
        if key in store.pages:
            assert store.pages[key] == cache[:, :, page].contiguous().view(torch.uint8).numpy().tobytes()
    tiers.close()


class _GatedStore(_SlowStore):
    """A store whose writes wait for `gate` (a disk that stalls)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.gate = threading.Event()
        self.gate.set()

    def put(self, key: bytes, payload) -> None:
        assert self.gate.wait(10)
        super().put(key, payload)


def test_host_memory_evicts_a_page_the_store_holds_before_one_it_would_drop(monkeypatch):
    """L2 of four blocks: two pages written to L3, then two more the stalled store has not written,
    then the first two used again (so the unwritten ones are least recently used). A fifth page takes
    a written page's block, not an unwritten one's: nothing is dropped, and once the store is back
    every page is in some tier."""
    from hy3c.serve.engine import kv_tiers
    from hy3c.serve.engine.kv_pages import page_keys

    store = _GatedStore()
    monkeypatch.setattr(kv_tiers, "open_store", lambda spec, namespace, max_bytes, blocks: store)
    cache = torch.randn(2, 2, 24, PAGE, 2, 8)
    page_bytes = cache[:, :, 0].numel() * cache.element_size()
    config = TierConfig(host_gib=4 * page_bytes / 2**30, store="gated:", write_queue=1, store_timeout=60.0)
    tiers = kv_tiers.KVTiers(cache, config)
    keys = page_keys(list(range(5 * PAGE + 1)), PAGE, b"", 5)
    for page in (1, 2):
        tiers.published(page, keys[page - 1])
    tiers.commit_saves()
    tiers.flush()
    assert set(store.pages) == set(keys[:2])
    store.gate.clear()
    for page in (3, 4):
        tiers.published(page, keys[page - 1])
    tiers.commit_saves()
    for page in (1, 2):  # L1 publishes them again: L2 holds them, now the most recently used
        tiers.published(page, keys[page - 1])
    assert len(tiers._unwritten) == 1  # page 3 with the stalled writer, page 4 waiting behind it
    tiers.published(5, keys[4])
    tiers.commit_saves()
    assert tiers.stats.l3_dropped == 0 and tiers.stats.l2_evicted == 1
    store.gate.set()
    tiers.flush()
    assert set(keys[2:]) <= set(store.pages)
    tiers.close()


def test_host_memory_is_shared_and_its_descriptor_closed_on_release_the_tensor_still_valid():
    """L2 lives in a memfd (what the writer process maps); `release` closes it (and unpins it on a
    GPU); the tensor over the mapping stays usable until it goes."""
    from hy3c.serve.engine.kv_tiers import SharedHost

    shared = SharedHost((3, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert os.readlink(f"/proc/self/fd/{shared.fd}").startswith("/memfd:hy3c-kv-l2")
    assert shared.blocks().block_bytes == 2 * 8 * 2 and shared.blocks().count == 3
    tensor = shared.tensor
    tensor.fill_(1.5)
    fd = shared.fd
    shared.release()
    with pytest.raises(OSError):
        os.fstat(fd)
    del shared
    assert float(tensor.sum()) == 1.5 * 48
