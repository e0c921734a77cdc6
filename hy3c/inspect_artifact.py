"""`hy3c inspect ART ...`: see what every pass did, from the artifact's files (never from logs).

passes                      one row per pass: status, matches, op delta, time, skip reason
ops [--after P]             op histogram after pass P (default: the final graph)
graph --after P [--layer N] the graph dump written after pass P (compile with --dump-graphs)
diff P1 P2                  op-histogram delta and unified diff of the dumps after P1 and P2
why-not P --node N          re-trace, replay the passes before P and explain why P left node N alone
cache-key                   every component of the cache key
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from hy3c.artifact import Artifact, ArtifactError, open_artifact


def _report(art: Artifact) -> dict:
    return art.read_json("compile_report.json")


def _pass_names(report: dict) -> list[str]:
    return [p["name"] for p in report["passes"]]


def _find_pass(report: dict, name: str) -> tuple[int, dict]:
    for index, entry in enumerate(report["passes"], start=1):
        if entry["name"] == name:
            return index, entry
    raise ArtifactError(f"no pass '{name}' in this artifact; its passes: {', '.join(_pass_names(report))}")


def format_pass_table(report: dict) -> str:
    rows = [("pass", "stage", "status", "matches", "ops delta", "ms", "note")]
    for p in report["passes"]:
        delta = ", ".join(f"{k}{v:+d}" for k, v in p["ops_delta"].items()) or "-"
        note = p.get("skip_reason") or p.get("error") or ""
        if p["name"] == "lower" and p.get("summary", {}).get("providers"):
            note = "; ".join(
                f"{op}: {'/'.join(f'{k}×{v}' for k, v in c.items())}"
                for op, c in p["summary"]["providers"].items()
            )
        rows.append(
            (p["name"], p["stage"], p["status"], str(p["matches"]), delta, f"{p['time_ms']:.1f}", note)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:6])) + ("  " + row[6] if row[6] else "")
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def _histogram_after(report: dict, after: str | None) -> dict[str, int]:
    """Op histogram after pass `after` ('traced' = before the first pass; None = the final graph)."""
    if not report["passes"]:
        return {}
    if after == "traced":
        return report["passes"][0]["ops_before"]
    if after is None:
        return report["passes"][-1]["ops_after"]
    return _find_pass(report, after)[1]["ops_after"]


def _dump(art: Artifact, report: dict, after: str) -> str:
    index, _ = (0, None) if after == "traced" else _find_pass(report, after)
    file = art.path / "graphs" / f"{index:02d}_{after}.txt"
    if not file.is_file():
        raise ArtifactError(
            f"{file}: no graph dump (compile with --dump-graphs to keep them; skipped passes write none)"
        )
    return file.read_text()


def inspect_command(
    path: str | Path,
    command: str,
    after: str | None = None,
    layer: int | None = None,
    first: str | None = None,
    second: str | None = None,
    node: str | None = None,
) -> str:
    art = open_artifact(path)
    if command == "cache-key":
        return json.dumps(art.manifest["cache_key"], indent=2)
    report = _report(art)
    if command == "passes":
        return format_pass_table(report)
    if command == "ops":
        hist = _histogram_after(report, after)
        width = max((len(k) for k in hist), default=0)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in hist.items())
    if command == "graph":
        if after is None:
            raise ArtifactError("graph needs --after PASS (or --after traced)")
        text = _dump(art, report, after)
        if layer is not None:
            text = "".join(line + "\n" for line in text.splitlines() if line.endswith(f"# layers.{layer}"))
        return text
    if command == "diff":
        before, later = _histogram_after(report, first), _histogram_after(report, second)
        keys = sorted(set(before) | set(later))
        lines = [
            f"{k}: {before.get(k, 0)} -> {later.get(k, 0)}"
            for k in keys
            if before.get(k, 0) != later.get(k, 0)
        ]
        try:
            diff = difflib.unified_diff(
                _dump(art, report, first).splitlines(),
                _dump(art, report, second).splitlines(),
                first,
                second,
                lineterm="",
            )
            lines += ["", *diff]
        except ArtifactError as exc:
            lines += ["", f"(no graph diff: {exc})"]
        return "\n".join(lines)
    if command == "why-not":
        from hy3c.compiler.why_not import why_not

        return why_not(art, after, node)
    raise ArtifactError(f"unknown inspect command {command!r}")
