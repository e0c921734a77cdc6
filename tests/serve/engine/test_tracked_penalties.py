"""Penalties read from the device (issue 27: host work per step independent of the context): a
penalised request's prompt mask and output counts live in `TrackedPenalties`, and the penalised
logits equal those computed from the host lists, bit for bit; the engine's outputs with penalties
equal those of the engine that reads the host lists."""

from __future__ import annotations

import random

import pytest
import torch

from hy3c.serve.engine.core import Engine, EngineConfig, GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import History, SamplingParams, TrackedPenalties, apply_penalties

VOCAB = 97


def _case(seed: int):
    rng = random.Random(seed)
    params, histories = [], []
    for row in range(7):
        params.append(
            SamplingParams(
                temperature=0.8,
                repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
                presence_penalty=rng.choice([0.0, 0.5, -0.25]),
                frequency_penalty=rng.choice([0.0, 0.3]),
                logit_bias=((rng.randrange(VOCAB), 2.0),) if row % 3 == 0 else (),
            )
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))]
        histories.append(History(prompt, output))
    logits = torch.randn(7, VOCAB) * 4
    logits[0, 3] = -float("inf")  # a masked token stays masked
    return logits, params, histories


@pytest.mark.parametrize("seed", range(4))
def test_tracked_penalties_equal_the_host_lists(seed):
    logits, params, histories = _case(seed)
    expected = apply_penalties(logits, params, histories)
    tracker = TrackedPenalties(VOCAB, "cpu", rows=2)  # grows while registering
    tracked = []
    for row, h in enumerate(histories):
        split = len(h.output) // 2  # registered with part of the output, the rest recorded after
        slot = tracker.slot(("request", row), h.prompt, h.output[:split])
        tracker.record([(slot, token) for token in h.output[split:]])
        tracked.append(History(h.prompt, h.output, tracker, slot))
    assert torch.equal(apply_penalties(logits, params, tracked), expected)
    assert tracker.counts.shape[0] >= 7


def test_a_freed_row_is_cleared_for_the_next_request():
    tracker = TrackedPenalties(VOCAB, "cpu", rows=1)
    slot = tracker.slot("a", [1, 2], [5, 5])
    tracker.drop("a")
    assert "a" not in tracker
    again = tracker.slot("b", [], [7])
    assert again == slot and tracker.counts[slot].sum() == 1 and not tracker.prompt[slot].any()


def _run(model, tokenizer, host_lists: bool, overlap: bool) -> dict[str, list[int]]:
    config = EngineConfig(
        num_pages=12, page_size=4, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=64
    )
    config.async_scheduling = overlap
    engine = Engine(model, tokenizer, config)
    if host_lists:  # the engine before: every step's penalties from the host lists
        engine._history = lambda live: History(live.request.prompt_ids, live.output)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.6, seed=11),
        SamplingParams(temperature=0.7, repetition_penalty=0.8, frequency_penalty=0.3, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, presence_penalty=1.0, seed=2, logit_bias=((9, 3.0),)),
    ]
    outputs: dict[str, list[StepOutput]] = {}
    for i, p in enumerate(params):
        prompt = [3 + i, 11, 7 + 2 * i, 5] * (1 + i % 2)
        request = GenerationRequest(f"r{i}", prompt, p, max_tokens=14 + 2 * i, ignore_eos=True)
        outputs[request.request_id] = []
        engine.submit(request, outputs[request.request_id].append)
    engine.run_until_done()  # the small pool preempts (recompute keeps each request's output)
    return {name: [t for out in outs for t in out.token_ids] for name, outs in outputs.items()}


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_outputs_with_tracked_penalties_equal_the_host_lists(model, tokenizer, overlap):
    tracked = _run(model, tokenizer, host_lists=False, overlap=overlap)
    assert tracked == _run(model, tokenizer, host_lists=True, overlap=overlap)
    assert all(len(tokens) >= 14 for tokens in tracked.values())
