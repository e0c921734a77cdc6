"""The OpenAI API over a real uvicorn server on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.server import ServeOptions
from tests.greedy import greedy

# the test command installs the client; the GPU machine (which runs `-m gpu tests/`) has none
openai = pytest.importorskip("openai", reason="the official openai client drives these tests")


@pytest.fixture(scope="module")
def artifact(tiny_ckpt, tmp_path_factory):
    return compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("serve") / "art", checkpoint=tiny_ckpt
    ).out


@pytest.fixture(scope="module")
def server(artifact):
    with BackgroundServer(
        ServeOptions(artifact, port=free_port(), kv_memory_gib=0.02, max_num_seqs=32)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    """Greedy continuation by the eager model, as `hy3c generate` computes it."""
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)

    def run(prompt: str, max_tokens: int, chat: bool = False) -> str:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        return greedy(model, tok, [tok.encode(text)], max_tokens, ignore_eos=False)[0].text

    return run


def _wait_until_idle(server, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running, waiting = server.engine.num_requests()
        if running == 0 and waiting == 0 and server.engine.pool.num_free == server.engine.pool.usable:
            return True
        time.sleep(0.02)
    return False


def test_completion_and_chat_equal_hy3c_generate(client, expected):
    out = client.completions.create(model="art", prompt="Hello world", max_tokens=12, temperature=0)
    assert out.choices[0].text == expected("Hello world", 12)
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens <= 12
    chat = client.chat.completions.create(
        model="art", messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0
    )
    assert chat.choices[0].message.content == expected("Hi", 10, chat=True)
    assert chat.choices[0].message.role == "assistant"


def test_streaming_with_usage_and_done(client, server, expected):
    chunks = list(
        client.chat.completions.create(
            model="art",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected("Hi", 10, chat=True)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True}
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_n_seed_stop_and_logprobs(client, expected):
    out = client.completions.create(
        model="art", prompt="The quick", max_tokens=8, temperature=0.9, seed=7, n=3
    )
    again = client.completions.create(
        model="art", prompt="The quick", max_tokens=8, temperature=0.9, seed=7, n=3
    )
    assert [c.text for c in out.choices] == [c.text for c in again.choices] and len(out.choices) == 3
    full = expected("The quick", 12)
    stop = full[3:6]
    cut = client.completions.create(
        model="art", prompt="The quick", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    lp = client.completions.create(model="art", prompt="The quick", max_tokens=4, temperature=0, logprobs=3)
    assert (
        len(lp.choices[0].logprobs.token_logprobs) == 4 and len(lp.choices[0].logprobs.top_logprobs[0]) == 3
    )
    chat = client.chat.completions.create(
        model="art",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and content[0].logprob <= 0 and len(content[0].top_logprobs) == 2


def test_prefix_cache_reports_cached_tokens(client):
    prompt = "repeat this long prompt so that it spans several pages of the kv cache " * 2
    client.completions.create(model="art", prompt=prompt, max_tokens=2, temperature=0)
    out = client.completions.create(model="art", prompt=prompt, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16


def test_200_concurrent_streams(server, expected):
    prompts = [f"request number {i}" for i in range(200)]

    async def one(client, prompt):
        stream = await client.completions.create(
            model="art", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    for prompt, text in list(zip(prompts, results))[::25]:
        assert text == expected(prompt, 6)
    assert _wait_until_idle(server)


def test_tiny_page_pool_preempts_and_outputs_stay_identical(artifact, expected):
    options = ServeOptions(artifact, port=free_port(), kv_memory_gib=None, max_num_seqs=8, page_size=4)
    with BackgroundServer(options) as srv:
        engine = srv.engine
    # a pool of 12 pages (4 tokens each) for 8 requests of ~24 tokens: preemption is unavoidable
    from hy3c.serve.engine.core import Engine, EngineConfig

    small = Engine(
        engine.runner,
        engine.tokenizer,
        EngineConfig(num_pages=13, page_size=4, max_num_seqs=8, max_model_len=48),
    )
    small.start()
    try:
        from hy3c.serve.engine.core import GenerationRequest
        from hy3c.serve.engine.sampler import SamplingParams

        prompts = [f"prompt {i} with a few words" for i in range(8)]
        results: dict[str, list[int]] = {}
        done = []

        def emit(out):
            results.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                done.append(out)

        for i, p in enumerate(prompts):
            small.submit(
                GenerationRequest(str(i), engine.tokenizer.encode(p), SamplingParams(temperature=0.0), 16),
                emit,
            )
        deadline = time.monotonic() + 60
        while len(done) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(done) == 8 and all(d.finish_reason in ("length", "stop") for d in done)
        assert small.scheduler.num_preemptions > 0
        for i, p in enumerate(prompts):
            assert engine.tokenizer.decode(results[str(i)]) == expected(p, 16)
        assert small.pool.num_free == small.pool.usable
    finally:
        small.stop()


def test_disconnect_aborts_and_frees_pages(server):
    aborted = server.engine.metrics.sample("hy3c:request_aborted_total")
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json={"prompt": "a long generation", "max_tokens": 3000, "stream": True, "temperature": 0},
        ) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    start = time.monotonic()
    assert _wait_until_idle(server, timeout=1.0), "pages were not freed within 1 s of the disconnect"
    assert server.engine.metrics.sample("hy3c:request_aborted_total") == aborted + 1
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[]", 400, "must be a JSON object"),
        (b"", 400, "must be a JSON object"),
        (json.dumps({"prompt": "x", "temperature": 7}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 10**6}).encode(), 400, "maximum context length"),
        (json.dumps({"prompt": "x", "model": "gpt-9"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": [10**7]}).encode(), 400, "vocabulary"),
        (json.dumps({"prompt": ""}).encode(), 400, "empty"),
        (json.dumps({"prompt": "x" * (2 << 20)}).encode(), 413, "exceeds"),
        (json.dumps({"prompt": "x", "seed": 2**64}).encode(), 400, "seed"),
        (json.dumps({"prompt": [5] * 100_000}).encode(), 400, "maximum context length"),
        (json.dumps({"prompt": "x", "stop": ["s" * 1000]}).encode(), 400, "stop"),
        (json.dumps({"prompt": "\ud800"}).encode(), 400, "cannot be tokenized"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, message):
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # still serving


def test_errors_outside_the_request_schema_are_openai_json(server):
    def chunked():  # no Content-Length: the limit is enforced on the streamed bytes
        for _ in range(3):
            yield b"x" * (1 << 20)

    too_big = httpx.post(f"{server.base_url}/v1/completions", content=chunked(), timeout=30)
    assert too_big.status_code == 413 and "exceeds" in too_big.json()["error"]["message"]
    missing = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["message"]
    wrong_method = httpx.get(f"{server.base_url}/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
    effort = httpx.post(
        f"{server.base_url}/tokenize",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"reasoning_effort": "max"},
        },
        timeout=30,
    )
    assert effort.status_code == 400 and "reasoning_effort must be" in effort.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_developer_role_is_the_system_prompt(server):
    def tokens(role):
        body = {"messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]}
        return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=30).json()["tokens"]

    assert tokens("developer") == tokens("system")


def test_logprobs_follow_the_openai_format(client):
    out = client.completions.create(
        model="art", prompt="The quick", max_tokens=6, temperature=0, logprobs=2, echo=True
    )
    lp = out.choices[0].logprobs
    prompt_tokens = out.usage.prompt_tokens
    assert len(lp.tokens) == prompt_tokens + 6  # with echo: the prompt's tokens, then the generated ones
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first has no context
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == out.choices[0].text or any(t.startswith("bytes:") for t in lp.tokens)
    assert "".join(lp.tokens[:prompt_tokens]) == "The quick"
    assert lp.text_offset[0] == 0 and lp.text_offset[prompt_tokens] == len("The quick")
    assert lp.text_offset == sorted(lp.text_offset) and len(set(lp.text_offset)) == len(lp.tokens)
    chat = client.chat.completions.create(
        model="art", messages=[{"role": "user", "content": "x"}], max_tokens=5, temperature=0, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert bytes(b for item in content for b in item.bytes).decode(errors="replace") == (
        chat.choices[0].message.content
    )


def test_a_request_the_engine_cannot_take_fails_alone(server, monkeypatch):
    """A failure while admitting one request answers that request; the engine keeps serving."""
    engine = server.engine
    original, seen = engine._admit, []

    def admit(request, emit):
        seen.append(request.params.top_k)
        if request.prompt_ids == engine.tokenizer.encode("reject me"):
            raise ValueError("injected admission failure")
        return original(request, emit)

    monkeypatch.setattr(engine, "_admit", admit)
    bad = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": "reject me", "max_tokens": 2, "temperature": 0.5, "top_k": 2**40},
        timeout=30,
    )
    assert bad.status_code == 500 and "injected admission failure" in bad.json()["error"]["message"]
    assert seen[-1] <= engine.runner.config.vocab_size  # an oversized top_k is clamped to the vocabulary
    assert engine.alive and httpx.get(f"{server.base_url}/health").status_code == 200
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_non_streaming_disconnect_aborts_while_tokens_flow(server):
    aborted = server.engine.metrics.sample("hy3c:request_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "a long generation", "max_tokens": 3000, "temperature": 0, "ignore_eos": True},
            timeout=1.0,
        )
    assert _wait_until_idle(server, timeout=2.0), "the abandoned request kept generating"
    assert server.engine.metrics.sample("hy3c:request_aborted_total") == aborted + 1


def test_models_health_metrics_tokenize(server):
    models = httpx.get(f"{server.base_url}/v1/models").json()
    assert models["data"][0]["id"] == "art" and models["data"][0]["max_model_len"] > 0
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "hy3c:time_to_first_token_seconds_bucket",
        "hy3c:kv_cache_usage_perc",
        "hy3c:request_success_total",
        "hy3c:num_preemptions_total",
        "hy3c:generation_tokens_total",
        "hy3c:engine_host_seconds_sum",
        "hy3c:kernel_builds_total",
    ):
        assert name in metrics
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello"}).json()
    assert (
        httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        == "Hello"
    )


def test_api_key_and_loopback_default(artifact):
    options = ServeOptions(artifact, port=free_port(), api_key="sekret", kv_memory_gib=0.01)
    assert options.host == "127.0.0.1"
    with BackgroundServer(options) as srv:
        denied = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(
            f"{srv.base_url}/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Authorization": "Bearer sekret"},
        )
        assert ok.status_code == 200
        assert httpx.get(f"{srv.base_url}/health").status_code == 200
        assert httpx.get(f"{srv.base_url}/openapi.json").status_code == 401
        bound = {sock.getsockname()[0] for server in srv.server.servers for sock in server.sockets}
        assert bound == {"127.0.0.1"}  # loopback only by default


def test_engine_error_fails_the_request_not_the_server(server):
    runner = server.engine.runner
    original = runner.step

    def broken(batch, kv):
        raise RuntimeError("injected kernel failure")

    runner.step = broken
    try:
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "boom", "max_tokens": 2}, timeout=30
        )
        assert (
            response.status_code == 500 and "injected kernel failure" in response.json()["error"]["message"]
        )
    finally:
        runner.step = original
    assert (
        httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30
        ).status_code
        == 200
    )
    assert _wait_until_idle(server)


def test_overloaded_and_dead_engine_answer_503(artifact):
    options = ServeOptions(artifact, port=free_port(), kv_memory_gib=0.01, max_waiting=0)
    with BackgroundServer(options) as srv:
        busy = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert busy.status_code == 503 and "overloaded" in busy.json()["error"]["message"]
        srv.engine.stop()
        assert httpx.get(f"{srv.base_url}/health").status_code == 503
        down = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert down.status_code == 503 and "engine is not running" in down.json()["error"]["message"]


def test_warm_up_prefills_each_token_count_class_then_samples_every_path(artifact, monkeypatch):
    from hy3c.serve.engine import core
    from hy3c.serve.engine.core import WARM_UP_TOKENS
    from hy3c.serve.http.server import build_engine

    options = ServeOptions(artifact, kv_memory_gib=0.02, max_num_batched_tokens=512, compile=False)
    engine, _tokenizer, _server = build_engine(options)
    steps = []
    run = engine.runner.step
    engine.runner.step = lambda batch, kv: steps.append(int(batch.input_ids.numel())) or run(batch, kv)
    masked = []
    fill = core.fill_masks
    monkeypatch.setattr(
        core,
        "fill_masks",
        lambda cs, masks, rows, *rest: masked.append(len(rows)) or fill(cs, masks, rows, *rest),
    )
    engine.warm_up()
    prefills = sorted({min(n, 512) for n in WARM_UP_TOKENS} | {511})
    assert steps[: 2 * len(prefills)] == [n for size in prefills for n in (size, 1)]  # prefill, then decode
    assert 4 * 64 in steps  # the sampler step: four requests, one per path
    assert steps[-2] == 2 * 64 and masked == [2, 2]  # then a greedy and a sampled one under a grammar
    assert not engine.scheduler.has_work
    assert engine.pool.num_free == engine.pool.usable and not engine.pool.page_of  # no pages, no cache
    fresh = build_engine(options)[0]
    assert engine.metrics.render("m") == fresh.metrics.render("m")


def test_a_steps_outputs_reach_a_shared_sink_in_one_call(artifact):
    """Emits that share a `batch_sink` get each step's outputs in one call (the HTTP server's loop is
    woken once per step); a plain callable is still called per output."""
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.sampler import SamplingParams
    from hy3c.serve.http.server import build_engine

    engine = build_engine(ServeOptions(artifact, kv_memory_gib=0.02, compile=False))[0]
    calls: list[list[str]] = []
    plain: list[str] = []

    class Shared:
        def __call__(self, items):
            calls.append([out.request_id for _, out in items])

    sink = Shared()

    class Emit:
        batch_sink = sink

        def __call__(self, out):
            raise AssertionError("a batched emit is not called one output at a time")

    params = SamplingParams(temperature=0.0)
    for name in ("a", "b", "c"):
        engine._admit(GenerationRequest(name, [5, 6, 7], params, max_tokens=3), Emit())
    engine._admit(
        GenerationRequest("d", [5, 6, 7], params, max_tokens=3), lambda out: plain.append(out.request_id)
    )
    while engine._iterate():
        pass
    assert calls and all(sorted(step) == ["a", "b", "c"] for step in calls)
    assert len(calls) == 3 and plain == ["d"] * 3


def test_a_failing_row_does_not_swallow_the_outputs_of_rows_done_before_it(artifact):
    """Request a finishes in the same step in which b's detokenizer raises: a still gets its final
    output (before the step's failure ends b), so its client does not wait forever."""
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.sampler import SamplingParams
    from hy3c.serve.http.server import build_engine

    engine = build_engine(ServeOptions(artifact, kv_memory_gib=0.02, compile=False))[0]
    got: dict[str, list] = {"a": [], "b": []}

    class Sink:
        def __call__(self, items):
            for _, out in items:
                got[out.request_id].append(out)

    class Emit:
        batch_sink = Sink()

        def __call__(self, out):
            got[out.request_id].append(out)

    params = SamplingParams(temperature=0.0)
    engine._admit(GenerationRequest("a", [5, 6, 7], params, max_tokens=1), Emit())
    engine._admit(GenerationRequest("b", [5, 6, 8], params, max_tokens=5), Emit())

    def broken_push(token):
        raise RuntimeError("detokenizer failure")

    engine._live["b"].detok.push = broken_push
    while engine._iterate():
        pass
    assert [(o.finished, o.finish_reason) for o in got["a"]] == [(True, "length")]
    assert got["b"][-1].finished and got["b"][-1].finish_reason == "error"


def test_a_list_of_prompts_is_one_request_with_a_choice_per_prompt_and_n(client, server, expected, tiny_ckpt):
    """OpenAI's batch of prompts (strings or token-id lists): choice index = prompt index * n + j, each
    the greedy continuation of its prompt; usage counts each prompt's tokens once; streaming too."""
    prompts = ["Hello world", "The quick"]
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    out = client.completions.create(model="art", prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expected(p, 5) for p in prompts for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert out.usage.completion_tokens <= 4 * 5
    ids = client.completions.create(
        model="art", prompt=[tok.encode(p) for p in prompts], max_tokens=5, temperature=0, echo=True
    )
    assert [c.text for c in ids.choices] == [p + expected(p, 5) for p in prompts]
    texts: dict[int, str] = {}
    chunks = list(
        client.completions.create(
            model="art",
            prompt=prompts,
            n=2,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: expected(prompts[i // 2], 5) for i in range(4)}
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens
    assert _wait_until_idle(server)


def test_tokenizer_info_lets_a_client_tokenize_and_render_chats_itself(server):
    """vLLM's GET /tokenizer_info (what lm-evaluation-harness's remote tokenizer reads): the tokenizer
    config's keys, its special tokens and the chat template, which renders what /tokenize renders."""
    import jinja2

    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    for key in (
        "tokenizer_class",
        "bos_token",
        "eos_token",
        "pad_token",
        "model_max_length",
        "chat_template",
    ):
        assert info[key], key
    assert info["added_tokens_decoder"]["0"] == info["bos_token"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(messages=messages, add_generation_prompt=True, bos_token=info["bos_token"])
    )
    by_client = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()["tokens"]
    by_server = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert by_client == by_server
