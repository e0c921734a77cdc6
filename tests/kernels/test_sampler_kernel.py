"""The Triton fused sampler (`hy3_triton.sample`) against `hy3.sample`'s reference, with injected noise
(exact ids), on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

import hy3c.kernels  # noqa: F401
from hy3c.kernels.sampler.fused_sampler import fused_sample
from hy3c.ops.sample import SKIP_DRAW
from hy3c.serve.engine.sampler import History, SamplingParams

hy3, tri = torch.ops.hy3, torch.ops.hy3_triton


def _reference(logits, params, noise, num_logprobs=0):
    """hy3.sample's reference over the columns of one SamplingParams for every row."""
    return hy3.sample(logits, *_columns(params, logits.shape[0]), noise, num_logprobs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
    ],
)
@pytest.mark.parametrize("logits_kind", ["distinct", "ties at the cut-off", "masked -inf entries"])
def test_fused_sampler_equals_reference_with_injected_noise(params, logits_kind):
    rows, vocab = 6, 1500
    logits = torch.randn(rows, vocab) * 3
    if logits_kind == "ties at the cut-off":  # coarse values, like a bf16 lm_head: many equal logits
        logits = (logits * 2).round() / 2
    elif logits_kind == "masked -inf entries":  # e.g. a logit bias or grammar mask
        logits[:, ::7] = float("-inf")
        logits[:, 3] = -1e30
    noise = torch.rand(rows, vocab)
    ref_tokens, ref_logprobs, *_ = _reference(logits, params, noise)
    tokens, logprobs = fused_sample(logits, *_columns(params, rows), noise=noise)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


def _columns(params: SamplingParams, rows: int) -> tuple[torch.Tensor, ...]:
    def col(value, dtype=torch.float32):
        return torch.full((rows,), value, dtype=dtype)

    return (
        col(params.temperature),
        col(params.top_k, torch.int32),
        col(params.top_p),
        col(params.min_p),
        col(0, torch.int32),
    )


@pytest.mark.parametrize(
    "params, falls_back",
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=1.0), False),  # no filter: drawn by the chunks
        (SamplingParams(temperature=0.7, top_k=5), False),
        (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02), False),
        (SamplingParams(temperature=1.0, min_p=0.3), False),  # peaked row: min-p cut above the floor
        (SamplingParams(temperature=3.0, top_p=0.99), True),  # flat: the top-p set leaves the candidates
        (SamplingParams(temperature=1.0, top_k=80), True),  # more than the merge keeps
    ],
)
def test_rows_split_over_chunks_merge_exactly_and_fall_back_only_when_needed(params, falls_back):
    """Small chunks (6 per row, 16 candidates each, 64 merged) so the merge and the fallback both run."""
    rows, vocab = 4, 1500
    logits = torch.randn(rows, vocab) * 2
    logits[:, torch.randperm(vocab)[:12]] += 8.0  # a peaked head spread over the chunks
    logits[2:] = (logits[2:] * 2).round() / 2  # coarse rows: ties at the chunk floors and cut-offs
    noise = torch.rand(rows, vocab)
    ref_tokens, ref_logprobs, *_ = _reference(logits, params, noise)
    fallback = torch.full((rows,), -1, dtype=torch.int32)
    tokens, logprobs = fused_sample(
        logits, *_columns(params, rows), noise, chunk=256, candidates=16, merge_top=64, fallback=fallback
    )
    assert fallback.tolist() == [int(falls_back)] * rows
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


def test_rows_marked_skip_draw_are_left_untouched_and_the_others_drawn_as_usual():
    """A decode graph replayed for its logits alone marks its captured draws SKIP_DRAW (`DecodeGraphs.run`)."""
    rows, vocab = 5, 1500
    logits = torch.randn(rows, vocab) * 2
    noise = torch.rand(rows, vocab)
    params = SamplingParams(temperature=3.0, top_p=0.99)  # flat: every drawn row falls back
    columns = list(_columns(params, rows))
    skipped = torch.tensor([False, True, False, True, True])
    columns[1] = torch.where(skipped, SKIP_DRAW, columns[1]).to(torch.int32)
    fallback = torch.full((rows,), -1, dtype=torch.int32)
    tokens, logprobs = fused_sample(
        logits, *columns, noise, chunk=256, candidates=16, merge_top=64, fallback=fallback
    )
    assert fallback.tolist() == [1, -1, 1, -1, -1]  # the skipped rows' outputs were never written
    ref_tokens, ref_logprobs, *_ = _reference(logits, params, noise)
    drawn = ~skipped
    assert torch.equal(tokens[drawn], ref_tokens[drawn])
    torch.testing.assert_close(logprobs[drawn], ref_logprobs[drawn], atol=1e-4, rtol=1e-4)


