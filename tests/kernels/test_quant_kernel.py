"""Triton FP8 activation quantization against the torch reference (bit-exact), under TRITON_INTERPRET=1."""

import pytest
import torch

import hy3c.kernels
import hy3c.ops  # noqa: F401

hy3, tri = torch.ops.hy3, torch.ops.hy3_triton


@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (7, 100), (33, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_quant_is_bit_exact(rows, cols, dtype):
    x = (torch.randn(rows, cols) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    x[0, :3] = torch.tensor([1000.0, -0.0, 1e-30]).to(dtype)
    q, s = tri.quant_fp8_per_token(x)
    rq, rs = hy3.quant_fp8_per_token(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_static_quant_saturates_like_reference():
    x = torch.randn(9, 80) * 50
    scale = torch.tensor([0.05])
    assert torch.equal(tri.quant_fp8(x, scale).view(torch.uint8), hy3.quant_fp8(x, scale).view(torch.uint8))


def test_opcheck_quant_kernels():
    torch.library.opcheck(tri.quant_fp8_per_token.default, (torch.randn(5, 64),))
