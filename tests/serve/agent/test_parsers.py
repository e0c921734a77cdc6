"""Hy3's reasoning and tool-call parsers on recorded Hy3-format text, in the released spelling
(`:opensource` suffix) and the preview's (none): whole and streamed (every split of the text gives the
same result), with malformed and cut-short calls."""

from __future__ import annotations

import json
import random

import pytest

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.serve.agent.markup import Hy3Markup
from hy3c.serve.agent.reasoning import ReasoningSplitter, split_reasoning
from hy3c.serve.agent.tool_calls import ToolCallParser, coerce_argument, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hourly": {"type": "boolean"},
                    "units": {"type": "array"},
                    "zip": {"type": "string"},
                },
            },
        },
    }
]


def _calls_text(s: str) -> str:
    return (
        f"I will look.<tool_calls{s}>\n<tool_call{s}>get_weather<tool_sep{s}>\n"
        f"<arg_key{s}>city</arg_key{s}>\n<arg_value{s}>São Paulo </arg_value{s}>\n"
        f"<arg_key{s}>days</arg_key{s}>\n<arg_value{s}>3</arg_value{s}>\n"
        f"<arg_key{s}>hourly</arg_key{s}>\n<arg_value{s}>true</arg_value{s}>\n"
        f'<arg_key{s}>units</arg_key{s}>\n<arg_value{s}>["C", "mm"]</arg_value{s}>\n'
        f"<arg_key{s}>zip</arg_key{s}>\n<arg_value{s}>01310</arg_value{s}>\n"
        f"</tool_call{s}>\n<tool_call{s}>get_time<tool_sep{s}>\n</tool_call{s}>\n</tool_calls{s}>"
    )


EXPECTED = [
    ("get_weather", {"city": "São Paulo ", "days": 3, "hourly": True, "units": ["C", "mm"], "zip": "01310"}),
    ("get_time", {}),
]


