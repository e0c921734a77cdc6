"""Serving on a CUDA GPU: Triton providers, CUDA-graph decode, the fused sampler at the real vocabulary."""

from __future__ import annotations

import pytest
import torch

from hy3c.serve.engine.sampler import History, SamplingParams, prepare_fused, sample, sample_reference

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
    from hy3c.kernels.sampler.fused_sampler import fused_sample

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


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)]
)
def test_fused_sampler_reads_a_grammar_mask_at_hy3_vocabulary(params):
    """Packed masks of 32 rows at the real vocabulary (a few hundred tokens, about half, all): the kernels' tokens
    and logprobs equal the reference's under the same mask and noise, inside the mask."""
    from hy3c.kernels.sampler.fused_sampler import fused_sample
    from hy3c.ops.sample import unpack_allowed

    rows, vocab = 32, 120832
    logits = torch.randn(rows, vocab, device="cuda") * 4
    noise = torch.rand(rows, vocab, device="cuda")
    words = torch.randint(-(2**31), 2**31 - 1, (rows, vocab // 32), dtype=torch.int32, device="cuda")
    words[: rows // 3] &= torch.randint(-(2**31), 2**31 - 1, words[: rows // 3].shape, device="cuda").int()
    words[: rows // 3, 100:] = 0  # a few hundred tokens at the vocabulary's start
    words[-4:] = -1  # every token
    allowed = unpack_allowed(words, vocab)
    columns = [torch.full((rows,), v, device="cuda") for v in (params.temperature, 0, params.top_p, 0.0, 0)]
    for at in (1, 4):
        columns[at] = columns[at].int()
    tokens, logprobs = fused_sample(logits, *columns, noise, allowed=words)
    ref_tokens, ref_logprobs, *_ = torch.ops.hy3.sample(logits, *columns, noise, 0, words)
    assert torch.equal(tokens, ref_tokens) and allowed[torch.arange(rows, device="cuda"), tokens].all()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-3, rtol=1e-4)


def test_fused_dispatch_with_logit_bias_tiny_temperatures_and_extreme_penalties():
    """What the engine calls on CUDA (`sample` with columns prepared before the step) equals the
    reference for logit_bias, temperatures below SAMPLING_EPS (greedy) and a 1e-300 repetition penalty,
    with finite logprobs."""
    rows, vocab = 6, 120832
    logits = torch.randn(rows, vocab, device="cuda") * 4
    noise = torch.rand(rows, vocab, device="cuda")
    params = [
        SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
        SamplingParams(temperature=0.9, logit_bias=((11, 100.0), (12, -100.0))),
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-300, top_k=5),
        SamplingParams(temperature=0.7, repetition_penalty=1e-300),
        SamplingParams(temperature=0.0, repetition_penalty=1e-300),
    ]
    # one seen token for the penalty rows: several at 1e30 would tie, and ties may break either way
    history = [History([1, 2, 3], [4, 5])] * 4 + [History([9], [])] * 2
    generators = [None] * rows
    prepared = prepare_fused(params, generators, torch.device("cuda"))
    assert prepared is not None  # the fused kernel decides on CUDA
    fused = sample(logits, params, history, generators, 3, noise=noise, prepared=prepared)
    ref = sample_reference(logits, params, history, generators, 3, noise=noise)
    assert fused.tokens == ref.tokens
    assert fused.tokens[0] == 7 and fused.tokens[1] == 11
    assert fused.tokens[2] == int(logits[2].argmax()) and fused.tokens[3] == int(logits[3].argmax())
    values = torch.tensor(fused.logprobs + [lp for row in fused.top for _, lp in row])
    assert torch.isfinite(values).all()
    torch.testing.assert_close(torch.tensor(fused.logprobs), torch.tensor(ref.logprobs), atol=1e-3, rtol=1e-4)


def test_served_artifact_on_gpu(tiny_ckpt, tmp_path):
    import httpx

    from hy3c.compiler.driver import compile_artifact
    from hy3c.recipe import load_recipe
    from hy3c.serve.http.demo import BackgroundServer, free_port
    from hy3c.serve.http.server import ServeOptions

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
        tiny = httpx.post(
            f"{server.base_url}/v1/completions", json={**body, "temperature": 1e-40}, timeout=60
        ).json()
        assert tiny["choices"][0]["text"] == first["choices"][0]["text"]  # below SAMPLING_EPS: greedy
        # prompt scoring (lm-eval's loglikelihood shape) on the GPU against the eager fp32 model
        ids = server.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")
        scored = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0},
            timeout=60,
        ).json()
        served = scored["choices"][0]["logprobs"]["token_logprobs"]
        assert served[0] is None and len(served) == len(ids)
        import hy3c

        ref = torch.log_softmax(hy3c.reference_logits(tiny_ckpt, torch.tensor([ids]))[0], dim=-1)
        expected = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        torch.testing.assert_close(torch.tensor(served[1:]), torch.tensor(expected), atol=0.1, rtol=0.05)
        biased = httpx.post(
            f"{server.base_url}/v1/completions",
            json={**body, "max_tokens": 4, "logit_bias": {"42": 100}, "ignore_eos": True},
            timeout=60,
        ).json()
        assert biased["choices"][0]["text"] == server.engine.tokenizer.decode([42] * 4)
