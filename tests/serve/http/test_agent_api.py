"""The agent API end to end with the official OpenAI client: tool calls (`tools`, `tool_choice` auto /
none, `parallel_tool_calls`), reasoning split into `reasoning_content` per reasoning effort, streamed
deltas that reassemble to the non-streamed message, and reasoning tokens in usage.

A random model never writes a tool call, so the model here is scripted: a tiny checkpoint whose
attention and MLP outputs are zero, so each position's logits depend on its own token only, with
embeddings and lm_head set so that greedy decoding walks one chain of tokens — from `<think>` (where
a low / high effort prompt ends) "ok" `</think>` (where a no_think prompt ends) then one Hy3 tool call
`f(x=1)` and eos. The server and parsers do not know that; they see Hy3 text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from hy3c.checkpoint.tokenizer import EOS, Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

openai = pytest.importorskip("openai")

S = ":opensource"
CHAIN = [
    f"<think{S}>", "o", "k", f"</think{S}>", f"<tool_calls{S}>", f"<tool_call{S}>", "f", f"<tool_sep{S}>",
    f"<arg_key{S}>", "x", f"</arg_key{S}>", f"<arg_value{S}>", "1", f"</arg_value{S}>", f"</tool_call{S}>",
    f"</tool_calls{S}>", EOS,
]  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "A function of x.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
]
MESSAGES = [{"role": "user", "content": "Call f."}]


def scripted_checkpoint(source: Path, out: Path) -> Path:
    """A copy of the tiny checkpoint whose greedy decoding follows CHAIN (module docstring); every
    token off the chain is followed by eos."""
    shutil.copytree(source, out)
    tokenizer = Hy3Tokenizer.from_dir(out)
    ids = []
    for text in CHAIN:
        (token,) = tokenizer.encode(text)
        ids.append(token)
    assert len(set(ids)) == len(ids), "a chain token repeats: its successor would be ambiguous"
    eos = tokenizer.token_to_id(EOS)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()  # attention and MLPs add nothing: the residual stream is the embedding
            elif name == "model.embed_tokens.weight":
                hidden = tensor.shape[1]
                tensor.zero_()
                tensor[:, hidden - 1] = 1.0  # every token: the "then eos" direction
                for k, token in enumerate(ids[:-1]):
                    tensor[token, k] = 1.0
            elif name == "model.norm.weight":
                tensor.fill_(1.0)
            elif name == "lm_head.weight":
                hidden = tensor.shape[1]
                tensor.zero_()
                tensor[eos, hidden - 1] = 5.0
                for k, successor in enumerate(ids[1:]):  # chain token k (embedding direction k) → k + 1
                    tensor[successor, k] = 10.0  # beats eos on the chain
        save_file({k: v.contiguous() for k, v in tensors.items()}, shard, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def client(tiny_ckpt, tmp_path_factory):
    work = tmp_path_factory.mktemp("agent")
    checkpoint = scripted_checkpoint(tiny_ckpt, work / "scripted")
    art = compile_artifact(load_recipe("cpu-reference"), work / "art", checkpoint=checkpoint).out
    with BackgroundServer(ServeOptions(art, port=0, kv_memory_gib=0.02)) as server:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _create(client, **fields):
    return client.chat.completions.create(
        model="art", messages=MESSAGES, temperature=0, max_tokens=40, **fields
    )


def _reassembled(stream) -> tuple[dict, str | None, dict | None]:
    """(message, finish_reason, usage) put together from streamed chunks, as a client does."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish, usage = None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = message["tool_calls"].setdefault(
                    call.index, {"id": None, "name": "", "arguments": ""}
                )
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return message, finish, usage


@pytest.mark.parametrize(("effort", "reasoning"), [("high", "ok"), ("low", "ok"), ("no_think", None)])
def test_a_tool_call_and_reasoning_whole_and_streamed(client, effort, reasoning):
    fields = {"tools": TOOLS, "extra_body": {"chat_template_kwargs": {"reasoning_effort": effort}}}
    whole = _create(client, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"x": 1}
    assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning
    details = whole.usage.completion_tokens_details
    assert (details.reasoning_tokens if details else None) == (None if reasoning is None else 2)

    stream = _create(client, stream=True, stream_options={"include_usage": True}, **fields)
    message, finish, usage = _reassembled(stream)
    assert finish == "tool_calls" and message["content"] == ""
    assert message["reasoning_content"] == (reasoning or "")
    assert message["tool_calls"] == {
        0: {"id": message["tool_calls"][0]["id"], "name": "f", "arguments": '{"x": 1}'}
    }
    assert usage["completion_tokens"] == whole.usage.completion_tokens


def test_the_openai_reasoning_effort_maps_onto_hy3s(client):
    whole = _create(client, tools=TOOLS, reasoning_effort="medium")  # → high
    assert whole.choices[0].message.model_extra["reasoning_content"] == "ok"


def test_without_tools_or_with_tool_choice_none_the_text_is_content(client):
    markup = (
        f"<tool_calls{S}><tool_call{S}>f<tool_sep{S}><arg_key{S}>x</arg_key{S}><arg_value{S}>1"
        f"</arg_value{S}></tool_call{S}></tool_calls{S}>"
    )
    for fields in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = _create(client, **fields).choices[0]
        assert choice.message.content == markup and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


def test_an_earlier_tool_call_and_its_result_go_back_into_the_prompt(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    response = client.chat.completions.create(
        model="art", messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    )
    assert response.choices[0].finish_reason == "tool_calls"  # the scripted model calls again


def test_chat_without_agent_features_is_the_plain_greedy_completion(tiny_artifact):
    """No tools, no reasoning: the chat content is exactly what /v1/completions gives for the
    templated prompt (no parser touches it)."""
    with BackgroundServer(ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02)) as server:
        plain = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        chat = plain.chat.completions.create(model="art", messages=MESSAGES, temperature=0, max_tokens=12)
        ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        completion = plain.completions.create(model="art", prompt=ids, temperature=0, max_tokens=12)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert "reasoning_content" not in (chat.choices[0].message.model_extra or {})


def test_parallel_tool_calls_false_keeps_the_first_call():
    from hy3c.serve.agent.chat_output import AgentOptions, ChoiceOutput
    from hy3c.serve.agent.markup import Hy3Markup

    call = (
        f"<tool_call{S}>f<tool_sep{S}><arg_key{S}>x</arg_key{S}><arg_value{S}>1</arg_value{S}></tool_call{S}>"
    )
    text = f"<tool_calls{S}>{call}{call.replace('>1<', '>2<')}</tool_calls{S}>"
    for parallel, count in ((True, 2), (False, 1)):
        output = ChoiceOutput(
            AgentOptions(Hy3Markup.with_suffix(S), tools=TOOLS, parallel_tool_calls=parallel)
        )
        deltas = output.feed(text) + output.finish()
        assert len(output.message()["tool_calls"]) == count
        assert {d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d} == set(range(count))
