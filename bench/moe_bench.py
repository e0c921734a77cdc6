"""MoE-path benchmark on one GPU (H200): router GEMM, FusedMoE bf16/FP8, against peers in the same run.

    python bench/moe_bench.py [--sweep] [--parts router,align,moe,breakdown] [--tokens 1,16,128,1024,8192]
        # markdown table; $OUT/moe.json (+ $OUT/fused_moe_<gpu>.json)

* Router GEMM, N=192, K=4096: fp32 cuBLAS, TF32 cuBLAS, hy3c dual-BF16 Triton; max abs error vs fp64.
* moe_align, E=192, top-8: one Triton program vs the device-side torch ops, both replayed in a CUDA
  graph as in a decode step; picks MAX_ALIGN_PAIRS.
* FusedMoE, E=192, top-8, H=4096, INTER=1536 (+ shared expert output added): hy3c bf16 and FP8
  (per-channel weights, per-token activations; at one token on sm_90 the Gluon kernels of
  `fused_moe_gluon`, replayed beside the Triton ones) vs the `torch._grouped_mm` path and the transformers
  per-expert loop, and the FP8 variant vs an FP8 path on `torch._scaled_grouped_mm` (the same
  per-token activation and per-channel weight scales); % of copy bandwidth on the active experts'
  weight bytes and % of bf16 peak.
* --sweep: tries launch configs per token bucket (CUDA-graph replays at T ≤ 128) and writes the best
  to $OUT/fused_moe_<gpu>.json, this GPU's table (`hy3c.kernels.moe.config.device_key`: h200 on an H200;
  the shipped configs for buckets not in --tokens); with the router part,
  also sweeps the dual-BF16 kernel's tiles and K splits per M.
* --parts breakdown (prefill sizes, the --tokens above 128): the FP8 FusedMoE's device time per kernel
  (torch.profiler, mean of 5 calls) against the measured FP8 dense peak at the same work (cuBLAS
  `torch._scaled_mm`, per-row / per-column scales, M = T · top-k rows through [4096 → 3072] and
  [1536 → 4096], as one dense GEMM each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import hy3c.kernels  # noqa: F401
from hy3c.kernels.moe.align import moe_align_torch, moe_align_triton
from hy3c.kernels.moe.config import MoeConfig, device_key, select_config, table_file
from hy3c.kernels.moe.fused_moe import fused_moe_triton
from hy3c.kernels.moe.router import router_gemm_dual_bf16
from hy3c.kernels.rowwise.quant import quant_fp8_per_token
from hy3c.ops.quant import FP8_DTYPE, split_router_weight

BW, PEAK = 4.25e12, 790e12
E, K_TOP, H, INTER = 192, 8, 4096, 1536
ROWS: list[tuple[str, ...]] = []
RESULTS: dict[str, dict] = {}
PERSISTENT = True  # the sweeps try the persistent Gluon GEMMs' configs (`--no-persistent`: not)
DOWN_TILES = True  # `--sweep-from-shipped` tries the down GEMM's own tiles (`--no-down-tiles`: not)


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_ms(fn) -> float | None:
    """Median ms of fn replayed from a CUDA graph (no launch overhead); None if it cannot be captured
    (e.g. a host sync for a data-dependent shape)."""
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as exc:  # capture errors surface as several exception types across torch versions
        print(f"not capturable: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def row(name, ms, pct="", ratio="") -> None:
    ROWS.append((name, f"{ms:.4f}" if ms < 0.1 else f"{ms:.3f}", pct, ratio))
    print("| " + " | ".join(ROWS[-1]) + " |", flush=True)  # a run cut short still shows what it measured


def router_sweep(x, hi, lo) -> dict[str, float]:
    """ms of the dual-BF16 kernel per (block_m, block_n, K splits) at this M."""
    times = {}
    m = x.shape[0]
    for bm in (16, 32, 64):
        if bm > 16 and bm > 2 * m:
            continue
        for bn in (32, 64):
            for splits in (1, 2, 4, 8, 16):
                ms = bench(lambda bm=bm, bn=bn, s=splits: router_gemm_dual_bf16(x, hi, lo, s, bm, bn))
                times[f"{bm},{bn},{splits}"] = ms
    return times


def router_bench(sweep: bool) -> None:
    d = "cuda"
    w = torch.randn(E, H, device=d) * 0.02
    hi, lo = split_router_weight(w)
    for m in (1, 2, 16, 64, 128, 208, 256, 384, 512, 768, 1024, 4096):
        x = torch.randn(m, H, device=d).to(torch.bfloat16)
        ref = x.double() @ w.double().t()
        torch.backends.cuda.matmul.allow_tf32 = False
        t32 = bench(lambda x=x: x.float() @ w.t())
        torch.backends.cuda.matmul.allow_tf32 = True
        ttf = bench(lambda x=x: x.float() @ w.t())
        err_tf = ((x.float() @ w.t()).double() - ref).abs().max().item()
        torch.backends.cuda.matmul.allow_tf32 = False
        out = router_gemm_dual_bf16(x, hi, lo)
        err = (out.double() - ref).abs().max().item()
        tdual = bench(lambda x=x: router_gemm_dual_bf16(x, hi, lo))
        RESULTS[f"router_M{m}"] = {
            "fp32_ms": t32,
            "tf32_ms": ttf,
            "dual_ms": tdual,
            "err_dual": err,
            "err_tf32": err_tf,
        }
        RESULTS[f"router_M{m}"]["cuda_graph_ms"] = {
            "fp32": graph_ms(lambda x=x: x.float() @ w.t()),
            "dual": graph_ms(lambda x=x: router_gemm_dual_bf16(x, hi, lo)),
        }
        if sweep:
            times = router_sweep(x, hi, lo)
            best = min(times, key=times.get)
            RESULTS[f"router_M{m}"]["sweep"] = times
            print(
                f"router sweep M={m}: best {times[best]:.4f} ms with (block_m, block_n, splits) = ({best}) "
                f"({t32 / times[best]:.2f}× vs fp32); graph fp32 / dual "
                f"{RESULTS[f'router_M{m}']['cuda_graph_ms']}"
            )
        row(
            f"router M={m}: fp32 cuBLAS / TF32 / dual-BF16",
            tdual,
            f"err {err:.1e} (tf32 {err_tf:.1e})",
            f"{t32 / tdual:.2f}× vs fp32 ({t32:.3f}), {ttf / tdual:.2f}× vs tf32 ({ttf:.3f})",
        )


def align_bench() -> None:
    for t in (1, 8, 32, 64, 128):
        ids = torch.stack([torch.randperm(E, device="cuda")[:K_TOP] for _ in range(t)]).int()
        same = all(
            torch.equal(a, b) for a, b in zip(moe_align_triton(ids, E, 16), moe_align_torch(ids, E, 16))
        )
        t_triton = do_bench_cudagraph(lambda ids=ids: moe_align_triton(ids, E, 16), rep=50)
        t_torch = do_bench_cudagraph(lambda ids=ids: moe_align_torch(ids, E, 16), rep=50)
        RESULTS[f"align_T{t}"] = {"triton_ms": t_triton, "torch_ms": t_torch, "equal": same}
        row(
            f"moe_align T={t} ({t * K_TOP} pairs): torch ops / Triton",
            t_triton,
            f"equal={same}",
            f"{t_torch / t_triton:.2f}× vs torch ({t_torch:.4f})",
        )


def grouped_mm_moe(x, ids, wt, w13, w2):
    t = x.shape[0]
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    tok = order // K_TOP
    counts = torch.bincount(flat, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, -1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)
    y = y * wt.flatten()[order, None]
    out = torch.zeros(t, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def triton_kernels_only(args):
    """fused_moe_triton on the Triton kernels even where its config would take the Gluon ones."""
    return fused_moe_triton(*args, gluon=False)


def quant_rows_torch(x):
    """Per-row FP8 e4m3 with an fp32 scale per row (amax / 448), as eager torch ops."""
    scale = x.float().abs().amax(-1).clamp(min=1e-12) / 448.0
    return (x.float() / scale[:, None]).to(FP8_DTYPE), scale


def scaled_grouped_mm_moe(x, ids, wt, q13, q2, s13, s2):
    """FP8 peer: `grouped_mm_moe` with both GEMMs through `torch._scaled_grouped_mm` (per-token
    activation scales, per-channel weight scales), activations quantized by eager torch ops."""
    t = x.shape[0]
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    tok = order // K_TOP
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    a, sa = quant_rows_torch(x[tok])
    gu = torch._scaled_grouped_mm(a, q13.transpose(1, 2), sa, s13, offs=offs, out_dtype=torch.bfloat16)
    g, u = gu.chunk(2, -1)
    h, sh = quant_rows_torch(F.silu(g) * u)
    y = torch._scaled_grouped_mm(h, q2.transpose(1, 2), sh, s2, offs=offs, out_dtype=torch.bfloat16)
    y = y * wt.flatten()[order, None]
    out = torch.zeros(t, H, device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float())
    return out.to(x.dtype)


def loop_moe(x, ids, wt, w13, w2):
    out = torch.zeros_like(x)
    mask = F.one_hot(ids.long(), E).permute(2, 1, 0)
    for e in (mask.sum((-1, -2)) > 0).nonzero():
        e = e[0]
        kp, ti = torch.where(mask[e])
        g, u = F.linear(x[ti], w13[e]).chunk(2, -1)
        out.index_add_(0, ti, (F.linear(F.silu(g) * u, w2[e]) * wt[ti, kp, None]).to(out.dtype))
    return out


def static_activation_scales(x, ids, w13) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 activation scales calibrated as a checkpoint's static ones are: the absmax of the
    MoE input and of the SiLU·up intermediate (from the first 16 tokens' pairs) over 448."""
    pairs = [(t, e) for t in range(min(16, x.shape[0])) for e in ids[t].tolist()]
    h_amax = max(
        (F.silu(g) * u).abs().max().item()
        for g, u in (F.linear(x[t], w13[e]).float().chunk(2) for t, e in pairs)
    )
    return (x.float().abs().max() / 448).reshape(1), torch.tensor([h_amax / 448], device=x.device)


