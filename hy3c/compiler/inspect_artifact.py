"""`hy3c inspect ART ...`: see what every pass did, from the artifact's files (never from logs).

passes                      one row per pass: status, matches, op delta, time, skip reason (a table
                            per program: the step program, then the draft program where there is one)
ops [--after P]             op histogram after pass P (default: the final graph)
graph --after P [--layer N] the graph dump written after pass P (compile with --dump-graphs)
diff P1 P2                  op-histogram delta and unified diff of the dumps after P1 and P2
why-not P --node N          re-trace, replay the passes before P and explain why P left node N alone
cache-key                   every component of the cache key
"""

from __future__ import annotations

import difflib
import json
import re
import textwrap
from pathlib import Path

from hy3c.program.artifact import Artifact, ArtifactError, open_artifact

_LAYER_MARK = re.compile(r"# layers\.(\d+)$")


def _report(art: Artifact) -> dict:
    return art.read_json("compile_report.json")


def _pass_names(report: dict) -> list[str]:
    return [p["name"] for p in report["passes"]]


def _find_pass(report: dict, name: str) -> tuple[int, dict]:
    for index, entry in enumerate(report["passes"], start=1):
        if entry["name"] == name:
            return index, entry
    raise ArtifactError(f"no pass '{name}' in this artifact; its passes: {', '.join(_pass_names(report))}")


TABLE_WIDTH = 120  # the pass table fits a terminal this wide; long cells wrap under their column


def lowering_note(summary: dict) -> str:
    """The lower pass's row note: providers by count, the ops that fell back, the nodes each kernel variant
    is on and off for, the config tables (details: `inspect ops`)."""
    providers: dict[str, int] = {}
    for choices in summary.get("providers", {}).values():
        for name, count in choices.items():
            providers[name] = providers.get(name, 0) + count
    note = ", ".join(f"{name}×{count}" for name, count in sorted(providers.items()))
    fallbacks = summary.get("fallbacks", {})
    if fallbacks:
        reasons = "; ".join(f"{name}: {why}" for name, why in summary.get("unavailable", {}).items())
        note += f"; {sum(fallbacks.values())} fell back ({reasons})"
    for name, variant in summary.get("variants", {}).items():
        on = sum(variant["on"].values())
        off = sum(sum(why.values()) for why in variant["off"].values())
        note += f"; {name} on×{on}" + (f" off×{off}" if off else "")
    tables = sorted(set(summary.get("config_tables", {}).values()))
    if tables:
        note += f"; configs: {', '.join(tables)}"
    return note + " (inspect ops --after lower)"


