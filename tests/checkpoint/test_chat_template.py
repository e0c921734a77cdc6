"""The tiny checkpoints' chat template renders as Hy3's released one (HY3_SPEC §11): the reasoning-mode
marker, the tools block, assistant tool calls (string arguments raw, others as JSON), tool results in
one <tool_responses>, think blocks per reasoning effort and `preserved_thinking`; every markup tag is
one token that decoding keeps, while control tokens are dropped."""

from __future__ import annotations

import pytest

from hy3c.checkpoint.tokenizer import CONTROL_TOKENS, MARKUP_TOKENS, Hy3Tokenizer

B, E = "<｜hy_begin_of_sentence:opensource｜>", "<｜hy_eos:opensource｜>"
U, A = "<｜hy_User:opensource｜>", "<｜hy_Assistant:opensource｜>"
MODE = "<｜reasoning_mode:opensource｜>reasoning_effort:"
T0, T1 = "<think:opensource>", "</think:opensource>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {"function": {"name": "get_weather", "arguments": {"city": "Zürich <old>", "days": 2, "units": ["C"]}}}


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> Hy3Tokenizer:
    return Hy3Tokenizer.from_dir(tiny_ckpt)


@pytest.mark.parametrize(
    ("effort", "prompt_end"), [(None, T0 + T1), ("no_think", T0 + T1), ("low", T0), ("high", T0)]
)
def test_generation_prompt_and_marker_follow_the_reasoning_effort(tok, effort, prompt_end):
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    text = tok.apply_chat_template([{"role": "user", "content": "Привет, 你好!"}], **kwargs)
    assert text == f"{B}{MODE}{effort or 'no_think'}{U}Привет, 你好!{A}{prompt_end}"


def test_an_unknown_reasoning_effort_is_an_error(tok):
    with pytest.raises(ValueError, match="reasoning_effort must be no_think, low or high, not medium"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], reasoning_effort="medium")


def test_tools_calls_and_results(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "warm"}]},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, reasoning_effort="high")
    tools_json = (
        '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}}}}'
    )
    header = (
        f"{B}Be brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tools_json}\n</tools>\n\n"
        "For function call returns, you should first print <tool_calls:opensource>\n"
        "For each function call, you should return object like:\n"
        "<tool_call:opensource>{function-name}<tool_sep:opensource>\n"
        "<arg_key:opensource>{arg-key-1}</arg_key:opensource>\n<arg_value:opensource>{arg-value-1}</arg_value:opensource>\n"
        "<arg_key:opensource>{arg-key-2}</arg_key:opensource>\n<arg_value:opensource>{arg-value-2}</arg_value:opensource>\n"
        "...\n</tool_call:opensource>\n"
        f"At the end of function call returns, you should print </tool_calls:opensource>{MODE}high"
    )
    call = (
        "<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
        "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Zürich <old></arg_value:opensource>\n"
        "<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>2</arg_value:opensource>\n"
        '<arg_key:opensource>units</arg_key:opensource>\n<arg_value:opensource>["C"]</arg_value:opensource>\n'
        f"</tool_call:opensource>\n</tool_calls:opensource>{E}"
    )
    results = (
        "<tool_responses:opensource>\n<tool_response:opensource>\nsunny\n</tool_response:opensource>\n"
        "<tool_response:opensource>\nwarm\n</tool_response:opensource>\n</tool_responses:opensource>"
    )
    # with tools the earlier turn's reasoning is kept (preserved_thinking defaults on)
    assert text == f"{header}{U}Weather?{A}{T0}I need the tool.{T1}{call}{results}{A}{T0}"


def test_reasoning_of_earlier_turns_is_dropped_without_tools(tok):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "new thought"},
    ]
    text = tok.apply_chat_template(messages, reasoning_effort="low")
    # the last turn follows the last user message: kept; it ends without eos (a continuation) and no
    # generation prompt follows an assistant turn
    assert text == f"{B}{MODE}low{U}a{A}{T0}{T1}b{E}{U}c{A}{T0}new thought{T1}d"
    kept = tok.apply_chat_template(messages, reasoning_effort="low", preserved_thinking=True)
    assert f"{T0}old thought{T1}" in kept


def test_markup_tokens_are_single_tokens_that_decoding_keeps(tok):
    for token in (*CONTROL_TOKENS, *MARKUP_TOKENS):
        assert len(tok.encode(token)) == 1, token
    text = f"{T0}why{T1}so<tool_calls:opensource>{E}"
    assert tok.decode(tok.encode(text)) == f"{T0}why{T1}so<tool_calls:opensource>"