def sweep_configs(t: int, fp8: bool) -> list[MoeConfig]:
    """Launch configs tried at T tokens. Decode sizes (T ≤ 128): 16-row blocks, narrow to wide column
    blocks (more programs balance the few active experts over the SMs), for FP8 wider K blocks (half the
    bytes per K) and the activation quantization inside the GEMMs or as its own kernels; and the weights
    as the MMA's rows (`swap_ab`: a wgmma with 16 token columns, FP8 weights read from shared memory
    without widening); at one token, every config with one pair per M block (`pair_blocks`, no
    alignment launch) and the combine in 256-column programs (the aligned blocks they replace are not
    re-timed here). Prefill sizes: FP8 with 3 or 4 stages (and 5 for 128-row blocks of 128 × 128
    above 1,024 tokens). Every size: weight tiles by pointer loads or
    by TMA bulk copies. (Five stages and
    64-row FP8 blocks at decode sizes are not swept: they never won, bench/LOG.md.)"""
    if t <= 128:
        k_blocks = (128, 256) if fp8 else (64, 128)
        rows = [
            MoeConfig(16, bn, bk, 1, 4, stages, on_load, tma)
            for bn in (32, 64, 128)
            for bk in k_blocks
            for stages in (3, 4)
            for on_load, tma in (
                ((False, False), (True, False), (False, True)) if fp8 else ((False, False), (False, True))
            )
        ]
        swapped = [
            MoeConfig(16, bn, bk, 1, 4, stages, on_load, tma, swap_ab=True)
            for bn in (64, 128)
            for bk in k_blocks
            for stages in (3, 4)
            for on_load, tma in (
                ((False, False), (False, True), (True, True)) if fp8 else ((False, False), (False, True))
            )
        ]
        if t == 1:  # one token's experts are distinct: a block per pair, no alignment launch; the combine
            # in 16 programs of 256 columns (faster than 4 of 1024)
            return [dataclasses.replace(cfg, pair_blocks=True, combine_block=256) for cfg in rows + swapped]
        return rows + swapped
    block_ms = (32, 64) if t <= 1024 else (64, 128)
    configs = [
        MoeConfig(bm, bn, bk, 8, 4 if bm <= 32 else 8, stages, tma=tma)
        for bm in block_ms
        for bn in (64, 128)
        for bk in ((128, 256) if fp8 else (64, 128))
        for stages in ((3, 4) if fp8 else (3,))
        for tma in (False, True)
    ]
    if fp8 and t > 1024:  # the H100's 8K pick (128 × 128 × 128, 4 stages, run Y) one stage deeper
        configs += [MoeConfig(128, 128, 128, 8, 8, 5, tma=tma) for tma in (False, True)]
    if t > 1024 and PERSISTENT:
        configs += persistent_sweep_configs(fp8)
    return configs


