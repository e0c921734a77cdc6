"""Triton silu_and_mul(_quant) and the attention-plan kernel against the torch references
(TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

import hy3c.kernels
import hy3c.ops  # noqa: F401
from hy3c.kernels.attention.plan_kernel import MAX_PLAN_REQUESTS

hy3, tri = torch.ops.hy3, torch.ops.hy3_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 40), (2, 3, 2 * 1100)])
def test_silu_and_mul_matches_the_reference(dtype, shape):
    x = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    out = tri.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)  # 1 bf16 ulp
    torch.testing.assert_close(out, hy3.silu_and_mul(x), **tol)
    strided = torch.cat([x, x], -1)[..., ::2]  # a strided last dim is copied first
    torch.testing.assert_close(tri.silu_and_mul(strided), hy3.silu_and_mul(strided), **tol)


@pytest.mark.parametrize("lengths", [[5], [0, 600, 256, 257, 1], list(range(1, 300, 7))])
def test_attention_plan_kernel_matches_the_reference(lengths):
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    new = [min(n, 1 + (n % 37)) for n in lengths]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    assert torch.equal(tri.attention_plan(seq_lens, qsl, 256, 16), hy3.attention_plan(seq_lens, qsl, 256, 16))


def test_attention_plan_of_too_many_requests_is_refused():
    n = MAX_PLAN_REQUESTS + 1
    with pytest.raises(ValueError, match="exceed"):
        tri.attention_plan(torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 256, 16)


def test_opcheck_activation_kernels():
    torch.library.opcheck(tri.silu_and_mul.default, (torch.randn(3, 64),))
    seq_lens, qsl = torch.tensor([3, 70], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32)
    torch.library.opcheck(tri.attention_plan.default, (seq_lens, qsl, 256, 16))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_quant_matches_the_reference(static, dtype):
    """The FP8 rows of the SwiGLU output for the next GEMM: per-row absmax scales, or a static one."""
    x = (4 * torch.randn(6, 2 * 200, generator=torch.Generator().manual_seed(5))).to(dtype)
    scale = torch.tensor([0.03]) if static else None
    q, q_scale = tri.silu_and_mul_quant(x, scale)
    ref_q, ref_scale = hy3.silu_and_mul_quant(x, scale)
    assert q.dtype == ref_q.dtype and q.shape == (6, 200) and q_scale.shape == (6, 1)
    torch.testing.assert_close(q_scale, ref_scale, atol=0, rtol=8e-3)
    torch.testing.assert_close(q.float() * q_scale, ref_q.float() * ref_scale, atol=0.05, rtol=0.07)
    if dtype == torch.float32:  # no intermediate rounding to differ: the same FP8 codes
        assert torch.equal(q.float(), ref_q.float())
    torch.library.opcheck(tri.silu_and_mul_quant.default, (x, scale))
    with pytest.raises(ValueError, match="exceed"):
        tri.silu_and_mul_quant(torch.randn(1, 2 * 16385), None)
