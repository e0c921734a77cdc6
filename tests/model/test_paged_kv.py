"""Prefill of a ragged batch (chunked, mixed with decodes) then decode steps == whole-sequence recompute."""

import pytest
import torch

from hy3c.loader import load_model
from hy3c.model import PagePool, SeqChunk, allocate_kv_cache, build_step_batch
from hy3c.reference import model_logits


@pytest.mark.parametrize(("page_size", "chunk"), [(4, 64), (16, 64), (5, 7), (7, 3)])
def test_chunked_prefill_then_decode_equals_recompute(tiny_ckpt, page_size, chunk):
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (1, 5, 16, 23)]
    pool = PagePool(64)
    kv = allocate_kv_cache(model.config, 64, page_size, torch.float32)
    pages: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    produced = [0] * len(prompts)
    while min(produced) < 5:
        chunks = []
        for r, seq in enumerate(seqs):
            new = seq[cached[r] : cached[r] + chunk]
            pool.grow(pages[r], cached[r] + len(new), page_size)
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
    assert pool.num_free < 64
