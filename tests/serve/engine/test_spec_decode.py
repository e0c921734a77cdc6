"""Speculative decoding's sampling side (`hy3c.serve.engine.spec_decode`) on crafted logits: greedy
verification is exact, the rejection rule emits the target's distribution (and accepts as often as the
theory says), seeds reproduce, penalties see the accepted drafts, forced acceptance follows its
geometric law, the flag's errors name their field, and the spec-decode counters count a step."""

from __future__ import annotations

import pytest
import torch

from hy3c.ops.sample import filter_mask
from hy3c.serve.engine.metrics import EngineMetrics
from hy3c.serve.engine.sampler import History, SamplingParams, apply_penalties
from hy3c.serve.engine.spec_decode import (
    ForcedAcceptance,
    SpeculativeConfig,
    draft,
    filter_rows,
    gather_drafts,
    mean_accepted_length,
    parse_speculative_config,
    verify,
)

GREEDY = SamplingParams(temperature=0.0)
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def one_hot_rows(tokens: list[int], vocab: int, low: float = 0.0) -> torch.Tensor:
    """Rows of logits whose argmax is each token (the others at `low` and below)."""
    rows = torch.full((len(tokens), vocab), low) - torch.arange(vocab) * 0.01
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


def histories(n: int) -> list[History]:
    return [History([0], [1]) for _ in range(n)]


# ---- greedy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accepted", range(5))
def test_greedy_accepts_exactly_the_prefix_matching_the_targets_argmax(accepted):
    """K = 4 drafts, the first `accepted` equal to the target's argmax of the row before them: that many
    accepted, then the target's argmax where the first mismatch is (or the bonus of the last row). A
    request with no drafts and one with 2 in the same batch keep their own rows."""
    vocab, target = 12, [3, 7, 1, 9, 4]
    drafts = [t if j < accepted else (t + 1) % vocab for j, t in enumerate(target[:4])]
    logits = torch.cat(
        [one_hot_rows(target, vocab), one_hot_rows([8], vocab), one_hot_rows([2, 6, 5], vocab)]
    )
    tokens = torch.tensor([*drafts, 2, 0])  # the third request: d_1 = 2 accepted, d_2 = 0 refused
    result = verify(logits, [4, 0, 2], tokens, None, [GREEDY] * 3, histories(3), [None] * 3, num_logprobs=1)
    counts, emitted = result.to_host()
    assert counts == [accepted, 0, 1]
    assert emitted == [target[: accepted + 1], [8], [2, 6]]
    assert result.tokens.shape == (3, 5) and result.tokens[1, 1:].tolist() == [-1] * 4
    assert result.last_tokens.tolist() == [target[accepted], 8, 6]
    chosen, top = result.logprobs_to_host()
    expected = torch.log_softmax(logits, -1)
    assert chosen[0] == pytest.approx([float(expected[j, t]) for j, t in enumerate(target[: accepted + 1])])
    assert [row[0][0] for row in top[0]] == target[: accepted + 1]  # the top-1 of a greedy row: its token


def test_greedy_drafting_takes_the_argmax_and_needs_no_probabilities():
    logits = torch.randn(6, 20)
    drafted = draft(logits, [GREEDY] * 6, [None] * 6)
    assert drafted.probs is None and torch.equal(drafted.tokens, logits.argmax(-1))