def persistent_sweep_configs(fp8: bool) -> list[MoeConfig]:
    """The persistent Gluon GEMMs' configs (`fused_moe_persistent`): 64 or 128 columns per operand for
    each GEMM, a ring of 3 or 4 slots (K boxes of 128 bytes; block_k says so for the Triton fallback)."""
    return [
        MoeConfig(128, bn, 128 if fp8 else 64, 8, 8, stages, persistent=True, down_block_n=down_bn)
        for bn in (64, 128)
        for down_bn in (64, 128)
        for stages in (3, 4)
    ]


PERSISTENT_CONFIG = {  # 128 rows × 128 columns per operand (both GEMMs), 4 ring slots; K boxes of 128 bytes
    "bf16": MoeConfig(128, 128, 64, 8, 8, 4, persistent=True),
    "fp8": MoeConfig(128, 128, 128, 8, 8, 4, persistent=True),
}


def persistent_rows(t, x, ids, wt, ref, bf16_weights, fp8_weights, t_bf16, t_fp8) -> None:
    """The persistent Gluon GEMMs (`fused_moe_persistent`) beside the shipped configs' rows: ms, error
    against the bf16 reference, the ratio to the shipped config of the same dtype and to shipped bf16.
    A failure (not an sm_90 GPU) is printed, not raised."""
    shipped = {"bf16": t_bf16, "fp8": t_fp8}
    for kind, weights in (("bf16", bf16_weights), ("fp8", fp8_weights)):
        cfg = PERSISTENT_CONFIG[kind]
        try:
            out = fused_moe_triton(x, wt, ids, *weights, None, None, None, config=cfg)
            ms = bench(lambda w=weights, c=cfg: fused_moe_triton(x, wt, ids, *w, None, None, None, config=c))
        except Exception as exc:  # report and go on: the other rows stand
            print(f"FusedMoE T={t}: persistent {kind} failed: {type(exc).__name__}: {exc}")
            continue
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        RESULTS[f"moe_T{t}"][f"hy3c_{kind}_persistent_ms"] = ms
        RESULTS[f"moe_T{t}"][f"rel_err_{kind}_persistent"] = err
        row(
            f"FusedMoE T={t}: hy3c {kind} persistent Gluon GEMMs (err {err:.1e})",
            ms,
            f"{2 * t * K_TOP * 3 * H * INTER / (ms * 1e-3) / 1e12:.0f} TFLOP/s",
            f"{shipped[kind] / ms:.2f}× vs shipped {kind}, {t_bf16 / ms:.2f}× vs hy3c bf16",
        )


