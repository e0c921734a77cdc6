"""Structured outputs on the random tiny model: whatever the weights, the token mask holds the output
to its grammar — `response_format` json_schema / json_object, vLLM's `structured_outputs` and
`guided_*` — greedy and sampled, whole and streamed, on chat and completions; bad grammars are a 400
naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["rain", "sun"]}, "maxItems": 2},
    },
    "required": ["city", "days", "hourly", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "The weather, as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with BackgroundServer(ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _json_schema(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.5, "seed": 7}]
)
def test_json_schema_output_always_validates(client, sampling):
    response = client.chat.completions.create(
        model="art", messages=MESSAGES, max_tokens=120, response_format=_json_schema(), n=3, **sampling
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_output_validates(client):
    stream = client.chat.completions.create(
        model="art",
        messages=MESSAGES,
        max_tokens=120,
        response_format=_json_schema(),
        temperature=1.0,
        seed=2,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_vllms_forms(server):
    def post(path: str, **fields) -> str:
        body = {"max_tokens": 60, "temperature": 1.0, "seed": 5, **fields}
        body.update({"messages": MESSAGES} if path == "chat" else {"prompt": "Answer:"})
        response = httpx.post(
            f"{server.base_url}/v1/{'chat/completions' if path == 'chat' else 'completions'}",
            json=body,
            timeout=120,
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        return choice["message"]["content"] if path == "chat" else choice["text"]

    # any JSON object: one the random model closes, one it is still writing at max_tokens (a valid start)
    closed = json.loads(post("chat", response_format={"type": "json_object"}, seed=1))
    assert isinstance(closed, dict)
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 0,
        "response_format": {"type": "json_object"},
    }
    cut = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    text = cut["message"]["content"]
    assert cut["finish_reason"] == "length" and text.startswith('{"') and not any(ord(c) < 32 for c in text)
    jsonschema.validate(
        json.loads(post("completions", structured_outputs={"json": SCHEMA}, max_tokens=120)), SCHEMA
    )
    jsonschema.validate(json.loads(post("completions", guided_json=SCHEMA, max_tokens=120)), SCHEMA)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", post("completions", guided_regex=r"[a-c]{3}-[0-9]{2}"))
    assert post("chat", structured_outputs={"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    assert post("completions", guided_choice=["left", "right"]) in ("left", "right")


def test_the_openai_clients_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=10)
        days: int = Field(ge=1, le=7)

    parsed = (
        client.chat.completions.parse(
            model="art", messages=MESSAGES, max_tokens=120, temperature=0, response_format=Weather
        )
        .choices[0]
        .message.parsed
    )
    assert isinstance(parsed, Weather)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": _json_schema({"type": "objekt"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_choice": ["x" * 1000] * 70}, "guided_choice"),  # past MAX_GRAMMAR_CHARS
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_grammars_are_a_400_naming_the_field(server, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    assert (
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
        == 200
    )


def _tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    """An OpenAI function tool whose parameters are an object of `properties`."""
    parameters = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}}),
    _tool("get_time", {}),
    _tool(
        "set_count",
        {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "exact": {"type": "boolean"},
            "label": {"type": "string"},
        },
    ),
]


def test_tool_choice_required_and_named_always_give_a_tool_call(client):
    """Even from random weights: the grammar admits only Hy3 tool calls to the tools given, so the
    parsed message always has one (its arguments cut short at max_tokens, at worst)."""
    for seed in range(4):
        for choice, names in (
            ("required", {"get_weather", "get_time", "set_count"}),
            ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
        ):
            response = client.chat.completions.create(
                model="art", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=160,
                temperature=1.0, seed=seed,
            )  # fmt: skip
            message = response.choices[0].message
            assert message.tool_calls, (message.content, response.choices[0].finish_reason)
            assert {call.function.name for call in message.tool_calls} <= names
            for call in message.tool_calls:
                assert isinstance(json.loads(call.function.arguments), dict)
            assert response.choices[0].finish_reason in ("tool_calls", "length")


def test_forced_tool_arguments_follow_their_parameter_types(client):
    """A named function whose parameters are an integer in [0, 99], a boolean and a string: under
    `tool_choice` the grammar holds the non-string values to JSON of their schemas, so the parsed
    arguments carry those types (random weights: whatever the model writes)."""
    named = {"type": "function", "function": {"name": "set_count"}}
    seen = set()
    for seed in range(8):
        response = client.chat.completions.create(
            model="art", messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200,
            temperature=1.0, seed=seed,
        )  # fmt: skip
        for call in response.choices[0].message.tool_calls or []:
            if response.choices[0].finish_reason != "tool_calls":
                continue  # cut at max_tokens: its last value may be unfinished
            arguments = json.loads(call.function.arguments)
            assert set(arguments) <= {"n", "exact", "label"}
            if "n" in arguments:
                assert type(arguments["n"]) is int and 0 <= arguments["n"] <= 99, arguments
            if "exact" in arguments:
                assert type(arguments["exact"]) is bool, arguments
            seen |= set(arguments)
    assert {"n", "exact"} <= seen  # the typed values were really written


def test_a_forced_call_writes_each_required_argument_once_in_the_schemas_order(client, tiny_artifact):
    """A named function with two required arguments and an optional string between them: every
    finished forced call writes both required ones, no argument twice, in the schema's order (random
    weights; a logit bias on the value's end tag keeps the string short)."""
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.serve.agent.markup import Hy3Markup

    tokenizer = Hy3Tokenizer.from_dir(tiny_artifact)
    value_close = tokenizer.added_tokens[Hy3Markup.of(tokenizer).arg_value_close]
    order = ["nights", "city", "late"]
    tool = _tool(
        "book",
        {
            "nights": {"type": "integer", "minimum": 1, "maximum": 9},
            "city": {"type": "string"},
            "late": {"type": "boolean"},
        },
        required=["late", "nights"],
    )
    finished = 0
    for seed in range(6):
        response = client.chat.completions.create(
            model="art", messages=MESSAGES, tools=[tool], max_tokens=120, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "book"}},
            logit_bias={str(value_close): 8},
        )  # fmt: skip
        choice = response.choices[0]
        if choice.finish_reason != "tool_calls":
            continue  # cut at max_tokens
        finished += 1
        (call,) = choice.message.tool_calls
        written = list(json.loads(call.function.arguments))
        assert {"nights", "late"} <= set(written) and written == [k for k in order if k in written], written
    assert finished >= 3


