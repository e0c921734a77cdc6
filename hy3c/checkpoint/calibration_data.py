"""The text `hy3c convert-fp8 --calibrate DATA` calibrates static FP8 scales on, as token windows.

    windows = calibration_windows(tokenizer, Path("calib.jsonl"), max_tokens=8192)

DATA is a `.jsonl` file — one JSON object per line whose `text` field is a string (as calibration sets
such as cnn_dailymail or pile samples are shipped), or one JSON string per line; blank lines are
skipped — or any other file, read as UTF-8 text. Without DATA the default is text every machine with
Python has: the standard library's top-level `.py` sources, in name order (Hy3 is a code and agent
model). Each text is tokenized with the checkpoint's tokenizer and cut into windows of `seq_len`
tokens, at most `max_tokens` in all. The file is only read: nothing in it is executed.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from hy3c.checkpoint.tokenizer import Hy3Tokenizer

DEFAULT_MAX_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
MAX_FILE_BYTES = 1 << 30  # a calibration file larger than this is refused, not read
TEXT_CHUNK_CHARS = 1 << 20  # a plain-text file is read and tokenized this many characters at a time


class CalibrationDataError(ValueError):
    """A calibration file hy3c cannot read; the message names the file (and line)."""


def _jsonl_texts(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="strict") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationDataError(f"{path}:{number}: not JSON ({exc.msg})") from None
            text = value.get("text") if isinstance(value, dict) else value
            if not isinstance(text, str):
                raise CalibrationDataError(
                    f"{path}:{number}: expected a JSON string or an object with a 'text' string"
                )
            yield text


def _texts(source: Path | None) -> Iterator[str]:
    if source is None:
        for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name):
            yield file.read_text(encoding="utf-8", errors="replace")
        return
    if not source.is_file():
        raise CalibrationDataError(f"{source}: not found (--calibrate takes a text or .jsonl file)")
    if source.stat().st_size > MAX_FILE_BYTES:
        raise CalibrationDataError(f"{source}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        if source.suffix == ".jsonl":
            yield from _jsonl_texts(source)
        else:
            with source.open(encoding="utf-8", errors="strict") as text:
                while chunk := text.read(TEXT_CHUNK_CHARS):  # tokenized a piece at a time: the budget
                    yield chunk  # stops the reading early, whatever the file's size
    except UnicodeDecodeError as exc:
        raise CalibrationDataError(f"{source}: not UTF-8 text ({exc.reason})") from None


def calibration_windows(
    tokenizer: Hy3Tokenizer,
    source: Path | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
) -> list[list[int]]:
    """Token windows of at most `seq_len` tokens (each at least 2), `max_tokens` in all, from `source`
    (the module docstring; None: the default text)."""
    if max_tokens < 2 or seq_len < 2:
        raise ValueError(f"calibration: max_tokens {max_tokens} and seq_len {seq_len} must be at least 2")
    windows: list[list[int]] = []
    budget = max_tokens
    for text in _texts(source):
        ids = tokenizer.encode(text)
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len][:budget]
            if len(window) >= 2:
                windows.append(window)
                budget -= len(window)
            if budget < 2:
                return windows
    if not windows:
        raise CalibrationDataError(f"{source}: fewer than 2 tokens of text to calibrate on")
    return windows
