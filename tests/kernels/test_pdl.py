"""Programmatic dependent launch: when it is used, the overrides of what a program chose, and that a
captured chain of PDL kernels where each reads the previous one's output gives the same result as
launches without PDL (a missing wait would read stale data)."""

from __future__ import annotations

import os

import pytest
import torch

import hy3c.kernels  # noqa: F401
from hy3c.kernels import overrides
from hy3c.kernels.pdl import pdl_launch

tri = torch.ops.hy3_triton


def test_pdl_is_off_on_the_cpu_and_when_the_program_or_an_override_says_so(monkeypatch):
    monkeypatch.delenv(overrides.PDL, raising=False)
    cpu = torch.device("cpu")
    for pdl in (False, True):
        assert pdl_launch(cpu, pdl) == {"PDL": False, "launch_pdl": False}
    assert overrides.variant(overrides.PDL, True) and not overrides.variant(overrides.PDL, False)
    monkeypatch.setenv(overrides.PDL, "0")
    assert not overrides.variant(overrides.PDL, True) and overrides.active() == {overrides.PDL: False}
    monkeypatch.setenv(overrides.PDL, "1")
    assert overrides.variant(overrides.PDL, False) and overrides.active() == {overrides.PDL: True}
    monkeypatch.setenv(overrides.PDL, "yes")
    with pytest.raises(ValueError, match="HY3C_PDL='yes': set it to 0"):
        overrides.variant(overrides.PDL, True)


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_forced_sets_the_override_and_restores_it_even_after_an_error(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(overrides.PDL, raising=False)
    else:
        monkeypatch.setenv(overrides.PDL, before)
    for on in (False, True):
        with pytest.raises(RuntimeError), overrides.forced(overrides.PDL, on):
            assert os.environ[overrides.PDL] == ("1" if on else "0")
            raise RuntimeError
        assert os.environ.get(overrides.PDL) == before


def _chain(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, steps: int, pdl: bool
) -> torch.Tensor:
    """Dependent Triton launches: add+RMSNorm, FP8 quantization of its output, SwiGLU, and again."""
    for _ in range(steps):
        normed, residual = tri.add_rms_norm(x, residual, weight, 1e-5, pdl=pdl)
        q, scale = tri.quant_fp8_per_token(normed, pdl=pdl)
        x = tri.silu_and_mul(torch.cat([q.to(x.dtype) * scale.to(x.dtype)] * 2, dim=-1), pdl=pdl)
    return residual


@pytest.mark.gpu
def test_a_captured_pdl_chain_matches_launches_without_pdl(monkeypatch):
    monkeypatch.delenv(overrides.PDL, raising=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    residual = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    assert pdl_launch(x.device, True)["PDL"] and not pdl_launch(x.device, False)["PDL"]
    expected = _chain(x, residual, weight, 40, pdl=False)
    assert torch.equal(_chain(x, residual, weight, 40, pdl=True), expected)
    _chain(x, residual, weight, 40, pdl=True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, residual, weight, 40, pdl=True)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
