"""The `cublas` providers (torch vendor GEMMs, CUDA-graph safe) against the hy3 references, on CPU."""

from __future__ import annotations

import pytest
import torch

import hy3c.kernels
import hy3c.ops  # noqa: F401

hy3, cublas = torch.ops.hy3, torch.ops.hy3_cublas


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (37, 8, 2), (16, 4, 4), (5, 16, 1)])
def test_grouped_moe_matches_reference(tokens, experts, top_k):
    x = torch.randn(tokens, 64)
    w13, w2 = 0.1 * torch.randn(experts, 96, 64), 0.1 * torch.randn(experts, 64, 48)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    ids[ids == experts - 1] = 0 if top_k == 1 else ids[ids == experts - 1]  # some experts get no token
    w = torch.rand(tokens, top_k)
    ref = hy3.moe_experts(x, w, ids, w13, w2, None, None, None, None)
    out = cublas.moe_experts(x, w, ids, w13, w2, None, None, None, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_moe_all_tokens_to_one_expert():
    x, w13, w2 = torch.randn(9, 32), torch.randn(4, 64, 32), torch.randn(4, 32, 32)
    ids, w = torch.zeros(9, 1, dtype=torch.int32) + 2, torch.ones(9, 1)
    torch.testing.assert_close(
        cublas.moe_experts(x, w, ids, w13, w2, None, None, None, None),
        hy3.moe_experts(x, w, ids, w13, w2, None, None, None, None),
    )


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "case"),
    [(9, 8, 2, "some -1"), (5, 4, 1, "one slot"), (4, 4, 2, "every id -1"), (12, 4, 4, "one expert left")],
)
def test_grouped_moe_skips_ids_of_no_expert(tokens, experts, top_k, case):
    """Ids of −1 (expert parallelism: experts of other ranks), with nonzero weights: the reference's
    output, which skips them; tokens whose every id is −1 get zeros. The −1 pairs sort past the grouped
    GEMMs' last offset, where torch leaves the rows as allocated (any values): they must not leak."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 64)
    w13, w2 = 0.1 * torch.randn(experts, 96, 64), 0.1 * torch.randn(experts, 64, 48)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[torch.rand(tokens, top_k, generator=gen) < 0.5] = -1
    ids[0] = -1
    if case == "every id -1":
        ids.fill_(-1)
    if case == "one expert left":  # only expert 2 held here: one group, all other rows past its offset
        ids[ids != 2] = -1
    w = torch.rand(tokens, top_k) + 0.5
    ref = hy3.moe_experts(x, w, ids, w13, w2, None, None, None, None)
    out = cublas.moe_experts(x, w, ids, w13, w2, None, None, None, None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0], torch.zeros(64))


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
def test_scaled_mm_matches_reference(per_token, per_channel):
    a, b = torch.randn(8, 64), torch.randn(32, 64)
    sa = a.abs().amax(-1, keepdim=True) / 448 if per_token else a.abs().max().reshape(1) / 448
    sb = b.abs().amax(-1) / 448 if per_channel else b.abs().max().reshape(1) / 448
    qa, qb = hy3.quant_fp8(a, sa), hy3.quant_fp8(b, sb.reshape(-1, 1))
    out = cublas.scaled_mm(qa, qb, sa, sb, torch.bfloat16)
    ref = hy3.scaled_mm(qa, qb, sa, sb, torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_opcheck_cublas_ops():
    x, ids = (
        torch.randn(6, 32),
        torch.tensor([[0, 1], [1, 2], [3, 0], [0, 2], [1, 3], [2, 3]], dtype=torch.int32),
    )
    torch.library.opcheck(
        cublas.moe_experts.default,
        (x, torch.rand(6, 2), ids, torch.randn(4, 16, 32), torch.randn(4, 32, 8), None, None, None, None),
    )
