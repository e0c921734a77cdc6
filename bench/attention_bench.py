"""Attention-path benchmark on one GPU (H200): correctness first, then every variant and its peers.

    python bench/attention_bench.py [--quick]     # prints a markdown table, writes $OUT/attention.json

1. Fused QK-norm + RoPE + FP8 quant + KV store at 16K tokens (Hy3 heads 64/8 × 128): the eager chain
   of hy3 L1 reference ops, `torch.compile` of that chain, the Triton kernel; bytes floor at 4.25 TB/s.
2. Decode attention, batch 32 of mixed lengths (1K…128K, the peer set: seed 1), page 64: dynamic
   split-KV vs static split-KV (16 splits per request, and the splits a
   FlashAttention-2-style heuristic picks from the grid), bf16 and FP8 KV, vs a loop of torch SDPA over contiguous
   bf16 KV; % of copy bandwidth on the KV bytes read. Then a single 128K request.
3. Causal prefill attention at 8K and 32K tokens vs torch SDPA (flash).

    python bench/attention_bench.py --spread      # the single 128K request's run-to-run spread only
    python bench/attention_bench.py --prefill     # the prefill rows only
    python bench/attention_bench.py --prefill-candidates  # prefill configs and SDPA, interleaved by round
    python bench/attention_bench.py --qknorm      # the fused QK-norm/RoPE/KV-store rows only
    python bench/attention_bench.py --sweep-qknorm  # … after its launch shapes
    python bench/attention_bench.py --decode-configs  # FP8 decode configs under both timers
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

import hy3c.kernels
import hy3c.ops  # noqa: F401
from hy3c.kernels import overrides
from hy3c.kernels.attention import plan as plan_mod
from hy3c.kernels.attention import qknorm_rope_kvstore
from hy3c.kernels.attention.config import (
    DECODE_CONFIG,
    GLUON_PREFILL_CONFIG,
    LaunchConfig,
    decode_config,
    prefill_config,
    triton_prefill_config,
)
from hy3c.kernels.attention.decode import decode_attention_dynamic
from hy3c.kernels.attention.prefill import prefill_attention
from hy3c.ops.fused import qknorm_rope_quant_kvstore_reference
from hy3c.ops.quant import FP8_DTYPE

from baselines.split_kv import decode_attention_static, heuristic_static_splits

BW = 4.25e12  # measured H200 copy bandwidth, bytes/s
HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 128, 64
hy3 = torch.ops.hy3
ROWS: list[tuple[str, ...]] = []
RESULTS: dict[str, dict] = {}


def bench(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def row(
    name: str, ms: float, floor_ms: float | None = None, base_ms: float | None = None, base_name: str = ""
) -> None:
    pct = f"{floor_ms / ms * 100:.0f}%" if floor_ms else ""
    ratio = f"{base_ms / ms:.2f}× vs {base_name}" if base_ms else ""
    ROWS.append((name, f"{ms:.3f}", pct, ratio))
    print("| " + " | ".join(ROWS[-1]) + " |", flush=True)  # a run cut short still shows what it measured
    RESULTS[name] = {
        "ms": ms,
        "floor_ms": floor_ms,
        "vs": base_name,
        "speedup": base_ms / ms if base_ms else None,
    }


def prefill_slots(tokens: int, device: str = "cuda") -> torch.Tensor:
    """A prefill's slots: consecutive within each page, the pages in random order (as the allocator
    hands them out)."""
    pages = torch.randperm(tokens // PAGE + 1, device=device)
    pos = torch.arange(tokens, device=device)
    return pages[pos // PAGE] * PAGE + pos % PAGE


def qknorm_bench(tokens: int) -> None:
    """The fused op at `tokens` tokens of a prefill (the issue's row); the same prefill after 5 decode
    tokens (a mixed batch: the V stores' runs no longer start at multiples of 16); every token at a
    random slot (the worst case for FP8's transposed V stores)."""
    d = "cuda"
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=d, dtype=torch.bfloat16)
    pos = torch.arange(tokens, device=d)
    qw = 1 + 0.1 * torch.randn(HEAD_DIM, device=d, dtype=torch.bfloat16)
    kw = 1 + 0.1 * torch.randn(HEAD_DIM, device=d, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, tokens // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=d)
    scales = torch.tensor([[0.05, 0.04]], device=d)
    slots = prefill_slots(tokens)
    random_slots = torch.randperm(tokens + PAGE, device=d)[:tokens]
    spare_page = tokens // PAGE  # unused by a prefill of tokens - 5
    after_decodes = torch.cat([spare_page * PAGE + torch.arange(5, device=d), prefill_slots(tokens - 5)])
    args = (qkv, pos, qw, kw, 1e-5, 11158840.0, cache, scales, 0, slots, HEADS, KV_HEADS)
    ref_cache = cache.clone()
    q_ref = qknorm_rope_quant_kvstore_reference(*args[:6], ref_cache, *args[7:])
    q_tri = torch.ops.hy3_triton.qknorm_rope_quant_kvstore(*args)
    err_q = (q_tri.float() - q_ref.float()).abs().max().item()
    err_kv = (cache.float() - ref_cache.float()).abs().max().item()
    RESULTS["qknorm_correctness"] = {"max_abs_err_q": err_q, "max_abs_err_kv": err_kv}
    eager = bench(lambda: qknorm_rope_quant_kvstore_reference(*args))
    compiled_fn = torch.compile(qknorm_rope_quant_kvstore_reference)
    compiled_fn(*args)
    inductor = bench(lambda: compiled_fn(*args))
    triton_ms = bench(lambda: torch.ops.hy3_triton.qknorm_rope_quant_kvstore(*args))
    random_args = (*args[:9], random_slots, *args[10:])
    random_ms = bench(lambda: torch.ops.hy3_triton.qknorm_rope_quant_kvstore(*random_args))
    shifted_args = (*args[:9], after_decodes, *args[10:])
    shifted_ms = bench(lambda: torch.ops.hy3_triton.qknorm_rope_quant_kvstore(*shifted_args))
    v32_ms = bench(lambda: qknorm_rope_kvstore.launch(*args, v_tokens=32))
    v32_shifted_ms = bench(lambda: qknorm_rope_kvstore.launch(*shifted_args, v_tokens=32))
    hadamard_ms = bench(lambda: torch.ops.hy3_triton.qknorm_rope_quant_kvstore(*args, True))
    floor = (
        (
            tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2
            + tokens * HEADS * HEAD_DIM * 2
            + tokens * 2 * KV_HEADS * HEAD_DIM
        )
        / BW
        * 1e3
    )
    row(f"qknorm+rope+fp8+kvstore T={tokens}: eager L1 chain", eager, floor)
    row(f"qknorm+rope+fp8+kvstore T={tokens}: torch.compile chain", inductor, floor, eager, "eager")
    row(f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton", triton_ms, floor, inductor, "torch.compile")
    row(
        f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton, V programs of 32 tokens",
        v32_ms,
        floor,
        triton_ms,
        f"{qknorm_rope_kvstore.V_TOKENS} tokens",
    )
    row(
        f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton, the prefill after 5 decode tokens",
        shifted_ms,
        floor,
        triton_ms,
        "prefill slots",
    )
    row(
        f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton, the prefill after 5 decode tokens, V programs of 32 tokens",
        v32_shifted_ms,
        floor,
        shifted_ms,
        f"{qknorm_rope_kvstore.V_TOKENS} tokens",
    )
    row(
        f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton, every token at a random slot",
        random_ms,
        floor,
        triton_ms,
        "prefill slots",
    )
    row(
        f"qknorm+rope+fp8+kvstore T={tokens}: hy3c Triton + Hadamard",
        hadamard_ms,
        floor,
        triton_ms,
        "without",
    )


def paged_cache(
    lengths: list[int],
    dtype: torch.dtype,
    kv_scale: float,
    device: str = "cuda",
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    page: int = PAGE,
):
    """A one-layer paged cache of random K/V (pages shuffled), its per-tensor scales and page table."""
    d = device
    pages_per = [-(-n // page) for n in lengths]
    total = sum(pages_per)
    cache = torch.empty(1, 2, total, page, kv_heads, head_dim, dtype=dtype, device=d)
    chunk = 1 << 14
    for start in range(0, total, chunk):  # random K/V, filled in chunks to bound temporaries
        n = min(chunk, total - start)
        values = torch.randn(1, 2, n, page, kv_heads, head_dim, device=d) / kv_scale
        cache[:, :, start : start + n] = values.clamp(-448, 448).to(dtype)  # e4m3 has no inf: no NaNs
    order = torch.randperm(total, device=d).int()
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32, device=d)
    cursor = 0
    for r, p in enumerate(pages_per):
        table[r, :p] = order[cursor : cursor + p]
        cursor += p
    scales = torch.tensor([[kv_scale, kv_scale]], device=d)
    return cache, table, scales


def decode_bench(lengths: list[int], label: str, sdpa_ms: float | None) -> None:
    d = "cuda"
    sms = torch.cuda.get_device_properties(d).multi_processor_count
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=d)
    qsl = torch.arange(len(lengths) + 1, dtype=torch.int32, device=d)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    scale = HEAD_DIM**-0.5
    tokens = sum(lengths)
    for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
        cache, table, scales = paged_cache(lengths, dtype, kv_scale)
        kv_bytes = tokens * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
        floor = kv_bytes / BW * 1e3
        dyn = decode_attention_dynamic(q, cache, scales, 0, table, seq_lens, scale, plan)
        if len(lengths) <= 32:  # correctness against the torch reference on the same paged data
            ref = hy3.attention(q, cache, scales, 0, table, seq_lens, qsl, scale)
            RESULTS[f"decode_{label}_{dtype}_max_abs_err"] = (dyn.float() - ref.float()).abs().max().item()
            static = decode_attention_static(q, cache, scales, 0, table, seq_lens, scale)
            RESULTS[f"decode_{label}_{dtype}_static_max_abs_err"] = (
                (static.float() - ref.float()).abs().max().item()
            )
            RESULTS[f"decode_{label}_{dtype}_nan"] = {
                "dynamic": dyn.isnan().any().item(),
                "reference": ref.isnan().any().item(),
                "cache": cache.float().isnan().any().item(),
            }
        name = "bf16" if dtype == torch.bfloat16 else "fp8"
        kv = (cache, scales, 0, table, seq_lens, scale)
        t_dyn = bench(lambda kv=kv: decode_attention_dynamic(q, *kv, plan))
        with overrides.forced(overrides.PDL, False):
            t_no_pdl = bench(lambda kv=kv: decode_attention_dynamic(q, *kv, plan))
        t_static = bench(lambda kv=kv: decode_attention_static(q, *kv))
        splits = heuristic_static_splits(
            len(lengths) * KV_HEADS, sms, plan_mod.cdiv(max(lengths), DECODE_CONFIG.block_n)
        )
        t_heuristic = bench(lambda kv=kv, n=splits: decode_attention_static(q, *kv, splits=n))
        row(f"decode {label} {name} KV: static split-KV, FA2-style splits ({splits})", t_heuristic, floor)
        row(f"decode {label} {name} KV: static split-KV (16)", t_static, floor)
        row(f"decode {label} {name} KV: dynamic split-KV", t_dyn, floor, t_static, "static (16)")
        row(f"decode {label} {name} KV: dynamic vs FA2-style static", t_dyn, floor, t_heuristic, "FA2-style")
        row(f"decode {label} {name} KV: dynamic, launched without PDL", t_no_pdl, floor, t_dyn, "with PDL")
        if dtype == FP8_DTYPE:  # the same blocks by per-row pointer loads (pages 64 does not divide)
            pointers = dataclasses.replace(decode_config(dtype, len(lengths)), tma=False)
            t_ptr = bench(lambda kv=kv, c=pointers: decode_attention_dynamic(q, *kv, plan, config=c))
            row(f"decode {label} {name} KV: dynamic, pointer loads", t_ptr, floor, t_dyn, "TMA (shipped)")
        if sdpa_ms is not None:
            row(f"decode {label} {name} KV: dynamic vs SDPA loop", t_dyn, floor, sdpa_ms, "SDPA loop (bf16)")
        del cache, kv


def sdpa_loop_ms(lengths: list[int]) -> float:
    d = "cuda"
    q = torch.randn(len(lengths), HEADS, 1, HEAD_DIM, device=d, dtype=torch.bfloat16)
    ks = [torch.randn(1, KV_HEADS, n, HEAD_DIM, device=d, dtype=torch.bfloat16) for n in lengths]
    vs = [torch.randn_like(k) for k in ks]
    ms = bench(
        lambda: [
            F.scaled_dot_product_attention(q[i : i + 1], ks[i], vs[i], enable_gqa=True)
            for i in range(len(lengths))
        ]
    )
    tokens = sum(lengths)
    row(
        f"decode B={len(lengths)} SDPA loop, contiguous bf16 KV (peer)",
        ms,
        tokens * KV_HEADS * HEAD_DIM * 4 / BW * 1e3,
    )
    return ms


def prefill_case(
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable, float]:
    """One causal prefill request of `tokens` new tokens at Hy3's heads: (q, seq_lens, query start
    locations, its attention plan, a call of torch SDPA on contiguous bf16 q/k/v of the same shape, FLOPs)."""
    d = "cuda"
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=d)
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device=d)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    qq = torch.randn(1, HEADS, tokens, HEAD_DIM, device=d, dtype=torch.bfloat16)
    kk = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device=d, dtype=torch.bfloat16)
    vv = torch.randn_like(kk)

    def sdpa_call() -> torch.Tensor:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)

    return q, seq_lens, qsl, plan, sdpa_call, 4 * HEADS * tokens * tokens * HEAD_DIM / 2


