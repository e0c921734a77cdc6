"""Structured logging: one `event key=value ...` line per record (logfmt), to stderr.

Modules log with `log_event(logger, "event_name", key=value, ...)`; `setup_logging()` is called once by
the CLI. Values with spaces are quoted so the lines stay machine-parsable.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    """A character as it may appear in a log line: backslash escapes for quotes, backslashes and line
    breaks, `\\uXXXX` for other control characters and lone surrogates (which stderr cannot encode)."""
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    if code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
        return f"\\u{code:04x}"
    return ch


def _fmt_value(value: Any) -> str:
    """One logfmt value. Values carry client text (model names, error messages): every line break and
    quote is escaped, so a value can never end its line or forge another record."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    escaped = "".join(_escape_char(ch) for ch in text)
    if not text or escaped != text or any(ch in text for ch in " ="):
        return f'"{escaped}"'
    return text


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, "%s", " ".join([event, *(f"{k}={_fmt_value(v)}" for k, v in fields.items())]))


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        # one record, one line, whatever a message holds (log_event escapes its values already)
        message = record.getMessage().replace("\r", "\\r").replace("\n", "\\n")
        return f"ts={ts} level={record.levelname.lower()} logger={record.name} event={message}"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (it may be swapped, e.g. by pytest)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str | int = "INFO") -> None:
    handler = _StderrHandler()
    handler.setFormatter(_LogfmtFormatter())
    root = logging.getLogger("hy3c")
    root.handlers[:] = [handler]
    root.setLevel(level if isinstance(level, int) else level.upper())
    root.propagate = False
