"""Triton fused sampler: temperature, top-k, top-p, min-p and a Gumbel-max draw, one program per row.

    tokens, logprobs = fused_sample(logits, temperature, top_k, top_p, min_p, seeds, noise=None)

Penalties are applied before (they touch only the tokens a request has seen). The kernel then works
on the row in L2-resident blocks: one pass for the max, min and log-sum-exp of logits / T; the top-k
and top-p cut-offs as logit thresholds found by bisection (each step counts the tokens / sums the
probability mass above a candidate threshold); min-p is the threshold max + log(min_p); a final pass
draws argmax(logprob + Gumbel noise) over the tokens above the highest threshold. Tokens tied with the
k-th (or the top-p cut-off token) are all kept, as in vLLM and the reference. Temperature 0 is
greedy (first arg-max). The noise is the request's seeded counter-based stream (`tl.rand`), or an
injected [B, V] tensor of uniforms — then the result equals the torch reference token for token.
Returns the chosen token and its logprob under the (penalised, tempered) distribution.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 8192  # elements per loop iteration: large, so each pass keeps many loads in flight (latency-bound)
BISECT_STEPS = 28  # resolution (max - min) / 2^28: far below the gap between distinct fp32 logits
NEGLIGIBLE: tl.constexpr = tl.constexpr(88.0)  # logit gap below the max whose tokens never matter


@triton.jit
def _row_stats(row_ptr, V, inv_t, BLOCK: tl.constexpr):
    m = float("-inf")
    lo = float("inf")
    s = 0.0
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        block_max = tl.max(x, axis=0)
        new_m = tl.maximum(m, block_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.where(ok, tl.exp(x - new_m), 0.0), axis=0)
        m = new_m
        lo = tl.minimum(lo, tl.min(tl.where(ok, x, float("inf")), axis=0))
    return m, lo, m + tl.log(s)


@triton.jit
def _count_and_mass(row_ptr, V, inv_t, lse, threshold, BLOCK: tl.constexpr):
    count = 0.0
    mass = 0.0
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        above = ok & (x >= threshold)
        count += tl.sum(above.to(tl.float32), axis=0)
        mass += tl.sum(tl.where(above, tl.exp(x - lse), 0.0), axis=0)
    return count, mass


@triton.jit
def _sample_kernel(
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
    out_token_ptr,
    out_logprob_ptr,
    USE_NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_l
    temperature = tl.load(temp_ptr + row)
    greedy = temperature == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
    m, lo, lse = _row_stats(row_ptr, V, inv_t, BLOCK)
    # bisect from m - NEGLIGIBLE at most: a token that far below the max has probability < e^-88 (it
    # cannot win the Gumbel draw or move top-p), and a -inf logit would keep every midpoint at -inf
    lo = tl.maximum(lo, m - NEGLIGIBLE)
    threshold = float("-inf")
    if not greedy:
        min_p = tl.load(minp_ptr + row)
        if min_p > 0.0:
            threshold = tl.maximum(threshold, m + tl.log(min_p))
        k = tl.load(topk_ptr + row).to(tl.float32)
        if (k > 0.0) & (k < V):
            a = lo
            b = m
            for _ in range(STEPS):  # largest t with count(x >= t) >= k
                mid = (a + b) * 0.5
                count, _unused = _count_and_mass(row_ptr, V, inv_t, lse, mid, BLOCK)
                take = count >= k
                a = tl.where(take, mid, a)
                b = tl.where(take, b, mid)
            threshold = tl.maximum(threshold, a)
        p = tl.load(topp_ptr + row)
        if p < 1.0:
            a = lo
            b = m
            for _ in range(STEPS):  # largest t with mass(x >= t) >= p
                mid = (a + b) * 0.5
                _unused, mass = _count_and_mass(row_ptr, V, inv_t, lse, mid, BLOCK)
                take = mass >= p
                a = tl.where(take, mid, a)
                b = tl.where(take, b, mid)
            threshold = tl.maximum(threshold, a)
    seed = tl.load(seed_ptr + row)
    best = float("-inf")
    best_idx = 0
    best_x = 0.0
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        if greedy:
            score = tl.where(ok, x, float("-inf"))
        else:
            if USE_NOISE:
                u = tl.load(noise_ptr + row.to(tl.int64) * stride_n + idx, mask=ok, other=0.5)
            else:
                u = tl.rand(seed, idx)
            u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
            gumbel = -tl.log(-tl.log(u))
            score = tl.where(ok & (x >= threshold), x - lse + gumbel, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_idx = tl.argmax(score, axis=0)
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_idx = tl.where(better, start + block_idx, best_idx)
        best_x = tl.where(better, tl.sum(tl.where(idx == start + block_idx, x, 0.0), axis=0), best_x)
    tl.store(out_token_ptr + row, best_idx)
    tl.store(out_logprob_ptr + row, best_x - lse)


def fused_sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row parameter tensors [B] (fp32; top_k int32 with 0 = off; seeds int32). → (tokens int64, logprobs fp32)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
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
            tokens,
            logprobs,
            USE_NOISE=noise is not None,
            BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
            STEPS=BISECT_STEPS,
            num_warps=8,
        )
    return tokens, logprobs
