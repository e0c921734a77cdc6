"""The token sampler as an op: `hy3::sample`, one token per row of logits (docs/ARCHITECTURE.md §4: a
pure-torch reference, kernel providers beside it — the Triton one is `hy3c.kernels.sampler`).

    tokens, logprobs, top_ids, top_logprobs, top_exact = torch.ops.hy3.sample(
        logits, temperature, top_k, top_p, min_p, seeds, noise, num_logprobs, allowed)

Inputs are the step's logits [B, V] (fp32, penalties and logit bias already applied: they depend on each
request's history, which the serving sampler holds) and per-row parameter columns [B]: temperature
(fp32, 0 = greedy), top_k (int32, 0 = off), top_p, min_p (fp32) and seeds (int32); `allowed`, when
given, a packed mask [B, ceil(V / 32)] int32 (bit j of word w allows token 32·w + j: a grammar's
structured-output mask, llguidance's and xgrammar's layout) whose disallowed tokens count as logits of
-inf — in the draw, the filters and the logprobs alike. Per row: temperature,
then min-p, top-k and top-p filtering (`filter_mask`, vLLM's order), then a draw — greedy (argmax) or
Gumbel-max over the kept logits with uniforms from `noise` [B, V] when given, else from the row's seed.
Returns the chosen token (int64), its logprob under the tempered distribution before filtering (fp32),
and the `num_logprobs` most likely tokens with their logprobs ([B, n] int32 and fp32); `top_exact` [B]
int32 (empty when n is 0: nothing to vouch for) is 0 for a row whose top-n a provider could not vouch
for (the Triton kernel's flat rows: the caller recomputes those rows), always 1 here.

A seed's stream differs between providers (torch's generator here, the kernel's counter-based
`tl.rand`): seeded draws follow the same distribution, and with injected noise the providers agree
token for token. The sampler runs after the step program, never inside it: no program may call it
(`hy3c.program.allowlist`).
"""

from __future__ import annotations

import torch
from torch import Tensor

SAMPLING_BLOCK_ROWS = 5  # temperature, top_p, min_p (fp32 bits), top_k, seed: one [5, rows] int32 block
# a block's top_k that says "do not draw this row": the fused sampler leaves it untouched (a decode graph
# replayed for its logits alone skips the draws it captured: `DecodeGraphs.run`)
SKIP_DRAW = -(2**31)


def block_columns(block: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`fused_sample`'s parameter columns for the first `rows` rows of a [5, R] int32 block whose
    rows 0-2 hold the fp32 bits of temperature, top_p and min_p and rows 3-4 top_k and the seed (one
    host-to-device copy takes them all)."""
    floats = block[:3].view(torch.float32)
    return floats[0, :rows], block[3, :rows], floats[1, :rows], floats[2, :rows], block[4, :rows]


def unpack_allowed(allowed: Tensor, vocab: int) -> Tensor:
    """A packed mask [B, W] int32 (the module docstring) as booleans [B, vocab]."""
    bits = torch.arange(32, device=allowed.device, dtype=torch.int32)
    return ((allowed.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()


def check_allowed(allowed: Tensor | None, logits: Tensor) -> None:
    """Raise a ValueError unless `allowed` is a packed mask that covers `logits` [B, V]."""
    if allowed is None:
        return
    rows, vocab = logits.shape
    if allowed.dtype != torch.int32 or allowed.dim() != 2 or allowed.shape[0] != rows:
        raise ValueError(
            f"sample: allowed must be int32 [{rows}, words], got {allowed.dtype} {list(allowed.shape)}"
        )
    if allowed.shape[1] * 32 < vocab:
        raise ValueError(
            f"sample: allowed has {allowed.shape[1]} words, {vocab} tokens need {(vocab + 31) // 32}"
        )


def filter_mask(probs: Tensor, min_p: float, top_k: int, top_p: float) -> Tensor:
    """Boolean mask [V] of the tokens min-p, then top-k, then top-p keep (the most likely is always kept).

    The filters apply in vLLM's order, each to what the previous kept: min-p keeps tokens with
    probability ≥ min_p · max; top-k the k most likely of those; top-p the most likely tokens whose
    mass, renormalised over what is still kept, reaches top_p. Tokens tied with the last one top-k or
    top-p keeps are kept too (as vLLM does), so the result does not depend on how a sort orders equal
    values.
    """
    sorted_probs, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if min_p > 0.0:
        keep &= sorted_probs >= min_p * sorted_probs[0]
    if 0 < top_k < sorted_probs.numel():
        keep &= sorted_probs >= sorted_probs[top_k - 1]
    if top_p < 1.0:
        kept = torch.where(keep, sorted_probs, 0.0)
        within = (kept.cumsum(-1) - kept < top_p * kept.sum()) & keep  # a prefix of the sorted order
        keep &= sorted_probs >= sorted_probs[max(int(within.sum()) - 1, 0)]
    keep[0] = True
    mask = torch.zeros_like(keep)
    mask[order] = keep
    return mask


def _seeded_uniforms(like: Tensor, seed: int) -> Tensor:
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return torch.rand(like.shape, generator=generator, device=like.device)


def sample_reference(
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
    """`hy3::sample` row by row (the module docstring)."""
    check_allowed(allowed, logits)
    rows = logits.shape[0]
    if allowed is not None:
        logits = logits.float().masked_fill(~unpack_allowed(allowed, logits.shape[1]), float("-inf"))
    columns = zip(temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist(), seeds.tolist())
    tokens, chosen, top_ids, top_logprobs = [], [], [], []
    for row, (t, k, p, m, seed) in enumerate(columns):
        scaled = logits[row].float() if t == 0.0 else logits[row].float() / t
        logprobs = torch.log_softmax(scaled, dim=-1)
        if t == 0.0:
            token = int(scaled.argmax())
        else:
            mask = filter_mask(logprobs.exp(), m, k, p)
            u = noise[row] if noise is not None else _seeded_uniforms(scaled, seed)
            gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
            token = int(torch.where(mask, scaled + gumbel, float("-inf")).argmax())
        tokens.append(token)
        chosen.append(logprobs[token])
        values, ids = logprobs.topk(num_logprobs)
        top_ids.append(ids)
        top_logprobs.append(values)
    if rows == 0:
        return sample_outputs(logits, num_logprobs)
    device = logits.device
    return (
        torch.tensor(tokens, dtype=torch.int64, device=device),
        torch.stack(chosen).float(),
        torch.stack(top_ids).int(),
        torch.stack(top_logprobs).float(),
        torch.ones(rows if num_logprobs else 0, dtype=torch.int32, device=device),
    )


@torch.library.custom_op("hy3::sample", mutates_args=())
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
    """One token per row: (tokens [B] int64, logprobs [B], top_ids [B, n] int32, top_logprobs [B, n],
    top_exact [B] int32, or [0] when n is 0), n = num_logprobs (the module docstring)."""
    return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, noise, num_logprobs, allowed)


def sample_outputs(logits: Tensor, num_logprobs: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Uninitialised outputs of `hy3::sample` for these logits (its fake, and the kernels' buffers)."""
    rows = logits.shape[0]
    return (
        logits.new_empty(rows, dtype=torch.int64),
        logits.new_empty(rows, dtype=torch.float32),
        logits.new_empty((rows, num_logprobs), dtype=torch.int32),
        logits.new_empty((rows, num_logprobs), dtype=torch.float32),
        logits.new_empty(rows if num_logprobs else 0, dtype=torch.int32),
    )


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seeds, noise, num_logprobs, allowed=None):
    return sample_outputs(logits, num_logprobs)
