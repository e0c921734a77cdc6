"""`reference_logits`: the eager model over whole sequences, for debugging and as the checks' oracle."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from hy3c.checkpoint.loader import load_model
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.model.hy3 import Hy3ForCausalLM, allocate_kv_cache


def model_logits(model: Hy3ForCausalLM, input_ids: Tensor, page_size: int = 16) -> Tensor:
    """Logits [B, T, vocab] (fp32) of every position of every row of input_ids [B, T]."""
    batch_size, length = input_ids.shape
    pages_per_seq = -(-length // page_size)
    device = model.embed_tokens.weight.device
    kv_cache = allocate_kv_cache(model.config, batch_size * pages_per_seq, page_size, model.dtype, device)
    chunks = [
        SeqChunk(row.tolist(), 0, list(range(b * pages_per_seq, (b + 1) * pages_per_seq)), "all")
        for b, row in enumerate(input_ids)
    ]
    batch = build_step_batch(chunks, page_size, device)
    with torch.no_grad():
        logits, _ = model(*batch.model_args(kv_cache))
    return logits.view(batch_size, length, -1)


def reference_logits(
    model_dir: str | Path, input_ids: Tensor, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Tensor:
    """Run the eager hy3c model of a checkpoint over input_ids [B, T] (or [T]); logits [B, T, vocab]."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor [B, T], got {tuple(ids.shape)} {ids.dtype}")
    model = load_model(model_dir, dtype=dtype, device=device, progress=False)
    if ids.numel() and (ids.min() < 0 or ids.max() >= model.config.vocab_size):
        raise ValueError(f"input_ids must lie in [0, {model.config.vocab_size})")
    return model_logits(model, ids.to(torch.int64))
