"""The compute floor of a prefix hit's TTFT on the 4-layer FP8 slice (CPU arithmetic, no GPU): what a
prompt's uncached tokens cost at the FP8 tensor-core limit when they attend to the whole context
(`e2e.prefill_floor_ms` with the hit's tokens cached), for two prefix-hit shares — the best TTFT ratio
between two tiers' settings whatever the engine does (issue 28's 3× goal: BENCHMARKS.md).

    python3 bench/prefix_floor.py --prompt-len 32768 --hits 0.3468,0.7998
"""

from __future__ import annotations

import argparse

from e2e import prefill_floor_ms

from hy3c.config import preset_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=32768)
    parser.add_argument("--hits", default="0,0.8", help="comma list of prefix-hit shares of the prompt")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    config = preset_config(f"real-shapes:{args.layers}")
    print("| hit % | cached tokens | computed tokens | floor ms |")
    print("|---|---|---|---|")
    floors = []
    for hit in (float(h) for h in args.hits.split(",")):
        computed = round(args.prompt_len * (1 - hit))
        cached = args.prompt_len - computed
        floors.append(prefill_floor_ms(config, computed, True, True, cached=cached))
        print(f"| {hit * 100:.2f} | {cached} | {computed} | {floors[-1]:.2f} |")
    print(f"first / last: {floors[0] / floors[-1]:.2f}×")


if __name__ == "__main__":
    main()
