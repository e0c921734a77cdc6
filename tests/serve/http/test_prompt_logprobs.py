"""Prompt logprobs (echo + logprobs, vLLM's prompt_logprobs, max_tokens 0) against the eager model's
logits (`hy3c.reference_logits`), on a server whose token budget (16) splits the prompts over several
steps (chunked prefill)."""

from __future__ import annotations

import httpx
import pytest
import torch

import hy3c
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.server import ServeOptions

openai = pytest.importorskip("openai", reason="the official openai client drives these tests")

BUDGET = 16  # max_num_batched_tokens: every prompt below is longer, so it is scored over several steps
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Once upon a time there was a little model that wanted to answer every question quickly.",
]


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, tmp_path_factory):
    return compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("prompt-lp") / "art", checkpoint=tiny_ckpt
    ).out


@pytest.fixture(scope="module")
def server(artifact):
    options = ServeOptions(
        artifact, port=free_port(), kv_memory_gib=0.02, max_num_seqs=16, max_num_batched_tokens=BUDGET
    )
    with BackgroundServer(options) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Hy3Tokenizer.from_dir(tiny_ckpt)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """log_softmax of the eager fp32 model's logits over a prompt: [T, vocab]."""

    def run(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(hy3c.reference_logits(tiny_ckpt, torch.tensor([ids]))[0], dim=-1)

    return run


def _scores(logprobs: torch.Tensor, ids: list[int]) -> list[float]:
    """Each prompt token's logprob under the position before it (token 0 has none)."""
    return [float(logprobs[p, ids[p + 1]]) for p in range(len(ids) - 1)]


def test_lm_eval_loglikelihood_request_scores_every_prompt_token(client, tok, reference):
    """lm-evaluation-harness's loglikelihood request: a batch of token-id prompts, echo, max_tokens 0,
    logprobs 1. Each choice echoes its prompt with a null first logprob, then the eager model's
    logprob of every token; the top-1 entry is the model's argmax (lm-eval's is_greedy)."""
    prompts = [tok.encode(text) for text in TEXTS]
    assert all(len(ids) > 2 * BUDGET for ids in prompts)
    out = client.completions.create(
        model="art", prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0, seed=1234
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice, ids, text in zip(out.choices, prompts, TEXTS):
        lp = choice.logprobs
        ref = reference(ids)
        assert choice.text == text and choice.finish_reason == "length"
        assert lp.tokens == [tok.token_text(t) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        torch.testing.assert_close(
            torch.tensor(lp.token_logprobs[1:]), torch.tensor(_scores(ref, ids)), atol=1e-4, rtol=0
        )
        assert sum(lp.token_logprobs[1:]) == pytest.approx(sum(_scores(ref, ids)), abs=1e-3)
        for p, top in enumerate(lp.top_logprobs[1:]):
            assert list(top) == [tok.token_text(int(ref[p].argmax()))]
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == sum(map(len, prompts))


def test_prompt_logprobs_in_vllms_shape_with_n_and_generation(server, tok, reference):
    """prompt_logprobs=3 with n=2: every choice carries the prompt's list — null, then per position the
    prompt token's {logprob, rank, decoded_token} and the top 3 (ranks 1-3) — raw logits, whatever the
    sampling parameters; the generated text is unaffected."""
    ids = tok.encode(TEXTS[0])
    body = {
        "prompt": TEXTS[0],
        "max_tokens": 3,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "repetition_penalty": 1.5,
        "logit_bias": {str(ids[5]): 50},
        "prompt_logprobs": 3,
    }
    out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    ref = reference(ids)
    assert len(out["choices"]) == 2
    for choice in out["choices"]:
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for p, entry in enumerate(scored[1:]):
            token = ids[p + 1]
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(float(ref[p, token]), abs=1e-4)
            assert mine["rank"] == int((ref[p] >= ref[p, token]).sum())
            assert mine["decoded_token"] == tok.token_text(token)
            values, top_ids = ref[p].topk(3)
            for rank, (t, v) in enumerate(zip(top_ids.tolist(), values.tolist()), 1):
                if t != token:
                    assert entry[str(t)] == {
                        "logprob": pytest.approx(v, abs=1e-4),
                        "rank": rank,
                        "decoded_token": tok.token_text(t),
                    }
            assert len(entry) in (3, 4)


def test_scoring_takes_nothing_from_the_prefix_cache_and_streams_with_echo(server, tok, reference):
    """A scored prompt is computed whole even when its pages are cached (their logits are needed), and
    gives the same scores again; a plain request after it reuses its pages. Streamed with echo, the first
    chunk carries the prompt and its logprobs."""
    ids = tok.encode(TEXTS[1])
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    again = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert all(
        len(entry) == 1 for entry in first["choices"][0]["prompt_logprobs"][1:]
    )  # k = 0: the token only
    plain = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": ids, "max_tokens": 2}, timeout=120
    )
    assert plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16

    stream = {
        "prompt": TEXTS[1],
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=stream, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    opening = chunks[0]["choices"][0]
    assert opening["text"].startswith(TEXTS[1])
    lp = opening["logprobs"]
    assert lp["tokens"][: len(ids)] == [tok.token_text(t) for t in ids] and lp["token_logprobs"][0] is None
    assert sum(lp["token_logprobs"][1 : len(ids)]) == pytest.approx(
        sum(_scores(reference(ids), ids)), abs=1e-3
    )
    assert lp["text_offset"][0] == 0


def test_prompt_rows_per_step_are_bounded_and_a_preempted_scoring_resumes(
    artifact, tiny_ckpt, reference, monkeypatch
):
    """At most PROMPT_LOGITS_ROWS scored rows per step (a long prompt takes several), and a request
    preempted half-way through scoring recomputes its KV but scores each position once."""
    import hy3c.serve.engine.scheduler as scheduler_mod
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.sampler import SamplingParams
    from hy3c.serve.http.server import build_engine

    monkeypatch.setattr(scheduler_mod, "PROMPT_LOGITS_ROWS", 7)
    engine = build_engine(ServeOptions(artifact, kv_memory_gib=0.02, compile=False))[0]
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    ids = tok.encode(TEXTS[0])
    rows: list[int] = []
    run = engine.runner.step
    engine.runner.step = lambda batch, kv: rows.append(int(batch.logits_indices.numel())) or run(batch, kv)
    outs = []
    request = GenerationRequest("a", ids, SamplingParams(temperature=0.0), max_tokens=2, prompt_logprobs=1)
    engine._admit(request, outs.append)
    engine._iterate()
    engine._iterate()
    seq = engine.scheduler.running[0]
    assert seq.computed == 14 and seq.score_prompt
    engine.scheduler._preempt(seq)  # what running out of pages does: KV freed, recomputed from 0
    while engine._iterate():
        pass
    assert max(rows) <= 7 and len(rows) > len(ids) // 7
    scored = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
    assert [t for t, _, _, _ in scored] == ids[1:]
    torch.testing.assert_close(
        torch.tensor([lp for _, lp, _, _ in scored]),
        torch.tensor(_scores(reference(ids), ids)),
        atol=1e-4,
        rtol=0,
    )
    assert sum(o.prompt_logprobs is not None for o in outs) == 1 and outs[-1].finished
    assert engine.pool.num_free == engine.pool.usable
