"""MTP speculative decoding's sampling side: the configuration, drafting, and the acceptance rule.

    config = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 3}', num_draft_layers)
    drafted = draft(mtp_logits, params, generators)                  # one draft token per request row
    drafts = gather_drafts([drafted_1, ..., drafted_K], num_drafts)  # request-major, as verify reads them
    verified = verify(target_logits, num_drafts, drafts.tokens, drafts.probs, params, history, generators)
    verified.tokens, verified.counts                                 # on the device: next step's inputs
    counts, tokens = verified.to_host()                              # one device→host copy

Each step the target model is fed, per decoding request i, k_i + 1 tokens — its last token and drafts
d_1..d_k (k_i ≤ K, 0 for a request that only samples its next token) — and returns k_i + 1 consecutive
rows of logits. Row j predicts the token after d_j and so checks d_{j+1}; row k_i gives the bonus token.
A request emits its a_i accepted drafts, then one more token: the correction at the first rejection or
the bonus when all k_i are accepted (1..k_i + 1 tokens a step).

The target distribution p of a row is built exactly as the engine's sampler builds it
(`hy3c.serve.engine.sampler`): logit bias, repetition/presence/frequency penalties over the history —
which for row j holds the drafts d_1..d_j before it (each row is only read when those were accepted) —
then temperature, then min-p, top-k, top-p (`hy3c.ops.sample.filter_mask`'s semantics, batched here).

* Greedy requests (temperature 0) accept d_{j+1} while it equals the argmax of row j; the emitted
  tokens are then exactly those of greedy decoding without speculation.
* Sampled requests follow the standard rejection rule (Leviathan et al., Chen et al. 2023): accept d
  with probability min(1, p(d) / q(d)) where q is the distribution d was drawn from; at the first
  rejection sample from normalize(max(0, p − q)); after k accepted, sample the bonus from p. The tokens
  emitted are distributed exactly as sampling from the target one token at a time. With no draft
  probabilities (`draft_probs=None`), every draft counts as drawn deterministically (q one-hot at d).

Draws come from each sampled request's generator in a fixed order (draft: one uniform per row;
verify: k_i + 1 uniforms per request, k_i tests and one for the final token, drawn whatever is
accepted), so a seeded request reproduces. Samples are drawn by inverse CDF from one uniform, so a
host generator costs a few bytes of upload, not a vocabulary of noise. Nothing here waits for the
device except where penalties need the drafts: a request with a repetition, presence or frequency
penalty and drafts has its drafts copied to the host once (the penalties' own index upload,
`apply_penalties`, waits for the device anyway).

`ForcedAcceptance` is a benchmark mode for random real-shape weights, whose drafts are never accepted:
see its docstring; the text of a forced run is not the model's output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import Tensor

from hy3c.ops.sample import unpack_allowed
from hy3c.serve.engine.sampler import History, SamplingParams, apply_penalties

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 8
_KEYS = ("method", "num_speculative_tokens", "forced_acceptance")
_FLAG = "--speculative-config"


# ---- configuration ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """`hy3c serve --speculative-config` (vLLM's spelling): the method (only "mtp": the checkpoint's own
    multi-token-prediction layers draft), K drafts per request and step, and `forced_acceptance`, the
    benchmark mode's acceptance probability (`ForcedAcceptance`; None = the real acceptance rule)."""

    method: str = "mtp"
    num_speculative_tokens: int
    forced_acceptance: float | None = None


