import torch

from hy3c.checkpoint.loader import load_model
from hy3c.model import SeqChunk, allocate_kv_cache, build_step_batch

from .spec_impl import load_hub_tensors, main_model, mtp


def _mtp_step(model, kv, tokens, start, pages, hidden_prev, page_size):
    batch = build_step_batch([SeqChunk(tokens, start, pages, "all")], page_size)
    return model.mtp_forward(
        batch.input_ids,
        batch.positions,
        hidden_prev,
        kv,
        batch.page_table,
        batch.seq_lens,
        batch.query_start_loc,
        batch.slot_mapping,
        batch.logits_indices,
    )


def test_mtp_layer_matches_an_independent_spec_implementation(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    cfg = model.config
    W = load_hub_tensors(tiny_ckpt)
    ids = torch.randint(0, cfg.vocab_size, (21,))
    ref_logits, ref_hidden = main_model(ids, W, cfg)
    ref_mtp_logits, ref_mtp_hidden = mtp(ids[1:], torch.arange(20), ref_hidden[:-1], W, cfg)

    page_size, pages = 8, [2, 0, 1]
    kv = allocate_kv_cache(cfg, 3, page_size, torch.float32)
    batch = build_step_batch([SeqChunk(ids.tolist(), 0, pages, "all")], page_size)
    with torch.no_grad():
        logits, hidden = model(*batch.model_args(kv))
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
        # MTP over the prompt in two chunks: its own KV layer must carry the first chunk to the second
        first_logits, first_hidden = _mtp_step(
            model, kv, ids[1:13].tolist(), 0, pages, hidden[:12], page_size
        )
        rest_logits, rest_hidden = _mtp_step(
            model, kv, ids[13:].tolist(), 12, pages, hidden[12:20], page_size
        )
    torch.testing.assert_close(torch.cat([first_logits, rest_logits]), ref_mtp_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first_hidden, rest_hidden]), ref_mtp_hidden, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref_mtp_logits, ref_logits[:20], atol=1e-2)  # MTP is its own layer
