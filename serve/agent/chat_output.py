"""One chat choice's generated text as OpenAI's assistant message: reasoning split off
(`reasoning_content`), Hy3 tool calls parsed into `tool_calls`, the rest `content`.

`ChoiceOutput.feed` takes each text delta and returns the chat deltas it completes (`finish` the rest);
the non-streamed message is those same deltas put together (`message`), so a streamed response always
reassembles to the non-streamed one."""

from __future__ import annotations

from dataclasses import dataclass

from hy3c.serve.agent.markup import Hy3Markup
from hy3c.serve.agent.reasoning import ReasoningSplitter
from hy3c.serve.agent.tool_calls import ToolCallParser


@dataclass(frozen=True)
class AgentOptions:
    """What a request asks of its output: reasoning split (`thinking`: effort low or high), tool calls
    parsed (`tools`: the request's, None when none or `tool_choice` is none) and at most one of them
    unless `parallel_tool_calls`; `reasoning_end_ids`, the ids of `</think>` and `<tool_calls>`, end
    the count of reasoning tokens."""

    markup: Hy3Markup | None
    thinking: bool = False
    tools: list[dict] | None = None
    parallel_tool_calls: bool = True
    reasoning_end_ids: frozenset[int] = frozenset()


class ChoiceOutput:
    def __init__(self, options: AgentOptions) -> None:
        self.options = options
        markup = options.markup
        self._splitter = ReasoningSplitter(markup, options.thinking) if markup and options.thinking else None
        self._calls = ToolCallParser(markup, options.tools) if markup and options.tools is not None else None
        self.reasoning_tokens = 0
        self._reasoning_done = self._splitter is None
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict] = []

    def count(self, token_ids: list[int]) -> None:
        """Count the reasoning tokens among a step's new ids (those before `</think>` or `<tool_calls>`)."""
        for token in token_ids:
            if self._reasoning_done:
                return
            if token in self.options.reasoning_end_ids:
                self._reasoning_done = True
            else:
                self.reasoning_tokens += 1

    def feed(self, text: str) -> list[dict]:
        reasoning, content = self._splitter.feed(text) if self._splitter else ("", text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict]:
        reasoning, content = self._splitter.finish() if self._splitter else ("", "")
        return self._deltas(reasoning, content, final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        self.reasoning += reasoning
        if self._calls is None:
            if content:
                deltas.append({"content": content})
                self.content += content
            return deltas
        events = self._calls.feed(content) if content else []
        if final:
            events += self._calls.finish()
        for event in events:
            if event.kind == "content":
                if event.text:
                    deltas.append({"content": event.text})
                    self.content += event.text
                continue
            if event.index > 0 and not self.options.parallel_tool_calls:
                continue
            if event.kind == "call":
                call = {"index": event.index, "id": event.call_id, "type": "function"}
                deltas.append({"tool_calls": [{**call, "function": {"name": event.text, "arguments": ""}}]})
                self.tool_calls.append(
                    {
                        "id": event.call_id,
                        "type": "function",
                        "function": {"name": event.text, "arguments": ""},
                    }
                )
            else:
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
                self.tool_calls[event.index]["function"]["arguments"] += event.text
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    def message(self) -> dict:
        """The assistant message of everything fed (after `finish`)."""
        message: dict = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self._splitter is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message
