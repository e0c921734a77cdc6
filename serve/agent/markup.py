"""Hy3's reasoning and tool-call tags as one tokenizer spells them: `<think:opensource>` in the released
tokenizer, `<think>` in the preview's (HY3_SPEC §11). Read off the tokenizer's added tokens, so a real
checkpoint and the tiny ones parse alike."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hy3c.checkpoint.tokenizer import Hy3Tokenizer, markup_token

_THINK = re.compile(r"^<think(:[^>]+)?>$")


@dataclass(frozen=True)
class Hy3Markup:
    think_open: str
    think_close: str
    tool_calls_open: str
    tool_calls_close: str
    tool_call_open: str
    tool_call_close: str
    tool_sep: str
    arg_key_open: str
    arg_key_close: str
    arg_value_open: str
    arg_value_close: str

    @classmethod
    def with_suffix(cls, suffix: str) -> Hy3Markup:
        def tag(name: str, closing: bool = False) -> str:
            return markup_token(name, closing, suffix)

        return cls(
            tag("think"),
            tag("think", True),
            tag("tool_calls"),
            tag("tool_calls", True),
            tag("tool_call"),
            tag("tool_call", True),
            tag("tool_sep"),
            tag("arg_key"),
            tag("arg_key", True),
            tag("arg_value"),
            tag("arg_value", True),
        )

    @classmethod
    def of(cls, tokenizer: Hy3Tokenizer) -> Hy3Markup | None:
        """The tokenizer's spelling (the suffix of its `<think…>` token), or None when it has no think
        token (not a Hy3 tokenizer: no reasoning or tool-call parsing)."""
        for token in tokenizer.added_tokens:
            found = _THINK.match(token)
            if found:
                return cls.with_suffix(found.group(1) or "")
        return None