def prefill_bench(tokens: int) -> None:
    """Causal prefill of one request over a paged bf16 and an FP8 KV cache vs SDPA on contiguous bf16:
    the shipped kernel per KV dtype (bf16: the warp-specialized Gluon kernel), the Triton kernel, and
    the Triton kernel with lazy rescaling."""
    q, seq_lens, qsl, plan, sdpa_call, flops = prefill_case(tokens)
    sdpa = bench(sdpa_call)
    row(f"prefill {tokens} causal: SDPA (flash, contiguous)", sdpa)
    RESULTS[f"prefill_{tokens}_tflops"] = {"sdpa": flops / sdpa / 1e9}
    for dtype, kv_scale, name in ((torch.bfloat16, 1.0, "bf16"), (FP8_DTYPE, 0.01, "fp8")):
        cache, table, scales = paged_cache([tokens], dtype, kv_scale)
        kv = (cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5, plan)
        shipped = prefill_config(dtype, cache.shape[3])
        kernel = "Gluon warp-specialized" if shipped.warp_specialized else "Triton"
        ours = bench(lambda kv=kv: prefill_attention(q, *kv))
        row(f"prefill {tokens} causal: hy3c {kernel} paged, {name} KV", ours, None, sdpa, "SDPA")
        RESULTS[f"prefill_{tokens}_tflops"][name] = flops / ours / 1e9
        ref = prefill_attention(q, *kv)
        triton_config = triton_prefill_config(dtype, cache.shape[3])
        others = {"eager": triton_config, "lazy": dataclasses.replace(triton_config, lazy_rescale=True)}
        if not shipped.warp_specialized:
            del others["eager"]  # the shipped row
        for what, config in others.items():
            alt = prefill_attention(q, *kv, config=config)
            err = ((alt.float() - ref.float()).norm() / ref.float().norm()).item()
            t_other = bench(lambda kv=kv, c=config: prefill_attention(q, *kv, config=c))
            row(
                f"prefill {tokens} causal: hy3c Triton paged, {name} KV, {what} rescale (rel. diff {err:.1e})",
                t_other,
                None,
                ours,
                "shipped",
            )
            RESULTS[f"prefill_{tokens}_tflops"][f"{name}_triton_{what}_rescale"] = flops / t_other / 1e9
        del cache, kv


