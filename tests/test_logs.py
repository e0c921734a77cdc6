"""Structured logs: one record is one line, whatever text a client puts into its values."""

from __future__ import annotations

import logging

import pytest

from hy3c.logs import log_event, setup_logging


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("plain", "plain"),
        ("two words", '"two words"'),
        ("k=v", '"k=v"'),
        ("", '""'),
        ('x"\nts=2026-12-02T00:00:00 level=info event=request path=/admin', r'"x\"\nts=2026-12-02T00:00:00'),
        ("back\\slash", r'"back\\slash"'),
        ("cr\rtab\t", r'"cr\rtab\t"'),
        ("bell\x07del\x7f", r'"bell\u0007del\u007f"'),
        ("\ud800", r'"\ud800"'),
        (0.123456, "0.1235"),
    ],
)
def test_values_are_escaped_so_a_value_cannot_forge_a_record(value, shown, capsys):
    setup_logging("INFO")
    log_event(logging.getLogger("hy3c.test"), "request", model=value, status=400)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"event=request model={shown}" in lines[0] and lines[0].endswith(" status=400")


def test_plain_log_calls_stay_on_one_line(capsys):
    setup_logging("INFO")
    logging.getLogger("hy3c.test").warning("first\nts=forged level=info event=fake\r")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith(r"event=first\nts=forged level=info event=fake\r")
