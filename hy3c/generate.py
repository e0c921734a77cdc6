"""Eager generation through the paged-KV model (`hy3c generate`): prefill, then decode step by step.

Several prompts run as one batch: the first step prefills all of them (in chunks of at most
`prefill_chunk` tokens per request), later steps decode one token per unfinished request, so mixed
prefill/decode batches and ragged lengths go through the same `forward` the compiler traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hy3c.config import Hy3Config
from hy3c.model.batch import PagePool, SeqChunk, build_step_batch
from hy3c.sampling import SamplingParams, sample_next


class StepModel(Protocol):
    """What generation needs: `Hy3ForCausalLM` and a compiled artifact's `Runner` both qualify."""

    config: Hy3Config
    device: torch.device

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor: ...

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator | None
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    output: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def generate_tokens(
    model: StepModel,
    prompts: list[list[int]],
    max_tokens: int,
    params: SamplingParams | list[SamplingParams] | None = None,
    stop_ids: list[int] | None = None,
    page_size: int = 16,
    prefill_chunk: int = 512,
) -> list[list[int]]:
    """Generate up to `max_tokens` tokens after each prompt; returns the generated ids per prompt
    (a stop token ends a request and is not included)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(params_list)} sampling parameter sets for {len(prompts)} prompts")
    device = model.device
    stop = set(stop_ids if stop_ids is not None else model.config.eos_token_ids)
    total_pages = sum(-(-(len(p) + max_tokens) // page_size) for p in prompts)
    pool = PagePool(total_pages)
    kv_cache = model.allocate_kv_cache(total_pages, page_size)
    requests = [_Request(p, sp, max_tokens, sp.make_generator(device)) for p, sp in zip(prompts, params_list)]
    with torch.no_grad():
        while True:
            active = [r for r in requests if not r.done]
            if not active:
                break
            chunks = []
            for r in active:
                tokens = r.tokens
                new = tokens[r.cached : r.cached + prefill_chunk]
                pool.grow(r.pages, r.cached + len(new), page_size)
                finishes_prompt = r.cached + len(new) == len(tokens)
                chunks.append(SeqChunk(new, r.cached, list(r.pages), "last" if finishes_prompt else "none"))
            batch = build_step_batch(chunks, page_size, device)
            logits, _ = model(*batch.model_args(kv_cache))
            for r, chunk in zip(active, chunks):
                r.cached += len(chunk.tokens)
            sampled_for = [active[i] for i in batch.logits_owner]
            next_ids = sample_next(
                logits, [r.params for r in sampled_for], [r.generator for r in sampled_for]
            )
            for r, token in zip(sampled_for, next_ids):
                if token in stop:
                    r.done = True
                    continue
                r.output.append(token)
                r.done = len(r.output) >= r.max_tokens
    return [r.output for r in requests]
