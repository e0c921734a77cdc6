"""Kernel variants built while serving are counted and logged (Triton's post-compile hook)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hy3c.serve.engine.kernel_builds import watch_kernel_builds
from hy3c.serve.engine.metrics import EngineMetrics

knobs = pytest.importorskip("triton").knobs


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_each_build_after_warm_up_counts_per_kernel_and_logs_a_warning(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    metrics = EngineMetrics()
    assert watch_kernel_builds(metrics.kernel_builds)
    hook = knobs.runtime.jit_post_compile_hook
    logger, collect = logging.getLogger("hy3c.serve"), _Collect()
    logger.addHandler(collect)
    try:
        for name in ("_prefill_kernel", "_prefill_kernel", "_merge_kernel"):
            hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False)
    finally:
        logger.removeHandler(collect)
    (family,) = [
        f for f in text_string_to_metric_families(metrics.render("m")) if f.name == "hy3c:kernel_builds"
    ]
    assert {(s.name, s.labels["kernel"], s.labels["model_name"], s.value) for s in family.samples} == {
        ("hy3c:kernel_builds_total", "_prefill_kernel", "m", 2.0),
        ("hy3c:kernel_builds_total", "_merge_kernel", "m", 1.0),
    }
    assert [m.split()[0] for m in collect.messages] == ["kernel_built_while_serving"] * 3
