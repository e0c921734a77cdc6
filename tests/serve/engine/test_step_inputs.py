"""StepInputs: the persistent page table's batches equal build_step_batch's, and a step's host work does
not grow with the context (counted in page-table cells written, not timed)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
from hy3c.serve.engine.step_inputs import StepInputs

FIELDS = (
    "input_ids",
    "positions",
    "page_table",
    "seq_lens",
    "query_start_loc",
    "slot_mapping",
    "logits_indices",
    "token_rows",
)


def assert_same_batch(got: StepBatch, want: StepBatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: {a.tolist()} != {b.tolist()}"
    assert got.logits_owner == want.logits_owner


@dataclass
class Request:
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV the request's pages hold


def random_steps(seed: int, page_size: int, device: str, steps: int = 120) -> StepInputs:
    """Random traffic through a StepInputs that starts with room for one request of one page (so it
    grows both ways): requests arrive (some over a prefix of pages, as a prefix-cache hit gives), feed
    prefill chunks or decode tokens with every logits mode, leave (their rows are reused), are
    preempted (a new, empty page list) — and every step's batch is checked against build_step_batch."""
    rng = random.Random(seed)
    inputs = StepInputs(page_size, device, rows=1, pages=1)
    live: dict[str, Request] = {}
    next_page, serial = 1, 0
    scheduled: set[str] = set()
    for _ in range(steps):
        if not live or rng.random() < 0.3:
            serial += 1
            hit = [rng.randrange(1, 10_000) for _ in range(rng.choice([0, 0, 1, 3]))]
            live[f"r{serial}"] = Request(hit, len(hit) * page_size)
        if len(live) > 1 and rng.random() < 0.15:
            gone = rng.choice(sorted(live))
            del live[gone]
            inputs.drop(gone)
        if live and rng.random() < 0.1:
            victim = live[rng.choice(sorted(live))]
            victim.pages, victim.computed = [], 0  # preempted: recomputed over new pages
        owners = rng.sample(sorted(live), rng.randint(1, len(live)))
        scheduled.update(owners)
        chunks = []
        for owner in owners:
            req = live[owner]
            count = rng.choice([1, 1, 1, 0, rng.randint(2, 3 * page_size + 5), rng.randint(64, 200)])
            end = req.computed + count
            while len(req.pages) * page_size < end:  # the scheduler grows the list in place
                req.pages.append(next_page)
                next_page += 1
            tokens = [rng.randrange(0, 500) for _ in range(count)]
            chunks.append(SeqChunk(tokens, req.computed, req.pages, rng.choice(["last", "all", "none"])))
            req.computed = end
        batch = inputs.build(chunks, owners)
        assert_same_batch(batch, build_step_batch(chunks, page_size))
    assert inputs.num_requests == len(scheduled & live.keys())  # the rows of those that left are free
    return inputs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batches_equal_build_step_batch_under_random_traffic(seed, page_size):
    random_steps(seed, page_size, "cpu")


def test_an_empty_step_and_a_chunk_without_tokens_match():
    inputs = StepInputs(4, "cpu")
    assert_same_batch(inputs.build([], []), build_step_batch([], 4))
    chunks = [SeqChunk([], 0, [], "last"), SeqChunk([3, 4], 0, [7], "all")]
    assert_same_batch(inputs.build(chunks, ["a", "b"]), build_step_batch(chunks, 4))


def test_a_dropped_requests_row_is_cleared_and_reused():
    inputs = StepInputs(2, "cpu", rows=2, pages=4)
    long_pages = [5, 6, 7, 8]
    inputs.build([SeqChunk([1] * 8, 0, long_pages)], ["long"])
    row = inputs.row_of("long")
    inputs.drop("long")
    assert inputs.row_of("long") is None and inputs.table[row].tolist() == [0, 0, 0, 0]
    chunks = [SeqChunk([1], 0, [9]), SeqChunk([1, 2, 3], 0, [3, 4])]
    batch = inputs.build(chunks, ["short", "other"])
    assert inputs.row_of("short") == row  # the freed row is taken again, without the old pages
    assert batch.page_table.tolist() == [[9, 0], [3, 4]]
    inputs.drop("never seen")  # ignored


