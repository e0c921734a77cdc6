"""Every class of bad input gets a 4xx with OpenAI's error JSON (status, `error.type`, `error.param`),
never a 500 or invalid JSON, and the server keeps serving: after each case a greedy request still
returns the eager model's continuation. Valid edge inputs (harmless extra parameters, extreme but legal
values) get a 200 whose body is strict JSON (no NaN or Infinity). One server for the module."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD_PROMPT, GOOD_TOKENS = "Hello world", 6


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    artifact = compile_artifact(
        load_recipe("cpu-reference"), tmp_path_factory.mktemp("bad-inputs") / "art", checkpoint=tiny_ckpt
    ).out
    with BackgroundServer(
        ServeOptions(artifact, port=free_port(), kv_memory_gib=0.02, max_num_seqs=16)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    """Greedy continuation by the eager model, as `hy3c generate` computes it."""
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)

    def run(prompt: str, max_tokens: int) -> str:
        return greedy(model, tok, [tok.encode(prompt)], max_tokens, ignore_eos=False)[0].text

    return run


def strict_json(text: str) -> Any:
    """JSON as the spec has it: NaN and Infinity (which Python's json accepts) are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def completion(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **fields}


@dataclass
class Case:
    name: str
    body: Any  # a dict (sent as JSON) or bytes (sent as they are)
    status: int
    param: str | None = None
    message: str = ""
    path: str = COMPLETIONS
    kind: str = "invalid_request_error"
    method: str = "POST"
    headers: dict = field(default_factory=lambda: {"content-type": "application/json"})

    def send(self, base_url: str) -> httpx.Response:
        content = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        return httpx.request(
            self.method, base_url + self.path, content=content, headers=self.headers, timeout=60
        )


def _types() -> list[Case]:
    return [
        Case("temperature a string", completion(temperature="hot"), 400, "temperature"),
        Case("max_tokens a string", completion(max_tokens="many"), 400, "max_tokens", "max_tokens"),
        Case("n a list", completion(n=[2]), 400, "n"),
        Case("stream a string", completion(stream="maybe"), 400, "stream"),
        Case("top_k a fraction", completion(top_k=1.5), 400, "top_k"),
        Case("logprobs a string", completion(logprobs="x"), 400, "logprobs"),
        Case("seed a string", completion(seed="x"), 400, "seed"),
        Case("prompt an object", completion(prompt={"text": "x"}), 400, "prompt"),
        Case("prompt a number", completion(prompt=5), 400, "prompt"),
        Case("prompt missing", {"max_tokens": 2}, 400, "prompt", "required"),
        Case("messages a string", chat(messages="hi"), 400, "messages", path=CHAT),
        Case("messages empty", chat(messages=[]), 400, "messages", path=CHAT),
        Case(
            "role unknown",
            chat(messages=[{"role": "wizard", "content": "x"}]),
            400,
            "messages.0.role",
            path=CHAT,
        ),
        Case("role missing", chat(messages=[{"content": "x"}]), 400, "messages.0.role", path=CHAT),
        Case("chat logprobs a number", chat(logprobs=3), 400, "logprobs", path=CHAT),
        Case(
            "chat_template_kwargs a string",
            chat(chat_template_kwargs="x"),
            400,
            "chat_template_kwargs",
            path=CHAT,
        ),
        Case("stream_options a string", completion(stream_options="yes"), 400, "stream_options"),
        Case("tokenize prompt a number", {"prompt": 5}, 400, "prompt", path="/tokenize"),
    ]


def _ranges() -> list[Case]:
    nan = json.dumps(completion(temperature=float("nan"))).encode()  # Python's json writes NaN
    infinite = json.dumps(completion(top_p=float("inf"))).encode()
    return [
        Case("temperature above 2", completion(temperature=7), 400, "temperature"),
        Case("temperature negative", completion(temperature=-1), 400, "temperature"),
        Case("temperature NaN", nan, 400, "temperature"),
        Case("top_p Infinity", infinite, 400, "top_p"),
        Case("top_p 0", completion(top_p=0), 400, "top_p"),
        Case("top_p above 1", completion(top_p=1.5), 400, "top_p"),
        Case("min_p above 1", completion(min_p=2), 400, "min_p"),
        Case("n 0", completion(n=0), 400, "n"),
        Case("n 17", completion(n=17), 400, "n"),
        Case("max_tokens negative", completion(max_tokens=-1), 400, "max_tokens"),
        Case(
            "max_tokens past the context", completion(max_tokens=10**6), 400, "max_tokens", "maximum context"
        ),
        Case("max_tokens 0 without echo", completion(max_tokens=0), 400, "max_tokens", "echo"),
        Case(
            "max_completion_tokens 0", chat(max_completion_tokens=0), 400, "max_completion_tokens", path=CHAT
        ),
        Case("logprobs 21", completion(logprobs=21), 400, "logprobs"),
        Case("top_logprobs 21", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", path=CHAT),
        Case("prompt_logprobs 21", completion(prompt_logprobs=21), 400, "prompt_logprobs"),
        Case("prompt_logprobs negative", completion(prompt_logprobs=-1), 400, "prompt_logprobs"),
        Case("presence_penalty 3", completion(presence_penalty=3), 400, "presence_penalty"),
        Case("frequency_penalty -3", completion(frequency_penalty=-3), 400, "frequency_penalty"),
        Case("repetition_penalty 0", completion(repetition_penalty=0), 400, "repetition_penalty"),
        Case("repetition_penalty 3", completion(repetition_penalty=3), 400, "repetition_penalty"),
        Case("seed 2^64", completion(seed=2**64), 400, "seed"),
        # numbers and flags are strict, as token ids are: a boolean is no count, 2.0 no integer
        Case(
            "max_completion_tokens past the context",
            chat(max_tokens=None, max_completion_tokens=10**11),
            400,
            "max_completion_tokens",
            "max_completion_tokens is",
            path=CHAT,
        ),
        Case("max_tokens true", completion(max_tokens=True), 400, "max_tokens"),
        Case("max_tokens 2.0", completion(max_tokens=2.0), 400, "max_tokens"),
        Case("chat max_tokens true", chat(max_tokens=True), 400, "max_tokens", path=CHAT),
        Case("n true", completion(n=True), 400, "n"),
        Case("temperature true", completion(temperature=True), 400, "temperature"),
        Case("seed 1e30", completion(seed=1e30), 400, "seed"),
        Case("stream 'yes'", completion(stream="yes"), 400, "stream"),
        Case("echo 1", completion(echo=1), 400, "echo"),
    ]


def _token_ids() -> list[Case]:
    return [
        Case("prompt id -1", completion(prompt=[-1, 5]), 400, "prompt", "vocabulary"),
        Case("prompt id 2^70", completion(prompt=[2**70]), 400, "prompt", "vocabulary"),
        Case("prompt id 2^63 with echo", completion(prompt=[2**63], echo=True), 400, "prompt", "vocabulary"),
        Case("batch id -3 with echo", completion(prompt=[[-3, 4]], echo=True), 400, "prompt", "vocabulary"),
        Case("prompt id past the vocabulary", completion(prompt=[10**7]), 400, "prompt", "vocabulary"),
        Case("prompt id a boolean", completion(prompt=[True, 5]), 400, "prompt"),
        Case("prompt id a fraction", completion(prompt=[1.5]), 400, "prompt"),
        Case("batch id a string", completion(prompt=[[1, "a"]]), 400, "prompt"),
        Case("batch id a boolean", completion(prompt=[[1, 2], [True]]), 400, "prompt"),
        Case("detokenize -1", {"tokens": [-1]}, 400, "tokens", "vocabulary", path="/detokenize"),
        Case("detokenize 2^70", {"tokens": [2**70]}, 400, "tokens", "vocabulary", path="/detokenize"),
        Case("detokenize a boolean", {"tokens": [True]}, 400, "tokens", path="/detokenize"),
        Case("detokenize a string", {"tokens": ["a"]}, 400, "tokens", path="/detokenize"),
        Case("stop_token_ids -1", completion(stop_token_ids=[-1]), 400, "stop_token_ids", "vocabulary"),
        Case("stop_token_ids 2^70", completion(stop_token_ids=[2**70]), 400, "stop_token_ids", "vocabulary"),
        Case("stop_token_ids a string", completion(stop_token_ids=["a"]), 400, "stop_token_ids"),
        Case("logit_bias id -1", completion(logit_bias={"-1": 1}), 400, "logit_bias", "vocabulary"),
        Case("logit_bias id 2^70", completion(logit_bias={str(2**70): 1}), 400, "logit_bias"),
        Case(
            "logit_bias id past the vocabulary", chat(logit_bias={"99999": 1}), 400, "logit_bias", path=CHAT
        ),
        Case("logit_bias key not a number", completion(logit_bias={"abc": 1}), 400, "logit_bias"),
        Case("logit_bias 101", completion(logit_bias={"5": 101}), 400, "logit_bias", "100"),
        Case("logit_bias a string", completion(logit_bias={"5": "x"}), 400, "logit_bias"),
        Case(
            "logit_bias NaN",
            json.dumps(completion(logit_bias={"5": float("nan")})).encode(),
            400,
            "logit_bias",
        ),
        Case("logit_bias a list", completion(logit_bias=[1]), 400, "logit_bias"),
    ]


def _unicode() -> list[Case]:
    lone = "\ud800"
    parts = [{"type": "text", "text": lone}]
    return [
        Case(
            "model a lone surrogate", completion(model=lone), 404, "model", "\\ud800", kind="not_found_error"
        ),
        Case(
            "chat model a lone surrogate", chat(model=lone), 404, "model", path=CHAT, kind="not_found_error"
        ),
        Case("prompt a lone surrogate", completion(prompt=lone), 400, "prompt", "surrogate"),
        Case("batch prompt a lone surrogate", completion(prompt=["ok", lone]), 400, "prompt"),
        Case(
            "content a lone surrogate",
            chat(messages=[{"role": "user", "content": lone}]),
            400,
            "messages",
            path=CHAT,
        ),
        Case(
            "content part a lone surrogate",
            chat(messages=[{"role": "user", "content": parts}]),
            400,
            "messages",
            path=CHAT,
        ),
        Case("stop a lone surrogate", completion(stop=[lone]), 400, "stop", "surrogate"),
        Case("logit_bias key a lone surrogate", completion(logit_bias={lone: 1}), 400, "logit_bias"),
        Case("tokenize a lone surrogate", {"prompt": lone}, 400, "prompt", path="/tokenize"),
        Case(
            "tokenize model a lone surrogate",
            {"prompt": "x", "model": lone},
            404,
            "model",
            path="/tokenize",
            kind="not_found_error",
        ),
        Case("body not UTF-8", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None, "not valid JSON"),
        Case(
            "a 5000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "4300"
        ),
        Case("a field name with a lone surrogate", b'{"prompt": "x", "\\ud800": 1}', 400, None, "field name"),
    ]


def _sizes() -> list[Case]:
    return [
        Case("body over the limit", completion(prompt="x" * (2 << 20)), 413, None, "exceeds"),
        Case("prompt past the context", completion(prompt=[5] * 100_000), 400, "prompt", "maximum context"),
        Case("prompt empty", completion(prompt=""), 400, "prompt", "empty"),
        Case("prompt ids empty", completion(prompt=[]), 400, "prompt", "empty"),
        Case("batch with an empty prompt", completion(prompt=["a", []]), 400, "prompt", "empty"),
        Case("1025 prompts", completion(prompt=["a"] * 1025), 400, "prompt", "1024"),
        Case("prompts x n over 1024", completion(prompt=["a"] * 600, n=2), 400, "n", "1024"),
    ]


def _nesting() -> list[Case]:
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    return [
        Case("prompt nested three deep", completion(prompt=[[[1]]]), 400, "prompt"),
        Case("batch of string lists", completion(prompt=[["a"]]), 400, "prompt"),
        Case(
            "image content",
            chat(messages=[{"role": "user", "content": image}]),
            400,
            "messages.0.content",
            path=CHAT,
        ),
        Case(
            "text part without text",
            chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            400,
            "messages.0.content",
            path=CHAT,
        ),
        Case("logit_bias nested", completion(logit_bias={"5": {"x": 1}}), 400, "logit_bias"),
        Case(
            "messages nested",
            chat(messages=[[{"role": "user", "content": "x"}]]),
            400,
            "messages.0",
            path=CHAT,
        ),
        Case("JSON nested past the parser's depth", b"[" * 100_000, 400, None),
        Case(
            "prompt nested past the parser's depth",
            b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            400,
            None,
        ),
    ]


def _stop_lists() -> list[Case]:
    return [
        Case("17 stop strings", completion(stop=[str(i) for i in range(17)]), 400, "stop", "16"),
        Case("stop string too long", completion(stop=["s" * 1000]), 400, "stop", "256"),
        Case("stop a number", completion(stop=5), 400, "stop"),
        Case("stop an object", completion(stop={"a": 1}), 400, "stop"),
        Case("stop with a number", completion(stop=["a", 1]), 400, "stop"),
        Case("stop nested", completion(stop=[["a"]]), 400, "stop"),
    ]


def _unknown_model() -> list[Case]:
    kind = "not_found_error"
    return [
        Case("completions", completion(model="gpt-9"), 404, "model", "does not exist", kind=kind),
        Case("chat", chat(model="gpt-9"), 404, "model", "does not exist", path=CHAT, kind=kind),
        Case("tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model", path="/tokenize", kind=kind),
        Case("detokenize", {"tokens": [5], "model": "gpt-9"}, 404, "model", path="/detokenize", kind=kind),
    ]


def _content_types() -> list[Case]:
    body = json.dumps(completion()).encode()
    return [
        Case(
            "form body",
            b"prompt=x",
            400,
            None,
            "JSON object",
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        Case(
            "JSON sent as text/plain", body, 400, None, "content-type", headers={"content-type": "text/plain"}
        ),
        Case(
            "multipart",
            b"--b\r\n\r\nx\r\n--b--",
            400,
            None,
            headers={"content-type": "multipart/form-data; boundary=b"},
        ),
    ]


def _malformed_json() -> list[Case]:
    return [
        Case("not JSON", b"{not json", 400, None, "not valid JSON"),
        Case("truncated", b'{"prompt": "x"', 400, None, "not valid JSON"),
        Case("trailing garbage", b'{"prompt": "x"} x', 400, None, "not valid JSON"),
        Case("empty body", b"", 400, None, "JSON object"),
        Case("an array", b"[]", 400, None, "JSON object"),
        Case("a string", b'"prompt"', 400, None, "JSON object"),
        Case("null", b"null", 400, None, "JSON object"),
    ]


def _wrong_method() -> list[Case]:
    return [
        Case("GET completions", b"", 405, method="GET"),
        Case("PUT chat", b"{}", 405, path=CHAT, method="PUT"),
        Case("POST models", b"{}", 405, path="/v1/models"),
        Case("DELETE tokenize", b"", 405, path="/tokenize", method="DELETE"),
        Case("unknown route", b"{}", 404, path="/v1/nothing"),
    ]


def _unsupported() -> list[Case]:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    return [
        Case(
            "response_format json_schema without a schema",
            chat(response_format={"type": "json_schema", "json_schema": {}}),
            400,
            "response_format.json_schema.schema",
            path=CHAT,
        ),
        Case(
            "a tool without a name",
            chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
            400,
            "tools.0.function.name",
            path=CHAT,
        ),
        Case(
            "a tool name OpenAI does not allow",
            chat(tools=[{"type": "function", "function": {"name": "get weather"}}]),
            400,
            "tools.0.function.name",
            path=CHAT,
        ),
        Case(
            "tool_choice required without tools", chat(tool_choice="required"), 400, "tool_choice", path=CHAT
        ),
        Case(
            "tool_choice required with a response_format",
            chat(tools=[tool], tool_choice="required", response_format={"type": "json_object"}),
            400,
            "response_format",
            "only one grammar per request",
            path=CHAT,
        ),
        Case(
            "tool parameters that are not a JSON schema",
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
            400,
            "tools.0.function.parameters",
            "not a valid JSON schema (at type",
            path=CHAT,
        ),
        Case(
            "tool parameters that are not a JSON schema, the call forced",
            chat(
                tools=[
                    tool,
                    {"type": "function", "function": {"name": "g", "parameters": {"required": "x"}}},
                ],
                tool_choice="required",
            ),
            400,
            "tools.1.function.parameters",
            "(at required: the type rule)",
            path=CHAT,
        ),
        Case(
            "tool parameters whose $schema is not a URI",
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$schema": []}}}]),
            400,
            "tools.0.function.parameters",
            "(at $schema",
            path=CHAT,
        ),
        Case(
            "tool_choice naming a function not in tools",
            chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "g"}}),
            400,
            "tool_choice",
            "'g', which is not in tools",
            path=CHAT,
        ),
        Case("reasoning_effort unknown", chat(reasoning_effort="max"), 400, "reasoning_effort", path=CHAT),
        Case(
            "chat_template_kwargs.reasoning_effort unknown",
            chat(chat_template_kwargs={"reasoning_effort": "medium"}),
            400,
            "chat_template_kwargs.reasoning_effort",
            path=CHAT,
        ),
        Case(
            "tool call arguments that are not JSON",
            chat(
                messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                ]
            ),
            400,
            "messages[1].tool_calls[0].function.arguments",
            path=CHAT,
        ),
        Case("functions", chat(functions=[{"name": "f"}]), 400, "functions", path=CHAT),
        Case("function_call", chat(function_call={"name": "f"}), 400, "function_call", path=CHAT),
        Case("guided_grammar", completion(guided_grammar="root ::= 'a'"), 400, "guided_grammar"),
        Case("structural_tag", chat(structural_tag={"type": "x"}), 400, "structural_tag", path=CHAT),
        Case("best_of", completion(best_of=3), 400, "best_of"),
        Case("suffix", completion(suffix="x"), 400, "suffix"),
        Case("audio", chat(audio={"voice": "x", "format": "wav"}), 400, "audio", path=CHAT),
        Case("modalities audio", chat(modalities=["text", "audio"]), 400, "modalities", path=CHAT),
        Case("beam search", completion(use_beam_search=True), 400, "use_beam_search"),
        Case("min_tokens", completion(min_tokens=5), 400, "min_tokens"),
        Case("skip_special_tokens false", completion(skip_special_tokens=False), 400, "skip_special_tokens"),
        Case("echo in chat", chat(echo=True), 400, "echo", path=CHAT),
        Case("prompt_logprobs streamed", completion(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
        Case(
            "chat prompt_logprobs streamed",
            chat(prompt_logprobs=1, stream=True),
            400,
            "prompt_logprobs",
            path=CHAT,
        ),
        Case(
            "template kwargs replace messages",
            chat(chat_template_kwargs={"messages": 1}),
            400,
            "chat_template_kwargs.messages",
            path=CHAT,
        ),
        Case(
            "template kwargs replace a special token",
            chat(chat_template_kwargs={"bos_token": "X"}),
            400,
            "chat_template_kwargs.bos_token",
            path=CHAT,
        ),
        Case("top_logprobs without logprobs", chat(top_logprobs=5), 400, "top_logprobs", path=CHAT),
        Case(
            "top_logprobs with logprobs false",
            chat(top_logprobs=2, logprobs=False),
            400,
            "top_logprobs",
            path=CHAT,
        ),
        Case(
            "add_generation_prompt a string",
            chat(chat_template_kwargs={"add_generation_prompt": "no"}),
            400,
            "chat_template_kwargs.add_generation_prompt",
            path=CHAT,
        ),
    ]


CLASSES = {
    "types": _types,
    "ranges": _ranges,
    "ids": _token_ids,
    "unicode": _unicode,
    "sizes": _sizes,
    "nesting": _nesting,
    "stop lists": _stop_lists,
    "unknown model": _unknown_model,
    "content type": _content_types,
    "malformed JSON": _malformed_json,
    "wrong method": _wrong_method,
    "unsupported": _unsupported,
}
BAD = [pytest.param(case, id=f"{group}: {case.name}") for group, make in CLASSES.items() for case in make()]


def _still_serving(server, expected) -> None:
    good = httpx.post(
        server.base_url + COMPLETIONS,
        json={"prompt": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert good.status_code == 200 and strict_json(good.text)["choices"][0]["text"] == expected(
        GOOD_PROMPT, GOOD_TOKENS
    )


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, expected, case: Case):
    response = case.send(server.base_url)
    assert response.status_code == case.status, response.text
    error = strict_json(response.text)["error"]
    assert error["type"] == case.kind and error["code"] == case.status
    assert error["message"] and "\n" not in error["message"]
    if case.status == 400 or case.param is not None:
        assert error["param"] == case.param
    assert case.message in error["message"]
    _still_serving(server, expected)


ACCEPTED = [
    pytest.param(completion(response_format={"type": "text"}), id="response_format text"),
    pytest.param(chat(tool_choice="none"), id="tool_choice none"),
    pytest.param(chat(tool_choice="auto", tools=[]), id="tool_choice auto without tools"),
    pytest.param(
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"), id="tools, auto"
    ),
    pytest.param(chat(reasoning_effort="low"), id="reasoning_effort"),
    pytest.param(
        chat(parallel_tool_calls=False, user="u", metadata={"k": "v"}, store=False, service_tier="auto"),
        id="bookkeeping fields",
    ),
    pytest.param(completion(some_future_field={"x": 1}), id="an unknown field"),
    pytest.param(completion(model=None, stream_options={"include_usage": False}), id="nulls and defaults"),
    pytest.param(completion(top_k=2**40, seed=-(2**63), n=2, temperature=0.5), id="extreme legal values"),
    pytest.param(completion(logit_bias={"5": -100, "6": 100}), id="logit_bias"),
    pytest.param(completion(prompt=["a", [5, 6]], n=2), id="a batch of prompts"),
    pytest.param(completion(echo=True, max_tokens=0, logprobs=1), id="prompt scoring"),
    pytest.param(
        chat(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        ),
        id="text parts",
    ),
    pytest.param(chat(chat_template_kwargs={"\ud800": "unused"}), id="an unused template variable"),
    pytest.param(completion(temperature=1e-40, logprobs=2, stream=True), id="temperature 1e-40 streamed"),
    pytest.param(completion(temperature=1e-300, logprobs=2), id="temperature 1e-300"),
    pytest.param(
        completion(repetition_penalty=1e-300, logprobs=2, temperature=1e-5, stream=True),
        id="repetition_penalty 1e-300 streamed",
    ),
    pytest.param(
        chat(repetition_penalty=1e-300, logprobs=True, top_logprobs=3, temperature=1e-5),
        id="chat repetition_penalty 1e-300",
    ),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_valid_edge_input_is_served_as_strict_json(server, expected, body):
    path = CHAT if "messages" in body else COMPLETIONS
    response = httpx.post(
        server.base_url + path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    if body.get("stream"):
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("choices" in strict_json(e) for e in events[:-1])
    else:
        assert strict_json(response.text)["choices"]
    _still_serving(server, expected)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6])
def test_a_temperature_below_the_epsilon_is_greedy(server, expected, temperature):
    body = {"prompt": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "temperature": temperature, "logprobs": 2}
    out = strict_json(httpx.post(server.base_url + COMPLETIONS, json=body, timeout=60).text)
    assert out["choices"][0]["text"] == expected(GOOD_PROMPT, GOOD_TOKENS)
    assert all(lp <= 0 for lp in out["choices"][0]["logprobs"]["token_logprobs"])


def test_add_generation_prompt_in_chat_template_kwargs_overrides_the_request(server):
    """As vLLM: chat_template_kwargs' add_generation_prompt replaces the request's."""
    messages = [{"role": "user", "content": "hi"}]

    def prompt_tokens(**fields) -> int:
        body = {"messages": messages, "max_tokens": 1, "temperature": 0, **fields}
        return strict_json(httpx.post(server.base_url + CHAT, json=body, timeout=60).text)["usage"][
            "prompt_tokens"
        ]

    without = httpx.post(
        server.base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    )
    assert prompt_tokens(chat_template_kwargs={"add_generation_prompt": False}) == without.json()["count"]
    assert prompt_tokens() == without.json()["count"] + 3  # the assistant tag, an empty think block


def test_tool_parameters_nested_past_the_recursion_limit_are_refused_not_a_crash():
    """Deeper than Python's recursion limit (whatever this process set it to): the schema check's
    recursion ends in a validation error naming the field, not an exception out of the parser."""
    import sys

    from pydantic import ValidationError

    from hy3c.serve.http.protocol import FunctionSpec

    schema: dict = {}
    for _ in range(sys.getrecursionlimit()):
        schema = {"properties": {"a": schema}}
    with pytest.raises(ValidationError) as caught:
        FunctionSpec(name="f", parameters=schema)
    (error,) = caught.value.errors()
    assert error["loc"] == ("parameters",) and "nested too deeply" in error["msg"]
