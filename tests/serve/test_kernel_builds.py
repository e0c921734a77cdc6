"""Kernel variants built while serving are counted and logged (Triton's post-compile hook)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from hy3c.serve.kernel_builds import watch_kernel_builds
from hy3c.serve.metrics import EngineMetrics

knobs = pytest.importorskip("triton").knobs


def test_each_build_after_warm_up_counts_per_kernel_and_logs_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    metrics = EngineMetrics()
    assert watch_kernel_builds(metrics.kernel_builds)
    hook = knobs.runtime.jit_post_compile_hook
    with caplog.at_level(logging.WARNING, logger="hy3c.serve"):
        for name in ("_prefill_kernel", "_prefill_kernel", "_merge_kernel"):
            hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False)
    rendered = metrics.render("m")
    assert 'hy3c:kernel_builds_total{model_name="m",kernel="_prefill_kernel"} 2.0' in rendered
    assert 'kernel="_merge_kernel"} 1.0' in rendered
    assert caplog.text.count("kernel_built_while_serving") == 3
