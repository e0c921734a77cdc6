"""The floor plan holds: each room of the code imports only the rooms below it (docs/ARCHITECTURE.md,
"Rooms"), and the serving stack loads no compiler."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the top-level folders and the import name setuptools maps each one to (pyproject.toml package-dir)
FOLDERS = {"hy3c": "hy3c", "passes": "hy3c.passes", "kernels": "hy3c.kernels", "serve": "hy3c.serve"}
BASE = ("config", "logs", "recipe")  # hy3c.config, hy3c.logs, hy3c.recipe: every room may use them

# room → the rooms it may import (besides itself and base); low rooms never import high ones
ALLOWED = {
    "base": set(),
    "ops": set(),
    "kernels": {"ops"},
    "model": {"ops", "kernels"},
    "program": {"ops", "kernels"},
    "checkpoint": {"ops", "kernels", "model", "program"},
    "passes": {"ops", "kernels", "model"},
    "runtime": {"ops", "kernels", "model", "program", "checkpoint"},
    "compiler": {"ops", "kernels", "model", "program", "checkpoint", "passes", "runtime"},
    "serve": set(),  # hy3c.serve's __init__: a docstring
    # what the agent API adds (Hy3 markup parsers, grammars): below the engine, which masks draws with it
    "serve.agent": {"checkpoint"},
    "serve.engine": {"ops", "kernels", "model", "program", "checkpoint", "runtime", "serve.agent"},
    "serve.http": {"ops", "kernels", "model", "program", "checkpoint", "runtime", "serve.agent", "serve.engine"},
    "recipes": set(),
    "hy3c": {"checkpoint"},  # the package's reference_logits, imported when called
    "cli": {"ops", "kernels", "model", "program", "checkpoint", "passes", "runtime", "compiler",
            "serve.engine", "serve.http"},
    "__main__": {"cli"},
}  # fmt: skip


def room(module: str) -> str:
    """A module's room: hy3c.<room>..., with serving in three: hy3c.serve.agent, .engine and .http."""
    parts = module.split(".")
    if len(parts) < 2:
        return "hy3c"
    if parts[1] == "serve" and len(parts) > 2:
        return f"serve.{parts[2]}"
    return "base" if parts[1] in BASE else parts[1]


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) → the modules where it happens (imports inside functions too)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for folder, package in FOLDERS.items():
        for file in (REPO / folder).rglob("*.py"):
            parts = file.relative_to(REPO / folder).with_suffix("").parts
            module = ".".join([package, *parts]).removesuffix(".__init__")
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                for target in targets:
                    if target.startswith("hy3c.") and room(target) != room(module):
                        edges[room(module), room(target)].append(module)
    return edges


def test_every_room_imports_only_the_rooms_below_it():
    edges = import_edges()
    assert edges, "the scan found no imports at all"
    unknown = sorted({r for pair in edges for r in pair} - set(ALLOWED))
    assert not unknown, f"rooms missing from the plan: {unknown}"
    wrong = {
        f"{a} -> {b}": sorted(set(where))
        for (a, b), where in edges.items()
        if b != "base" and b not in ALLOWED[a]
    }
    assert not wrong, wrong


def test_the_recipe_and_the_passes_do_not_import_each_other_both_ways():
    edges = import_edges()
    assert ("base", "passes") not in edges  # hy3c.recipe validates no pass config itself
    assert ("passes", "base") in edges  # the passes read the recipe's models


def test_the_http_layer_sits_on_the_engine_not_the_reverse():
    edges = import_edges()
    assert ("serve.http", "serve.engine") in edges
    assert ("serve.engine", "serve.http") not in edges


def test_the_serving_stack_loads_no_compiler():
    probe = (
        "import json, sys\n"
        "import hy3c.serve.http.server, hy3c.serve.http.api, hy3c.serve.engine.core, hy3c.runtime.artifact\n"
        "heavy = ('hy3c.passes', 'hy3c.compiler', 'torch._inductor')\n"
        "print(json.dumps([m for m in sys.modules if m.startswith(heavy)]))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
