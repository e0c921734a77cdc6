"""Incremental, UTF-8-safe detokenization with stop strings that may span token boundaries.

With a byte-level BPE tokenizer (`Hy3Tokenizer.streaming_bytes`), each token's bytes go through an
incremental UTF-8 decoder: an incomplete character waits for the bytes that complete it — one table
lookup per token, no tokenizer call. Otherwise each new token is decoded together with the tokens
since the last emitted text (prefix offset / read offset), so only the new text is produced; text
that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
The last `max(len(stop)) - 1` characters are also held back, so a stop string split across tokens is
found before any of it is streamed. The stop string itself is not emitted.
"""

from __future__ import annotations

import codecs

from hy3c.tokenizer import Hy3Tokenizer

TRIM_CHARS = 1024


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Hy3Tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded text a stop search may still look at, and what is not yet returned
        self.emitted = 0  # characters of `text` already returned
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.stopped_by: str | None = None
        self.bytes_of = tokenizer.streaming_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self.bytes_of is not None else None

    def push(self, token: int) -> str:
        """Add one token; return the text now safe to stream ('' if held back or already stopped)."""
        if self.stopped_by is not None:
            return ""
        if self.utf8 is not None:
            self.text += self.utf8.decode(self.bytes_of[token] if 0 <= token < len(self.bytes_of) else b"")
            return self._release()
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release()

    def _release(self) -> str:
        found = [
            (at, stop)
            for stop in self.stop
            if (at := self.text.find(stop, max(self.emitted - len(stop), 0))) != -1
        ]
        if found:  # the match that starts first in the text wins, whatever the order of `stop`
            at, self.stopped_by = min(found, key=lambda hit: hit[0])
            self.text = self.text[:at]
            return self._take(len(self.text))
        return self._take(max(len(self.text) - self.holdback, self.emitted))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        done = self.emitted - self.longest_stop  # text before this no stop search reads again
        if done > TRIM_CHARS:  # drop it now and then: `text` stays short, appends stay cheap
            self.text = self.text[done:]
            self.emitted -= done
        return out

    def flush(self) -> str:
        """At the end of generation: everything not yet streamed — held-back characters and a final
        incomplete UTF-8 sequence (as U+FFFD, like a whole-sequence decode)."""
        if self.stopped_by is not None:
            return ""
        if self.utf8 is not None:
            self.text += self.utf8.decode(b"", final=True)
        else:
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self.tokenizer.decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        released = self._release()
        return released + ("" if self.stopped_by is not None else self._take(len(self.text)))
