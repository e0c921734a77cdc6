"""Kernels for Nsight Compute (ncu) on the H200, and a reader of its per-instruction output.

The device's `nvidia-h200` machines run on Firecracker, where ncu reads the hardware counters. This
script launches the kernels of one case inside a profiler range, after warm-up calls that compile them,
so that ncu sees exactly one launch of each:

    ncu --clock-control none --profile-from-start off --set full -f -o $OUT/prefill \
        python3 bench/ncu_kernels.py prefill          # 8K causal prefill: bf16 paged kernel and SDPA
    ncu --clock-control none --profile-from-start off --set full -f -o $OUT/moe \
        python3 bench/ncu_kernels.py moe              # FusedMoE at T=1: bf16, FP8 static, FP8 dynamic
    ncu --import $OUT/moe.ncu-rep --page details > $OUT/moe.txt
    ncu --import $OUT/moe.ncu-rep --page source --csv --print-source sass > $OUT/moe_sass.csv
    python3 bench/ncu_kernels.py summary $OUT/moe_sass.csv     # stalls and hottest instructions

`--clock-control none` leaves the GPU's clocks alone (device/METHOD.md); `--set full` replays each
kernel about 40 times with its caches flushed, so durations read there are cold-cache single launches,
not the graph-replay times of the benchmarks.
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

WARM_UP_CALLS = 2


def prefill_calls(tokens: int) -> list[Callable[[], object]]:
    """One causal prefill request of `tokens` at Hy3's heads: the paged Triton kernel over a bf16 cache
    (the shipped config) and torch SDPA on contiguous q/k/v."""
    sys.path.insert(0, str(Path(__file__).parent))
    import attention_bench as ab
    import torch

    from hy3c.kernels.attention.prefill import prefill_attention

    q, seq_lens, qsl, plan, sdpa_call, _ = ab.prefill_case(tokens)
    cache, table, scales = ab.paged_cache([tokens], torch.bfloat16, 1.0)
    paged = functools.partial(
        prefill_attention, q, cache, scales, 0, table, seq_lens, qsl, ab.HEAD_DIM**-0.5, plan
    )
    return [paged, sdpa_call]


def moe_calls(tokens: int) -> list[Callable[[], object]]:
    """One FusedMoE layer at Hy3's shapes (random experts, per-channel FP8 weight scales), with the
    shipped configs: bf16 weights, FP8 with a static activation scale, FP8 with per-token scales."""
    import torch

    from hy3c.kernels.moe.fused_moe import fused_moe_triton
    from hy3c.ops.quant import FP8_DTYPE

    experts, top_k, hidden, inter, d = 192, 8, 4096, 1536, "cuda"
    w13 = torch.randn(experts, 2 * inter, hidden, device=d, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=d, dtype=torch.bfloat16) * 0.02
    s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
    q13, q2 = (w13.float() / s13[..., None]).to(FP8_DTYPE), (w2.float() / s2[..., None]).to(FP8_DTYPE)
    a_scale = torch.tensor([0.01], device=d)
    x = torch.randn(tokens, hidden, device=d, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device=d)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, device=d)
    variants = [
        (w13, w2, None, None, None, None),
        (q13, q2, s13, s2, a_scale, a_scale),
        (q13, q2, s13, s2, None, None),
    ]
    return [functools.partial(fused_moe_triton, x, weights, ids, *v, None) for v in variants]


def profile(calls: list[Callable[[], object]]) -> None:
    """Each call warmed up (compiled) outside the profiler range, then once inside it."""
    import torch

    for call in calls:
        for _ in range(WARM_UP_CALLS):
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def read_source_page(path: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, column names, one row per SASS instruction) for each kernel in an ncu
    `--page source --csv --print-source sass` export."""
    kernels: list[tuple[str, list[str], list[list[str]]]] = []
    with path.open(newline="") as f:
        for fields in csv.reader(f):
            if not fields:
                continue
            if fields[0] == "Kernel Name":
                kernels.append((fields[1], [], []))
            elif fields[0] == "Address" and kernels:
                kernels[-1][1].extend(fields)
            elif kernels and kernels[-1][1]:
                kernels[-1][2].append(fields)
    return kernels


def summarize(path: Path, top: int) -> None:
    """Per kernel: the share of warp-state samples by stall reason, and the instructions holding most
    samples (with their two main stall reasons)."""
    for name, columns, rows in read_source_page(path):
        samples = columns.index("Warp Stall Sampling (All Samples)")
        executed = columns.index("Instructions Executed")
        stalls = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
        total = sum(int(r[samples]) for r in rows) or 1
        by_reason = Counter({c[6:]: sum(int(r[columns.index(c)]) for r in rows) for c in stalls})
        print(f"## {name[:90]}: {len(rows)} instructions, {total} samples")
        print("stalls: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(8) if v))
        for index, r in sorted(enumerate(rows), key=lambda t: -int(t[1][samples]))[:top]:
            reasons = sorted(((int(r[columns.index(c)]), c[6:]) for c in stalls), reverse=True)[:2]
            why = ", ".join(f"{reason} {n}" for n, reason in reasons if n)
            print(
                f"  {index:5d} {int(r[samples]) / total:6.1%} x{r[executed]:>8}  {r[1].strip()[:64]}  ({why})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=["prefill", "moe", "summary"])
    parser.add_argument("csv", nargs="?", type=Path, help="summary: an ncu source-page CSV export")
    parser.add_argument("--tokens", type=int, help="prefill: 8192 by default; moe: 1")
    parser.add_argument("--top", type=int, default=20, help="summary: instructions listed per kernel")
    args = parser.parse_args()
    if args.case == "summary":
        if args.csv is None:
            parser.error("summary needs the CSV file of `ncu --page source --csv --print-source sass`")
        summarize(args.csv, args.top)
    elif args.case == "prefill":
        profile(prefill_calls(args.tokens or 8192))
    else:
        profile(moe_calls(args.tokens or 1))


if __name__ == "__main__":
    main()
