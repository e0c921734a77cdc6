"""Probe for issue 4's FP8 decode goal (FP8 KV ≥ 1.8× bf16): would FP8 K and V going straight into
e4m3 MMAs pay, before the KV layout changes for it?

    python bench/fp8_pv_probe.py               # H200: a table of CUDA-graph replays, errors vs reference
    TRITON_INTERPRET=1 python bench/fp8_pv_probe.py --cpu-check  # the probe vs the reference (CPU)

What the sm_90 PTX shows (compiled on the CPU): with 16 query rows as the MMA's rows, Triton never emits
an e4m3 MMA — it widens e4m3 operands to f16 for `mma.sync` (280 `cvt` per loop body even with q
quantized), which is why decode's FP8 QK product never paid. Per loop body the shipped FP8 decode
issues bf16 decode's 128 f16 `mma.sync` plus 256 conversions and a shared-memory round trip for V
(32 more `st.shared.v4`), for half the bytes (64 `cp.async` against 128): 78% of copy bandwidth on
the mixed batch where bf16 reaches 103–105%. With the keys, then the head dims, as the MMA's rows
(Sᵀ = K · qᵀ, Oᵀ = Vᵀ · Pᵀ) both products are e4m3 wgmma m64n16k32 with no conversion at all — but the
PV product needs V with the keys contiguous (the MMA's K dimension): V pages stored transposed,
[pages, kv_heads, head_dim, page_size]. This probe builds such a copy of V beside the shipped cache and
runs a decode kernel over it — q quantized per row, P scaled by 448 into e4m3 — with the shipped
dynamic schedule and combine kernel; K and Vᵀ by pointer loads (128-key blocks) or TMA page slices
(64-key blocks); and, for comparison, the shipped V pages transposed inside the kernel (no layout
change; the PTX shows the transposition as byte-wide shared-memory stores: 96 `st.shared.b8` per TMA
loop body against 32 for P alone). All against the shipped FP8 and bf16 decode in the same run. If a
row over transposed pages reaches the goal and the in-kernel transposition does not, the layout change
(kv_store, reference, prefill, decode) is worth making; the probe kernel itself is not used by the
engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph
from triton.tools.tensor_descriptor import TensorDescriptor

import hy3c.kernels
import hy3c.ops  # noqa: F401
from hy3c.kernels import attention_plan as plan_mod
from hy3c.kernels.paged_attention import (
    LaunchConfig,
    _find_request,
    _quantize_rows_e4m3,
    _search_iters,
    _store_partial,
    _tiles_per_cta,
    combine_partials,
    decode_attention_dynamic,
    decode_config,
    num_decode_ctas,
)
from hy3c.ops.quant import FP8_DTYPE

BENCH_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH_DIR), str(BENCH_DIR.parent)]  # run as a file or as -m bench.fp8_pv_probe
from attention_bench import paged_cache  # noqa: E402

BW = 4.25e12
HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 128, 64
LOG2E = tl.constexpr(1.4426950408889634)
hy3 = torch.ops.hy3


@triton.jit
def _probe_block(
    q8,
    q_scale,
    m_i,
    l_i,
    acc,
    k_ptr,
    vt_ptr,
    page_row_ptr,
    key,
    key_end,
    head,
    stride_kpage,
    stride_koff,
    stride_khead,
    stride_vpage,
    stride_vhead,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    FP8_PV: tl.constexpr,
    SWAP: tl.constexpr,
    TMA: tl.constexpr,
    VT_LAYOUT: tl.constexpr,
):
    """One block of BLOCK_N keys: e4m3 QKᵀ, online softmax in base 2, PV from the transposed V pages."""
    key = tl.multiple_of(key, BLOCK_N)
    n = key + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    valid = n < key_end
    if TMA:  # one page slice (BLOCK_N divides the page) per operand, bulk-copied into shared memory
        page = tl.load(page_row_ptr + key // PAGE_SIZE)
        row = page * PAGE_SIZE + key % PAGE_SIZE
        k = k_ptr.load([row, head * HEAD_DIM])
        if VT_LAYOUT:
            vt = vt_ptr.load([(page * stride_vpage + head * stride_vhead) // PAGE_SIZE, key % PAGE_SIZE])
        else:  # the shipped V pages, transposed in the kernel
            vt = tl.trans(vt_ptr.load([row, head * HEAD_DIM]))
        if MASK:  # rows past the end come from the page's unused slots
            vt = tl.where(valid[None, :], vt, tl.zeros_like(vt))
    else:
        if MASK:
            page = tl.load(page_row_ptr + n // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            page = tl.load(page_row_ptr + n // PAGE_SIZE).to(tl.int64)
        k_rows = page * stride_kpage + (n % PAGE_SIZE) * stride_koff + head * stride_khead
        if VT_LAYOUT:  # per page run of keys (contiguous in a transposed page), so the loads vectorize
            RUNS: tl.constexpr = BLOCK_N // PAGE_SIZE if BLOCK_N > PAGE_SIZE else 1
            RUN: tl.constexpr = BLOCK_N // RUNS
            run = tl.arange(0, RUNS)
            run_ok = key + run * RUN < key_end
            run_page = tl.load(page_row_ptr + key // PAGE_SIZE + run, mask=run_ok, other=0).to(tl.int64)
            run_base = run_page * stride_vpage + head * stride_vhead + key % PAGE_SIZE
            offs = (
                run_base[None, :, None]
                + (d * PAGE_SIZE)[:, None, None]
                + tl.max_contiguous(tl.arange(0, RUN), RUN)[None, None, :]
            )
            vt_ptrs = vt_ptr + tl.reshape(offs, (HEAD_DIM, BLOCK_N))
        else:  # the shipped V pages (K's layout), transposed in the kernel
            vt_ptrs = tl.trans(vt_ptr + k_rows[:, None] + d[None, :])
        if MASK:
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :])
            vt = tl.load(vt_ptrs)
    if SWAP:  # keys and head dims as the MMA's rows (Sᵀ = K·qᵀ, Oᵀ = Vᵀ·Pᵀ): e4m3 wgmma m64n16k32
        s = tl.trans(tl.dot(k, tl.trans(q8))) * q_scale[:, None]
    else:  # 16 query rows: no wgmma; Triton widens e4m3 operands to f16 for mma.sync
        s = tl.dot(q8, tl.trans(k)) * q_scale[:, None]
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    if FP8_PV:  # p ≤ 1: scaled by 448 into e4m3's range, the 1/448 applied to the product
        p8 = (p * 448.0).to(tl.float8e4nv)
        if SWAP:
            pv = tl.trans(tl.dot(vt, tl.trans(p8))) * (1.0 / 448.0)
        else:
            pv = tl.dot(p8, tl.trans(vt)) * (1.0 / 448.0)
    else:
        pv = tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["num_requests", "search_iters"])
def _probe_decode_kernel(
    q_ptr,
    k_ptr,
    vt_ptr,
    scales_ptr,
    page_table_ptr,
    seq_lens_ptr,
    plan_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_requests,
    search_iters,
    num_ctas,
    min_ctas,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kpage,
    stride_koff,
    stride_khead,
    stride_vpage,
    stride_vhead,
    stride_pt,
    stride_po_slot,
    stride_po_head,
    stride_pl_slot,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8_PV: tl.constexpr,
    SWAP: tl.constexpr,
    TMA: tl.constexpr,
    VT_LAYOUT: tl.constexpr,
):
    """The shipped dynamic schedule (equal tile ranges per CTA, partials for the combine kernel)."""
    head = tl.program_id(0)
    cta = tl.program_id(1)
    quota = _tiles_per_cta(plan_ptr, num_requests, num_ctas, min_ctas, MIN_TILES)
    total = tl.load(plan_ptr + num_requests)
    t = cta * quota
    t_end = tl.minimum(t + quota, total)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    qk_scale = sm_scale * tl.load(scales_ptr) * LOG2E
    v_scale = tl.load(scales_ptr + 1)
    while t < t_end:
        r = _find_request(plan_ptr, t, num_requests, search_iters)
        first_tile = tl.load(plan_ptr + r)
        seg_end = tl.minimum(t_end, tl.load(plan_ptr + r + 1))
        length = tl.load(seq_lens_ptr + r)
        q = tl.load(
            q_ptr + r * stride_qt + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )
        q8, q_scale = _quantize_rows_e4m3(q)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        key_begin = (t - first_tile) * KV_TILE
        key_end = tl.minimum((seg_end - first_tile) * KV_TILE, length)
        full_end = key_begin + (key_end - key_begin) // BLOCK_N * BLOCK_N
        page_row = page_table_ptr + r * stride_pt
        for key in range(key_begin, full_end, BLOCK_N):
            m_i, l_i, acc = _probe_block(
                q8, q_scale, m_i, l_i, acc, k_ptr, vt_ptr, page_row, key, key_end, head,
                stride_kpage, stride_koff, stride_khead, stride_vpage, stride_vhead, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, False, FP8_PV, SWAP, TMA, VT_LAYOUT,
            )  # fmt: skip
        for key in range(full_end, key_end, BLOCK_N):
            m_i, l_i, acc = _probe_block(
                q8, q_scale, m_i, l_i, acc, k_ptr, vt_ptr, page_row, key, key_end, head,
                stride_kpage, stride_koff, stride_khead, stride_vpage, stride_vhead, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, True, FP8_PV, SWAP, TMA, VT_LAYOUT,
            )  # fmt: skip
        _store_partial(
            part_o_ptr + (cta + r) * stride_po_slot + head * stride_po_head,
            part_lse_ptr + (cta + r) * stride_pl_slot + head * GROUP_PAD,
            acc,
            m_i,
            l_i,
            v_scale,
            GROUP,
            GROUP_PAD,
            HEAD_DIM,
        )
        t = seg_end


def transposed_v(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer's V pages [pages, page_size, kv_heads, head_dim] as [pages, kv_heads, head_dim, page_size]."""
    return kv_cache[layer, 1].permute(0, 2, 3, 1).contiguous()


