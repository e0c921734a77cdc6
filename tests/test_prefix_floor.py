"""bench/e2e.py's compute floor of a prefill after a prefix hit (bench/prefix_floor.py; no GPU needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hy3c.config import preset_config

BENCH = Path(__file__).parent.parent / "bench"


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e", BENCH / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("cached", "computed"), [(6552, 1640), (26208, 6560), (1, 32767)])
def test_a_hits_floor_is_the_whole_prompts_less_its_cached_prefix(cached, computed):
    """A prompt in two chunks costs what it costs in one: the second chunk attends to the first, and the
    last token's lm_head (counted once a call) is counted twice."""
    e2e = _e2e()
    config = preset_config("real-shapes:4")
    lm_head_ms = 2 * config.vocab_size * config.hidden_size / e2e.FP8_FLOPS * 1e3
    whole = e2e.prefill_floor_ms(config, cached + computed, True, True)
    parts = e2e.prefill_floor_ms(config, cached, True, True) + e2e.prefill_floor_ms(
        config, computed, True, True, cached=cached
    )
    assert parts - lm_head_ms == pytest.approx(whole, rel=1e-12)
    assert e2e.prefill_floor_ms(config, computed, True, True, cached=cached) > e2e.prefill_floor_ms(
        config, computed, True, True
    )


def test_prefix_floor_prints_the_ratio_of_two_hits(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("prefix_floor", BENCH / "prefix_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["prefix_floor.py", "--prompt-len", "32768", "--hits", "0,0.8"])
    module.main()
    out = capsys.readouterr().out
    assert "| 0.00 | 0 | 32768 | 98.34 |" in out  # the cold 32K prefill's floor (BENCHMARKS.md)
    assert "first / last: 3.52×" in out
