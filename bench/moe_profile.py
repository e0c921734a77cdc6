"""Where one FusedMoE layer's time goes at decode sizes (H200): per-kernel GPU time from the profiler
against the layer's CUDA-graph replay time.

    python bench/moe_profile.py [--tokens 1,16]     # markdown table; $OUT/moe_profile.json

For each variant (bf16 weights; FP8 weights with per-token or static activation scales), with the
shipped configs: the layer replayed from a CUDA graph (median µs, as a decode step runs it, with
programmatic dependent launch); the same without PDL; and a capture without PDL replayed under
torch.profiler — each kernel's mean GPU time per replay (without PDL a kernel's time is its own: with
it, a kernel's programs start early and wait). "boundaries" = the replay without PDL minus the
kernels' sum (launch gaps inside the graph); each kernel's own ramp and tail are inside its time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench_cudagraph

import hy3c.kernels  # noqa: F401
from hy3c.kernels import overrides
from hy3c.kernels.moe.config import select_config
from hy3c.kernels.moe.fused_moe import fused_moe_triton
from hy3c.ops.quant import FP8_DTYPE

E, K_TOP, H, INTER = 192, 8, 4096, 1536
REPLAYS = 50


def kernel_times(graph: torch.cuda.CUDAGraph) -> dict[str, float]:
    """Mean GPU µs per replay of each kernel name launched by the graph."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            totals[event.name] += event.device_time
    return {name: us / REPLAYS for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured into a CUDA graph (after a warm-up call on the capture stream)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,16")
    args = parser.parse_args()
    d = "cuda"
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device=d, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, INTER, device=d, dtype=torch.bfloat16) * 0.02
    s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
    q13 = (w13.float() / s13[..., None]).to(FP8_DTYPE)
    q2 = (w2.float() / s2[..., None]).to(FP8_DTYPE)
    a_scale = torch.tensor([0.01], device=d)
    results: dict[str, dict] = {}
    print(
        "| T | variant | config | replay µs | replay without PDL µs | kernels' sum µs | boundaries µs "
        "| kernels (µs) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, H, device=d, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=d)[:K_TOP] for _ in range(t)]).int()
        wt = torch.rand(t, K_TOP, device=d)
        variants = {  # config kind → weights, weight scales, activation scales
            "bf16": (w13, w2, None, None, None, None),
            "fp8": (q13, q2, s13, s2, None, None),
            "fp8_static": (q13, q2, s13, s2, a_scale, a_scale),
        }
        for kind, weights in variants.items():
            layer = functools.partial(fused_moe_triton, x, wt, ids, *weights, None)
            with overrides.forced(overrides.PDL, True):
                replay_us = do_bench_cudagraph(layer, rep=50, return_mode="median") * 1e3
            with overrides.forced(overrides.PDL, False):  # serialized kernels: each one's time is its own
                serial_us = do_bench_cudagraph(layer, rep=50, return_mode="median") * 1e3
                kernels = kernel_times(capture(layer))
            total = sum(kernels.values())
            short = ", ".join(f"{n.split('(')[0][:28]} {us:.1f}" for n, us in kernels.items())
            cfg = select_config(t, kind, torch.cuda.get_device_name())
            print(
                f"| {t} | {kind} | {cfg} | {replay_us:.1f} | {serial_us:.1f} | {total:.1f} | "
                f"{serial_us - total:.1f} | {short} |"
            )
            results[f"T{t}_{kind}"] = {
                "replay_us": replay_us,
                "replay_without_pdl_us": serial_us,
                "kernels_us": kernels,
                "config": str(cfg),
            }
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