def down_sweep_configs(base: MoeConfig, fp8: bool) -> list[MoeConfig]:
    """The down GEMM's own tiles tried from a prefill bucket's config (`MoeConfig.down`): its K (the
    intermediate width, 1,536) is a third of the gate-up's and its N (hidden, 4,096) 2.7× the gate-up's
    per half, so wider column blocks and another pipeline depth may suit it. The base itself (no tiles
    of its own) is among them."""
    return [base] + [
        dataclasses.replace(
            base, down_block_n=bn, down_block_k=bk, down_num_warps=warps, down_num_stages=stages
        )
        for bn in (128, 256)
        for bk in ((128, 256) if fp8 else (64, 128))
        for warps, stages in ((8, 3), (8, 4), (4, 3))
    ]


def sweep_bucket(x, ids, wt, variants: dict[str, tuple], from_shipped: bool) -> dict[str, MoeConfig]:
    """Best config of each variant (kind → weights, weight scales, activation scales) at this token
    count: replayed from CUDA graphs at decode sizes (as a decode step runs them), plain launches above.
    At prefill sizes the joint best is then given the down GEMM's own tiles where they win
    (`down_sweep_configs`; a persistent pick takes its down columns from the first sweep). `from_shipped`
    (prefill sizes): no joint sweep — the down tiles from the shipped config and the persistent configs."""
    t = x.shape[0]
    timer = graph_ms if t <= 128 else bench
    chosen = {}
    for kind, weights in variants.items():
        if t > 128 and kind == "fp8_static":  # prefill buckets: fp8_static takes fp8's tiles
            continue
        default = select_config(t, kind, torch.cuda.get_device_name())
        tried: dict[str, float | None] = {}

        def best_of(configs: list[MoeConfig], stage: str, weights=weights, kind=kind, tried=tried):
            best: tuple[float, MoeConfig] | None = None
            for cfg in configs:
                try:
                    ms = timer(lambda c=cfg, w=weights: fused_moe_triton(x, wt, ids, *w, None, config=c))
                except Exception:  # shared memory overflow for large tiles
                    continue
                tried[str(cfg)] = ms
                shown = "not timed" if ms is None else f"{ms:.4f} ms"
                print(f"sweep {kind} T={t} ({stage}): {shown} {cfg}", flush=True)
                if ms is not None and (best is None or ms < best[0]):
                    best = (ms, cfg)
            return best

        fp8 = kind != "bf16"
        if from_shipped and t > 128:
            candidates = down_sweep_configs(default, fp8) if DOWN_TILES else [default]
            candidates += persistent_sweep_configs(fp8) if PERSISTENT else []
            best = best_of(candidates, "down tiles, persistent")
        else:
            best = best_of(sweep_configs(t, fp8), "tiles")
            if t > 128 and best is not None and not best[1].persistent:
                best = best_of(down_sweep_configs(best[1], fp8), "down tiles") or best
        if best is None:  # nothing could be timed (every capture failed): keep the shipped config
            print(f"sweep {kind} T={t}: no config could be timed")
            continue
        default_ms = timer(lambda c=default, w=weights: fused_moe_triton(x, wt, ids, *w, None, config=c))
        shipped = f"{default_ms:.4f} ms" if default_ms is not None else "not capturable"
        print(f"sweep {kind} T={t}: best {best[0]:.4f} ms with {best[1]}; shipped {shipped} {default}")
        RESULTS.setdefault(f"sweep_T{t}", {})[kind] = {
            "best_ms": best[0],
            "best": best[1].__dict__,
            "shipped_ms": default_ms,
            "timer": "cuda_graph" if t <= 128 else "launches",
            "tried": tried,
        }
        chosen[kind] = best[1]
    return chosen