def test_decode_steps_write_only_the_pages_they_add_whatever_the_context():
    """A 64K-token request (4096 pages of 16): after its prefill, a decode step writes the one page
    cell it appends, or none — per-step host work is O(pages added), not O(context). Rebuilding its
    row each step (build_step_batch's way) would write 4096 cells a step."""
    page_size, context = 16, 65536
    inputs = StepInputs(page_size, "cpu", rows=2, pages=64)
    pages: list[int] = []
    other = [1]
    computed = 0
    while computed < context:
        count = min(8192, context - computed)
        pages.extend(range(len(pages) + 2, -(-(computed + count) // page_size) + 2))
        inputs.build([SeqChunk([7] * count, computed, pages)], ["long"])
        computed += count
    writes = []
    for _ in range(3 * page_size):
        if computed % page_size == 0:
            pages.append(len(pages) + 2)
        before = inputs.cells_written
        chunks = [SeqChunk([7], computed, pages), SeqChunk([3], 0, other)]
        batch = inputs.build(chunks, ["long", "short"])
        writes.append(inputs.cells_written - before)
        computed += 1
    # the first step writes the short request's page and the long one's 4097th; then a page every 16
    assert writes == [2] + [int(s % page_size == 0) for s in range(1, 3 * page_size)]
    assert_same_batch(batch, build_step_batch(chunks, page_size))


def test_replaced_pages_rewrite_the_row():
    inputs = StepInputs(4, "cpu")
    pages = [4, 5, 6]
    inputs.build([SeqChunk([1] * 12, 0, pages)], ["a"])
    readmitted = [9, 5]  # preempted, then readmitted over other pages: a new list
    chunks = [SeqChunk([1] * 8, 0, readmitted)]
    assert inputs.build(chunks, ["a"]).page_table.tolist() == [[9, 5]]
    assert inputs.table[inputs.row_of("a"), :3].tolist() == [9, 5, 0]


def test_fed_tokens_go_up_with_the_batch():
    """The (token index, draw row) pairs of tokens fed from the device ride in the batch's upload; the
    other inputs are those of a build without them."""
    inputs = StepInputs(4, "cpu")
    chunks = [SeqChunk([1, 0], 0, [3]), SeqChunk([0], 9, [5, 6, 7])]
    fed = inputs.build(chunks, ["a", "b"], [(1, 0), (2, 1)])
    assert fed.feed_index.tolist() == [[1, 2], [0, 1]]
    plain = StepInputs(4, "cpu").build(chunks, ["a", "b"])
    assert plain.feed_index is None
    for name in ("input_ids", "positions", "slot_mapping", "page_table", "seq_lens", "logits_indices"):
        assert getattr(fed, name).tolist() == getattr(plain, name).tolist(), name


def test_bad_calls_are_one_line_errors():
    inputs = StepInputs(4, "cpu")
    chunk = SeqChunk([1], 0, [3])
    with pytest.raises(ValueError, match="1 chunks but 2 owners"):
        inputs.build([chunk], ["a", "b"])
    with pytest.raises(ValueError, match="appears twice"):
        inputs.build([chunk, chunk], ["a", "a"])
    with pytest.raises(ValueError, match="request 0: 1 pages cannot hold 5 tokens"):
        inputs.build([SeqChunk([1] * 5, 0, [3])], ["a"])
    with pytest.raises(ValueError, match="page_size"):
        StepInputs(0, "cpu")


@pytest.mark.gpu
def test_on_cuda_batches_match_and_building_does_not_wait_for_the_device():
    """On CUDA: the random traffic's batches equal build_step_batch's, and a build while the stream is
    busy returns before the stream is done (no pageable copy, which would synchronize it)."""
    random_steps(0, 16, "cuda", steps=60)
    inputs = StepInputs(16, "cuda")
    chunks = [SeqChunk([1, 2], 0, [3]), SeqChunk([4], 20, [5, 6])]
    inputs.build(chunks, ["a", "b"])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for a while (~0.1 s)
    chunks[0].pages.append(7)
    batch = inputs.build([SeqChunk([9], 16, chunks[0].pages), chunks[1]], ["a", "b"])
    assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert batch.page_table.tolist() == [[3, 7], [5, 6]]
    assert batch.slot_mapping.tolist() == [7 * 16, 6 * 16 + 4]  # position 20: page 1 of [5, 6]