def probe_decode(
    q,
    kv_cache,
    vt,
    kv_scales,
    layer,
    page_table,
    seq_lens,
    sm_scale,
    plan,
    config: LaunchConfig,
    fp8_pv: bool,
    swap: bool = True,
) -> torch.Tensor:
    """Decode with the probe kernel over the K pages and `vt` (V pages stored transposed) — or, vt None,
    the shipped V pages transposed in the kernel — merged by the shipped combine. config.tma: page
    slices by TMA (block_n must divide the page)."""
    num_requests, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[4]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    num_ctas = num_decode_ctas(q.device, kv_heads, config.ctas_per_sm)
    min_ctas = min(num_decode_ctas(q.device, kv_heads, config.min_ctas_per_sm), num_ctas)
    slots = num_ctas + num_requests
    part_o = torch.empty((slots, kv_heads, group, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((slots, kv_heads, group_pad), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    k = kv_cache[layer, 0]
    vt_layout = vt is not None
    v = vt if vt_layout else kv_cache[layer, 1]
    k_arg, v_arg = k, v
    if config.tma:
        pages, page = k.shape[0], k.shape[1]
        rows_box = ([pages * page, kv_heads * head_dim], [kv_heads * head_dim, 1], [config.block_n, head_dim])
        k_arg = TensorDescriptor(k, *rows_box)
        if vt_layout:
            v_arg = TensorDescriptor(
                v, [pages * kv_heads * head_dim, page], [page, 1], [head_dim, config.block_n]
            )
        else:
            v_arg = TensorDescriptor(v, *rows_box)
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim)
    _probe_decode_kernel[(kv_heads, num_ctas)](
        q,
        k_arg,
        v_arg,
        kv_scales[layer],
        page_table,
        seq_lens,
        plan,
        part_o,
        part_lse,
        num_requests,
        _search_iters(num_requests),
        num_ctas,
        min_ctas,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_lse.stride(0),
        KV_TILE=plan_mod.KV_TILE,
        BLOCK_N=config.block_n,
        MIN_TILES=config.min_tiles_per_cta,
        PAGE_SIZE=kv_cache.shape[3],
        FP8_PV=fp8_pv,
        SWAP=swap,
        TMA=config.tma,
        VT_LAYOUT=vt_layout,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **common,
    )
    return combine_partials(out, plan, part_o, part_lse, num_ctas, min_ctas, config.min_tiles_per_cta)


def paged_case(
    lengths, dtype, kv_scale, device, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE
):
    """q, a one-layer paged cache of random K/V (the attention bench's), scales, page table, lengths,
    query starts and the attention plan."""
    cache, table, scales = paged_cache(lengths, dtype, kv_scale, device, kv_heads, head_dim, page)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    qsl = torch.arange(len(lengths) + 1, dtype=torch.int32, device=device)
    q = torch.randn(len(lengths), heads, head_dim, device=device, dtype=torch.bfloat16)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(heads // kv_heads))
    return q, cache, scales, table, seq_lens, qsl, plan


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def cpu_check() -> None:
    """Tiny shapes under TRITON_INTERPRET=1: both probe variants against the torch reference."""
    from tests.kernels.interp_shim import install  # the interpreter's bf16/fp8 fixes, as the tests use

    install()
    torch.manual_seed(0)
    case = paged_case([1, 17, 300, 70], FP8_DTYPE, 0.05, "cpu", heads=8, kv_heads=2, head_dim=32, page=16)
    q, cache, scales, table, seq_lens, qsl, plan = case
    ref = hy3.attention(q, cache, scales, 0, table, seq_lens, qsl, 0.2)
    vt = transposed_v(cache, 0)
    pointers = LaunchConfig(block_n=32, num_warps=4, num_stages=1)
    tma = LaunchConfig(block_n=16, num_warps=4, num_stages=1, tma=True)
    cases = itertools.product((pointers, tma), (False, True), (False, True), (vt, None))
    for config, fp8_pv, swap, v in cases:
        out = probe_decode(q, cache, v, scales, 0, table, seq_lens, 0.2, plan, config, fp8_pv, swap)
        err = rel_err(out, ref)
        what = f"TMA {config.tma}, FP8 PV {fp8_pv}, swap {swap}, V pages transposed {v is not None}"
        print(f"cpu check, {what}: relative error {err:.2e}")
        if err > 5e-2:
            raise SystemExit(f"probe kernel disagrees with the reference ({what}: {err:.2e})")


def gpu_table() -> None:
    d = "cuda"
    gen = torch.Generator().manual_seed(1)  # the attention bench's mixed batch
    lengths = [int(x) for x in torch.randint(1024, 131072, (32,), generator=gen)]
    lengths[0] = 131072
    results: dict[str, dict] = {}
    print("| case | ms (graph replays) | % copy BW | vs shipped FP8 | vs shipped bf16 | rel. err |")
    print("|---|---|---|---|---|---|")
    for label, case_lengths in (("B=32 mixed", lengths), ("B=1 128K", [lengths[0]])):
        torch.manual_seed(0)
        timed = {}
        for dtype, kv_scale in ((torch.bfloat16, 1.0), (FP8_DTYPE, 0.01)):
            q, cache, scales, table, seq_lens, qsl, plan = paged_case(case_lengths, dtype, kv_scale, d)
            kv = (cache, scales, 0, table, seq_lens, HEAD_DIM**-0.5, plan)
            timed[dtype] = do_bench_cudagraph(lambda kv=kv, q=q: decode_attention_dynamic(q, *kv), rep=50)
            if dtype != FP8_DTYPE:
                del cache
                continue
            kv_bytes = sum(case_lengths) * KV_HEADS * HEAD_DIM * 2
            ref = hy3.attention(q, cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5)
            vt = transposed_v(cache, 0)
            rows = [("shipped FP8", timed[dtype], rel_err(decode_attention_dynamic(q, *kv), ref))]
            shipped_cfg = decode_config(FP8_DTYPE, len(case_lengths))
            variants = [  # (block_n, TMA, e4m3 PV, swapped operands, V pages transposed, CTAs/SM, stages)
                *[(64, True, True, True, True, c, n) for c, n in ((2, 3), (4, 3), (6, 2), (8, 2))],
                *[(64, True, True, True, False, c, n) for c, n in ((4, 3), (8, 2))],
                *[(128, False, True, True, True, c, n) for c, n in ((2, 2), (3, 2), (8, 2))],
                (128, False, True, True, False, 3, 2),  # the shipped V layout, transposed in the kernel
                (128, False, False, True, True, 3, 2),  # Vᵀ widened: what the e4m3 PV product alone brings
                (128, False, True, False, True, 3, 2),  # 16 query rows as the MMA's rows: no wgmma
            ]
            for block_n, tma, fp8_pv, swap, transposed, ctas, stages in variants:
                cfg = LaunchConfig(block_n=block_n, num_warps=4, num_stages=stages, ctas_per_sm=ctas, tma=tma)
                if ctas == shipped_cfg.ctas_per_sm:  # the batch config's minimum range per CTA too
                    cfg = dataclasses.replace(shipped_cfg, block_n=block_n, num_stages=stages, tma=tma)
                v = vt if transposed else None
                args = (q, cache, v, scales, 0, table, seq_lens, HEAD_DIM**-0.5, plan, cfg, fp8_pv, swap)
                name = (
                    f"probe, {block_n}-key blocks{' by TMA' if tma else ''}, "
                    f"{'e4m3 PV' if fp8_pv else 'Vᵀ widened'}{'' if swap else ', q rows as MMA rows'}, "
                    f"V {'pages transposed' if transposed else 'transposed in the kernel'}, "
                    f"{ctas} CTAs/SM, {stages} stages"
                )
                try:
                    out = probe_decode(*args)
                except Exception as exc:  # out of resources
                    print(f"{name}: {type(exc).__name__}")
                    continue
                ms = do_bench_cudagraph(lambda a=args: probe_decode(*a), rep=50)
                rows.append((name, ms, rel_err(out, ref)))
            for name, ms, err in rows:
                pct = kv_bytes / BW * 1e3 / ms * 100
                vs8 = timed[FP8_DTYPE] / ms
                vs16 = timed[torch.bfloat16] / ms
                print(f"| {label}: {name} | {ms:.4f} | {pct:.0f}% | {vs8:.2f}× | {vs16:.2f}× | {err:.1e} |")
                results[f"{label}: {name}"] = {"ms": ms, "rel_err": err, "bf16_ms": timed[torch.bfloat16]}
            del cache, vt
    results["env"] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_pv_probe.json"), "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-check", action="store_true", help="tiny shapes under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.cpu_check:
        cpu_check()
    else:
        gpu_table()


if __name__ == "__main__":
    main()