def parse_speculative_config(text: str, num_draft_layers: int) -> SpeculativeConfig:
    """Parse the flag's JSON for an artifact with `num_draft_layers` MTP layers; every bad input is a
    one-line ValueError naming the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{_FLAG}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f'{_FLAG}: give a JSON object, e.g. {{"method": "mtp", "num_speculative_tokens": 2}}'
        )
    unknown = [key for key in raw if key not in _KEYS]
    if unknown:
        raise ValueError(f"{_FLAG}: unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    method = raw.get("method", "mtp")
    if method not in METHODS:
        raise ValueError(
            f"{_FLAG} method: {method!r} is not supported (only {', '.join(map(repr, METHODS))})"
        )
    if "num_speculative_tokens" not in raw:
        raise ValueError(f"{_FLAG} num_speculative_tokens: required (1..{MAX_SPECULATIVE_TOKENS})")
    k = raw["num_speculative_tokens"]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"{_FLAG} num_speculative_tokens: must be an integer in 1..{MAX_SPECULATIVE_TOKENS} (got {k!r})"
        )
    alpha = raw.get("forced_acceptance")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0
    ):
        raise ValueError(f"{_FLAG} forced_acceptance: must be a number in [0, 1] (got {alpha!r})")
    if num_draft_layers == 0:
        raise ValueError(
            f"{_FLAG} method mtp: the artifact has no MTP program (compiled with --no-mtp or a checkpoint"
            " without MTP layers)"
        )
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, forced_acceptance=None if alpha is None else float(alpha)
    )


# ---- the benchmark mode -----------------------------------------------------------------------------
class ForcedAcceptance:
    """Acceptance decided by a coin, not by the tokens: a benchmark of speculation's cost on random
    real-shape weights, whose drafts the target never accepts.

    At each draft position a Bernoulli(alpha) draw accepts or refuses; a request's run ends at its
    first refusal. Every position up to and including that one emits the target's own greedy token of
    its row — the draft is replaced by the target's next token — so a step emits what an acceptance rate
    of alpha would (on average 1 + alpha + … + alpha^k tokens for k drafts) at the cost of a real
    verification. The text is NOT the model's output: rows after an accepted position were computed
    from the fed draft, not from the token emitted in its place. It measures cost only.

    The draws are a hash of (seed, draw number) with the draw counter a device tensor advanced on the
    device: the same decisions on every device, no host work per draw, and capturable in a CUDA graph
    (a captured speculative step draws from the same counter as an uncaptured one)."""

    def __init__(self, alpha: float, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"forced_acceptance: must be a number in [0, 1] (got {alpha!r})")
        self.alpha, self.seed = float(alpha), seed
        self._drawn: dict[torch.device, Tensor] = {}  # device → int64 [1]: draws made there

    def _counter(self, device: torch.device) -> Tensor:
        """The draws made on `device` so far (int64 [1], advanced on the device)."""
        drawn = self._drawn.get(device)
        if drawn is None:
            drawn = self._drawn[device] = torch.zeros(1, dtype=torch.long, device=device)
        return drawn

    def accepts(self, count: int, device: torch.device) -> Tensor:
        """The next `count` positions' decisions (bool [count] on `device`)."""
        device = torch.device(device)
        drawn = self._counter(device)
        index = drawn + torch.arange(count, device=device)
        drawn.add_(count)
        return _uniform_hash(index, self.seed) < self.alpha

    def accepts_rows(self, real: Tensor, k: int) -> Tensor:
        """The decisions of a captured step's [b, k] draft positions (bool), drawn for the `real` rows
        only (bool [b]; padding rows draw nothing and read False), in the order `accepts` would draw
        them for those rows — the same decisions as an uncaptured step of the same requests."""
        device = real.device
        drawn = self._counter(device)
        rows = real.long()
        index = drawn + (rows.cumsum(0) - 1)[:, None] * k + torch.arange(k, device=device)[None, :]
        drawn.add_(rows.sum() * k)
        return (_uniform_hash(index, self.seed) < self.alpha) & real[:, None]


_MASK = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash finalizer in int64 lanes (every product below 2^63: no overflow on any
    device)."""
    for multiplier in (0x7FEB352D, 0x5BD1E995):
        x = ((x ^ (x >> 16)) * multiplier) & _MASK
    return x ^ (x >> 15)


def _to_unit(x: Tensor) -> Tensor:
    """32-bit hashes as uniforms in [0, 1) (their top 24 bits: exact in fp32)."""
    return (x >> 8).float() / float(1 << 24)


def _uniform_hash(index: Tensor, seed: int) -> Tensor:
    """A uniform in [0, 1) per int64 index, from a 32-bit integer hash of (seed, index)."""
    return _to_unit(_mix32((index * 0x9E37 + seed * 0x85EB + 0x2545F491) & _MASK))


# the uniform column of a verification's final token (its draft tests use columns 0..k − 1)
FINAL_DRAW = MAX_SPECULATIVE_TOKENS


def draw_seeds(params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One draw call's seed per row: 31 bits drawn from a sampled row's generator (the default one when
    None), 0 for a greedy row. Every uniform the call uses in that row is hashed from it
    (`seeded_uniforms`), so a seeded request reproduces whichever path draws its tokens — the captured
    speculative step or the launches of an uncaptured one — as long as both draw its seeds in the same
    order: per step, the verification's, then one per drafting pass."""
    return [
        0 if p.greedy else int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=_host(g)))
        for p, g in zip(params, generators)
    ]