def _streamed(parser: ToolCallParser, text: str, rng: random.Random) -> tuple[str, list]:
    """Feed `text` in random pieces; (content, [(index, id, name, arguments)]) from the events."""
    events, at = [], 0
    while at < len(text):
        step = rng.randint(1, 9)
        events += parser.feed(text[at : at + step])
        at += step
    events += parser.finish()
    calls: dict[int, list] = {}
    for e in events:
        if e.kind == "call":
            calls[e.index] = [e.call_id, e.text, ""]
        elif e.kind == "arguments":
            assert calls[e.index][0] == e.call_id
            calls[e.index][2] += e.text
    content = "".join(e.text for e in events if e.kind == "content")
    return content, [(i, *calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("suffix", [":opensource", ""])
def test_tool_calls_whole_and_streamed_in_either_spelling(suffix):
    markup = Hy3Markup.with_suffix(suffix)
    text = _calls_text(suffix)
    content, calls = parse_tool_calls(markup, text, TOOLS)
    assert content == "I will look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    for seed in range(20):
        streamed_content, streamed = _streamed(ToolCallParser(markup, TOOLS), text, random.Random(seed))
        assert streamed_content == content
        assert [(name, json.loads(args)) for _, _, name, args in streamed] == EXPECTED


def test_text_without_calls_is_all_content_even_when_it_ends_like_a_tag():
    markup = Hy3Markup.with_suffix(":opensource")
    for text in ("plain answer", "ends with <tool_ca", "a < b and <tool_x>"):
        assert parse_tool_calls(markup, text, TOOLS) == (text, [])
        assert _streamed(ToolCallParser(markup, TOOLS), text, random.Random(0)) == (text, [])


def test_malformed_and_cut_short_calls():
    m = Hy3Markup.with_suffix(":opensource")
    s = ":opensource"
    # cut inside the second argument's value: the first argument is kept
    cut = (
        f"<tool_calls{s}><tool_call{s}>get_weather<tool_sep{s}><arg_key{s}>city</arg_key{s}>"
        f"<arg_value{s}>Oslo</arg_value{s}><arg_key{s}>days</arg_key{s}><arg_value{s}>4"
    )
    content, calls = parse_tool_calls(m, cut, TOOLS)
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]
    # cut before the name ended: no call
    assert parse_tool_calls(m, f"x<tool_calls{s}><tool_call{s}>get_wea", TOOLS) == ("x", [])
    # a value that is not of its type stays text; text after </tool_calls> is dropped
    odd = (
        f"<tool_calls{s}><tool_call{s}> get_weather <tool_sep{s}><arg_key{s}>days</arg_key{s}>"
        f"<arg_value{s}>three</arg_value{s}></tool_call{s}></tool_calls{s}>trailing"
    )
    content, calls = parse_tool_calls(m, odd, TOOLS)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"days": "three"}'}
    # an unknown tool's values: JSON when they parse
    other = f"<tool_calls{s}><tool_call{s}>f<tool_sep{s}><arg_key{s}>n</arg_key{s}><arg_value{s}>7</arg_value{s}></tool_call{s}>"
    assert json.loads(parse_tool_calls(m, other, TOOLS)[1][0]["function"]["arguments"]) == {"n": 7}


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.5", {"type": "number"}, 4.5),
        ("4", {"type": "number"}, 4),
        ("false", {"type": "boolean"}, False),
        ("null", {"type": "string"}, "null"),
        ("null", {"type": ["string", "null"]}, None),
        ("null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1", {"type": "array"}, "[1"),
        (" 007 ", {"type": "string"}, " 007 "),
        ("007", None, "007"),
        ("[1, 2]", None, [1, 2]),
        ("NaN", {"type": "number"}, "NaN"),  # NaN and Infinity are not JSON: the text stays
        ("Infinity", None, "Infinity"),
        ("9" * 5000, {"type": "integer"}, "9" * 5000),  # too long to parse (int() refuses past 4300 digits)
        ("1", {"enum": ["1", "2"]}, "1"),  # an enum of strings: its values stay strings
        ("true", {"const": "true"}, "true"),
        ("null", {"type": ["string", "null"], "enum": ["a", "null"]}, "null"),
        ("2", {"enum": [1, 2]}, 2),
    ],
)
def test_argument_values_take_their_parameter_type(value, schema, expected):
    assert coerce_argument(value, schema) == expected


@pytest.mark.parametrize("suffix", [":opensource", ""])
def test_reasoning_split_whole_and_streamed(suffix):
    m = Hy3Markup.with_suffix(suffix)
    cases = [
        (f"Let me think.</think{suffix}>The answer is 4.", "Let me think.", "The answer is 4."),
        (f"<think{suffix}>again</think{suffix}>done", "again", "done"),  # a reopened block
        ("never closed", "never closed", ""),  # cut short: all reasoning
        (f"plan<tool_calls{suffix}><tool_call{suffix}>", "plan", f"<tool_calls{suffix}><tool_call{suffix}>"),
        (f"a </think{suffix[:3]} b", f"a </think{suffix[:3]} b", ""),  # a tag's start is only text
    ]
    for text, reasoning, content in cases:
        assert split_reasoning(m, text, thinking=True) == (reasoning, content)
        for seed in range(10):
            rng, splitter, pieces, at = random.Random(seed), ReasoningSplitter(m, True), [], 0
            while at < len(text):
                step = rng.randint(1, 5)
                pieces.append(splitter.feed(text[at : at + step]))
                at += step
            pieces.append(splitter.finish())
            assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content)
        assert split_reasoning(m, text, thinking=False) == (None, text)  # no_think: all content


def test_markup_is_read_off_the_tokenizer(tiny_ckpt):
    markup = Hy3Markup.of(Hy3Tokenizer.from_dir(tiny_ckpt))
    assert markup == Hy3Markup.with_suffix(":opensource")
    assert markup.think_close == "</think:opensource>" and markup.tool_sep == "<tool_sep:opensource>"
