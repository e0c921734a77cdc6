"""Launch configs of the Triton attention kernels (`decode`, `prefill`): the tunables
and the choices `bench/attention_bench.py --sweep` made on the H200 (BENCHMARKS.md), picked per KV dtype,
batch size and page size on the host."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hy3c.kernels.attention.plan import PREFILL_ROWS
from hy3c.ops.quant import FP8_DTYPE


@dataclass(frozen=True)
class LaunchConfig:
    """Tunables of one attention kernel (chosen by bench/attention_bench.py --sweep on the H200)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2  # dynamic decode only: CTAs per SM over all KV heads
    min_tiles_per_cta: int = 1  # dynamic decode only: ranges of at least this many KV tiles, as long as
    min_ctas_per_sm: int = 2  # … the equal share over this many CTAs per SM allows (tiles_per_cta)
    q_rows: int = PREFILL_ROWS  # prefill only: query rows per program (the plan must use the same)
    lazy_rescale: bool = False  # prefill: rescale acc only when a row's max grows by more than 2^8
    tma: bool = False  # K/V blocks by TMA bulk copies (block_n divides the page)
    max_registers: int = 0  # a cap on registers per thread (0: the compiler's choice), for more CTAs per SM
    warp_specialized: bool = False  # prefill, bf16 KV on sm_90: the Gluon kernel (prefill_gluon) —
    # block_n keys per block, num_stages K/V ring slots; its warps and registers are its own (Triton elsewhere)

    def launch_options(self) -> dict[str, int]:
        """num_warps, num_stages and the register cap as Triton launch options."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return options | ({"maxnreg": self.max_registers} if self.max_registers else {})


# bf16 KV: 128-key pointer loads, 2 stages, 2 CTAs per SM (the best of `bench/attention_bench.py --sweep` on
# the H200; decode near copy bandwidth, BENCHMARKS.md)
DECODE_CONFIG = LaunchConfig(block_n=128, num_warps=4, num_stages=2, ctas_per_sm=2)


# FP8 KV: 64-key page slices by TMA, 5 stages — three K/V buffers (53 KB of shared memory): the copies'
# coordinates come from a page-table load in the loop, and Triton 3.6 gives that load a stage of its own,
# so 2-4 stages keep only two buffers and the next block's copy waits in the loop. A batch takes 6 CTAs
# per SM with ranges of at least 16 tiles (4K keys) while 2 CTAs per SM stay busy, which keeps short
# requests from splitting into many partials (each one more for the combine to merge); fewer requests
# take 3 CTAs per SM and ranges of any size.
FP8_BATCH_DECODE_CONFIG = LaunchConfig(
    block_n=64, num_warps=4, num_stages=5, ctas_per_sm=6, min_tiles_per_cta=16, min_ctas_per_sm=2, tma=True
)
FP8_BATCH_MIN_REQUESTS = 8
FP8_DECODE_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=5, ctas_per_sm=3, tma=True)


def decode_config(kv_dtype: torch.dtype, num_requests: int, page_size: int = 64) -> LaunchConfig:
    """The dynamic decode launch config for a KV dtype, batch size and page size (known on the host):
    pointer loads where a block does not tile the page."""
    if kv_dtype != FP8_DTYPE:
        return DECODE_CONFIG
    config = FP8_BATCH_DECODE_CONFIG if num_requests >= FP8_BATCH_MIN_REQUESTS else FP8_DECODE_CONFIG
    return config if page_size % config.block_n == 0 else replace(config, tma=False)


# prefill: 128 query rows (16 tokens × 8 heads at Hy3's GQA; the plan's PREFILL_ROWS).
# bf16 KV on an sm_90 GPU: the warp-specialized Gluon kernel (prefill_gluon: a TMA producer warp,
# two consumer warpgroups at 240 registers of the launch's 168 × 384, the next block's QKᵀ and this block's
# P·V issued together, the softmax beside P·V): 128-key blocks (two 64-key page slices), a two-slot K/V
# ring; it is faster than the Triton kernel, which Triton 3.6 does not pipeline this way.
# Elsewhere the Triton kernel, 64-key blocks as TMA bulk copies. Its copies' coordinates come from a
# page-table load in the loop, and Triton 3.6 splits num_stages between that load and the copies: 2-4
# stages keep two K/V buffers (the copy of block i+1 is issued at the end of block i, so the next block
# waits for it), 5 stages three.
# bf16 KV: 4 warps, 2 stages — 96 KB of shared memory, two CTAs per SM (5 stages would take 128 KB: one
# CTA per SM, slower); FP8 KV: 4 warps, 5 stages — three 16 KB buffers in 64 KB, still two CTAs per SM
# (faster than 8 warps capped at 128 registers with 2 stages).
# Pages that a 64-key block does not tile (a page size that 64 does not divide) take per-row pointer loads.
# Rescaling is eager: lazy rescaling is slower for bf16 and, since P·V is an e4m3 product, for FP8 KV too.
# The measured ratios to SDPA are in BENCHMARKS.md.
GLUON_PREFILL_CONFIG = LaunchConfig(block_n=128, num_stages=2, tma=True, warp_specialized=True)
PREFILL_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=2, tma=True)
FP8_PREFILL_CONFIG = LaunchConfig(block_n=64, num_warps=4, num_stages=5, tma=True)
PREFILL_CONFIG_ANY_PAGE = LaunchConfig(block_n=64, num_warps=4, num_stages=3)


def prefill_config(kv_dtype: torch.dtype, page_size: int = 64, gluon: bool = True) -> LaunchConfig:
    """The prefill launch config for a KV cache's dtype and page size (known on the host) and whether the
    program runs the Gluon kernel: the warp-specialized config where it may (the launch still checks
    the inputs, `prefill_gluon.unsupported_launch`), else `triton_prefill_config`."""
    if gluon and kv_dtype != FP8_DTYPE and page_size % 64 == 0:
        return GLUON_PREFILL_CONFIG
    return triton_prefill_config(kv_dtype, page_size)


def triton_prefill_config(kv_dtype: torch.dtype, page_size: int = 64) -> LaunchConfig:
    """The Triton prefill kernel's launch config for a KV cache's dtype and page size."""
    config = FP8_PREFILL_CONFIG if kv_dtype == FP8_DTYPE else PREFILL_CONFIG
    return config if page_size % config.block_n == 0 else PREFILL_CONFIG_ANY_PAGE
