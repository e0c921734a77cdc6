"""Triton fused sampler: temperature, min-p, top-k, top-p and a Gumbel-max draw, rows split over CTAs.

`hy3_triton::sample` implements `hy3::sample` (`hy3c.ops.sample`, the reference); `fused_sample` is the
launch, with the tunables and the fallback flags the tests read:

    tokens, logprobs = fused_sample(logits, temperature, top_k, top_p, min_p, seeds, noise=None, allowed=None)

Penalties are applied before (they touch only the tokens a request has seen). A row whose top_k is
`SKIP_DRAW` is not drawn: both kernels return at once and its outputs are left as they were (a decode
graph replayed for its logits alone, whose captured draws nobody reads). A structured output's
grammar mask comes in packed (`allowed` [B, ceil(V / 32)] int32, one bit a token, `hy3c.ops.sample`):
every read of a row's logits reads its bits beside them and takes a disallowed token as -inf, so the
mask costs a 32nd of the logits' bytes and no launch of its own. Filters follow
`hy3c.ops.sample.filter_mask`: min-p, then top-k, then top-p renormalised over what is left;
tokens tied at a cut-off are kept. Two launches; the logits are read once on the usual path:

1. `_chunk_kernel`, one program per (row, chunk of CHUNK tokens): the chunk's max and sum of
   exp(x - max) of x = logits / T; its CANDIDATES largest values (`tl.topk`), whose smallest is the
   chunk's floor, and the tokens above the floor (then those equal to it, by index, while slots
   remain) compacted into the candidate slots. A row with no filter also draws here: the chunk's best
   Gumbel-perturbed logit.
2. `_merge_kernel`, one program per row: log-sum-exp from the chunk stats; the MERGE_TOP largest
   candidates as sorted int64 keys (orderable float bits << 32 | inverted index, so ties order by
   lower index). Every token above F = the largest chunk floor (or the smallest of those MERGE_TOP)
   is among them, so any cut-off above F is exact from them alone: min-p is max + log(min_p), top-k
   the k-th, top-p a prefix sum in sorted order; the draw is argmax(x + Gumbel) over those kept.
   Greedy is the first. A row whose cut-off falls at or below F (a flat distribution under top-p,
   top-k beyond the candidates) finds its cut-offs by bisection over the whole row instead (count /
   mass above a threshold), then draws in one more pass. The first n sorted candidates are also the
   row's top-n logprobs, when asked for.

The noise is the request's seeded counter-based stream (`tl.rand(seed, token)`), or an injected
[B, V] tensor of uniforms — then the result equals the torch reference token for token. Returns the
chosen token and its logprob under the (penalised, tempered) distribution.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hy3c.kernels.registry import Provider, register_provider
from hy3c.ops.sample import SKIP_DRAW, block_columns, check_allowed, sample_outputs

CHUNK = 4096  # tokens per program of the chunk kernel (held in registers)
CANDIDATES = 32  # largest tokens each chunk hands to the merge
MERGE_TOP = 256  # largest candidates the merge keeps, sorted
BISECT_STEPS = 28  # fallback resolution (max - min) / 2^28: far below the gap between distinct fp32 logits
NEGLIGIBLE: tl.constexpr = tl.constexpr(88.0)  # logit gap below the max whose tokens never matter
INDEX_MASK: tl.constexpr = tl.constexpr(0x7FFFFFFF)
EMPTY: tl.constexpr = tl.constexpr(-(2**63))  # key of a padding slot: below every real key
SKIPPED: tl.constexpr = tl.constexpr(SKIP_DRAW)  # a row's top_k when nobody reads its draw


@triton.jit
def _inverse_temperature(temp_ptr, row):
    """→ (whether the row samples (temperature > 0; else greedy), 1 / temperature or 1)."""
    temperature = tl.load(temp_ptr + row)
    sampled = temperature != 0.0
    return sampled, tl.where(sampled, 1.0 / tl.where(sampled, temperature, 1.0), 1.0)


@triton.jit
def _has_filter(topk_ptr, topp_ptr, minp_ptr, row, V):
    k = tl.load(topk_ptr + row)
    return (tl.load(minp_ptr + row) > 0.0) | ((k > 0) & (k < V)) | (tl.load(topp_ptr + row) < 1.0)


@triton.jit
def _gumbel(noise_ptr, stride_n, row, seed, idx, ok, USE_NOISE: tl.constexpr):
    if USE_NOISE:
        u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + idx, mask=ok, other=0.5)
    else:
        u = tl.rand(seed, idx)
    u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
    return -tl.log(-tl.log(u))


@triton.jit
def _load_scaled(row_ptr, idx, ok, inv_t, allowed_row_ptr, HAS_MASK: tl.constexpr):
    """x = logits / T at `idx`, -inf where out of the row or (HAS_MASK) not allowed by its packed mask."""
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
    if HAS_MASK:
        words = tl.load(allowed_row_ptr + idx // 32, mask=ok, other=0)
        x = tl.where(((words >> (idx % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _to_key(x, idx):
    """fp32 value and token index → int64 whose order is (value, then lower index first)."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & INDEX_MASK)
    return (ordered.to(tl.int64) << 32) | (idx ^ INDEX_MASK).to(tl.int64)