def test_fused_sampler_seeded_stream_is_reproducible_and_respects_top_k():
    logits = torch.randn(4, 700)
    args = (torch.full((4,), 1.0), torch.full((4,), 3, dtype=torch.int32), torch.ones(4), torch.zeros(4))
    a, _ = fused_sample(logits, *args, torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    b, _ = fused_sample(logits, *args, torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    assert torch.equal(a, b)
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(t) in top3[r].tolist() for r, t in enumerate(a))


def test_top_logprobs_come_from_the_candidates_and_rows_they_cannot_vouch_for_are_flagged():
    rows, vocab, n = 4, 1500, 5
    logits = torch.randn(rows, vocab) * 3
    logits[2] = 0.0  # flat row: its 5th token sits at every chunk's floor
    top = (
        torch.empty(rows, n, dtype=torch.int32),
        torch.empty(rows, n),
        torch.empty(rows, dtype=torch.int32),
    )
    fused_sample(logits, *_columns(SamplingParams(temperature=0.7), rows), chunk=256, candidates=16, top=top)
    expected_values, expected_ids = torch.log_softmax(logits / 0.7, -1).topk(n)
    assert top[2].tolist() == [1, 1, 0, 1]
    for row in (0, 1, 3):
        assert top[0][row].tolist() == expected_ids[row].tolist()
        torch.testing.assert_close(top[1][row], expected_values[row], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_triton_provider_of_hy3_sample_equals_the_reference(num_logprobs):
    """`hy3_triton.sample` passes opcheck and returns what `hy3.sample`'s reference does for rows of
    mixed parameters: tokens, logprobs and (where the kernel vouches for them) the top logprobs."""
    rows, vocab = 5, 1500
    logits = torch.randn(rows, vocab) * 3
    logits[4] = 0.0  # flat: the kernel cannot vouch for its top logprobs
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)]
    mixed += [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.1, min_p=0.05)]
    mixed.append(SamplingParams(temperature=0.9))
    columns = [torch.cat(c) for c in zip(*(_columns(p, 1) for p in mixed))]
    noise = torch.rand(rows, vocab)
    args = (logits, *columns, noise, num_logprobs)
    torch.library.opcheck(tri.sample.default, args)
    ours, ref = tri.sample(*args), hy3.sample(*args)
    assert torch.equal(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1], atol=1e-4, rtol=1e-4)
    assert ours[2].shape == ref[2].shape == (rows, num_logprobs)
    assert ours[4].shape == ref[4].shape == (rows if num_logprobs else 0,)
    if num_logprobs:
        assert ours[4].tolist() == [1, 1, 1, 1, 0] and ref[4].tolist() == [1] * rows
        assert torch.equal(ours[2][:4], ref[2][:4])
        torch.testing.assert_close(ours[3][:4], ref[3][:4], atol=1e-5, rtol=1e-5)


def test_serving_sampler_through_the_kernels_equals_the_reference_with_logprobs():
    """`hy3c.serve.engine.sampler`'s CUDA path (run here by the interpreter): tokens, chosen and top
    logprobs."""
    from hy3c.serve.engine.sampler import _sample_fused, fused_inputs, sample_reference

    rows, vocab = 4, 1500
    logits = torch.randn(rows, vocab) * 3
    logits[3] = 0.0  # flat: the kernel cannot vouch for its top logprobs, the host recomputes them
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams()]
    params.append(SamplingParams())
    history = [History([5, 6], [7]), History([], [9, 9]), History([1], []), History([], [])]
    noise = torch.rand(rows, vocab)
    inputs = fused_inputs(params, [0] * rows, logits.device)
    ours = _sample_fused(logits, params, history, inputs, 4, noise).result()
    ref = sample_reference(logits, params, history, [None] * rows, 4, noise)
    assert ours.tokens == ref.tokens
    torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=1e-4)
    for got, want in zip(ours.top, ref.top):
        assert [i for i, _ in got] == [i for i, _ in want]
        torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]))


