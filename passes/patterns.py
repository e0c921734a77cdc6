"""Pattern helper over `torch._inductor.pattern_matcher`'s pattern language (docs/ARCHITECTURE.md §5).

    rewriter = PatternRewriter("fuse_add_rms_norm")
    rewriter.register(pattern, literals={"eps": ctx.model.rms_norm_eps}, rewrite=fn, check=same_shape)
    sites = rewriter.apply(gm)

Patterns are `CallFunction` / `KeywordArg` expressions matched by Inductor's matcher. Scalar arguments
(eps, head_dim, split sizes) are matched as wildcards and then re-validated by the mandatory `literals`
check against the exact values of the model being compiled, so a pattern can never silently match a
different shape or epsilon. Matching is find-then-rewrite: all matches are collected first, overlapping
ones are dropped, then each is rewritten. (Inductor's own `PatternMatcherPass.apply` is not used: it
refuses graphs traced on the meta device, which is how hy3c traces the 80-layer model.)
`explain(node)` says why a node is or is not matched (`hy3c inspect why-not`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx
from torch._inductor.pattern_matcher import FailedMatch, Match, PatternExpr

from hy3c.passes.base import Site

Rewrite = Callable[[Match, fx.Graph], Site]
Check = Callable[[Match], str | None]  # None = ok, else why the match is rejected


@dataclass
class _Registered:
    pattern: PatternExpr
    literals: dict[str, object]
    rewrite: Rewrite
    check: Check | None

    def anchors(self) -> list[object]:
        return list(getattr(self.pattern, "fns", []))

    def reject_reason(self, match: Match) -> str | None:
        for key, expected in self.literals.items():
            got = match.kwargs.get(key)
            if got != expected:
                return f"literal {key}={got!r} differs from the model's {expected!r}"
        return self.check(match) if self.check else None


class PatternRewriter:
    def __init__(self, name: str) -> None:
        self.name = name
        self._registered: list[_Registered] = []

    def register(
        self, pattern: PatternExpr, literals: dict[str, object], rewrite: Rewrite, check: Check | None = None
    ) -> None:
        """Register the largest patterns first; `literals` are re-checked on every match."""
        self._registered.append(_Registered(pattern, literals, rewrite, check))

    def find(self, gm: fx.GraphModule) -> list[tuple[_Registered, Match]]:
        found = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            for entry in self._registered:
                if node.target not in entry.anchors():
                    continue
                match = entry.pattern.match(node)
                if not isinstance(match, FailedMatch) and entry.reject_reason(match) is None:
                    found.append((entry, match))
                    break
        return found

    def apply(self, gm: fx.GraphModule) -> list[Site]:
        consumed: set[fx.Node] = set()
        sites = []
        for entry, match in self.find(gm):
            nodes = set(match.nodes)
            if nodes & consumed:
                continue
            consumed |= nodes
            sites.append(entry.rewrite(match, gm.graph))
        return sites

    def explain(self, node: fx.Node) -> str:
        """Why `node` is or is not rewritten by this pass's patterns."""
        lines = []
        for i, entry in enumerate(self._registered):
            if node.target not in entry.anchors():
                names = ", ".join(str(a) for a in entry.anchors())
                lines.append(
                    f"pattern {i}: node {node.name} calls {node.target}, the pattern is anchored on {names}"
                )
                continue
            match = entry.pattern.match(node)
            if isinstance(match, FailedMatch):
                lines.append(f"pattern {i}: no match: {match}")
                continue
            reason = entry.reject_reason(match)
            lines.append(
                f"pattern {i}: matched, but rejected: {reason}" if reason else f"pattern {i}: matches"
            )
        return "\n".join(lines) if lines else "the pass registers no patterns"
