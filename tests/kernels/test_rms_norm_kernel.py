"""Triton RMSNorm / residual add + RMSNorm against the torch references (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

import hy3c.kernels
import hy3c.ops  # noqa: F401
from hy3c.kernels.registry import providers_for

hy3, tri = torch.ops.hy3, torch.ops.hy3_triton


def _inputs(shape, dtype, strided=False):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape[:-1], 2 * shape[-1] if strided else shape[-1], generator=gen)).to(dtype)
    x = x[..., ::2] if strided else x  # a last dim with stride 2: the kernel needs a copy
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "strided"), [((1, 4096), False), ((7, 40), False), ((2, 3, 64), True)])
def test_add_rms_norm_and_rms_norm_match_the_references(dtype, shape, strided):
    x, residual, weight = _inputs(shape, dtype, strided)
    out, total = tri.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_total = hy3.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)  # the residual stream is bit-exact
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=8e-3)  # 1 bf16 ulp
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(tri.rms_norm(x, weight, 1e-5), hy3.rms_norm(x, weight, 1e-5), **tol)
    assert out.shape == x.shape and out.dtype == dtype


def test_rms_norm_of_no_rows_and_a_row_too_long():
    empty = torch.empty(0, 32)
    assert tri.rms_norm(empty, torch.ones(32), 1e-5).shape == (0, 32)
    with pytest.raises(ValueError, match="exceed"):
        tri.rms_norm(torch.randn(1, 16385), torch.ones(16385), 1e-5)


def test_opcheck_rms_norm_kernels():
    x, residual, weight = _inputs((5, 64), torch.float32)
    torch.library.opcheck(tri.rms_norm.default, (x, weight, 1e-5))
    torch.library.opcheck(tri.add_rms_norm.default, (x, residual, weight, 1e-5))


def test_providers_registered_for_cuda_with_their_limits():
    for op in ("rms_norm", "add_rms_norm"):
        triton_provider = next(p for p in providers_for(op) if p.name == "triton")
        assert triton_provider.devices == frozenset({"cuda"}) and triton_provider.cuda_graph_safe
    add = next(p for p in providers_for("add_rms_norm") if p.name == "triton")
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(n) for n in ("x", "residual", "weight")]
    nodes[0].meta["val"] = torch.empty(4, 64, dtype=torch.bfloat16)
    nodes[1].meta["val"] = torch.empty(4, 64, dtype=torch.float32)
    node = graph.call_function(hy3.add_rms_norm.default, (*nodes, 1e-5))
    assert "differ" in add.supports(node)
    nodes[1].meta["val"] = torch.empty(4, 64, dtype=torch.bfloat16)
    assert add.supports(node) is None
    nodes[0].meta["val"] = nodes[1].meta["val"] = torch.empty(4, 16385, dtype=torch.bfloat16)
    assert "longer" in add.supports(node)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_quant_matches_the_reference(static, dtype):
    """Norm, residual and the FP8 rows the next GEMM reads, in one pass: per-row or static scales."""
    x, residual, weight = _inputs((6, 96), dtype)
    scale = torch.tensor([0.02]) if static else None
    out, total, q, q_scale = tri.add_rms_norm_quant(x, residual, weight, 1e-5, scale)
    ref_out, ref_total, ref_q, ref_scale = hy3.add_rms_norm_quant(x, residual, weight, 1e-5, scale)
    assert torch.equal(total, ref_total) and q.dtype == ref_q.dtype and q_scale.shape == (6, 1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=8e-3)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(q_scale, ref_scale, atol=0, rtol=8e-3)
    # the FP8 rows are those of the kernel's own normed output (exact), and within an e4m3 step of the reference
    own_q = (out.float() / q_scale).clamp(-448, 448).to(q.dtype)
    assert torch.equal(q.float(), own_q.float())
    torch.testing.assert_close(q.float() * q_scale, ref_q.float() * ref_scale, atol=0.1, rtol=0.07)
    torch.library.opcheck(tri.add_rms_norm_quant.default, (x, residual, weight, 1e-5, scale))


def test_fakes_match_the_kernels_for_strided_input_and_quant_needs_rows():
    """The kernels write contiguous outputs whatever x's layout (so must the fakes), and the quantized
    form takes [T, H] activations only (its scales are per row)."""
    x = torch.randn(64, 5).t()  # [5, 64] with a strided last dim
    weight = torch.ones(64)
    torch.library.opcheck(tri.rms_norm.default, (x, weight, 1e-5))
    torch.library.opcheck(tri.add_rms_norm.default, (x, torch.randn(5, 64), weight, 1e-5))
    for op in (tri.add_rms_norm_quant, hy3.add_rms_norm_quant):
        with pytest.raises(ValueError, match=r"\[T, H\]"):
            op(torch.randn(2, 3, 64), torch.randn(2, 3, 64), weight, 1e-5, None)
    for op in (tri.silu_and_mul_quant, hy3.silu_and_mul_quant):
        with pytest.raises(ValueError, match=r"\[T, 2I\]"):
            op(torch.randn(2, 3, 64), None)