def moe_bench(sweep: bool, token_counts: tuple[int, ...], from_shipped: bool = False) -> None:
    w13, w2, q13, q2, s13, s2 = experts()
    tuned: dict[str, dict[int, MoeConfig]] = {"bf16": {}, "fp8": {}, "fp8_static": {}}
    for t in token_counts:
        x, ids, wt = routed_tokens(t)
        active = ids.unique().numel()
        wbytes = active * 3 * H * INTER * 2
        flops = 2 * t * K_TOP * 3 * H * INTER
        ref = grouped_mm_moe(x, ids, wt, w13, w2)
        ours = fused_moe_triton(x, wt, ids, w13, w2, None, None, None, None, None)
        err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        t_group = bench(lambda x=x, ids=ids, wt=wt: grouped_mm_moe(x, ids, wt, w13, w2))
        t_ours = bench(
            lambda x=x, ids=ids, wt=wt: fused_moe_triton(x, wt, ids, w13, w2, None, None, None, None, None)
        )
        t_fp8 = bench(
            lambda x=x, ids=ids, wt=wt: fused_moe_triton(x, wt, ids, q13, q2, s13, s2, None, None, None)
        )
        a13, a2 = static_activation_scales(x, ids, w13)
        t_fp8s = bench(
            lambda x=x, ids=ids, wt=wt, a13=a13, a2=a2: fused_moe_triton(
                x, wt, ids, q13, q2, s13, s2, a13, a2, None
            )
        )
        fp8s_out = fused_moe_triton(x, wt, ids, q13, q2, s13, s2, a13, a2, None)
        err8s = ((fp8s_out.float() - ref.float()).norm() / ref.float().norm()).item()
        fp8_out = fused_moe_triton(x, wt, ids, q13, q2, s13, s2, None, None, None)
        err8 = ((fp8_out.float() - ref.float()).norm() / ref.float().norm()).item()
        t_loop = bench(lambda x=x, ids=ids, wt=wt: loop_moe(x, ids, wt, w13, w2)) if t <= 128 else None
        try:
            peer8 = scaled_grouped_mm_moe(x, ids, wt, q13, q2, s13, s2)
            err_peer8 = ((peer8.float() - ref.float()).norm() / ref.float().norm()).item()
            t_peer8 = bench(lambda x=x, ids=ids, wt=wt: scaled_grouped_mm_moe(x, ids, wt, q13, q2, s13, s2))
        except RuntimeError as exc:  # a torch build without the sm90 FP8 grouped GEMM
            print(f"_scaled_grouped_mm peer unavailable: {exc}")
            t_peer8 = err_peer8 = None
        RESULTS[f"moe_T{t}"] = {
            "grouped_mm_ms": t_group,
            "hy3c_bf16_ms": t_ours,
            "hy3c_fp8_ms": t_fp8,
            "hy3c_fp8_static_ms": t_fp8s,
            "rel_err_fp8_static": err8s,
            "loop_ms": t_loop,
            "scaled_grouped_mm_fp8_ms": t_peer8,
            "rel_err_scaled_grouped_mm_fp8": err_peer8,
            "active_experts": active,
            "rel_err_bf16": err,
            "rel_err_fp8": err8,
        }
        bw = (
            f"{wbytes / (t_ours * 1e-3) / BW * 100:.0f}% BW, {flops / (t_ours * 1e-3) / PEAK * 100:.0f}% peak"
        )
        row(f"FusedMoE T={t}: grouped_mm peer", t_group, f"{wbytes / (t_group * 1e-3) / BW * 100:.0f}% BW")
        if t_loop:
            row(f"FusedMoE T={t}: transformers loop peer", t_loop)
        row(
            f"FusedMoE T={t}: hy3c bf16 (err {err:.1e})", t_ours, bw, f"{t_group / t_ours:.2f}× vs grouped_mm"
        )
        if t_peer8 is not None:
            row(
                f"FusedMoE T={t}: _scaled_grouped_mm FP8 peer (err {err_peer8:.1e})",
                t_peer8,
                f"{wbytes / 2 / (t_peer8 * 1e-3) / BW * 100:.0f}% BW",
            )
        row(
            f"FusedMoE T={t}: hy3c FP8 (err {err8:.1e})",
            t_fp8,
            f"{wbytes / 2 / (t_fp8 * 1e-3) / BW * 100:.0f}% BW",
            f"{t_ours / t_fp8:.2f}× vs hy3c bf16"
            + (f", {t_peer8 / t_fp8:.2f}× vs _scaled_grouped_mm" if t_peer8 is not None else ""),
        )
        row(
            f"FusedMoE T={t}: hy3c FP8, static activation scales (err {err8s:.1e})",
            t_fp8s,
            f"{wbytes / 2 / (t_fp8s * 1e-3) / BW * 100:.0f}% BW",
            f"{t_ours / t_fp8s:.2f}× vs hy3c bf16",
        )
        if t > 1024 and PERSISTENT:  # prefill sizes: the persistent Gluon GEMMs in one fixed config
            persistent_rows(t, x, ids, wt, ref, (w13, w2, None, None), (q13, q2, s13, s2), t_ours, t_fp8)
        if t <= 128:  # decode sizes: replayed from a CUDA graph, as a decode step runs them
            x_rows = quant_fp8_per_token(x)  # the norm's per-token FP8 rows of x (x_q, x_q_scale)
            graph = {
                "grouped_mm peer": graph_ms(lambda x=x, ids=ids, wt=wt: grouped_mm_moe(x, ids, wt, w13, w2)),
                "hy3c bf16": graph_ms(
                    lambda x=x, ids=ids, wt=wt: fused_moe_triton(x, wt, ids, w13, w2, *[None] * 5)
                ),
                "hy3c FP8": graph_ms(
                    lambda x=x, ids=ids, wt=wt: fused_moe_triton(x, wt, ids, q13, q2, s13, s2, *[None] * 3)
                ),
                "hy3c FP8 static": graph_ms(
                    lambda x=x, ids=ids, wt=wt, a13=a13, a2=a2: fused_moe_triton(
                        x, wt, ids, q13, q2, s13, s2, a13, a2, None
                    )
                ),
                # as the model runs it (pass fuse_moe_input_quant): x comes quantized by the norm
                "hy3c FP8, x from the norm": graph_ms(
                    lambda x=x, ids=ids, wt=wt, xq=x_rows: fused_moe_triton(
                        x, wt, ids, q13, q2, s13, s2, None, None, None, *xq
                    )
                ),
            }
            if (
                t == 1
            ):  # the pair-block configs run the Gluon kernels on sm_90: the Triton kernels beside them
                graph |= {
                    f"{name} (Triton kernels)": graph_ms(lambda args=args: triton_kernels_only(args))
                    for name, args in (
                        ("hy3c bf16", (x, wt, ids, w13, w2, *[None] * 5)),
                        (
                            "hy3c FP8, x from the norm",
                            (x, wt, ids, q13, q2, s13, s2, None, None, None, *x_rows),
                        ),
                        ("hy3c FP8 static", (x, wt, ids, q13, q2, s13, s2, a13, a2, None)),
                    )
                }
            RESULTS[f"moe_T{t}"]["cuda_graph_ms"] = graph
            for name, ms in graph.items():
                if ms is None:
                    row(f"FusedMoE T={t}, CUDA graph: {name}", float("nan"), "not capturable")
                    continue
                share = wbytes / (2 if "FP8" in name else 1) / (ms * 1e-3) / BW * 100
                bf16_ms = graph["hy3c bf16 (Triton kernels)" if "Triton kernels" in name else "hy3c bf16"]
                ratio = f"{bf16_ms / ms:.2f}× vs bf16" if "FP8" in name and bf16_ms else ""
                row(f"FusedMoE T={t}, CUDA graph: {name}", ms, f"{share:.0f}% BW", ratio)
        if sweep:
            variants = {
                "bf16": (w13, w2, None, None, None, None),
                "fp8": (q13, q2, s13, s2, None, None),
                "fp8_static": (q13, q2, s13, s2, a13, a2),
            }
            for kind, cfg in sweep_bucket(x, ids, wt, variants, from_shipped).items():
                tuned[kind][t] = cfg
    if sweep and os.environ.get("OUT"):  # swept buckets replace theirs; the others keep the shipped configs
        file = table_file(device_key(torch.cuda.get_device_name()))  # this GPU's table
        shipped = json.loads(file.read_text()) if file.is_file() else {}
        for kind, table in tuned.items():
            shipped.setdefault(kind, {}).update({str(t): cfg.__dict__ for t, cfg in table.items()})
        with open(os.path.join(os.environ["OUT"], file.name), "w") as f:
            json.dump(shipped, f, indent=1)
            f.write("\n")


