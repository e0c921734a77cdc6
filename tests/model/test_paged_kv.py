"""Prefill of a ragged batch (chunked, mixed with decodes) then decode steps == whole-sequence recompute."""

import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.model import SeqChunk, allocate_kv_cache, build_step_batch


@pytest.mark.parametrize(("page_size", "chunk"), [(4, 64), (16, 64), (5, 7), (7, 3)])
def test_chunked_prefill_then_decode_equals_recompute(tiny_ckpt, page_size, chunk):
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (1, 5, 16, 23)]
    free = iter(range(63, -1, -1))  # pages from the top down, interleaved between the requests
    kv = allocate_kv_cache(model.config, 64, page_size, torch.float32)
    pages: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    produced = [0] * len(prompts)
    while min(produced) < 5:
        chunks = []
        for r, seq in enumerate(seqs):
            new = seq[cached[r] : cached[r] + chunk]
            while len(pages[r]) * page_size < cached[r] + len(new):
                pages[r].append(next(free))
            chunks.append(
                SeqChunk(
                    new, cached[r], list(pages[r]), "last" if cached[r] + len(new) == len(seq) else "none"
                )
            )
        batch = build_step_batch(chunks, page_size)
        with torch.no_grad():
            logits, _ = model(*batch.model_args(kv))
        for r, c in enumerate(chunks):
            cached[r] += len(c.tokens)
        for row, r in enumerate(batch.logits_owner):
            expected = model_logits(model, torch.tensor([seqs[r]]))[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=1e-5)
            seqs[r].append(int(logits[row].argmax()))
            produced[r] += 1


def test_step_batch_values_and_packed_layout():
    """build_step_batch: the flat inputs of a mixed step, held as 16-byte-aligned views of two tensors."""
    chunks = [
        SeqChunk([5, 6, 7], 0, [3], "last"),
        SeqChunk([9], 10, [1, 2], "all"),
        SeqChunk([], 4, [0], "none"),
    ]
    batch = build_step_batch(chunks, 8)
    assert batch.input_ids.tolist() == [5, 6, 7, 9]
    assert batch.positions.tolist() == [0, 1, 2, 10]
    assert batch.slot_mapping.tolist() == [24, 25, 26, 18]
    assert batch.page_table.tolist() == [[3, 0], [1, 2], [0, 0]]
    assert batch.seq_lens.tolist() == [3, 11, 4]
    assert batch.query_start_loc.tolist() == [0, 3, 4, 4]
    assert batch.logits_indices.tolist() == [2, 3] and batch.logits_owner == [0, 1]
    assert torch.equal(batch.token_rows, torch.stack([batch.input_ids, batch.positions, batch.slot_mapping]))
    for tokens in (1, 2, 3, 5):
        b = build_step_batch([SeqChunk(list(range(tokens)), 0, [0], "last")] * 3, 8)
        tensors = [b.input_ids, b.positions, b.slot_mapping, b.logits_indices, b.page_table, b.seq_lens]
        assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in [*tensors, b.query_start_loc])
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 2
    empty = build_step_batch([], 8)
    assert empty.page_table.shape == (0, 1) and empty.query_start_loc.tolist() == [0]
