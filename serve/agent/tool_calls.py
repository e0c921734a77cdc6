"""Hy3's tool calls parsed out of generated content into OpenAI's `tool_calls`, whole or streamed.

Hy3 writes, after any plain content:

    <tool_calls>
    <tool_call>NAME<tool_sep>
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    …
    </tool_call>
    …
    </tool_calls>

(tags as the tokenizer spells them, `markup.Hy3Markup`). A value is raw text; it becomes JSON by the
type the tool's parameter schema gives it (a string, or one of an enum of strings, stays as written;
integer, number, boolean, null, object and array are parsed, and a value that does not parse as its
type stays a string); without a schema a value that parses as JSON is taken as such. Content is the text before `<tool_calls>`; text
after it outside calls is dropped. A call cut short (the output ended inside it) keeps the arguments
completed so far. The whole text and its deltas give the same calls: the whole is parsed by feeding it
as one delta."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from hy3c.serve.agent.markup import Hy3Markup
from hy3c.serve.agent.reasoning import held_back

MAX_PARSED_CHARS = 4000  # a longer argument value stays text


@dataclass
class ToolCallEvent:
    """A streamed piece: content text, a call's start (index, id, name) or its arguments (JSON text)."""

    kind: str  # "content" | "call" | "arguments"
    text: str = ""
    index: int = 0
    call_id: str = ""


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema names (its `type`, and those of its anyOf / oneOf options)."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    types = [kinds] if isinstance(kinds, str) else [k for k in kinds or [] if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types += schema_types(option)
    return types


def string_choices(schema: Any) -> list[str] | None:
    """A schema's `const` or `enum` values when they are all strings (a forced call writes one of them
    raw, and it stays a string whatever it looks like: "1", "true"); else None."""
    if not isinstance(schema, dict):
        return None
    options = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return options
    return None


def coerce_argument(value: str, schema: Any) -> Any:
    """An argument's raw text as the JSON value its parameter schema calls for (module docstring)."""
    types = schema_types(schema)
    if types == ["string"] or string_choices(schema) is not None:
        return value
    text = value.strip()
    if len(text) > MAX_PARSED_CHARS:  # not parsed: stays text (int() refuses > 4300 digits anyway)
        return value
    for kind in types:
        if kind == "boolean" and text in ("true", "false"):
            return text == "true"
        if kind == "null" and text == "null":
            return None
        if kind == "integer" and re.fullmatch(r"-?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if not math.isfinite(number):  # NaN and Infinity are not JSON
                continue
            return int(text) if re.fullmatch(r"-?\d+", text) else number
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    if not types:
        try:
            parsed = json.loads(text)
            json.dumps(parsed, allow_nan=False)  # NaN / Infinity parse but are not JSON
            return parsed
        except ValueError:
            pass
    return value


class ToolCallParser:
    """`feed` each content delta, then `finish`: each returns the `ToolCallEvent`s it completes.
    `tools` are the request's (OpenAI's `{"type": "function", "function": {name, parameters}}`)."""

    def __init__(self, markup: Hy3Markup, tools: list[dict] | None = None) -> None:
        self.markup = markup
        m = markup
        self._call = re.compile(
            re.escape(m.tool_call_open)
            + "(.*?)"
            + re.escape(m.tool_sep)
            + "(.*?)"
            + re.escape(m.tool_call_close),
            re.DOTALL,
        )
        self._head = re.compile(re.escape(m.tool_call_open) + "(.*?)" + re.escape(m.tool_sep), re.DOTALL)
        self._pair = re.compile(
            re.escape(m.arg_key_open)
            + "(.*?)"
            + re.escape(m.arg_key_close)
            + r"\s*"
            + re.escape(m.arg_value_open)
            + "(.*?)"
            + re.escape(m.arg_value_close),
            re.DOTALL,
        )
        self._parameters = {}
        for tool in tools or []:
            function = tool.get("function") or {}
            properties = (function.get("parameters") or {}).get("properties")
            self._parameters[function.get("name")] = properties if isinstance(properties, dict) else {}
        self._pending = ""  # content held back (may begin <tool_calls>)
        self._calls_text: str | None = None  # the text after <tool_calls>, once it came
        self._scan = 0  # where the next call starts in it
        self._searched = 0  # where the open call's closing tag is looked for next
        self._open: tuple[str, str] | None = None  # the started call's (id, name), not yet closed
        self._done = False  # </tool_calls> seen
        self.calls: list[dict] = []  # OpenAI tool_calls, complete ones and (after finish) a cut one

    def feed(self, text: str) -> list[ToolCallEvent]:
        if self._done:
            return []
        if self._calls_text is None:
            text = self._pending + text
            self._pending = ""
            at = text.find(self.markup.tool_calls_open)
            if at < 0:
                keep = held_back(text, (self.markup.tool_calls_open,))
                if keep:
                    self._pending, text = text[-keep:], text[:-keep]
                return [ToolCallEvent("content", text)] if text else []
            events = [ToolCallEvent("content", text[:at])] if at else []
            self._calls_text = ""
            return events + self.feed(text[at + len(self.markup.tool_calls_open) :])
        self._calls_text += text
        return self._advance()

    def _advance(self) -> list[ToolCallEvent]:
        assert self._calls_text is not None
        events: list[ToolCallEvent] = []
        while True:
            rest = self._calls_text[self._scan :]
            if self._open is None:
                end = rest.find(self.markup.tool_calls_close)
                head = self._head.search(rest)
                if end >= 0 and (head is None or end < head.start()):
                    self._done = True
                    return events
                if head is None:
                    return events
                self._open = (f"call_{uuid.uuid4().hex[:24]}", head.group(1).strip())
                events.append(ToolCallEvent("call", self._open[1], len(self.calls), self._open[0]))
            # the open call ends at its closing tag: look for it only in text not searched before
            close = self._calls_text.find(self.markup.tool_call_close, self._searched)
            if close < 0:
                self._searched = max(self._scan, len(self._calls_text) - len(self.markup.tool_call_close) + 1)
                return events
            end = close + len(self.markup.tool_call_close)
            call = self._call.match(
                self._calls_text, self._calls_text.find(self.markup.tool_call_open, self._scan), end
            )
            events.append(self._close(call.group(2) if call else ""))
            self._scan = self._searched = end

    def _close(self, body: str) -> ToolCallEvent:
        assert self._open is not None
        call_id, name = self._open
        parameters = self._parameters.get(name, {})
        arguments = {
            key.strip(): coerce_argument(value, parameters.get(key.strip()))
            for key, value in self._pair.findall(body)
        }
        text = json.dumps(arguments, ensure_ascii=False)
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": text}})
        self._open = None
        return ToolCallEvent("arguments", text, len(self.calls) - 1, call_id)

    def finish(self) -> list[ToolCallEvent]:
        """Content held back, or the cut call's arguments so far."""
        if self._calls_text is None:
            pending, self._pending = self._pending, ""
            return [ToolCallEvent("content", pending)] if pending else []
        if self._open is not None and not self._done:
            head = self._head.search(self._calls_text, self._scan)
            return [self._close(self._calls_text[head.end() :] if head else "")]
        return []


def parse_tool_calls(markup: Hy3Markup, text: str, tools: list[dict] | None) -> tuple[str, list[dict]]:
    """(content, OpenAI tool_calls) of a whole generated content."""
    parser = ToolCallParser(markup, tools)
    events = parser.feed(text) + parser.finish()
    return "".join(e.text for e in events if e.kind == "content"), parser.calls