def experts() -> tuple[torch.Tensor, ...]:
    """Hy3's routed experts at random: bf16 w13 and w2, their FP8 copies and per-channel scales."""
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    s13, s2 = w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448
    q13 = (w13.float() / s13[..., None]).to(FP8_DTYPE)
    q2 = (w2.float() / s2[..., None]).to(FP8_DTYPE)
    return w13, w2, q13, q2, s13, s2


def routed_tokens(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t random rows, each routed to K_TOP distinct random experts, and their routing weights."""
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K_TOP] for _ in range(t)]).int()
    return x, ids, torch.rand(t, K_TOP, device="cuda")


def dense_fp8_ms(m: int, n: int, k: int) -> float:
    """ms of one cuBLAS FP8 GEMM [m, k] × [k, n] with per-row and per-column scales, bf16 out, and
    fast accumulation (as Triton's FP8 dots on sm_90 accumulate: the faster peer)."""
    a = torch.randn(m, k, device="cuda").to(FP8_DTYPE)
    b = torch.randn(n, k, device="cuda").to(FP8_DTYPE).t()
    sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    return bench(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True))


def prefill_breakdown(token_counts: tuple[int, ...]) -> None:
    """Per-kernel device time of the FP8 FusedMoE at each prefill size, and its whole against the
    dense FP8 GEMMs of the same work (the measured peak it could reach)."""
    _, _, q13, q2, s13, s2 = experts()
    for t in (t for t in token_counts if t > 128):
        x, ids, wt = routed_tokens(t)

        def run(pdl: bool, x=x, ids=ids, wt=wt):
            return fused_moe_triton(x, wt, ids, q13, q2, s13, s2, None, None, None, pdl=pdl)

        whole = bench(lambda: run(True))
        # each kernel's own interval: without programmatic dependent launch, which starts a kernel
        # while the one before it still runs (its interval would hold that wait)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run(False)
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] = kernels.get(event.name, 0.0) + event.time_range.elapsed_us() / 5e3
        gate_up, down = dense_fp8_ms(t * K_TOP, 2 * INTER, H), dense_fp8_ms(t * K_TOP, H, INTER)
        flops = 2 * t * K_TOP * 3 * H * INTER
        dense = gate_up + down
        RESULTS[f"breakdown_T{t}"] = {
            "fused_moe_fp8_ms": whole,
            "kernels_ms": kernels,
            "dense_gate_up_ms": gate_up,
            "dense_down_ms": down,
        }
        row(
            f"FP8 FusedMoE T={t}, whole",
            whole,
            f"{flops / (whole * 1e-3) / 1e12:.0f} TFLOP/s",
            f"{dense / whole * 100:.0f}% of cuBLAS dense FP8 ({dense:.3f} ms, "
            f"{flops / (dense * 1e-3) / 1e12:.0f} TFLOP/s)",
        )
        for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1]):
            row(f"  T={t} kernel {name[:70]}", ms, f"{ms / whole * 100:.0f}% of the whole")
        for name, ms, gemm_flops in (("gate-up", gate_up, flops * 2 // 3), ("down", down, flops // 3)):
            row(f"  T={t} cuBLAS dense FP8 {name} GEMM", ms, f"{gemm_flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--sweep-from-shipped",
        action="store_true",
        help="prefill sizes: only the down GEMM's own tiles from the shipped configs and the persistent ones",
    )
    parser.add_argument(
        "--parts", default="router,align,moe", help="comma list of router, align, moe, breakdown"
    )
    parser.add_argument("--tokens", default="1,16,128,1024,8192", help="moe: comma list of token counts")
    parser.add_argument(
        "--no-persistent", action="store_true", help="sweeps leave out the persistent Gluon GEMMs' configs"
    )
    parser.add_argument(
        "--no-down-tiles",
        action="store_true",
        help="--sweep-from-shipped leaves out the down GEMM's own tiles",
    )
    args = parser.parse_args()
    global PERSISTENT, DOWN_TILES
    PERSISTENT, DOWN_TILES = not args.no_persistent, not args.no_down_tiles
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    if "router" in parts:
        router_bench(args.sweep)
    if "align" in parts:
        align_bench()
    if "moe" in parts:
        moe_bench(
            args.sweep or args.sweep_from_shipped,
            tuple(int(t) for t in args.tokens.split(",")),
            args.sweep_from_shipped,
        )
    if "breakdown" in parts:
        prefill_breakdown(tuple(int(t) for t in args.tokens.split(",")))
    RESULTS["env"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print("| case | ms | notes | ratio |")
    print("|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
