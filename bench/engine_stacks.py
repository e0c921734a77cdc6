"""`hy3c serve` with a thread that samples the engine thread's Python stack every millisecond, counted
by phase — what the engine does (or waits for) while a load runs against the server over HTTP, where
`engine_probe.py` cannot look. The phase is the text of PHASE_FILE (the driver writes e.g. `json`
before a `hy3c bench serve` run and `none` after: `none` is not sampled). Every 5 s it writes OUT (JSON:
per phase the sample count, the top stacks of the innermost 7 frames, and the functions most often
among the innermost 4). A frame shown inside a call that released the GIL (a torch op, a CUDA wait,
llguidance's pool) may be waiting to get it back from the HTTP loop. The sampler takes the GIL too:
it slows the server a little (compare TPOT with an unsampled run).

    python3 bench/engine_stacks.py PHASE_FILE OUT serve ART [hy3c serve flags]
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from hy3c.cli import main

SAMPLE_S = 1e-3
DUMP_S = 5.0


def _frame_name(frame: traceback.FrameSummary, line: bool = True) -> str:
    return (
        f"{os.path.basename(frame.filename)}:{frame.lineno}:{frame.name}"
        if line
        else (f"{os.path.basename(frame.filename)}:{frame.name}")
    )


def sample(phase_file: Path, out: Path) -> None:
    stacks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    functions: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    engine = None
    dumped = time.monotonic()
    while True:
        time.sleep(SAMPLE_S)
        if engine is None:
            engine = next((t.ident for t in threading.enumerate() if t.name == "hy3c-engine"), None)
            continue
        try:
            phase = phase_file.read_text().strip()
        except OSError:
            phase = "none"
        frame = sys._current_frames().get(engine)
        if frame is None or phase == "none":
            continue
        stack = traceback.extract_stack(frame)[-7:]
        stacks[phase][" <- ".join(_frame_name(f) for f in reversed(stack))] += 1
        functions[phase].update({_frame_name(f, line=False) for f in stack[-4:]})
        totals[phase] += 1
        if time.monotonic() - dumped > DUMP_S:
            dumped = time.monotonic()
            report = {
                p: {
                    "total": totals[p],
                    "stacks": stacks[p].most_common(40),
                    "functions": functions[p].most_common(40),
                }
                for p in stacks
            }
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=0))
            tmp.replace(out)


if __name__ == "__main__":
    phase_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    threading.Thread(target=sample, args=(phase_path, out_path), daemon=True).start()
    sys.argv = ["hy3c", *sys.argv[3:]]
    raise SystemExit(main())
