"""`hy3.sample`, the token sampler op: its filters, its draws and its fake (the Triton provider is checked
against it in tests/kernels/test_sampler_kernel.py)."""

from __future__ import annotations

import pytest
import torch

import hy3c.ops  # noqa: F401
from hy3c.ops.sample import filter_mask

hy3 = torch.ops.hy3


def _columns(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    full = torch.full
    return (
        full((rows,), temperature),
        full((rows,), top_k, dtype=torch.int32),
        full((rows,), top_p),
        full((rows,), min_p),
        torch.arange(rows, dtype=torch.int32) + 7,
    )


def test_filters_apply_min_p_then_top_k_then_top_p():
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    assert filter_mask(probs, 0.0, 2, 1.0).tolist() == [False, True, True, False]
    assert filter_mask(probs, 0.0, 0, 0.6).tolist() == [False, True, True, False]
    assert filter_mask(probs, 0.5, 0, 1.0).tolist() == [False, True, True, False]
    # top-p renormalises over what min-p kept: 0.5 / 0.8 < 0.7 keeps the second token too
    assert filter_mask(probs, 0.5, 0, 0.7).tolist() == [False, True, True, False]


def test_top_k_and_top_p_keep_every_token_tied_at_the_cut_off():
    probs = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])
    tied = [False, True, True, True, False]
    assert filter_mask(probs, 0.0, 2, 1.0).tolist() == tied
    assert filter_mask(probs, 0.0, 0, 0.5).tolist() == tied
    assert filter_mask(probs, 0.0, 1, 1.0).tolist() == [False, False, True, False, False]


@pytest.mark.parametrize("num_logprobs", [0, 4])
@pytest.mark.parametrize("with_noise", [False, True])
def test_opcheck(num_logprobs, with_noise):
    logits = torch.randn(3, 50)
    noise = torch.rand(3, 50) if with_noise else None
    torch.library.opcheck(hy3.sample.default, (logits, *_columns(3, 0.8, 5, 0.9), noise, num_logprobs))
    empty = torch.empty(0, 50)
    torch.library.opcheck(hy3.sample.default, (empty, *_columns(0, 0.8), noise, num_logprobs))


def test_greedy_rows_take_the_argmax_and_logprobs_are_the_tempered_distributions():
    logits = torch.randn(4, 60) * 3
    temperature = torch.tensor([0.0, 0.5, 0.0, 1.3])
    columns = (temperature, *_columns(4, 1.0)[1:])
    tokens, logprobs, top_ids, top_logprobs, exact = hy3.sample(logits, *columns, torch.rand(4, 60), 3)
    assert tokens[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    tempered = torch.log_softmax(logits / torch.where(temperature > 0, temperature, 1.0)[:, None], -1)
    torch.testing.assert_close(logprobs, tempered.gather(1, tokens[:, None])[:, 0])
    values, ids = tempered.topk(3)
    assert torch.equal(top_ids, ids.int()) and exact.tolist() == [1] * 4
    torch.testing.assert_close(top_logprobs, values)


def test_draws_are_gumbel_max_over_the_kept_tokens_of_the_noise_or_the_seed():
    """With noise, the token is argmax(x / T + Gumbel(u)) over what the filters keep; without, each row's
    seed gives the same draws every time, and only kept tokens are drawn."""
    logits = torch.randn(2, 40)
    noise = torch.rand(2, 40)
    columns = _columns(2, 0.7, top_k=3)
    tokens = hy3.sample(logits, *columns, noise, 0)[0]
    kept = logits >= logits.topk(3).values[:, -1:]
    gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
    expected = torch.where(kept, logits / 0.7 + gumbel, float("-inf")).argmax(-1)
    assert torch.equal(tokens, expected)
    first, again = hy3.sample(logits, *columns, None, 0)[0], hy3.sample(logits, *columns, None, 0)[0]
    assert torch.equal(first, again) and kept.gather(1, first[:, None]).all()
