"""FusedMoE launch configs: the tunables (`MoeConfig`) and the tuned choices per token-count bucket and
variant (bf16, FP8 with dynamic or static activation scales).

Tuned tables are per GPU model, `configs/fused_moe_<key>.json` (written by `bench/moe_bench.py --sweep`
on that GPU), the key from the GPU's name (`device_key`: "NVIDIA H200" → h200, "NVIDIA H20" → h20). A
launch takes the table of the GPU it runs on; a GPU without one takes the built-in defaults (untuned,
logged once) — never another GPU's tiles. The `lower` pass records which table a recipe's target gets
(`table_for`), the recipe targets being GPU keys themselves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from hy3c.logs import log_event

log = logging.getLogger("hy3c.kernels")

CONFIG_DIR = Path(__file__).parent / "configs"


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
    # W4A8: int4 weights widened to the e4m3 subnormals q · 2⁻⁹ (|q| under q's sign bit, a few integer
    # operations a word; the 2⁹ taken out after the MMA) instead of through fp16 (fused_moe_w4a8)
    int4_subnormal: bool = False
    # W4A8 with pair_blocks: the gate-up GEMM's K cut into split_k parts, one program each, summed in fp32
    # by atomics (the last part's program finishes the tile): more programs for one token's few tiles
    split_k: int = 1
    # the down GEMM's own tiles (0: the gate-up's value). Its K is the intermediate width, a third of the
    # gate-up's, and its N the hidden size, so its best tile need not be the gate-up's; it shares the
    # M blocks (one alignment) and the weight-tile path (`tma`)
    down_block_n: int = 0
    down_block_k: int = 0
    down_num_warps: int = 0
    down_num_stages: int = 0
    # bf16 / FP8 at prefill sizes: the persistent warp-specialized Gluon GEMMs (`fused_moe_persistent`:
    # 128-row M blocks, block_n columns per operand, num_stages ring slots) where the program chose the
    # Gluon kernels and they can run; elsewhere this config's Triton kernels
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.combine_block & (self.combine_block - 1):
            raise ValueError(f"combine_block must be a power of two, got {self.combine_block}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be at least 1, got {self.split_k}")
        own = {name: getattr(self, name) for name in DOWN_FIELDS}
        if any(value < 0 for value in own.values()):
            raise ValueError(f"down tiles must be positive or 0 (the gate-up's), got {own}")
        if self.pair_blocks and any(own.values()):
            raise ValueError("down tiles are for aligned M blocks, not pair_blocks (one token)")
        if self.persistent and (self.pair_blocks or self.swap_ab or self.quant_on_load or self.split_k != 1):
            raise ValueError(
                "persistent: aligned M blocks of token rows (no pair_blocks, swap_ab, quant_on_load, split_k)"
            )

    def down(self) -> MoeConfig:
        """The down GEMM's config: this one with its own tiles where it has them."""
        if not any(getattr(self, name) for name in DOWN_FIELDS):
            return self
        own = {
            name.removeprefix("down_"): getattr(self, name) or getattr(self, name.removeprefix("down_"))
            for name in DOWN_FIELDS
        }
        return dataclasses.replace(self, **own, **dict.fromkeys(DOWN_FIELDS, 0))


DOWN_FIELDS = ("down_block_n", "down_block_k", "down_num_warps", "down_num_stages")


_DEFAULTS = {  # upper token bound of the bucket → config (bf16 and FP8 alike unless a table says otherwise)
    16: MoeConfig(16, 64, 128, 1, 4, 4),
    128: MoeConfig(16, 128, 128, 1, 4, 4),
    1024: MoeConfig(64, 128, 64, 8, 4, 3),
    1 << 40: MoeConfig(128, 128, 64, 8, 8, 3),
}


_W4A8_DEFAULTS = {  # W4A8 experts: the weights as the MMA's rows for few tokens, K blocks of two scale
    # groups from 2 to 128 tokens (1.14× / 1.08× blocks of one at 16 / 128, H100 run 35f), of one elsewhere;
    # the subnormal widening up to 1,024 tokens (1.10–1.34× the fp16 one at these tiles, H100 run Z) and
    # 64-row blocks above (3.2× faster than 128-row ones at 8,192 tokens, H100 run V)
    1: MoeConfig(16, 64, 128, 1, 4, 4, swap_ab=True, pair_blocks=True, int4_subnormal=True),
    16: MoeConfig(16, 64, 256, 1, 4, 3, swap_ab=True, int4_subnormal=True),
    128: MoeConfig(16, 64, 256, 1, 4, 3, swap_ab=True, int4_subnormal=True),
    1024: MoeConfig(64, 128, 128, 8, 4, 3, int4_subnormal=True),
    1 << 40: MoeConfig(64, 128, 128, 8, 4, 3),
}


def device_key(gpu_name: str) -> str:
    """A GPU's table key: its name without the vendor, lower case, other characters as underscores
    ("NVIDIA H200" → h200, "NVIDIA H100 80GB HBM3" → h100_80gb_hbm3)."""
    return re.sub(r"[^a-z0-9]+", "_", gpu_name.removeprefix("NVIDIA ").lower()).strip("_")


def table_file(key: str) -> Path:
    """The tuned table of the GPU with this key (it may not exist)."""
    return CONFIG_DIR / f"fused_moe_{key}.json"


def table_for(key: str) -> str:
    """What a GPU (by key) runs, as the compile report says it: its table's file name, or the defaults."""
    file = table_file(key)
    if file.is_file():
        return file.name
    tuned = sorted(p.stem.removeprefix("fused_moe_") for p in CONFIG_DIR.glob("fused_moe_*.json"))
    return f"untuned defaults (no {file.name}; tuned: {', '.join(tuned) or 'none'})"


@cache
def _tuned(key: str | None) -> dict[str, dict[int, MoeConfig]]:
    """The tuned table of a GPU (None: not a GPU), {} where it has none (logged once per GPU)."""
    if key is None:
        return {}
    file = table_file(key)
    if not file.is_file():
        log_event(log, "moe_configs_untuned", level=logging.WARNING, gpu=key, missing=file.name)
        return {}
    log_event(log, "moe_configs", gpu=key, table=file.name)
    data = json.loads(file.read_text())
    return {kind: {int(t): MoeConfig(**c) for t, c in table.items()} for kind, table in data.items()}


def config_kind(fp8: bool, static_activations: bool, w4a8: bool = False) -> str:
    """A table's variant: bf16, fp8 (dynamic per-token activations), fp8_static, w4a8 (int4 experts,
    either activation scheme)."""
    if w4a8:
        return "w4a8"
    if not fp8:
        return "bf16"
    return "fp8_static" if static_activations else "fp8"


def select_config(num_tokens: int, kind: str, gpu_name: str | None) -> MoeConfig:
    """The config of the smallest bucket holding num_tokens, from the `kind` table of the GPU named
    `gpu_name` (buckets that fp8_static lacks come from fp8's), or the built-in defaults where that GPU
    has no table (None: not a GPU, the CPU interpreter)."""
    tuned = _tuned(device_key(gpu_name) if gpu_name is not None else None)
    defaults = _W4A8_DEFAULTS if kind == "w4a8" else _DEFAULTS
    table = {**tuned.get(kind.removesuffix("_static"), {}), **tuned.get(kind, {})} or defaults
    bound = min((t for t in table if t >= num_tokens), default=max(table))
    return table[bound]