def test_forced_string_arguments_keep_to_their_enum_and_length(client):
    """String arguments are written raw, held to their schema: a string enum gives one of its values,
    a maxLength / minLength bounds the text (random weights: whatever the model writes), and a plain
    string takes any text."""
    tool = _tool(
        "get_weather",
        {
            "unit": {"type": "string", "enum": ["c", "f", 'kelvin "K"']},
            "city": {"type": "string", "minLength": 2, "maxLength": 5},
            "code": {"const": "1"},  # a string, though it reads as a number
        },
        required=["unit", "city", "code"],
    )
    finished = 0
    for seed in range(6):
        response = client.chat.completions.create(
            model="art", messages=MESSAGES, tools=[tool], max_tokens=120, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        if response.choices[0].finish_reason != "tool_calls":
            continue  # cut at max_tokens
        finished += 1
        (call,) = response.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert arguments["unit"] in ("c", "f", 'kelvin "K"'), arguments
        assert 2 <= len(arguments["city"]) <= 5 and arguments["code"] == "1", arguments
    assert finished >= 4


def test_with_reasoning_the_tool_call_comes_after_it(client):
    """Reasoning on: the grammar lets the reasoning run (a random model may not close it within
    max_tokens) and then admits only the tool calls."""
    extra = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    for seed in range(4):
        response = client.chat.completions.create(
            model="art", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60,
            temperature=1.0, seed=seed, extra_body=extra,
        )  # fmt: skip
        choice = response.choices[0]
        if choice.message.tool_calls:
            assert choice.message.model_extra["reasoning_content"] is not None
        else:  # still reasoning: nothing else came out
            assert choice.finish_reason == "length" and not choice.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_with_reasoning_the_response_format_holds_the_content_after_it(client, tiny_artifact, stream):
    """Reasoning on: the reasoning runs free up to its end tag (pulled early by a logit bias: random
    weights rarely write it), and the content after it validates against the schema."""
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.serve.agent.markup import Hy3Markup

    tokenizer = Hy3Tokenizer.from_dir(tiny_artifact)
    close = tokenizer.added_tokens[Hy3Markup.of(tokenizer).think_close]
    extra = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    reasoned = 0
    for seed in range(3):
        response = client.chat.completions.create(
            model="art", messages=MESSAGES, response_format=_json_schema(), max_tokens=160,
            temperature=1.0, seed=seed, logit_bias={str(close): 6}, extra_body=extra, stream=stream,
        )  # fmt: skip
        if stream:
            chunks = [chunk.choices[0] for chunk in response if chunk.choices]
            reasoning = "".join((c.delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
            content = "".join(c.delta.content or "" for c in chunks)
            finish = chunks[-1].finish_reason
        else:
            message = response.choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content
            finish = response.choices[0].finish_reason
        assert finish == "stop", (reasoning, content)
        jsonschema.validate(json.loads(content), SCHEMA)
        reasoned += bool(reasoning)
    assert reasoned  # some reasoning was written before the tag


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(server):
    body = {
        "prompt": "x",
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "guided_choice": ["yes", "no"],
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    choice = response.json()["choices"][0]
    assert (
        response.status_code == 200 and choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop"
    )


def test_no_reasoning_split_when_the_prompt_does_not_end_in_a_think_block(server):
    """Without a generation prompt the template opens no think block: the output is content."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "add_generation_prompt": False,
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }
    message = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][
        0
    ]["message"]
    assert "reasoning_content" not in message and message["content"]


def test_tools_whose_parameters_are_not_a_json_schema_are_a_400_naming_them(client):
    """Under `tool_choice` required (whose grammar reads the parameters) as under auto (which does not)."""
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]
    for choice in ("required", "auto"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="art", messages=MESSAGES, tools=odd, tool_choice=choice, max_tokens=40, temperature=0
            )
        error = caught.value.body
        assert error["param"] == "tools.0.function.parameters", error
        assert "(at properties: the type rule)" in error["message"], error


def test_a_grammar_past_the_librarys_limits_is_a_400_and_the_server_goes_on(server):
    """llguidance builds this regex's lexer lazily: the compile-time first mask meets the limit."""
    body = {"prompt": "x", "max_tokens": 4, "guided_regex": "a{1000000}"}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "guided_regex" and "lexer" in error["message"]
    streamed = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=120)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    failed = [e["error"] for e in events if "error" in e]
    assert len(failed) == 1 and failed[0]["code"] == 400 and failed[0]["param"] == "guided_regex"
    assert (
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code
        == 200
    )


def test_structured_outputs_and_tool_calls_under_mtp(tiny_artifact):
    """A server speculating with the artifact's MTP layer (K = 2): json_schema outputs validate,
    greedy ones equal the plain server's, and `tool_choice: required` still gives a tool call (each
    verified row masked by the grammar past the drafts before it)."""
    config = '{"method": "mtp", "num_speculative_tokens": 2}'
    contents = {}
    for speculative in (None, config):
        options = ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02, speculative_config=speculative)
        with BackgroundServer(options) as running:
            client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0)
            response = client.chat.completions.create(
                model="art", messages=MESSAGES, max_tokens=120, response_format=_json_schema(), temperature=0
            )
            contents[speculative] = response.choices[0].message.content
            sampled = client.chat.completions.create(
                model="art", messages=MESSAGES, max_tokens=120, response_format=_json_schema(),
                temperature=1.0, seed=3, n=2,
            )  # fmt: skip
            for choice in sampled.choices:
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            called = client.chat.completions.create(
                model="art", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=160,
                temperature=1.0, seed=1,
            )  # fmt: skip
            assert called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(contents[config]), SCHEMA)
    assert contents[config] == contents[None]
