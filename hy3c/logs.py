"""Structured logging: one `event key=value ...` line per record (logfmt), to stderr.

Modules log with `log_event(logger, "event_name", key=value, ...)`; `setup_logging()` is called once by
the CLI. Values with spaces are quoted so the lines stay machine-parsable.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any


def _fmt_value(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if not text or any(ch in text for ch in ' ="'):
        text = '"' + text.replace('"', '\\"') + '"'
    return text


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, "%s", " ".join([event, *(f"{k}={_fmt_value(v)}" for k, v in fields.items())]))


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        return f"ts={ts} level={record.levelname.lower()} logger={record.name} event={record.getMessage()}"


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
