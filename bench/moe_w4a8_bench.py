"""W4A8 FusedMoE on one GPU (H200) against hy3c's FP8 and bf16 FusedMoE in the same run.

    python bench/moe_w4a8_bench.py [--tokens 1,16,128,1024,8192] [--sweep]
        # markdown table; $OUT/moe_w4a8.json (+ $OUT/fused_moe_<gpu>.json with --sweep)
    TRITON_INTERPRET=1 python -m bench.moe_w4a8_bench --device cpu --tokens 1,20 --sweep   # logic check

Hy3's routed experts: E=192, top-8, H=4096, INTER=1536, groups of 128 input columns per int4 scale.
x arrives as the norm's per-token FP8 rows (pass fuse_moe_input_quant), as in the model. Times are
CUDA-graph replays at T ≤ 128 (as a decode step runs them), plain launches above. Each variant's output
is checked against the torch reference first (relative error printed). % of copy bandwidth counts the
weight bytes the active experts need (W4A8: half a byte per weight plus the fp32 group scales).
--sweep: tries launch configs per token count and writes the best into this GPU's table (kind w4a8),
keeping the other kinds as shipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import hy3c.kernels  # noqa: F401
from hy3c.kernels.moe.config import MoeConfig, device_key, select_config, table_file
from hy3c.kernels.moe.fused_moe import fused_moe_triton
from hy3c.kernels.rowwise.quant import quant_fp8_per_token
from hy3c.ops.quant import FP8_DTYPE, quantize_int4_groups

BW = 4.25e12
E, K_TOP, H, INTER, GROUP = 192, 8, 4096, 1536, 128
ROWS: list[tuple[str, ...]] = []
RESULTS: dict[str, dict] = {}


def timed(fn, tokens: int) -> float | None:
    try:
        if not torch.cuda.is_available():  # the logic check on a CPU (--device cpu): one call, wall clock
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        if tokens <= 128:
            return do_bench_cudagraph(fn, rep=50, return_mode="median")
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as exc:  # a config past shared memory, or not capturable
        print(f"not timed: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def row(*cells: str) -> None:
    ROWS.append(cells)
    print("| " + " | ".join(cells) + " |", flush=True)


def sweep_configs(tokens: int) -> list[MoeConfig]:
    """W4A8 launch configs tried at T tokens, each with the fp16 and the subnormal widening: at decode
    sizes 16-row blocks with the weights as the MMA's rows or not, 64–256 weight rows per program, K
    blocks of one group, 2–4 stages (pair blocks at one token); above, 64- or 128-row blocks of 128 or
    256 columns. At decode sizes also, subnormal only, more bytes in flight: K blocks of one group in
    6 or 8 stages, or of 2 and 4 groups (`w4a8_block_k`) in 2–4, 8 warps beside 4; at one token also
    the gate-up's K split in 2 or 4 (`MoeConfig.split_k`)."""
    configs = _launch_configs(tokens)
    deeper = []
    if tokens <= 128:
        deeper = [
            MoeConfig(16, bn, bk, 1, warps, stages, swap_ab=True, int4_subnormal=True)
            for bn in (64, 128)
            for bk, stages in ((128, 6), (128, 8), (256, 3), (256, 4), (512, 2), (512, 3))
            for warps in (4, 8)
        ]
        if tokens == 1:
            deeper = [dataclasses.replace(c, pair_blocks=True, combine_block=256) for c in deeper]
            deeper += [  # the gate-up's K split: 2 or 4 programs a tile where 192 tiles fill 132 SMs unevenly
                MoeConfig(16, bn, bk, 1, 4, stages, swap_ab=True, pair_blocks=True, combine_block=256,
                          int4_subnormal=True, split_k=split)
                for bn in (64, 128)
                for bk, stages in ((128, 4), (256, 3))
                for split in (2, 4)
            ]  # fmt: skip
    return configs + [dataclasses.replace(c, int4_subnormal=True) for c in configs] + deeper