@triton.jit
def _from_key(key):
    ordered = (key >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & INDEX_MASK)).to(tl.float32, bitcast=True)
    return value, (key & INDEX_MASK).to(tl.int32) ^ INDEX_MASK


@triton.jit
def _row_max_and_lse(stats_ptr, row, N_CHUNKS, CHUNKS_P2: tl.constexpr):
    """The row's max and log-sum-exp from the chunk kernel's per-chunk (max, sum exp(x - max), floor)."""
    chunks = tl.arange(0, CHUNKS_P2)
    ok = chunks < N_CHUNKS
    chunk_m = tl.load(stats_ptr + (row * N_CHUNKS + chunks) * 3, mask=ok, other=float("-inf"))
    chunk_s = tl.load(stats_ptr + (row * N_CHUNKS + chunks) * 3 + 1, mask=ok, other=0.0)
    m = tl.max(chunk_m, axis=0)
    return m, m + tl.log(
        tl.sum(tl.where(chunk_m > float("-inf"), chunk_s * tl.exp(chunk_m - m), 0.0), axis=0)
    )


@triton.jit
def _chunk_kernel(
    logits_ptr,
    stride_l,
    V,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    seed_ptr,
    noise_ptr,
    stride_n,
    allowed_ptr,
    stride_a,
    stats_ptr,
    cand_value_ptr,
    cand_id_ptr,
    best_ptr,
    best_id_ptr,
    USE_NOISE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CHUNK: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.load(topk_ptr + row) == SKIPPED:
        return
    chunk = tl.program_id(1)
    slot = row * tl.num_programs(1) + chunk
    sampled, inv_t = _inverse_temperature(temp_ptr, row)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = idx < V
    x = _load_scaled(
        logits_ptr + row.to(tl.int64) * stride_l,
        idx,
        ok,
        inv_t,
        allowed_ptr + row.to(tl.int64) * stride_a,
        HAS_MASK,
    )
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - tl.where(m > float("-inf"), m, 0.0)), 0.0), axis=0)
    floor = tl.min(tl.topk(x, CANDIDATES), axis=0)
    tl.store(stats_ptr + slot * 3, m)
    tl.store(stats_ptr + slot * 3 + 1, s)
    tl.store(stats_ptr + slot * 3 + 2, floor)
    # the tokens above the floor (fewer than CANDIDATES), then those at it while slots remain
    above = ok & (x > floor)
    at = ok & (x == floor)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    pos = (
        tl.where(above, tl.cumsum(above.to(tl.int32), axis=0), n_above + tl.cumsum(at.to(tl.int32), axis=0))
        - 1
    )
    store = (above | at) & (pos < CANDIDATES)
    base = slot.to(tl.int64) * CANDIDATES
    tl.store(cand_value_ptr + base + pos, x, mask=store)
    tl.store(cand_id_ptr + base + pos, idx, mask=store)
    slots = tl.arange(0, CANDIDATES)
    n_stored = n_above + tl.sum(at.to(tl.int32), axis=0)
    tl.store(cand_id_ptr + base + slots, -1, mask=slots >= n_stored)  # empty slots
    if sampled & ~_has_filter(topk_ptr, topp_ptr, minp_ptr, row, V):
        score = x + _gumbel(noise_ptr, stride_n, row, tl.load(seed_ptr + row), idx, ok, USE_NOISE)
        score = tl.where(ok, score, float("-inf"))
        best = tl.argmax(score, axis=0)
        tl.store(best_ptr + slot * 2, tl.max(score, axis=0))
        tl.store(best_ptr + slot * 2 + 1, tl.sum(tl.where(tl.arange(0, CHUNK) == best, x, 0.0), axis=0))
        tl.store(best_id_ptr + slot, chunk * CHUNK + best)


