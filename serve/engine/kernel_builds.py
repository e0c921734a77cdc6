"""Count the Triton kernel variants built while the server runs.

A kernel variant is built the first time a launch needs a specialization the process has not seen
(new constexprs, or an integer argument newly equal to 1 or a multiple of 16): it is compiled, or read
from Triton's disk cache, on the engine thread, and the step waits. The engine's warm-up exists to
make that happen before "ready"; `watch_kernel_builds` makes any build after it visible as
`hy3c:kernel_builds_total{kernel=...}` and a structured log line.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter

from hy3c.logs import log_event

log = logging.getLogger("hy3c.serve")


def watch_kernel_builds(counter: Counter) -> bool:
    """Route Triton's post-compile hook to `counter` (labelled by kernel; replacing any hook); False
    without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return False

    def on_build(*, fn: Any, **_: Any) -> None:
        counter.labels(kernel=fn.name).inc()
        log_event(log, "kernel_built_while_serving", logging.WARNING, kernel=fn.name)

    knobs.runtime.jit_post_compile_hook = on_build
    return True