def _launch_configs(tokens: int) -> list[MoeConfig]:
    if tokens <= 128:
        configs = [
            MoeConfig(16, bn, 128, 1, 4, stages, swap_ab=swap)
            for bn in (64, 128)
            for stages in (2, 3, 4)
            for swap in (True, False)
        ]
        configs.append(MoeConfig(16, 256, 128, 1, 8, 3, swap_ab=True))
        if tokens == 1:
            configs = [dataclasses.replace(c, pair_blocks=True, combine_block=256) for c in configs]
        return configs
    return [MoeConfig(bm, bn, 128, 8, warps, 3) for bm in (64, 128) for bn in (128, 256) for warps in (4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,16,128,1024,8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a logic check at small widths (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    d = args.device
    if d == "cpu":
        from tests.kernels.interp_shim import install  # the interpreter's rounding fixes the tests use

        install()
        global E, K_TOP, H, INTER, GROUP
        E, K_TOP, H, INTER, GROUP = 8, 2, 128, 64, 32
    w13 = torch.randn(E, 2 * INTER, H, device=d, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, INTER, device=d, dtype=torch.bfloat16) * 0.02
    s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
    f13, f2 = (w13.float() / s13[..., None]).to(FP8_DTYPE), (w2.float() / s2[..., None]).to(FP8_DTYPE)
    p13, g13 = quantize_int4_groups(w13, GROUP)
    p2, g2 = quantize_int4_groups(w2, GROUP)
    tuned: dict[int, MoeConfig] = {}
    gpu = torch.cuda.get_device_name() if d == "cuda" else None
    row("T", "variant", "ms", "% copy BW", "rel. err vs its reference", "W4A8 speed-up")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, H, device=d, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=d)[:K_TOP] for _ in range(t)]).int()
        wt = torch.rand(t, K_TOP, device=d)
        xq = quant_fp8_per_token(x)
        active = ids.unique().numel()
        weights = active * 3 * H * INTER
        int4 = (p13, p2, g13, g2, None, None)
        int4_bytes = weights // 2 + weights // GROUP * 4
        shipped = select_config(t, "w4a8", gpu)
        fp16 = dataclasses.replace(shipped, int4_subnormal=False)
        subnormal = dataclasses.replace(shipped, int4_subnormal=True)
        variants = {  # name: (weights and scales, x's FP8 rows or none, weight bytes, config)
            "bf16": ((w13, w2, None, None, None, None), (), 2 * weights, None),
            "fp8": ((f13, f2, s13, s2, None, None), xq, weights, None),
            "w4a8": (int4, xq, int4_bytes, fp16),  # the shipped tiles, widened through fp16
            # widened as sign-magnitude e4m3 subnormals q · 2⁻⁹ (`MoeConfig.int4_subnormal`)
            "w4a8 subnormal": (int4, xq, int4_bytes, subnormal),
        }
        times: dict[str, float | None] = {}
        for name, (w, extra, nbytes, config) in variants.items():
            call = (x, wt, ids, *w, None, *extra)
            ref = torch.ops.hy3.fused_moe(*call)
            out = fused_moe_triton(*call, config=config)
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            ms = times[name] = timed(
                lambda call=call, config=config: fused_moe_triton(*call, config=config), t
            )
            RESULTS.setdefault(f"T{t}", {})[name] = {"ms": ms, "rel_err": err, "bytes": nbytes}
            shown = f"{ms:.4f}" if ms is not None else "n/a"
            share = f"{nbytes / (ms * 1e-3) / BW * 100:.0f}%" if ms else ""
            row(str(t), name, shown, share, f"{err:.1e}", "")
        if args.sweep:
            call = (x, wt, ids, *int4, None, *xq)
            best: tuple[float, MoeConfig] | None = None
            for cfg in sweep_configs(t):
                ms = timed(lambda cfg=cfg, call=call: fused_moe_triton(*call, config=cfg), t)
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, cfg)
            if best is not None:
                out = fused_moe_triton(*call, config=best[1])
                err = float((out.float() - torch.ops.hy3.fused_moe(*call).float()).norm())
                print(f"sweep T={t}: best {best[0]:.4f} ms {best[1]} (abs err norm {err:.2e})")
                RESULTS[f"T{t}"]["w4a8_swept"] = {"ms": best[0], "config": best[1].__dict__}
                tuned[t] = best[1]
                times["w4a8, best swept config"] = best[0]
                row(str(t), "w4a8, best swept config", f"{best[0]:.4f}", "", "", "")
        w4a8 = min((ms for name, ms in times.items() if name.startswith("w4a8") and ms), default=None)
        if w4a8 and times["fp8"] and times["bf16"]:
            ratio = f"{times['fp8'] / w4a8:.2f}× vs FP8, {times['bf16'] / w4a8:.2f}× vs bf16"
            row(str(t), "w4a8 (best)", f"{w4a8:.4f}", "", "", ratio)
    if d == "cpu":
        return
    RESULTS["env"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    current = select_config(1, "w4a8", torch.cuda.get_device_name())
    print(f"shipped w4a8 config at T=1: {current}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_w4a8.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        if tuned:
            file = table_file(device_key(torch.cuda.get_device_name()))
            table = json.loads(file.read_text()) if file.is_file() else {}
            table.setdefault("w4a8", {}).update({str(t): cfg.__dict__ for t, cfg in tuned.items()})
            with open(os.path.join(os.environ["OUT"], file.name), "w") as f:
                json.dump(table, f, indent=1)
                f.write("\n")


if __name__ == "__main__":
    main()
