"""Reference token sampler (pure torch): greedy, temperature, top-k, top-p, min-p, per-request seeds.

`sample_next(logits [B, V], params)` returns one token id per row. A request's `torch.Generator` is
seeded from its `seed`, so the same seed gives the same continuation; without a seed the draw is random.
A temperature below SAMPLING_EPS is greedy (as vLLM): dividing logits by it would overflow fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (logits / 1e-40 overflow fp32 to inf)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [V] after temperature, top-k, top-p and min-p (fp32)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def sample_next(
    logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    out = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            out.append(int(row.argmax()))
        else:
            probs = filtered_probs(row, p)
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
