"""Programmatic dependent launch: when it is used, and that a captured chain of PDL kernels where each
reads the previous one's output gives the same result as launches without PDL (a missing wait would
read stale data)."""

from __future__ import annotations

import os

import pytest
import torch

import hy3c.kernels  # noqa: F401
from hy3c.kernels.pdl import pdl_env, pdl_launch

tri = torch.ops.hy3_triton


def test_pdl_is_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("HY3C_PDL", "0")
    assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_pdl_env_sets_the_switch_and_restores_it_even_after_an_error(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("HY3C_PDL", raising=False)
    else:
        monkeypatch.setenv("HY3C_PDL", before)
    for on in (False, True):
        with pytest.raises(RuntimeError), pdl_env(on):
            assert os.environ["HY3C_PDL"] == ("1" if on else "0")
            raise RuntimeError
        assert os.environ.get("HY3C_PDL") == before


def _chain(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, steps: int) -> torch.Tensor:
    """Dependent Triton launches: add+RMSNorm, FP8 quantization of its output, SwiGLU, and again."""
    for _ in range(steps):
        normed, residual = tri.add_rms_norm(x, residual, weight, 1e-5)
        q, scale = tri.quant_fp8_per_token(normed)
        x = tri.silu_and_mul(torch.cat([q.to(x.dtype) * scale.to(x.dtype)] * 2, dim=-1))
    return residual


@pytest.mark.gpu
def test_a_captured_pdl_chain_matches_launches_without_pdl(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    assert pdl_launch(x.device)["PDL"]
    monkeypatch.setenv("HY3C_PDL", "0")
    expected = _chain(x, residual, weight, 40)
    monkeypatch.delenv("HY3C_PDL")
    assert torch.equal(_chain(x, residual, weight, 40), expected)
    _chain(x, residual, weight, 40)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, residual, weight, 40)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
