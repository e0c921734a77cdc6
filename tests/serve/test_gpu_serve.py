"""Serving on a CUDA GPU: Triton providers, CUDA-graph decode, the fused sampler at the real vocabulary."""

from __future__ import annotations

import pytest
import torch

from hy3c.serve.sampler import History, SamplingParams, sample_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01),  # decided by the candidates
        SamplingParams(temperature=1.0, top_p=0.95),  # flat logits: the fallback kernel decides
        SamplingParams(temperature=0.9),  # no filter: drawn by the chunk kernel
        SamplingParams(temperature=0.0),
    ],
)
def test_fused_sampler_at_hy3_vocabulary_equals_reference(params):
    from hy3c.kernels.sampler import fused_sample

    rows, vocab = 8, 120832
    logits = torch.randn(rows, vocab, device="cuda") * 4
    noise = torch.rand(rows, vocab, device="cuda")
    ref = sample_reference(logits, [params] * rows, [History([], [])] * rows, [None] * rows, noise=noise)

    def col(value, dtype=torch.float32):
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    columns = (col(params.temperature), col(params.top_k, torch.int32), col(params.top_p), col(params.min_p))
    tokens, logprobs = fused_sample(logits, *columns, col(0, torch.int32), noise)
    assert tokens.tolist() == ref.tokens
    torch.testing.assert_close(logprobs.cpu(), torch.tensor(ref.logprobs), atol=1e-3, rtol=1e-4)


def test_served_artifact_on_gpu(tiny_ckpt, tmp_path):
    import httpx

    from hy3c.compiler.driver import compile_artifact
    from hy3c.recipe import load_recipe
    from hy3c.serve.demo import BackgroundServer, free_port
    from hy3c.serve.server import ServeOptions

    art = compile_artifact(load_recipe("h200-bf16"), tmp_path / "art", checkpoint=tiny_ckpt).out
    options = ServeOptions(art, port=free_port(), kv_memory_gib=0.05, max_num_seqs=8, compile=False)
    with BackgroundServer(options) as server:
        assert server.engine.runner.decode_graphs is not None  # decode steps replay CUDA graphs
        body = {"prompt": "hello there", "max_tokens": 12, "temperature": 0}
        first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        second = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert second["usage"]["completion_tokens"] == 12
        sampled = httpx.post(
            f"{server.base_url}/v1/completions",
            json={**body, "temperature": 0.9, "seed": 3, "n": 2},
            timeout=60,
        )
        assert sampled.status_code == 200 and len(sampled.json()["choices"]) == 2