def sweep_prefill(tma_only: bool = False) -> None:
    """Prefill launch configs at 8K tokens, bf16 and FP8 KV: query rows per program, key block, warps,
    stages, a register cap for 8 warps, key blocks by TMA bulk copies (one per page slice) or per-row
    pointer loads (tma_only: TMA blocks only, as the shipped configs use); eager rescaling (the default)."""
    d = "cuda"
    q = torch.randn(8192, HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
    seq_lens = torch.tensor([8192], dtype=torch.int32, device=d)
    qsl = torch.tensor([0, 8192], dtype=torch.int32, device=d)
    flops = 4 * HEADS * 8192 * 8192 * HEAD_DIM / 2
    for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
        cache, table, scales = paged_cache([8192], dtype, kv_scale)
        for rows in (128, 256):
            plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8, rows))
            for block_n, tma in ((64, True),) if tma_only else ((64, False), (128, False), (64, True)):
                # 8 warps over 128 rows also capped at 128 registers: two CTAs per SM (uncapped: 216, one)
                shapes = ((4, 0), (8, 0), (8, 128)) if rows <= 128 else ((8, 0),)
                for (warps, max_registers), stages in itertools.product(shapes, (2, 3, 4) if tma else (2, 3)):
                    cfg = LaunchConfig(
                        block_n=block_n,
                        num_warps=warps,
                        num_stages=stages,
                        q_rows=rows,
                        tma=tma,
                        max_registers=max_registers,
                    )
                    label = (
                        f"sweep prefill 8192 {dtype} rows={rows} block_n={block_n} warps={warps} "
                        f"max_registers={max_registers or 'auto'} stages={stages} tma={tma}"
                    )
                    try:
                        ms = bench(
                            lambda c=cfg, p=plan, kv=(cache, scales, 0, table): prefill_attention(
                                q, *kv, seq_lens, qsl, HEAD_DIM**-0.5, p, config=c
                            )
                        )
                    except Exception as exc:  # e.g. out of shared memory for the larger tiles
                        print(f"{label}: failed {type(exc).__name__}")
                        continue
                    print(f"{label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        del cache


def prefill_candidates(rounds: int = 4) -> None:
    """The shipped prefill configs against candidate configs, interleaved with torch SDPA round by round
    after 2 s of SDPA (a long sweep heats the GPU and lowers its clock, so every ratio is taken within one
    round), at 8K and 32K tokens, bf16 and FP8 KV. Prints each config's ms per round and its ratio to SDPA."""
    # num_stages: Triton splits the pipeline depth between the page-table load and the TMA copies that
    # depend on it, so 2-4 stages keep the copies one block ahead and 5 two blocks (three buffers)
    tma = functools.partial(LaunchConfig, tma=True)
    candidates = {
        "Gluon warp-specialized, 128 keys, 2 slots": GLUON_PREFILL_CONFIG,
        "64 keys, 4 warps, 2 stages": tma(block_n=64, num_warps=4, num_stages=2),
        "64 keys, 4 warps, 5 stages": tma(block_n=64, num_warps=4, num_stages=5),
        "64 keys, 8 warps ≤128 regs, 2 stages": tma(block_n=64, num_warps=8, num_stages=2, max_registers=128),
    }
    for tokens in (8192, 32768):
        q, seq_lens, qsl, plan, sdpa_call, flops = prefill_case(tokens)
        for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
            cache, table, scales = paged_cache([tokens], dtype, kv_scale)
            kv = (cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5, plan)
            shipped = prefill_config(dtype, cache.shape[3])
            ref = prefill_attention(q, *kv)
            times: dict[str, list[float]] = {"SDPA": []}
            warm_until = time.perf_counter() + 2.0  # the clock settles under load before round 1
            while time.perf_counter() < warm_until:
                sdpa_call()
                torch.cuda.synchronize()
            runs = {n: c for n, c in candidates.items() if dtype == torch.bfloat16 or not c.warp_specialized}
            for _ in range(rounds):
                times["SDPA"].append(bench(sdpa_call))
                for name, cfg in runs.items():
                    out = prefill_attention(q, *kv, config=cfg)
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    assert err < 1e-2, f"{name}: relative difference {err:.1e} from the shipped config"
                    call = (q, *kv)
                    times.setdefault(name, []).append(
                        bench(lambda a=call, c=cfg: prefill_attention(*a, config=c))
                    )
            for name, ms in times.items():
                mark = " (shipped)" if runs.get(name) == shipped else ""
                ratios = " / ".join(f"{s / m:.3f}" for s, m in zip(times["SDPA"], ms, strict=True))
                line = " / ".join(f"{m:.3f}" for m in ms)
                tf = flops / min(ms) / 1e9
                print(
                    f"| prefill {tokens} {dtype_name(dtype)} KV: {name}{mark} | {line} | {tf:.0f} | {ratios} |"
                )
                RESULTS[f"prefill candidates {tokens} {dtype_name(dtype)} {name}"] = {"ms": ms}


def sweep_qknorm() -> None:
    """Fused QK-norm/RoPE/FP8/KV-store launch shapes at 1 … 16K tokens of a prefill (slots consecutive
    per page), then the tokens and KV heads per FP8 V program at 16K."""
    d = "cuda"
    tokens = 16384
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=d, dtype=torch.bfloat16)
    pos = torch.arange(tokens, device=d)
    w = 1 + 0.1 * torch.randn(HEAD_DIM, device=d, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, tokens // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=d)
    scales = torch.tensor([[0.05, 0.04]], device=d)
    slots = prefill_slots(tokens)
    floor = (
        (
            tokens * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2
            + tokens * HEADS * HEAD_DIM * 2
            + tokens * 2 * KV_HEADS * HEAD_DIM
        )
        / BW
        * 1e3
    )

    def time(n: int, **tunables) -> float:
        args = (qkv[:n], pos[:n], w, w, 1e-5, 11158840.0, cache, scales, 0, slots[:n], HEADS, KV_HEADS)
        return bench(lambda: qknorm_rope_kvstore.launch(*args, **tunables))

    groups = HEADS // qknorm_rope_kvstore.q_group(HEADS) + 1
    for block_t, warps, per_program in (
        (4, 8, None),
        (4, 4, None),
        (8, 8, None),
        (2, 4, None),
        (4, 8, groups // 2),
        (8, 4, 1),
    ):
        for n in (1, 32, 128, 1024, tokens):
            ms = time(n, block_t=block_t, num_warps=warps, groups_per_program=per_program)
            print(
                f"sweep qknorm T={n} block_t={block_t} warps={warps} groups/program={per_program or 'auto'}: "
                f"{ms:.4f} ms ({floor * n / tokens / ms * 100:.0f}% BW)"
            )
    for v_tokens, v_heads in ((16, 1), (16, 2), (16, 4), (16, 8), (32, 1), (32, 2)):
        ms = time(tokens, v_tokens=v_tokens, v_heads=v_heads)
        print(f"sweep qknorm T={tokens} V programs of {v_tokens} tokens × {v_heads} KV heads: {ms:.4f} ms")


def sweep_decode(lengths: list[int]) -> None:
    """Dynamic decode launch configs on the mixed batch and its longest request, bf16 and FP8 KV: key
    block, warps, stages, CTAs per SM, minimum range per CTA."""
    d = "cuda"
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=d)
    qsl = torch.arange(len(lengths) + 1, dtype=torch.int32, device=d)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    single = [lengths[0]]
    single_plan = hy3.attention_plan(
        torch.tensor(single, dtype=torch.int32, device=d),
        torch.arange(2, dtype=torch.int32, device=d),
        plan_mod.KV_TILE,
        plan_mod.prefill_q_block(8),
    )
    for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
        cache, table, scales = paged_cache(lengths, dtype, kv_scale)
        floor = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * cache.element_size() / BW * 1e3
        single_floor = single[0] * KV_HEADS * HEAD_DIM * 2 * cache.element_size() / BW * 1e3
        shapes = ((128, 4), (256, 4), (256, 8)) if dtype == FP8_DTYPE else ((64, 4), (128, 4), (128, 8))
        occupancy = [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1)] + [(8, 8), (8, 16), (8, 32)] * (
            dtype == FP8_DTYPE
        )
        for (block_n, warps), stages, (ctas, min_tiles) in itertools.product(shapes, (2, 3), occupancy):
            cfg = LaunchConfig(
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
                ctas_per_sm=ctas,
                min_tiles_per_cta=min_tiles,
            )
            kv = (cache, scales, 0, table, seq_lens, HEAD_DIM**-0.5, plan)
            try:
                ms = bench(lambda c=cfg, kv=kv: decode_attention_dynamic(q, *kv, config=c))
            except Exception as exc:  # e.g. out of shared memory for the larger tiles
                print(f"sweep decode {dtype} {cfg}: failed {type(exc).__name__}")
                continue
            one = (cache, scales, 0, table[:1], seq_lens[:1], HEAD_DIM**-0.5, single_plan)
            ms1 = bench(lambda c=cfg, one=one: decode_attention_dynamic(q[:1], *one, config=c))
            print(
                f"sweep decode {dtype} block_n={block_n} warps={warps} stages={stages} ctas/sm={ctas} "
                f"min tiles/CTA={min_tiles}: B=32 mixed {ms:.3f} ms ({floor / ms * 100:.0f}% BW), "
                f"B=1 {single[0] // 1024}K {ms1:.3f} ms ({single_floor / ms1 * 100:.0f}% BW)"
            )
        del kv, one


