"""PassManager: runs the recipe's passes in order and reports on each (docs/ARCHITECTURE.md §5).

For every pass it evaluates the gate, times `run`, eliminates dead code, lints and recompiles the
graph, records op histograms before/after, optionally writes a dump, and produces one `PassResult`.
A pass that raises is recorded as failed and stops the compile with a `PassError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from torch import fx

from hy3c.logs import log_event
from hy3c.passes.base import CompileCtx, Pass, PassConfig, PassResult
from hy3c.passes.dump import format_graph
from hy3c.passes.graph_utils import histogram_delta, op_histogram
from hy3c.passes.registry import PASS_REGISTRY
from hy3c.recipe import PassSpec

log = logging.getLogger("hy3c.passes")


class PassError(RuntimeError):
    def __init__(self, result: PassResult) -> None:
        super().__init__(f"pass '{result.name}' failed: {result.error}")
        self.result = result


def build_pass(spec: PassSpec) -> tuple[Pass, PassConfig]:
    cls = PASS_REGISTRY[spec.name]
    return cls(), cls.Config.model_validate(spec.config)


class PassManager:
    def __init__(
        self, specs: list[PassSpec], ctx: CompileCtx, dump_dir: Path | None = None, program: str = "step"
    ) -> None:
        self.specs = specs
        self.ctx = ctx
        self.dump_dir = dump_dir
        self.program = program  # which graph the passes rewrite (step, mtp), named in the logs

    def _dump(self, index: int, name: str, gm: fx.GraphModule) -> None:
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / f"{index:02d}_{name}.txt").write_text(format_graph(gm))

    def run(
        self,
        gm: fx.GraphModule,
        stop_before: str | None = None,
        on_pass: Callable[[str], None] | None = None,
    ) -> list[PassResult]:
        """Run every pass (or those before `stop_before`); gm is rewritten in place. `on_pass(name)` is
        called after each pass (progress display)."""
        self._dump(0, "traced", gm)
        results = []
        for index, spec in enumerate(self.specs, start=1):
            if spec.name == stop_before:
                break
            results.append(self._run_one(index, spec, gm))
            if on_pass is not None:
                on_pass(spec.name)
        return results

    def _run_one(self, index: int, spec: PassSpec, gm: fx.GraphModule) -> PassResult:
        pass_, config = build_pass(spec)
        before = op_histogram(gm)
        nodes_before = len(gm.graph.nodes)
        result = PassResult(
            name=spec.name,
            stage=pass_.stage.name,
            status="skipped",
            config=config.model_dump(),
            ops_before=before,
            ops_after=before,
            nodes_before=nodes_before,
            nodes_after=nodes_before,
        )
        start = time.perf_counter()
        try:
            reason = "disabled in the recipe" if not spec.enabled else pass_.gate(self.ctx, config)
            if reason is not None:
                result.skip_reason = reason
                log_event(log, "pass_skipped", program=self.program, name=spec.name, reason=reason)
                return result
            sites = pass_.run(gm, self.ctx, config)
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
        except Exception as exc:
            result.status, result.error = "failed", f"{type(exc).__name__}: {exc}"
            raise PassError(result) from exc
        result.time_ms = (time.perf_counter() - start) * 1e3
        after = op_histogram(gm)
        result.status = "ran"
        result.sites = sites
        result.matches = len(sites)
        result.ops_after = after
        result.ops_delta = histogram_delta(before, after)
        result.nodes_after = len(gm.graph.nodes)
        result.summary = pass_.summary()
        self._dump(index, spec.name, gm)
        log_event(
            log,
            "pass_ran",
            program=self.program,
            name=spec.name,
            matches=result.matches,
            ms=result.time_ms,
            nodes=f"{nodes_before}->{result.nodes_after}",
        )
        return result
