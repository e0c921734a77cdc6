"""`hy3c generate`: the serving engine driven offline. Its greedy output is the model's step-by-step
argmax, scheduling does not change it, and its seeded sampled text is the server's for the same seed."""

from __future__ import annotations

import httpx
import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.cli import build_parser, main
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import ServingSpec, load_recipe
from hy3c.serve.engine.core import GenerationRequest
from hy3c.serve.engine.offline import generate
from hy3c.serve.engine.sampler import DEFAULT_TEMPERATURE, SamplingParams
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.server import ServeOptions
from tests.greedy import greedy


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Hy3Tokenizer.from_dir(tiny_ckpt)


def _ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_greedy_generation_equals_step_by_step_recompute(model, tok):
    prompts = [[5, 9, 100, 7], list(range(20, 51))]
    for prompt, out in zip(prompts, greedy(model, tok, prompts, 6)):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(model_logits(model, torch.tensor([seq]))[0, -1].argmax()))
        assert out.token_ids == seq[len(prompt) :] and out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids)


def test_chunked_prefill_page_size_and_batch_limits_do_not_change_greedy_output(model, tok):
    prompts = [list(range(3, 40)), [7], list(range(3, 30))]
    requests = [
        GenerationRequest(str(i), p, SamplingParams(temperature=0.0), 5, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    base = _ids(generate(model, tok, requests))
    # 4 tokens a step over pages of 3: prompts prefilled over many steps, one request at a time
    tight = ServingSpec(page_size=3, max_num_batched_tokens=4, max_num_seqs=1)
    assert _ids(generate(model, tok, requests, tight)) == base
    assert _ids(generate(model, tok, requests, page_size=5)) == base


def test_seeded_sampling_is_reproducible_and_follows_the_seed(model, tok):
    def sampled(seed: int) -> list[int]:
        request = GenerationRequest(
            "s", [1, 2, 3], SamplingParams(temperature=1.0, seed=seed), 20, ignore_eos=True
        )
        return generate(model, tok, [request])[0].token_ids

    assert sampled(11) == sampled(11)
    assert sampled(11) != sampled(12)


def test_stop_token_ends_generation_and_is_not_returned(model, tok):
    first = greedy(model, tok, [[4, 5, 6]], 1)[0].token_ids[0]
    request = GenerationRequest("s", [4, 5, 6], SamplingParams(temperature=0.0), 8, stop_token_ids=[first])
    [out] = generate(model, tok, [request])
    assert out.token_ids == [] and out.finish_reason == "stop" and out.stop_reason == first


def test_generate_refuses_what_the_engine_cannot_run(model, tok):
    params = SamplingParams()
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        generate(model, tok, [GenerationRequest("a", [], params, 2)])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        generate(model, tok, [GenerationRequest("a", [1, 2], params, 0)])
    with pytest.raises(ValueError, match="share a request_id"):
        generate(model, tok, [GenerationRequest("a", [1], params, 2), GenerationRequest("a", [2], params, 2)])


def test_one_default_temperature():
    """The CLI's --temperature default is SamplingParams' (the API's: a body without one samples at it)."""
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"])
    assert args.temperature == SamplingParams().temperature == DEFAULT_TEMPERATURE == 1.0


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    art = compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("generate") / "art", checkpoint=tiny_ckpt
    ).out
    with BackgroundServer(ServeOptions(art, port=free_port(), kv_memory_gib=0.02)) as server:
        yield art, server


def _cli_text(art, capsys, prompt: str, flags: list[str]) -> str:
    capsys.readouterr()
    assert main(["generate", "--artifact", str(art), "--prompt", prompt, "--max-tokens", "16", *flags]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def _server_text(server, prompt: str, body: dict) -> str:
    reply = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 16, **body}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("flags", "body"),
    [
        (["--temperature", "0"], {"temperature": 0}),
        (["--temperature", "0.8", "--seed", "3"], {"temperature": 0.8, "seed": 3}),
        (["--seed", "3"], {"seed": 3}),  # both defaults: the same temperature
        (
            ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05", "--seed", "5"],
            {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 5},
        ),
    ],
)
def test_generate_prints_the_servers_completion(served, capsys, flags, body):
    art, server = served
    for prompt in ("Hello", "The quick brown fox"):
        assert _cli_text(art, capsys, prompt, flags) == _server_text(server, prompt, body)


def test_the_seeded_comparison_compares_samples(served, capsys):
    """The equalities above are of sampled text: other seeds, or greedy, give other text."""
    art, server = served
    seeded = _cli_text(art, capsys, "Hello", ["--temperature", "0.8", "--seed", "3"])
    assert seeded != _cli_text(art, capsys, "Hello", ["--temperature", "0"])
    assert seeded != _server_text(server, "Hello", {"temperature": 0.8, "seed": 4})