def decode_spread(length: int, repeats: int = 6) -> None:
    """The single-request decode rows' run-to-run spread: `repeats` timings of one `length` request in
    each setting — L2 flushed before every run (`do_bench`, as the table's rows) or CUDA-graph replays
    back to back; PDL on or off; pages in random order (as the rows) or in order — for bf16 and FP8 KV,
    beside SDPA on contiguous KV; min / median / max ms and % of copy bandwidth at the median."""
    d = "cuda"
    seq_lens = torch.tensor([length], dtype=torch.int32, device=d)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=d)
    q = torch.randn(1, HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    timers = {"L2 flushed": bench, "graph replays": lambda fn: do_bench_cudagraph(fn, rep=40)}
    print("| case | min | median | max | % BW (median) |")
    print("|---|---|---|---|---|")

    def show(name: str, times: list[float], kv_bytes: int) -> None:
        times = sorted(times)
        med = times[len(times) // 2]
        print(
            f"| {name} | {times[0]:.4f} | {med:.4f} | {times[-1]:.4f} | {kv_bytes / BW * 1e3 / med * 100:.0f}% |"
        )
        RESULTS[f"spread {name}"] = {"ms": times}

    sdpa_bytes = length * KV_HEADS * HEAD_DIM * 2 * 2
    qq = torch.randn(1, HEADS, 1, HEAD_DIM, device=d, dtype=torch.bfloat16)
    kk = torch.randn(1, KV_HEADS, length, HEAD_DIM, device=d, dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    for timer_name, timer in timers.items():  # the peer under both timers
        times = [
            timer(lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)) for _ in range(repeats)
        ]
        show(f"SDPA, contiguous bf16 KV, {timer_name}", times, sdpa_bytes)
    for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
        cache, table, scales = paged_cache([length], dtype, kv_scale)
        kv_bytes = length * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
        in_order = torch.arange(table.shape[1], dtype=torch.int32, device=d)[None]
        for pages, page_table in (("random pages", table), ("pages in order", in_order)):
            kv = (cache, scales, 0, page_table, seq_lens, HEAD_DIM**-0.5, plan)
            for (timer_name, timer), pdl in itertools.product(timers.items(), (True, False)):
                with overrides.forced(overrides.PDL, pdl):
                    times = [timer(lambda kv=kv: decode_attention_dynamic(q, *kv)) for _ in range(repeats)]
                name = f"{dtype_name(dtype)} {pages}, {timer_name}, PDL {'on' if pdl else 'off'}"
                show(name, times, kv_bytes)
        del cache


def decode_configs(lengths: list[int], repeats: int = 3) -> None:
    """FP8 decode launch configs (64-key TMA page slices) on the mixed batch and its longest request,
    under both timers — L2 flushed before every run (`do_bench`, the table's rows) and CUDA-graph
    replays (as decode runs) — beside bf16's shipped config; median of `repeats` timings."""
    d = "cuda"
    timers = {"L2 flushed": bench, "graph replays": lambda fn: do_bench_cudagraph(fn, rep=40)}
    fp8_configs = [
        LaunchConfig(
            block_n=64, num_warps=4, num_stages=stages, ctas_per_sm=ctas, min_tiles_per_cta=tiles, tma=True
        )
        for ctas, stages, tiles in (
            (8, 2, 16),
            (3, 2, 1),
            (8, 5, 16),
            (6, 5, 16),
            (4, 5, 16),
            (4, 5, 1),
            (3, 5, 1),
            (2, 5, 1),
        )
    ]  # 5 stages: three K/V buffers (2-4 keep two; the page-table load takes a stage)
    print("| case | config | L2 flushed ms | graph replays ms | % BW (graph) | bf16 / this (graph) |")
    print("|---|---|---|---|---|---|")
    for label, case in (("B=32 mixed", lengths), (f"B=1 {lengths[0] // 1024}K", lengths[:1])):
        seq_lens = torch.tensor(case, dtype=torch.int32, device=d)
        qsl = torch.arange(len(case) + 1, dtype=torch.int32, device=d)
        q = torch.randn(len(case), HEADS, HEAD_DIM, device=d, dtype=torch.bfloat16)
        plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
        bf16_graph = None
        for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
            cache, table, scales = paged_cache(case, dtype, kv_scale)
            kv_bytes = sum(case) * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
            kv = (cache, scales, 0, table, seq_lens, HEAD_DIM**-0.5, plan)
            shipped = decode_config(dtype, len(case))
            for cfg in [shipped] if dtype == torch.bfloat16 else fp8_configs:
                ms = {
                    name: sorted(
                        timer(lambda c=cfg, kv=kv, q=q: decode_attention_dynamic(q, *kv, config=c))
                        for _ in range(repeats)
                    )[repeats // 2]
                    for name, timer in timers.items()
                }
                bf16_graph = bf16_graph or ms["graph replays"]
                what = (
                    f"{dtype_name(dtype)} {cfg.ctas_per_sm} CTAs/SM, {cfg.num_stages} stages, "
                    f"min {cfg.min_tiles_per_cta} tiles{' (shipped)' if cfg == shipped else ''}"
                )
                pct = kv_bytes / BW * 1e3 / ms["graph replays"] * 100
                print(
                    f"| {label} | {what} | {ms['L2 flushed']:.4f} | {ms['graph replays']:.4f} | {pct:.0f}% | "
                    f"{bf16_graph / ms['graph replays']:.2f}× |",
                    flush=True,
                )
                RESULTS[f"configs {label} {what}"] = ms
            del cache, kv


def dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp8"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke test)")
    parser.add_argument("--sweep", action="store_true", help="time each kernel's tunables first")
    parser.add_argument("--sweep-decode", action="store_true", help="only the decode sweep, then the rows")
    parser.add_argument(
        "--sweep-prefill",
        nargs="?",
        const="all",
        choices=("all", "tma"),
        help="only the prefill sweep (all variants, or the TMA ones) and the prefill rows",
    )
    parser.add_argument("--spread", action="store_true", help="only the single-request decode spread")
    parser.add_argument("--prefill", action="store_true", help="only the prefill rows")
    parser.add_argument(
        "--prefill-candidates", action="store_true", help="prefill configs interleaved with SDPA by round"
    )
    parser.add_argument(
        "--decode-configs", action="store_true", help="only FP8 decode configs under both timers"
    )
    parser.add_argument("--qknorm", action="store_true", help="only the fused QK-norm/RoPE/KV-store rows")
    parser.add_argument("--sweep-qknorm", action="store_true", help="its launch shapes, then its rows")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.qknorm or args.sweep_qknorm:
        if args.sweep_qknorm:
            sweep_qknorm()
        qknorm_bench(16384)
        return
    if args.spread:
        decode_spread(131072)
        return
    if args.prefill_candidates:
        prefill_candidates()
        return
    if args.prefill:
        for tokens in (8192, 32768):
            prefill_bench(tokens)
        return
    if args.sweep_prefill:
        sweep_prefill(tma_only=args.sweep_prefill == "tma")
        for tokens in (8192, 32768):
            prefill_bench(tokens)
        print("\n".join("| " + " | ".join(r) + " |" for r in ROWS))
        return
    qknorm_bench(2048 if args.quick else 16384)
    gen = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(1024, 131072, (32,), generator=gen)]
    lengths[0] = 131072
    if args.quick:
        lengths = [n // 16 for n in lengths]
    if args.decode_configs:
        decode_configs(lengths)
        return
    if args.sweep:
        sweep_qknorm()
        sweep_decode(lengths)
        sweep_prefill()
    elif args.sweep_decode:
        sweep_decode(lengths)
    sdpa = sdpa_loop_ms(lengths)
    decode_bench(lengths, f"B=32 mixed ({sum(lengths) / 1e6:.2f}M tok)", sdpa)
    single = [lengths[0]]
    decode_bench(single, f"B=1 {lengths[0] // 1024}K", sdpa_loop_ms(single))
    for tokens in (2048,) if args.quick else (8192, 32768):
        prefill_bench(tokens)
    RESULTS["env"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print("| case | ms | % of copy BW | ratio |")
    print("|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    print(
        json.dumps(
            {k: v for k, v in RESULTS.items() if "err" in k or k == "env" or "correct" in k}, default=str
        )
    )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