# ---- the target distribution --------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_batched_filter_matches_filter_mask_row_by_row(seed):
    torch.manual_seed(seed)
    rows, vocab = 24, 50
    logits = torch.randn(rows, vocab).round(decimals=1)  # ties, which the filters keep together
    probs = torch.softmax(logits, -1)
    min_p = torch.tensor([0.0, 0.1, 0.3] * 8)
    top_k = torch.tensor([0, 1, 5, 50, 7, 0, 3, 20] * 3)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.2, 0.99, 1.0] * 4)
    mask = filter_rows(probs, min_p, top_k, top_p)
    for row in range(rows):
        expected = filter_mask(probs[row], float(min_p[row]), int(top_k[row]), float(top_p[row]))
        assert torch.equal(mask[row], expected), row


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What the engine's sampler draws from, computed with the op's own filter (the reference)."""
    probs = torch.log_softmax(logits / params.temperature, -1).exp()
    probs = torch.where(filter_mask(probs, params.min_p, params.top_k, params.top_p), probs, 0.0)
    return probs / probs.sum()


def chi_square(samples: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `samples` against the distribution `expected`; a token of
    probability 0 must never appear."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target never samples was emitted"
    want = expected.double()[support] * samples.numel()
    assert want.min() >= 5, "too few samples reached this position for the test"
    return float(((counts[support] - want) ** 2 / want).sum()), int(support.sum()) - 1


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=3),
    SamplingParams(temperature=1.4, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.15, top_k=4),
]


@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "t0.6-topk3", "t1.4-topp0.7", "minp-topk"])
@pytest.mark.parametrize("draft_probs", [True, False], ids=["sampled-drafts", "greedy-drafts"])
def test_rejection_rule_emits_the_targets_distribution(params, draft_probs):
    """K = 2 drafts drawn from a draft distribution far from the target's (rolled logits; or its
    argmax, with no probabilities given), overlapping it. Over many seeded requests: the first token follows target row
    0, the second (given d_1 accepted) row 1 — a correction or accepted draft —, the third (both
    accepted) the bonus of row 2; and d_1 is accepted as often as sum min(p, q) says."""
    vocab, k, n = 6, 2, 12000
    target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0], [0.0, 2.5, 0.3, 1.2, -0.5, 0.8], [1.0] * 6])
    target[2, 4] = 2.0
    drafting = torch.stack([target[0].roll(1), target[1].roll(2)])  # q far from p, overlapping it
    all_params = [params] * n
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    if draft_probs:
        positions = [draft(drafting[j].expand(n, vocab), all_params, generators) for j in range(k)]
    else:
        positions = [draft(drafting[j].expand(n, vocab), [GREEDY] * n, [None] * n) for j in range(k)]
        positions = [type(p)(p.tokens, None) for p in positions]
    drafts = gather_drafts(positions, [k] * n)
    assert drafts.tokens.shape == (n * k,)
    logits = target.repeat(n, 1)
    result = verify(
        logits, [k] * n, drafts.tokens, drafts.probs, all_params, histories(n), generators, num_logprobs=0
    )
    counts, tokens = result.counts, result.tokens
    p = [target_distribution(target[j], params) for j in range(k + 1)]
    for column, reached in enumerate([counts >= 0, counts >= 1, counts == 2]):
        statistic, dof = chi_square(tokens[reached, column], p[column])
        assert statistic < CHI2_999[dof], (column, statistic, dof)
    q0 = target_distribution(drafting[0], params) if draft_probs else torch.eye(vocab)[drafting[0].argmax()]
    acceptance = float((counts >= 1).double().mean())
    expected = float(torch.minimum(p[0], q0).sum())
    assert acceptance == pytest.approx(expected, abs=4 * (expected * (1 - expected) / n) ** 0.5 + 1e-3)
    # the logprobs are those of the processed (tempered, unfiltered) target rows
    logprob = torch.log_softmax(target / params.temperature, -1)
    assert torch.allclose(result.logprobs[:, 0], logprob[0][tokens[:, 0]])


def test_a_request_without_drafts_samples_its_next_token_from_the_target():
    n = 8000
    row = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    params = SamplingParams(temperature=0.8, top_p=0.9)
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    empty = torch.empty(0, dtype=torch.long)
    result = verify(row.repeat(n, 1), [0] * n, empty, None, [params] * n, histories(n), generators)
    assert result.tokens.shape == (n, 1) and not result.counts.any()
    statistic, dof = chi_square(result.tokens[:, 0], target_distribution(row, params))
    assert statistic < CHI2_999[dof]


def test_seeded_requests_reproduce_and_different_seeds_differ():
    vocab, n, k = 30, 16, 3
    torch.manual_seed(0)
    target, drafting = torch.randn(n * (k + 1), vocab), torch.randn(k, vocab)
    params = [SamplingParams(temperature=1.0, seed=7)] * n

    def run(seed: int) -> tuple[list[int], list[list[int]]]:
        generators = [torch.Generator().manual_seed(seed + i) for i in range(n)]
        positions = [draft(drafting[j].expand(n, vocab), params, generators) for j in range(k)]
        drafts = gather_drafts(positions, [k] * n)
        return verify(
            target, [k] * n, drafts.tokens, drafts.probs, params, histories(n), generators
        ).to_host()

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_gather_drafts_puts_each_requests_drafts_together():
    """Passes over the requests still drafting (num_drafts 2, 0, 3): request-major output."""
    first = draft(one_hot_rows([10, 30], 40), [GREEDY] * 2, [None] * 2)  # requests 0 and 2
    second = draft(one_hot_rows([11, 31], 40), [GREEDY] * 2, [None] * 2)
    third = draft(one_hot_rows([32], 40), [GREEDY], [None])
    assert gather_drafts([first, second, third], [2, 0, 3]).tokens.tolist() == [10, 11, 30, 31, 32]


# ---- penalties ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 2.0}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}],
    ids=["repetition", "presence", "frequency"],
)
def test_penalties_see_the_drafts_accepted_before_a_row(penalty):
    """d_1 = 2 is accepted at row 0; at row 1 token 2 leads (3.0 against 2.0) only without the penalty
    that d_1 being in the history brings, so a greedy request refuses d_2 = 2 and emits 4. A sampled
    request's logprobs are those of the rows penalised with the drafts before them."""
    vocab = 8
    rows = torch.full((3, vocab), -1.0)
    rows[0, 2] = 5.0
    rows[1, 2], rows[1, 4] = 3.0, 2.0
    rows[2, 6] = 1.0
    drafts = torch.tensor([2, 2])
    history = History([5], [6])
    greedy = SamplingParams(temperature=0.0, **penalty)
    result = verify(rows, [2], drafts, None, [greedy], [history], [None])
    assert result.to_host() == ([1], [[2, 4]])
    unpenalised = verify(rows, [2], drafts, None, [GREEDY], [history], [None])
    assert unpenalised.to_host() == ([2], [[2, 2, 6]])

    sampled = SamplingParams(temperature=1.0, seed=3, **penalty)
    result = verify(
        rows, [2], drafts, None, [sampled], [history], [torch.Generator().manual_seed(3)], num_logprobs=0
    )
    count = int(result.counts[0])
    expected = [
        torch.log_softmax(apply_penalties(rows[j : j + 1], [sampled], [History([5], [6, *[2] * j])])[0], -1)
        for j in range(count + 1)
    ]
    emitted = result.tokens[0, : count + 1].tolist()
    assert result.logprobs[0, : count + 1].tolist() == [float(expected[j][t]) for j, t in enumerate(emitted)]