def _host(generator: torch.Generator | None) -> torch.device | str:
    return "cpu" if generator is None else generator.device


def seeded_uniforms(seeds: Tensor, columns: Tensor | int) -> Tensor:
    """Uniforms in [0, 1) hashed from (seed, column), `seeds` and `columns` broadcast against each other
    (int64 on the device: no host work, capturable in a CUDA graph)."""
    return _to_unit(_mix32(_mix32(seeds & _MASK) ^ ((columns * 0x9E3779B1) & _MASK)))


# ---- shared pieces ------------------------------------------------------------------------------------
def _upload(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list on `device`; on CUDA through pinned memory without blocking (a pageable copy would
    wait for the queued model step)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class RowColumns:
    """Per-row sampling parameters on the device; temperature 1 in greedy rows (their logprobs are
    those of the untempered logits, as the sampler's)."""

    greedy: Tensor
    temperature: Tensor
    min_p: Tensor
    top_k: Tensor
    top_p: Tensor
    filtered: bool  # some sampled row filters (else the sort is skipped)


def row_columns(params: list[SamplingParams], device: torch.device) -> RowColumns:
    floats = _upload(
        [(p.temperature or 1.0, p.min_p, p.top_p, float(p.greedy)) for p in params], torch.float32, device
    ).reshape(len(params), 4)
    top_k = _upload([p.top_k for p in params], torch.long, device)
    filtered = any(not p.greedy and (p.min_p > 0 or p.top_k > 0 or p.top_p < 1) for p in params)
    return RowColumns(floats[:, 3] > 0, floats[:, 0], floats[:, 1], top_k, floats[:, 2], filtered)


def filter_rows(probs: Tensor, min_p: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """`hy3c.ops.sample.filter_mask` for every row at once (per-row parameter columns [R]), with no host
    sync: the bool [R, V] mask of the tokens min-p, then top-k, then top-p keep, ties with the last kept
    token kept, the most likely always kept."""
    vocab = probs.shape[1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    keep &= sorted_probs >= sorted_probs.gather(1, (k - 1)[:, None])
    kept = torch.where(keep, sorted_probs, 0.0)
    within = (kept.cumsum(-1) - kept < top_p[:, None] * kept.sum(-1, keepdim=True)) & keep
    last = (within.sum(-1, keepdim=True) - 1).clamp(min=0)
    keep = torch.where((top_p < 1.0)[:, None], keep & (sorted_probs >= sorted_probs.gather(1, last)), keep)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


def row_distribution(logprobs: Tensor, columns: RowColumns) -> Tensor:
    """The sampling distribution of each row: its tempered probabilities over the tokens the filters
    keep, renormalised (what the sampler's Gumbel-max over the kept logits draws from)."""
    probs = logprobs.exp()
    if columns.filtered:
        probs = torch.where(filter_rows(probs, columns.min_p, columns.top_k, columns.top_p), probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of non-negative `weights` [R, V] (unnormalised), by inverse CDF from one
    uniform in [0, 1) per row; never a zero-weight token (rounding at the top end is clamped to the
    last token with weight)."""
    cdf = weights.cumsum(-1)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    positions = torch.arange(weights.shape[1], device=weights.device)
    last = torch.where(weights > 0, positions, 0).amax(-1)
    return torch.minimum(tokens, last)


# ---- drafting -------------------------------------------------------------------------------------------
@dataclass
class Draft:
    """Draft tokens (int64 [R], on the device) and the distribution q each row drew from ([R, V]: the
    request's tempered, filtered probabilities; one-hot at the token in greedy rows), None when every
    row is greedy."""

    tokens: Tensor
    probs: Tensor | None


def draft(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> Draft:
    """One draft token per row of the MTP layer's logits [R, V]: the argmax in greedy rows; in sampled
    rows a draw, with one uniform from the request's generator, from q — the request's temperature, then
    min-p, top-k, top-p as the target uses them, no penalties (the draft distribution may differ from the
    target's: the acceptance rule corrects for it). No host sync."""
    logits = logits.float()
    if all(p.greedy for p in params):
        return Draft(logits.argmax(-1), None)
    device = logits.device
    columns = row_columns(params, device)
    seeds = _upload(draw_seeds(params, generators), torch.long, device)
    tokens, q = draw_drafts(logits, columns, seeded_uniforms(seeds, 0))
    return Draft(tokens, q)


def draw_drafts(logits: Tensor, columns: RowColumns, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """`draft`'s rule on fp32 logits [R, V] with the rows' parameter columns and one uniform per row:
    (tokens [R], q [R, V]: one-hot at the argmax in greedy rows). Device work only."""
    argmax = logits.argmax(-1)
    q = row_distribution(torch.log_softmax(logits / columns.temperature[:, None], -1), columns)
    one_hot = torch.zeros_like(q).scatter_(1, argmax[:, None], 1.0)
    q = torch.where(columns.greedy[:, None], one_hot, q)
    return torch.where(columns.greedy, argmax, _inverse_cdf(q, uniforms)), q


def gather_drafts(positions: list[Draft], num_drafts: list[int]) -> Draft:
    """The request-major layout `verify` reads from K drafting passes: `positions[j]` holds the j-th
    draft of each request with num_drafts[i] > j, in request order; the result holds request i's drafts
    d_1..d_k consecutively. Probabilities are kept when every pass has them."""
    offsets, index, seen = [], [], 0
    for part in positions:
        offsets.append(seen)
        seen += part.tokens.shape[0]
    counters = [0] * len(positions)
    for k in num_drafts:
        for j in range(k):
            index.append(offsets[j] + counters[j])
            counters[j] += 1
    if not positions:
        return Draft(torch.empty(0, dtype=torch.long), None)
    device = positions[0].tokens.device
    where = _upload(index, torch.long, device)
    tokens = torch.cat([part.tokens for part in positions])[where]
    with_probs = all(part.probs is not None for part in positions)
    probs = torch.cat([part.probs for part in positions])[where] if with_probs else None
    return Draft(tokens, probs)


# ---- verification ---------------------------------------------------------------------------------------
@dataclass
class Verified:
    """A step's verification, on the device: `tokens` int64 [R, K+1], request i's emitted tokens in
    columns 0..counts[i] (its accepted drafts, then the correction or bonus), −1 after; `counts` int64
    [R], the accepted drafts a_i. With logprobs asked: `logprobs` fp32 [R, K+1] of each emitted token
    under its row's processed target distribution (0 in padding), and with top-n also `top_ids` int64
    and `top_logprobs` fp32 [R, K+1, n]."""

    tokens: Tensor
    counts: Tensor
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None

    @property
    def last_tokens(self) -> Tensor:
        """Each request's last emitted token (int64 [R], on the device): the next step's first fed token."""
        return self.tokens.gather(1, self.counts[:, None])[:, 0]

    def to_host(self) -> tuple[list[int], list[list[int]]]:
        """(accepted counts, each request's emitted tokens) in one device→host copy."""
        packed = torch.cat([self.counts[:, None], self.tokens], 1).tolist()
        return [row[0] for row in packed], [row[1 : row[0] + 2] for row in packed]

    def logprobs_to_host(self) -> tuple[list[list[float]], list[list[list[tuple[int, float]]]]]:
        """Each request's emitted tokens' logprobs and their top-n (token, logprob) lists, in one
        device→host copy (empty lists when no logprobs were asked)."""
        if self.logprobs is None:
            return [[] for _ in range(self.counts.shape[0])], [[] for _ in range(self.counts.shape[0])]
        rows, width = self.tokens.shape
        parts = [self.counts[:, None].double(), self.logprobs.double()]
        if self.top_ids is not None and self.top_logprobs is not None:
            parts += [self.top_ids.double().reshape(rows, -1), self.top_logprobs.double().reshape(rows, -1)]
        packed = torch.cat(parts, 1).tolist()
        n = 0 if self.top_ids is None else self.top_ids.shape[2]
        chosen, top = [], []
        for row in packed:
            emitted = int(row[0]) + 1
            chosen.append(row[1 : 1 + emitted])
            ids, values = row[1 + width : 1 + width + width * n], row[1 + width + width * n :]
            top.append([[(int(ids[m * n + t]), values[m * n + t]) for t in range(n)] for m in range(emitted)])
        return chosen, top


def _penalised(
    logits: Tensor,
    num_drafts: list[int],
    draft_tokens: Tensor,
    params: list[SamplingParams],
    history: list[History],
) -> Tensor:
    """The target rows after logit bias and penalties (`apply_penalties`), row j of a request with its
    drafts d_1..d_j added to the output history. The drafts come to the host (one copy) only when a
    request with drafts has a repetition, presence or frequency penalty."""
    penalised = [
        k > 0 and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        for k, p in zip(num_drafts, params)
    ]
    drafts = draft_tokens.tolist() if any(penalised) else []
    row_params, row_history, start = [], [], 0
    for k, p, h, with_drafts in zip(num_drafts, params, history, penalised):
        row_params += [p] * (k + 1)
        if with_drafts:
            row_history += [History(h.prompt, h.output + drafts[start : start + j]) for j in range(k + 1)]
        else:
            row_history += [h] * (k + 1)
        start += k
    return apply_penalties(logits, row_params, row_history)


def verify(
    target_logits: Tensor,
    num_drafts: list[int],
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    params: list[SamplingParams],
    history: list[History],
    generators: list[torch.Generator | None],
    forced: ForcedAcceptance | None = None,
    num_logprobs: int | None = None,
    allowed: Tensor | None = None,
) -> Verified:
    """Accept or reject each request's drafts against the target rows (module docstring for the rule).

    `target_logits` [N, V]: request i's num_drafts[i] + 1 rows, consecutive, requests in order;
    `draft_tokens` [sum(num_drafts)] and `draft_probs` [sum(num_drafts), V] (the q each was drawn from;
    None: drawn deterministically) in the same request-major order (`gather_drafts`); `history`: each
    request's prompt and output so far, without the drafts. `forced`: the benchmark mode. `num_logprobs`:
    None for no logprobs, 0 for the emitted tokens', n for the top n too. `allowed`: a packed grammar
    mask per target row (`hy3c.ops.sample`; row j of a request masked by its grammar after d_1..d_j),
    whose disallowed tokens are -inf in p: a draft the grammar refuses is never accepted, and the
    correction and bonus tokens follow the grammar."""
    rows_needed, drafted = sum(num_drafts) + len(num_drafts), sum(num_drafts)
    if not len(params) == len(history) == len(generators) == len(num_drafts):
        raise ValueError("verify: params, history, generators and num_drafts differ in length")
    if target_logits.shape[0] != rows_needed or draft_tokens.shape[0] != drafted:
        raise ValueError(
            f"verify: {target_logits.shape[0]} target rows and {draft_tokens.shape[0]} drafts for"
            f" num_drafts {num_drafts} (want {rows_needed} and {drafted})"
        )
    device = target_logits.device
    if not num_drafts:
        empty = torch.empty(0, 1, dtype=torch.long, device=device)
        return Verified(empty, empty[:, 0])
    requests, width = len(num_drafts), max(num_drafts, default=0) + 1
    tables, row_params, start, draft_start = [], [], 0, 0
    sampled = forced is None and not all(p.greedy for p in params)
    seeds = draw_seeds(params, generators) if sampled else [0] * requests
    for k, p, seed in zip(num_drafts, params, seeds):
        row_of = [start + min(m, k) for m in range(width)]
        draft_of = [draft_start + min(j, k - 1) if k else 0 for j in range(width - 1)]
        tables.append(row_of + draft_of + [int(j < k) for j in range(width - 1)] + [k, seed])
        row_params += [p] * (k + 1)
        start, draft_start = start + k + 1, draft_start + k
    table = _upload(tables, torch.long, device).reshape(requests, 3 * width)
    rows, drafts_at = table[:, :width], table[:, width : 2 * width - 1]
    valid, limit, seed_column = table[:, 2 * width - 1 : -2] > 0, table[:, -2], table[:, -1]

    logits = _penalised(target_logits.float(), num_drafts, draft_tokens, params, history)
    if allowed is not None:
        logits = logits.masked_fill(~unpack_allowed(allowed, logits.shape[-1]), float("-inf"))
    columns = row_columns(row_params, device)
    greedy = columns.greedy[rows[:, 0]]  # per request
    logprobs = torch.log_softmax(logits / columns.temperature[:, None], -1)
    argmax = logits.argmax(-1)
    d = draft_tokens[drafts_at] if drafted else torch.zeros(requests, 0, dtype=torch.long, device=device)
    checking = rows[:, :-1]  # row j checks d_{j+1}

    if forced is not None:
        decided = forced.accepts(drafted, device)
        accept = decided[drafts_at] if drafted else valid
        accepted_part = argmax[rows]
    else:
        accept = d == argmax[checking]
        accepted_part = torch.cat([d, d.new_zeros(requests, 1)], 1)
    if sampled:
        target_probs = row_distribution(logprobs, columns)
        draws = torch.arange(width, device=device)
        uniforms = seeded_uniforms(seed_column[:, None], torch.where(draws < width - 1, draws, FINAL_DRAW))
        p_d = target_probs[checking, d]
        q_d = draft_probs[drafts_at, d] if draft_probs is not None and drafted else torch.ones_like(p_d)
        accept = torch.where(greedy[:, None], accept, uniforms[:, :-1] * q_d < p_d)
    counts = (accept & valid).long().cumprod(1).sum(1)
    final_row = rows.gather(1, counts[:, None])[:, 0]
    final = argmax[final_row]
    if sampled:
        target = target_probs[final_row]
        if drafted:
            at = counts.clamp(max=width - 2)[:, None]
            if draft_probs is not None:
                q = draft_probs[drafts_at.gather(1, at)[:, 0]]
            else:
                q = torch.zeros_like(target).scatter_(1, d.gather(1, at), 1.0)
            drawn = residual_draw(target, q, counts < limit, uniforms[:, -1])
        else:
            drawn = _inverse_cdf(target, uniforms[:, -1])
        final = torch.where(greedy, final, drawn)
    position = torch.arange(width, device=device)[None, :]
    tokens = torch.where(
        position < counts[:, None],
        accepted_part,
        torch.where(position == counts[:, None], final[:, None], -1),
    )
    out = Verified(tokens, counts)
    if num_logprobs is not None:
        emitted = position <= counts[:, None]
        chosen = logprobs[rows, tokens.clamp(min=0)]
        out.logprobs = torch.where(emitted, chosen, 0.0)
        if num_logprobs > 0:
            values, ids = logprobs.topk(num_logprobs, dim=-1)
            out.top_ids, out.top_logprobs = ids[rows], values[rows]
    return out


def residual_draw(target: Tensor, q: Tensor, rejected: Tensor, uniform: Tensor) -> Tensor:
    """Each request's token after its accepted drafts (`target` [R, V] its row's distribution p, `q`
    [R, V] the distribution of the draft it rejected): from normalize(max(0, p − q)) where it
    rejected one (p itself if that is empty), from p where it accepted all (the bonus); by inverse
    CDF from one uniform a row. Device work only."""
    residual = torch.where(rejected[:, None], (target - q).clamp(min=0.0), target)
    target = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    return _inverse_cdf(target, uniform)


def mean_accepted_length(alpha: float, k: int) -> float:
    """Expected tokens emitted per step for k drafts each accepted with probability alpha (independent,
    a run ending at the first refusal): 1 + alpha + alpha² + … + alpha^k (vLLM's mean acceptance
    length)."""
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


__all__ = [
    "Draft",
    "ForcedAcceptance",
    "SpeculativeConfig",
    "Verified",
    "draft",
    "filter_rows",
    "gather_drafts",
    "mean_accepted_length",
    "parse_speculative_config",
    "verify",
]
