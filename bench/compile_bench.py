"""Compile-time benchmark (CPU): cold compile time and peak RSS, warm start.

    python bench/compile_bench.py [--workdir DIR]

Measures, each in a fresh process:
  * `hy3c compile` of the tiny checkpoint (h20-w8a8c8 with dynamic activations) — trace, passes, package;
  * `hy3c compile --preset full` — the 80-layer config traced on the meta device, all passes, packaging
    without weights;
  * artifact load + first compiled step of the tiny artifact, cold (empty compile cache) and warm (the
    cache the cold run saved), excluding nothing: weight I/O of the tiny model is negligible.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEP = """
import time, sys, torch
t0 = time.perf_counter()
import hy3c.runtime.artifact as A
from hy3c.model import SeqChunk, build_step_batch
runner = A.load(sys.argv[1], compile=True)
t1 = time.perf_counter()
batch = build_step_batch([SeqChunk(list(range(1, 40)), 0, [0, 1, 2], "last")], 16)
runner(*batch.model_args(runner.allocate_kv_cache(8, 16)))
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def _run(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GiB of this child process, stdout)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        stdout.seek(0)
        return wall, usage.ru_maxrss / 2**20, stdout.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="hy3c-compile-bench-"))
    hy3c = [sys.executable, "-m", "hy3c.cli"]
    ckpt = root / "tiny"
    if not ckpt.exists():
        subprocess.run([*hy3c, "init-checkpoint", "--out", str(ckpt)], check=True, capture_output=True)
    rows = []
    recipe = ["--recipe", "h20-w8a8c8", "--set", "quant.activations=dynamic"]
    for label, source in (
        ("tiny (3 layers, weights)", ["--model", str(ckpt)]),
        ("full (80 layers, meta)", ["--preset", "full"]),
    ):
        out = root / f"art-{label.split()[0]}"
        shutil.rmtree(out, ignore_errors=True)
        wall, rss, _ = _run([*hy3c, "compile", *source, *recipe, "--out", str(out)])
        timings = json.loads((out / "compile_report.json").read_text())["timings"]
        rows.append(
            (
                f"compile {label}",
                f"{wall:.1f}",
                f"{timings['trace_s']:.1f}",
                f"{timings['passes_s']:.1f}",
                f"{timings['package_s']:.1f}",
                f"{rss:.2f}",
            )
        )
    art = root / "tiny-cpu"
    shutil.rmtree(art, ignore_errors=True)
    subprocess.run(
        [*hy3c, "compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out", str(art)],
        check=True,
        capture_output=True,
    )
    cache = root / "inductor-cache"  # fresh: the first run fills it, the second reuses it
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["HY3C_CACHE_DIR"] = str(cache)
    for label in ("cold", "warm"):
        wall, rss, out = _run([sys.executable, "-c", STEP, str(art)])
        load_s, first_step_s = map(float, out.split())
        rows.append(
            (
                f"load + first compiled step, {label} cache",
                f"{wall:.1f}",
                f"load {load_s:.2f}",
                f"step {first_step_s:.1f}",
                "",
                f"{rss:.2f}",
            )
        )
    print("| what | wall s | trace s | passes s | package s | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