@triton.jit
def _merge_kernel(
    logits_ptr,
    stride_l,
    V,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    seed_ptr,
    noise_ptr,
    stride_n,
    allowed_ptr,
    stride_a,
    stats_ptr,
    cand_value_ptr,
    cand_id_ptr,
    best_ptr,
    best_id_ptr,
    out_token_ptr,
    out_logprob_ptr,
    fallback_ptr,
    top_id_ptr,
    top_logprob_ptr,
    top_exact_ptr,
    N_CHUNKS,
    top_n,
    USE_NOISE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CANDIDATES: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    MERGE_TOP: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    if tl.load(topk_ptr + row) == SKIPPED:
        return
    sampled, inv_t = _inverse_temperature(temp_ptr, row)
    chunks = tl.arange(0, CHUNKS_P2)
    chunk_ok = chunks < N_CHUNKS
    m, lse = _row_max_and_lse(stats_ptr, row, N_CHUNKS, CHUNKS_P2)
    floors = tl.load(stats_ptr + (row * N_CHUNKS + chunks) * 3 + 2, mask=chunk_ok, other=float("-inf"))

    offs = tl.arange(0, CHUNKS_P2 * CANDIDATES)
    base = row.to(tl.int64) * N_CHUNKS * CANDIDATES
    ids = tl.load(cand_id_ptr + base + offs, mask=offs < N_CHUNKS * CANDIDATES, other=-1)
    values = tl.load(cand_value_ptr + base + offs, mask=ids >= 0, other=0.0)
    keys = tl.topk(tl.where(ids >= 0, _to_key(values, ids), EMPTY), MERGE_TOP)  # sorted, descending
    values, ids = _from_key(keys)
    real = keys != EMPTY
    values = tl.where(real, values, float("-inf"))
    # F: every token above the largest chunk floor and above the last kept candidate is among these
    f = tl.maximum(tl.max(floors, axis=0), tl.min(values, axis=0))
    first_value = tl.max(values, axis=0)
    rank = tl.arange(0, MERGE_TOP)
    first_id = tl.max(tl.where(rank == 0, ids, 0), axis=0)

    if top_n > 0:  # the most likely tokens' logprobs: exact when the n-th lies above F
        top = rank < top_n
        tl.store(top_id_ptr + row * top_n + rank, ids, mask=top)
        tl.store(top_logprob_ptr + row * top_n + rank, values - lse, mask=top)
        last = tl.max(tl.where(rank == top_n - 1, values, float("-inf")), axis=0)
        tl.store(top_exact_ptr + row, (last > f).to(tl.int32))

    token = first_id
    value = first_value
    fallback = 0
    if sampled:
        k = tl.load(topk_ptr + row)
        min_p = tl.load(minp_ptr + row)
        top_p = tl.load(topp_ptr + row)
        if _has_filter(topk_ptr, topp_ptr, minp_ptr, row, V):
            t = float("-inf")
            if min_p > 0.0:
                t = m + tl.log(min_p)
            if (k > 0) & (k < V):
                t = tl.maximum(t, tl.max(tl.where(rank == k - 1, values, float("-inf")), axis=0))
            if top_p < 1.0:
                inside = real & (values >= t)
                w = tl.where(inside, tl.exp(values - m), 0.0)
                # the mass top-p renormalises over: the candidates' if they hold all of it, else the row's
                mass = tl.where(t > f, tl.sum(w, axis=0), tl.exp(lse - m))
                within = inside & (tl.cumsum(w, axis=0) - w < top_p * mass)
                cut = tl.min(tl.where(within, values, first_value), axis=0)
                # a finite min-p / top-k cut-off at or below F leaves that mass unknown: fall back
                t = tl.where((t > f) | (t == float("-inf")), tl.maximum(t, cut), f)
            seed = tl.load(seed_ptr + row)
            if t > f:
                kept = real & (values >= t)
                score = values + _gumbel(noise_ptr, stride_n, row, seed, ids, kept, USE_NOISE)
                score = tl.where(kept, score, float("-inf"))
                best = tl.max(score, axis=0)
                # ties in score: the lowest token id, as torch's argmax over the vocabulary
                token = tl.min(tl.where(kept & (score == best), ids, 2**31 - 1), axis=0)
                value = tl.max(tl.where(kept & (ids == token), values, float("-inf")), axis=0)
            else:
                fallback = 1
                token, value = _sample_by_bisection(
                    logits_ptr + row.to(tl.int64) * stride_l,
                    allowed_ptr + row.to(tl.int64) * stride_a,
                    V,
                    inv_t,
                    m,
                    k,
                    min_p,
                    top_p,
                    noise_ptr,
                    stride_n,
                    row,
                    seed,
                    USE_NOISE,
                    HAS_MASK,
                    BLOCK,
                    STEPS,
                )
        else:
            slots = row * N_CHUNKS + chunks
            best_scores = tl.load(best_ptr + slots * 2, mask=chunk_ok, other=float("-inf"))
            best = tl.max(best_scores, axis=0)
            winner = tl.min(tl.where(best_scores == best, chunks, CHUNKS_P2), axis=0)  # lowest id on ties
            token = tl.load(best_id_ptr + row * N_CHUNKS + winner)
            value = tl.load(best_ptr + (row * N_CHUNKS + winner) * 2 + 1)
    tl.store(out_token_ptr + row, token.to(tl.int64))
    tl.store(out_logprob_ptr + row, value - lse)
    tl.store(fallback_ptr + row, fallback)


@triton.jit
def _sample_by_bisection(
    row_ptr,
    allowed_row_ptr,
    V,
    inv_t,
    m,
    k,
    min_p,
    top_p,
    noise_ptr,
    stride_n,
    row,
    seed,
    USE_NOISE: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    """The fallback: cut-offs by bisection over the whole row, then one pass for the draw."""
    # a token this far below the max has probability < e^-88: it cannot win the draw or
    # move top-p, and a -inf logit would keep every bisection midpoint at -inf
    lo = m - NEGLIGIBLE
    t = float("-inf")
    if min_p > 0.0:
        t = m + tl.log(min_p)
    if (k > 0) & (k < V):
        t = tl.maximum(
            t,
            _bisect(
                row_ptr, allowed_row_ptr, V, inv_t, m, lo, k.to(tl.float32), False, HAS_MASK, STEPS, BLOCK
            ),
        )
    if top_p < 1.0:
        _count, mass = _count_and_mass(row_ptr, allowed_row_ptr, V, inv_t, m, t, HAS_MASK, BLOCK)
        t = tl.maximum(
            t,
            _bisect(
                row_ptr,
                allowed_row_ptr,
                V,
                inv_t,
                m,
                tl.maximum(lo, t),
                top_p * mass,
                True,
                HAS_MASK,
                STEPS,
                BLOCK,
            ),
        )
    best = float("-inf")
    best_idx = 0
    best_x = 0.0
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        x = _load_scaled(row_ptr, idx, ok, inv_t, allowed_row_ptr, HAS_MASK)
        score = x + _gumbel(noise_ptr, stride_n, row, seed, idx, ok, USE_NOISE)
        score = tl.where(ok & (x >= t), score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0)
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_idx = tl.where(better, start + block_idx, best_idx)
        best_x = tl.where(better, tl.sum(tl.where(idx == start + block_idx, x, 0.0), axis=0), best_x)
    return best_idx, best_x


@triton.jit
def _count_and_mass(
    row_ptr, allowed_row_ptr, V, inv_t, m, threshold, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr
):
    count = 0.0
    mass = 0.0
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        x = _load_scaled(row_ptr, idx, ok, inv_t, allowed_row_ptr, HAS_MASK)
        above = ok & (x >= threshold)
        count += tl.sum(above.to(tl.float32), axis=0)
        mass += tl.sum(tl.where(above, tl.exp(x - m), 0.0), axis=0)
    return count, mass


@triton.jit
def _bisect(
    row_ptr,
    allowed_row_ptr,
    V,
    inv_t,
    m,
    lo,
    target,
    BY_MASS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Largest threshold t in [lo, m] with count(x ≥ t) ≥ target (or mass, by BY_MASS)."""
    a = lo
    b = m
    for _ in range(STEPS):
        mid = (a + b) * 0.5
        count, mass = _count_and_mass(row_ptr, allowed_row_ptr, V, inv_t, m, mid, HAS_MASK, BLOCK)
        take = tl.where(BY_MASS, mass, count) >= target
        a = tl.where(take, mid, a)
        b = tl.where(take, b, mid)
    return a


def fused_sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    noise: Tensor | None = None,
    chunk: int = CHUNK,
    candidates: int = CANDIDATES,
    merge_top: int = MERGE_TOP,
    fallback: Tensor | None = None,
    top: tuple[Tensor, Tensor, Tensor] | None = None,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row parameter tensors [B] (fp32; top_k int32 with 0 = off; seeds int32); `allowed`: a packed
    mask [B, ≥ ceil(V / 32)] int32 of the tokens each row may draw (`hy3c.ops.sample`), or None.

    → (tokens int64, logprobs fp32). `fallback` ([B] int32), if given, is set to 1 for the rows whose
    cut-offs the candidates could not decide (then found by bisection), else 0. `top` = (ids [B, n]
    int32, logprobs [B, n] fp32, exact [B] int32), if given, receives the n most likely tokens of each
    row (n ≤ the merged candidates) with their logprobs; `exact` is 0 for a row whose n-th token the
    candidates cannot vouch for (ties or a flat tail at the chunk floors): recompute those rows.
    """
    rows, vocab = logits.shape
    check_allowed(allowed, logits)
    chunk = min(chunk, triton.next_power_of_2(vocab))
    candidates = min(candidates, chunk)
    n_chunks = triton.cdiv(vocab, chunk)
    merge_top = min(merge_top, triton.next_power_of_2(n_chunks) * candidates)
    device = logits.device
    stats = torch.empty(rows, n_chunks, 3, dtype=torch.float32, device=device)  # max, sum exp, floor
    cand_values = torch.empty(rows, n_chunks, candidates, dtype=torch.float32, device=device)
    cand_ids = torch.empty(rows, n_chunks, candidates, dtype=torch.int32, device=device)
    best = torch.empty(rows, n_chunks, 2, dtype=torch.float32, device=device)  # (score, logit) per chunk
    best_ids = torch.empty(rows, n_chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    if fallback is None:
        fallback = torch.empty(rows, dtype=torch.int32, device=device)
    top_n = top[0].shape[1] if top is not None else 0
    if top_n > merge_top:
        raise ValueError(f"top logprobs: {top_n} tokens asked, the merge keeps {merge_top} candidates")
    top_ids, top_logprobs, top_exact = top if top is not None else (tokens, logprobs, fallback)
    if rows == 0:
        return tokens, logprobs
    row_args = (
        logits,
        logits.stride(0),
        vocab,
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        noise if noise is not None else logits,
        noise.stride(0) if noise is not None else 0,
        allowed if allowed is not None else logits,
        allowed.stride(0) if allowed is not None else 0,
        stats,
        cand_values,
        cand_ids,
        best,
        best_ids,
    )
    _chunk_kernel[(rows, n_chunks)](
        *row_args,
        USE_NOISE=noise is not None,
        HAS_MASK=allowed is not None,
        CHUNK=chunk,
        CANDIDATES=candidates,
        num_warps=8 if chunk >= 4096 else 4,
    )
    _merge_kernel[(rows,)](
        *row_args,
        tokens,
        logprobs,
        fallback,
        top_ids,
        top_logprobs,
        top_exact,
        n_chunks,
        top_n,
        USE_NOISE=noise is not None,
        HAS_MASK=allowed is not None,
        CANDIDATES=candidates,
        CHUNKS_P2=triton.next_power_of_2(n_chunks),
        MERGE_TOP=merge_top,
        BLOCK=min(8192, triton.next_power_of_2(vocab)),
        STEPS=BISECT_STEPS,
        num_warps=8,
    )
    return tokens, logprobs


def draw_pair(logits: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row of `logits` drawn with the parameters of `block` (`block_columns`), no
    filters' fallback reported: (tokens int64, [rows, 2] float64 holding each token and its logprob,
    which one copy takes to the host). Launches kernels only: a CUDA graph captures it (the decode
    graphs with sampling, `hy3c.runtime.cuda_graphs`)."""
    tokens, logprobs = fused_sample(logits, *block_columns(block, logits.shape[0]))
    return tokens, torch.stack([tokens.double(), logprobs.double()], 1)


@torch.library.custom_op("hy3_triton::sample", mutates_args=())
def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    noise: Tensor | None,
    num_logprobs: int,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows = logits.shape[0]
    top = (
        logits.new_empty((rows, num_logprobs), dtype=torch.int32),
        logits.new_empty((rows, num_logprobs), dtype=torch.float32),
        logits.new_empty(rows if num_logprobs else 0, dtype=torch.int32),
    )
    tokens, logprobs = fused_sample(
        logits,
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        noise,
        top=top if num_logprobs else None,
        allowed=allowed,
    )
    return tokens, logprobs, *top


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, noise, num_logprobs, allowed=None):
    return sample_outputs(logits, num_logprobs)


register_provider(Provider("triton", "sample", torch.ops.hy3_triton.sample.default, frozenset({"cuda"})))