@pytest.mark.slow  # ~55 s per case on 2 cores under TRITON_INTERPRET=1 (the chi-square needs many draws)
@pytest.mark.parametrize("top_k", [0, 4])  # 0: drawn by the chunk kernel; 4: from the merged candidates
def test_seeded_kernel_draws_follow_the_distribution(top_k):
    """Chi-square goodness of fit of the kernel's seeded stream (`tl.rand`, one seed per row) against
    softmax(logits / T) over the kept tokens (fixed seeds)."""
    rows = 800  # the rarest kept token still expects ≥ 11 draws
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0]).repeat(rows, 1)
    params = SamplingParams(temperature=0.8, top_k=top_k)
    columns = list(_columns(params, rows))
    columns[4] = torch.arange(rows, dtype=torch.int32) * 7919 + 11  # a seed per row
    tokens, _ = fused_sample(logits, *columns)
    probs = torch.softmax(logits[0] / 0.8, -1)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
        probs /= probs.sum()
    counts = torch.bincount(tokens, minlength=6).float()
    assert (counts[probs == 0] == 0).all()
    expected = probs[probs > 0] * rows
    chi2 = float(((counts[probs > 0] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # p = 0.001 at ≤ 5 degrees of freedom


def _packed(allowed: torch.Tensor, words: int) -> torch.Tensor:
    """Booleans [B, V] as a packed int32 mask [B, words] (bit j of word w: token 32·w + j)."""
    rows, vocab = allowed.shape
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    packed = (bits.view(rows, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),  # drawn by the chunks
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0, top_k=80),  # beyond the merge: the bisection reads the mask too
        SamplingParams(temperature=3.0, top_p=0.99),  # flat: bisection
    ],
)
def test_packed_grammar_mask_is_read_by_the_kernel_as_the_reference_applies_it(params):
    """Rows allowing a few tokens (one of them in a chunk of its own), many, every token, and a mask
    wider than the vocabulary (the tokenizer's width): tokens, logprobs and the fallback path agree
    with the reference, and no drawn token is outside its mask."""
    rows, vocab = 4, 1500
    logits = torch.randn(rows, vocab) * 2
    logits[:, torch.randperm(vocab)[:12]] += 8.0
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[0, [3, 700, 1499]] = True  # three tokens, in three of the six chunks
    allowed[1] = torch.rand(vocab) < 0.4
    allowed[2] = True
    allowed[3, 1000:1200] = True  # one chunk's worth, the head mostly outside it
    mask = _packed(allowed, (vocab + 31) // 32 + 2)
    noise = torch.rand(rows, vocab)
    columns = _columns(params, rows)
    ref_tokens, ref_logprobs, *_ = hy3.sample(logits, *columns, noise, 0, mask)
    tokens, logprobs = fused_sample(
        logits, *columns, noise, chunk=256, candidates=16, merge_top=64, allowed=mask
    )
    assert allowed[torch.arange(rows), tokens].all()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(hy3.sample(masked, *columns, noise, 0)[0], ref_tokens)  # the mask is -inf logits


def test_sampler_ops_take_the_mask_through_opcheck_and_refuse_a_narrow_one():
    rows, vocab = 3, 100
    logits = torch.randn(rows, vocab)
    mask = _packed(torch.rand(rows, vocab) < 0.5, 4)
    columns = _columns(SamplingParams(temperature=0.8, top_p=0.9), rows)
    noise = torch.rand(rows, vocab)
    for op in (hy3.sample.default, tri.sample.default):
        torch.library.opcheck(op, (logits, *columns, noise, 2, mask))
    ours, ref = tri.sample(logits, *columns, noise, 2, mask), hy3.sample(logits, *columns, noise, 2, mask)
    assert torch.equal(ours[0], ref[0])
    with pytest.raises(ValueError, match="allowed has 3 words, 100 tokens need 4"):
        fused_sample(logits, *columns, noise, allowed=mask[:, :3].contiguous())