def format_pass_table(report: dict) -> str:
    """One row per pass; the op delta and the note wrap within TABLE_WIDTH columns."""
    rows = [("pass", "stage", "status", "matches", "ms", "ops delta / note")]
    for p in report["passes"]:
        delta = ", ".join(f"{k}{v:+d}" for k, v in p["ops_delta"].items())
        note = p.get("skip_reason") or p.get("error") or ""
        if p["name"] == "lower" and p.get("summary", {}).get("providers"):
            delta, note = "", lowering_note(p["summary"])  # its delta only renames ops: summarised
        detail = "; ".join(part for part in (delta, note) if part) or "-"
        rows.append((p["name"], p["stage"], p["status"], str(p["matches"]), f"{p['time_ms']:.1f}", detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    indent = sum(widths) + 2 * len(widths)
    lines = []
    for row in rows:
        head = "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  "
        wrapped = textwrap.wrap(row[5], max(TABLE_WIDTH - indent, 30), break_on_hyphens=False) or [""]
        lines.append(head + wrapped[0])
        lines.extend(" " * indent + more for more in wrapped[1:])
    return "\n".join(line.rstrip() for line in lines)


def format_program_tables(art: Artifact, report: dict) -> str:
    """The pass table of every program the artifact holds, each under its name; for an artifact without
    a draft program, why it has none (when its manifest says)."""
    programs = art.manifest.get("programs") or {}
    tables = [f"program step ({art.manifest['program']['file']})", format_pass_table(report)]
    mtp = programs.get("mtp")
    if mtp is not None:
        passes = report.get("programs", {}).get("mtp", {}).get("passes", [])
        tables += [
            "",
            f"program mtp (depth {mtp['depth']}, {mtp['file']})",
            format_pass_table({"passes": passes}),
        ]
    elif programs.get("mtp_absent"):
        tables += ["", f"no draft program: {programs['mtp_absent']}"]
    return "\n".join(tables)


def _is_lowered(report: dict, after: str | None) -> bool:
    """Whether the graph after pass `after` (None: the final graph) has been through `lower`."""
    names = _pass_names(report)
    if "lower" not in names or after == "traced":
        return False
    return after is None or names.index(after) >= names.index("lower")


def _providers_after_lower(report: dict) -> str:
    """op → provider counts chosen by `lower`, with each fallback's reason, the kernel variants each op
    runs, and the config tables (for `inspect ops`)."""
    entry = next((p for p in report["passes"] if p["name"] == "lower" and p["status"] == "ran"), None)
    if entry is None or not entry.get("summary", {}).get("providers"):
        return ""
    summary = entry["summary"]
    fallbacks = summary.get("fallbacks", {})
    variants = summary.get("variants", {})
    tables = summary.get("config_tables", {})
    lines = ["", "providers (lower):"]
    for op, choices in summary["providers"].items():
        chosen = ", ".join(f"{name}×{count}" for name, count in choices.items())
        if op in fallbacks:
            chosen += f"  ({fallbacks[op]} fell back: {'; '.join(summary.get('unavailable', {}).values())})"
        runs = [f"{name}×{v['on'][op]}" for name, v in variants.items() if op in v["on"]]
        runs += [
            f"{name} off×{count}: {why}"
            for name, v in variants.items()
            for why, count in v["off"].get(op, {}).items()
        ]
        if op in tables:
            runs.append(f"configs: {tables[op]}")
        lines.append(f"  {op}: {chosen}" + (f"  [{'; '.join(runs)}]" if runs else ""))
    if variants:
        lines += ["", "kernel variants (lower):"]
        lines += [f"  {name}: {v['rule']}" for name, v in variants.items()]
    if tables:
        lines.append("  configs: the target's table as shown; a launch takes the table of the GPU it runs on")
    return "\n".join(lines)


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
    name = f"graphs/{index:02d}_{after}.txt"
    file = art.path / name
    if not file.is_file():
        raise ArtifactError(
            f"{file}: no graph dump (compile with --dump-graphs to keep them; skipped passes write none)"
        )
    return art.file(name).read_text()  # a link outside the artifact is refused


def _layer_lines(dump: str, layer: int) -> str:
    """The lines of a graph dump that belong to decoder layer `layer` (marked `# layers.N`)."""
    lines = dump.splitlines()
    picked = [line + "\n" for line in lines if line.endswith(f"# layers.{layer}")]
    if not picked:
        layers = sorted({int(m.group(1)) for line in lines if (m := _LAYER_MARK.search(line))})
        known = f"layers {layers[0]}..{layers[-1]}" if layers else "no layer-tagged nodes"
        raise ArtifactError(f"--layer {layer}: no node of that layer in this graph ({known})")
    return "".join(picked)


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
        return format_program_tables(art, report)
    if command == "ops":
        hist = _histogram_after(report, after)
        width = max((len(k) for k in hist), default=0)
        text = "\n".join(f"{k.ljust(width)}  {v}" for k, v in hist.items())
        return text + (_providers_after_lower(report) if _is_lowered(report, after) else "")
    if command == "graph":
        if after is None:
            raise ArtifactError("graph needs --after PASS (or --after traced)")
        text = _dump(art, report, after)
        if layer is not None:
            text = _layer_lines(text, layer)
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