# ---- forced acceptance ----------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.3, 0.7])
def test_forced_acceptance_follows_the_geometric_law(alpha):
    """Acceptance by a seeded coin: the mean emitted length is 1 + alpha + … + alpha^k, position j is
    reached with probability alpha^(j+1), and every emitted token is the target's own argmax."""
    vocab, k, n = 16, 3, 6000
    torch.manual_seed(0)
    logits = torch.randn(n * (k + 1), vocab)
    drafts = torch.randint(0, vocab, (n * k,))
    sampled = SamplingParams(temperature=1.0)
    result = verify(
        logits, [k] * n, drafts, None, [sampled] * n, histories(n), [None] * n, ForcedAcceptance(alpha, 5)
    )
    lengths = result.counts.double() + 1
    assert float(lengths.mean()) == pytest.approx(mean_accepted_length(alpha, k), abs=0.05)
    for j in range(k):
        assert float((result.counts > j).double().mean()) == pytest.approx(alpha ** (j + 1), abs=0.03)
    argmax = logits.argmax(-1).reshape(n, k + 1)
    emitted = torch.arange(k + 1)[None, :] <= result.counts[:, None]
    assert torch.equal(torch.where(emitted, argmax, -1), result.tokens)
    again = verify(
        logits, [k] * n, drafts, None, [sampled] * n, histories(n), [None] * n, ForcedAcceptance(alpha, 5)
    )
    assert torch.equal(again.tokens, result.tokens)


@pytest.mark.parametrize(("alpha", "count"), [(0.0, 0), (1.0, 3)])
def test_forced_acceptance_edges(alpha, count):
    vocab, k, n = 9, 3, 50
    logits = torch.randn(n * (k + 1), vocab)
    drafts = torch.randint(0, vocab, (n * k,))
    result = verify(
        logits, [k] * n, drafts, None, [GREEDY] * n, histories(n), [None] * n, ForcedAcceptance(alpha, 0)
    )
    assert result.counts.tolist() == [count] * n
    assert torch.equal(result.tokens[:, : count + 1], logits.argmax(-1).reshape(n, k + 1)[:, : count + 1])
    assert mean_accepted_length(alpha, k) == count + 1


def test_forced_acceptance_rejects_a_probability_outside_the_unit_interval():
    with pytest.raises(ValueError, match=r"forced_acceptance: must be a number in \[0, 1\]"):
        ForcedAcceptance(1.5, 0)


# ---- the flag -------------------------------------------------------------------------------------------
def test_speculative_config_parses_vllms_spelling():
    config = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 3}', 1)
    assert config == SpeculativeConfig(method="mtp", num_speculative_tokens=3, forced_acceptance=None)
    forced = parse_speculative_config('{"num_speculative_tokens": 2, "forced_acceptance": 0.8}', 1)
    assert forced.method == "mtp" and forced.forced_acceptance == 0.8


