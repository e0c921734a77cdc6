"""FusedMoE launch configs: the tunables (`MoeConfig`) and the tuned choices per token-count bucket and
variant (bf16, FP8 with dynamic or static activation scales), read from `configs/fused_moe_h200.json`
(written by `bench/moe_bench.py --sweep`) or built-in defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CONFIG_FILE = Path(__file__).parent / "configs" / "fused_moe_h200.json"


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    quant_on_load: bool = False  # FP8: quantize activation rows inside the GEMMs (no quantization kernels)
    tma: bool = False  # weight tiles by TMA bulk copies (block_n must tile each expert's rows)
    swap_ab: bool = False  # weights as the MMA's rows (acc^T = W · a^T): a wgmma with block_m token columns
    pair_blocks: bool = False  # one (token, slot) pair per M block, no alignment launch (for one token)
    combine_block: int = 1024  # columns per program of the combine (more programs for few tokens)

    def __post_init__(self) -> None:
        if self.combine_block & (self.combine_block - 1):
            raise ValueError(f"combine_block must be a power of two, got {self.combine_block}")


_DEFAULTS = {  # upper token bound of the bucket → config (bf16 and FP8 alike unless the file says otherwise)
    16: MoeConfig(16, 64, 128, 1, 4, 4),
    128: MoeConfig(16, 128, 128, 1, 4, 4),
    1024: MoeConfig(64, 128, 64, 8, 4, 3),
    1 << 40: MoeConfig(128, 128, 64, 8, 8, 3),
}


@cache
def _tuned() -> dict[str, dict[int, MoeConfig]]:
    if not CONFIG_FILE.is_file():
        return {}
    data = json.loads(CONFIG_FILE.read_text())
    return {kind: {int(t): MoeConfig(**c) for t, c in table.items()} for kind, table in data.items()}


def config_kind(fp8: bool, static_activations: bool) -> str:
    """The config file's table for a variant: bf16, fp8 (dynamic per-token activations), fp8_static."""
    if not fp8:
        return "bf16"
    return "fp8_static" if static_activations else "fp8"


def select_config(num_tokens: int, kind: str) -> MoeConfig:
    """The config of the smallest bucket holding num_tokens, from the file's `kind` table (buckets that
    fp8_static lacks come from fp8's) or the built-in defaults."""
    tuned = _tuned()
    table = {**tuned.get(kind.removesuffix("_static"), {}), **tuned.get(kind, {})} or _DEFAULTS
    bound = min((t for t in table if t >= num_tokens), default=max(table))
    return table[bound]
