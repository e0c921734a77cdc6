"""Reasoning split from content (`reasoning_content`), whole or streamed.

Hy3's template opens the assistant turn inside a think block when the reasoning effort is low or high
(`<think>`), and closes it at once for no_think (`<think></think>`). So with reasoning on, generated
text is reasoning until `</think>` — or until a `<tool_calls>` that comes first, which ends the
reasoning and stays in the content for the tool-call parser — and content after it; a leading
`<think>` (a model that opens the block again) is dropped. With no_think all of it is content."""

from __future__ import annotations

from hy3c.serve.agent.markup import Hy3Markup


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `tags` (kept until the next delta)."""
    for size in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in tags):
            return size
    return 0


class ReasoningSplitter:
    """`feed` each text delta, then `finish`: each returns (reasoning delta, content delta)."""

    def __init__(self, markup: Hy3Markup, thinking: bool) -> None:
        self.markup = markup
        self.in_reasoning = thinking
        self._pending = ""
        self._started = False  # anything emitted (a leading <think> is only dropped at the start)

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        text = self._pending + text
        self._pending = ""
        m = self.markup
        if not self._started:
            if m.think_open.startswith(text):  # maybe a leading <think>: wait for more
                self._pending = text
                return "", ""
            if text.startswith(m.think_open):
                text = text[len(m.think_open) :]
        ends = [(at, tag) for tag in (m.think_close, m.tool_calls_open) if (at := text.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self.in_reasoning = False
            self._started = True
            rest = text[at + len(m.think_close) :] if tag == m.think_close else text[at:]
            return text[:at], rest
        keep = held_back(text, (m.think_close, m.tool_calls_open))
        if keep:
            self._pending = text[-keep:]
            text = text[:-keep]
        self._started = self._started or bool(text)
        return text, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning still (the block never closed)."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self.in_reasoning else ("", pending)


def split_reasoning(markup: Hy3Markup, text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole generated text."""
    splitter = ReasoningSplitter(markup, thinking)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    return (reasoning if thinking else None), content + more_content