@pytest.mark.parametrize(
    ("text", "layers", "message"),
    [
        ("{num_speculative_tokens: 2}", 1, "--speculative-config: not JSON"),
        ("[2]", 1, "--speculative-config: give a JSON object"),
        ('{"num_speculative_tokens": 2, "model": "x"}', 1, "--speculative-config: unknown key 'model'"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', 1, "method: 'eagle' is not supported"),
        ('{"method": "mtp"}', 1, "num_speculative_tokens: required"),
        ('{"num_speculative_tokens": 0}', 1, "num_speculative_tokens: must be an integer in 1..8 (got 0)"),
        ('{"num_speculative_tokens": 9}', 1, "num_speculative_tokens: must be an integer in 1..8 (got 9)"),
        ('{"num_speculative_tokens": 2.0}', 1, "num_speculative_tokens: must be an integer in 1..8"),
        ('{"num_speculative_tokens": true}', 1, "num_speculative_tokens: must be an integer in 1..8"),
        ('{"num_speculative_tokens": 2, "forced_acceptance": 1.2}', 1, "forced_acceptance: must be a number"),
        ('{"num_speculative_tokens": 2, "forced_acceptance": "0.5"}', 1, "forced_acceptance: must be a"),
        ('{"num_speculative_tokens": 2}', 0, "the artifact has no MTP program (compiled with --no-mtp or"),
    ],
)
def test_speculative_config_errors_name_the_field(text, layers, message):
    with pytest.raises(ValueError) as error:
        parse_speculative_config(text, layers)
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- metrics --------------------------------------------------------------------------------------------
def test_speculated_counts_drafts_accepted_tokens_and_positions():
    metrics = EngineMetrics()
    metrics.speculated([3, 3, 0, 2], [3, 1, 0, 2])
    metrics.speculated([0], [0])  # nothing drafted: nothing counted
    metrics.speculated([3], [0])
    assert metrics.sample("hy3c:spec_decode_num_drafts_total") == 4
    assert metrics.sample("hy3c:spec_decode_num_draft_tokens_total") == 11
    assert metrics.sample("hy3c:spec_decode_num_accepted_tokens_total") == 6
    per_pos = [
        metrics.sample("hy3c:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
        for j in range(3)
    ]
    assert per_pos == [3, 2, 1]
    text = metrics.render("art")
    assert 'hy3c:spec_decode_num_accepted_tokens_per_pos_total{model_name="art",position="2"} 1.0' in text
    assert "# TYPE hy3c:spec_decode_num_drafts_total counter" in text


# ---- on the GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_on_cuda_draft_and_verify_never_wait_for_the_device_and_match_the_host():
    """Without penalties, drafting and verifying make no synchronizing CUDA call (sync debug mode
    "error"); greedy and forced results equal what the rule gives on the host; sampled requests' first
    token follows the target's distribution with the engine's host generators."""
    vocab, k, n = 8, 3, 9000
    torch.manual_seed(0)
    base, drafting = torch.randn(k + 1, vocab), torch.randn(k, vocab)
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.95)
    mixed = [GREEDY if i % 3 == 0 else params for i in range(n)]
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    target = base.repeat(n, 1).cuda()
    drafting = drafting.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        positions = [draft(drafting[j].expand(n, vocab), mixed, generators) for j in range(k)]
        drafts = gather_drafts(positions, [k] * n)
        result = verify(
            target, [k] * n, drafts.tokens, drafts.probs, mixed, histories(n), generators, num_logprobs=2
        )
        forced = verify(
            target, [k] * n, drafts.tokens, None, mixed, histories(n), generators, ForcedAcceptance(0.5, 1)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.tokens.is_cuda and result.counts.is_cuda and result.top_ids.is_cuda
    greedy = torch.arange(n) % 3 == 0
    host = verify(
        base.repeat(n, 1), [k] * n, drafts.tokens.cpu(), None, [GREEDY] * n, histories(n), [None] * n
    )
    assert torch.equal(result.tokens.cpu()[greedy], host.tokens[greedy])
    argmax = base.argmax(-1).repeat(n, 1)
    emitted = torch.arange(k + 1)[None, :] <= forced.counts.cpu()[:, None]
    assert torch.equal(forced.tokens.cpu(), torch.where(emitted, argmax, -1))
    statistic, dof = chi_square(result.tokens.cpu()[~greedy, 0], target_distribution(base[0], params))
    assert statistic < CHI2_999[dof]
