"""Greedy generation through the serving engine, as `hy3c generate` runs it: how the tests run a step
model — a compiled `Runner` or the eager `Hy3ForCausalLM` — over whole requests."""

from __future__ import annotations

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.engine.core import GenerationRequest, StepModel
from hy3c.serve.engine.offline import Generation, generate
from hy3c.serve.engine.sampler import SamplingParams


def greedy(
    model: StepModel,
    tokenizer: Hy3Tokenizer,
    prompts: list[list[int]],
    max_tokens: int,
    ignore_eos: bool = True,
) -> list[Generation]:
    """Each prompt's greedy continuation of up to `max_tokens` tokens (by default through EOS, so
    every one is `max_tokens` long)."""
    params = SamplingParams(temperature=0.0)
    requests = [
        GenerationRequest(str(i), prompt, params, max_tokens, ignore_eos=ignore_eos)
        for i, prompt in enumerate(prompts)
    ]
    return generate(model, tokenizer, requests)
