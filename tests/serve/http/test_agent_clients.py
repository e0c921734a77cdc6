"""The agent API through the libraries agents use, against `hy3c serve` of the random tiny model:
LangChain's `with_structured_output` and `bind_tools`, and LiteLLM's completion with tools and a
JSON schema. The grammars make the answers well formed whatever the weights."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from pydantic import BaseModel, Field

from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

pytest.importorskip("llguidance")


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def base_url(tiny_artifact):
    with BackgroundServer(ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02)) as server:
        yield f"{server.base_url}/v1"


def test_langchain_structured_output_and_bound_tools(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        base_url=base_url, api_key="none", model="art", temperature=0, max_tokens=120, max_retries=0
    )
    forecast = model.with_structured_output(Forecast, method="json_schema").invoke("The forecast, please.")
    assert isinstance(forecast, Forecast)
    message = model.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"] * len(message.tool_calls)
    assert message.tool_calls and all(isinstance(call["args"], dict) for call in message.tool_calls)


def test_litellm_tools_and_json_schema(base_url):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    litellm = pytest.importorskip("litellm")
    common = {
        "model": "openai/art",
        "api_base": base_url,
        "api_key": "none",
        "temperature": 0,
        "max_tokens": 120,
    }
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    called = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        tool_choice="required",
        **common,
    )
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    schema = {**Forecast.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode asks
    answered = litellm.completion(
        messages=[{"role": "user", "content": "The forecast, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "forecast", "schema": schema, "strict": True},
        },
        **common,
    )
    jsonschema.validate(json.loads(answered.choices[0].message.content), schema)
