"""Offline generation (`hy3c generate`): the serving engine driven to the end on the calling thread — no
HTTP, no engine thread — so `generate` and `serve` run one engine loop, scheduler, page pool and
sampler, and a seeded request gives the same tokens either way.

    results = generate(model, tokenizer, [GenerationRequest("0", ids, SamplingParams(seed=3), 32)])

`model` is anything the engine steps (`StepModel`): a compiled artifact's `Runner`, the
`ShardedRunner` over an artifact's ranks (`hy3c.runtime.distributed.start_ranks`; the caller shuts it
down) or the eager `Hy3ForCausalLM`. The page size and batch limits are `serving`'s — the artifact recipe's, as `hy3c
serve` uses them; for the eager model, which has no recipe, a recipe's defaults (`ServingSpec()`). The
KV cache holds every request at once (prompt + max_tokens each, and the scratch page; with attention
data parallelism, each DP rank's does), so nothing is preempted. No CUDA graph is captured and no warm-up runs: one short job would not earn their cost back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.recipe import ServingSpec
from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepModel, StepOutput
from hy3c.serve.engine.spec_decode import SpeculativeConfig


@dataclass
class Generation:
    """A request's whole output: its step outputs joined."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None

    def add(self, out: StepOutput) -> None:
        """The engine's emit: append one step's output."""
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error


def offline_config(
    requests: list[GenerationRequest],
    serving: ServingSpec,
    page_size: int | None = None,
    async_scheduling: bool = True,
    speculative: SpeculativeConfig | None = None,
) -> EngineConfig:
    """An engine configuration whose KV cache holds all `requests` at once, with `serving`'s batch
    limits and page size (`page_size` overrides it)."""
    page_size = serving.page_size if page_size is None else page_size
    lengths = [len(r.prompt_ids) + r.max_tokens for r in requests]
    return EngineConfig(
        num_pages=1 + sum(-(-n // page_size) for n in lengths),  # + page 0, the scratch page
        page_size=page_size,
        max_num_seqs=serving.max_num_seqs,
        max_num_batched_tokens=serving.max_num_batched_tokens,
        max_model_len=max(lengths, default=1),
        async_scheduling=async_scheduling,
        speculative=speculative,
    )


def generate(
    model: StepModel,
    tokenizer: Hy3Tokenizer,
    requests: list[GenerationRequest],
    serving: ServingSpec | None = None,
    page_size: int | None = None,
    async_scheduling: bool = True,
    speculative: SpeculativeConfig | None = None,
) -> list[Generation]:
    """Run `requests` to their end through an engine over `model` (see the module docstring); their
    outputs in the order given. A request the engine fails is a RuntimeError naming it."""
    if len({r.request_id for r in requests}) < len(requests):
        raise ValueError("two requests share a request_id")
    for request in requests:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id}: the prompt has no tokens")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id}: max_tokens must be at least 1")
    config = offline_config(requests, serving or ServingSpec(), page_size, async_scheduling, speculative)
    engine = Engine(model, tokenizer, config)
    results = [Generation(r.request_id) for r in requests]
    for request, result in zip(requests, results):
        engine.submit(request, result.add)
    engine.run_until_done()
    failed = next((r for r in results if r.error is not None), None)
    if failed is not None:
        raise RuntimeError(f"request {failed.request_id}: {failed.error}")
    return results
