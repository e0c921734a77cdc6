"""The pass interface (docs/ARCHITECTURE.md §5).

A pass is one class in one module: a `name`, a `stage`, a pydantic `Config` (extra="forbid"),
`gate(ctx, config)` returning a skip reason or None, and `run(gm, ctx, config)` rewriting the graph in
place and returning the `Site`s it changed. The `PassManager` does everything else (lint, DCE, timing,
op histograms, dumps, the `PassResult`). Passes read nothing but their arguments: the graph, the
`CompileCtx` and their config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import fx

from hy3c.config import Hy3Config
from hy3c.recipe import TARGET_ARCH, ParallelSpec, QuantSpec


class Stage(IntEnum):
    CANONICALIZE = 0
    SHARD = 1
    QUANT = 2
    FUSE = 3
    LOWER = 4
    CLEANUP = 5


@dataclass(frozen=True)
class CompileCtx:
    """Everything a pass may read (no env vars, no global distributed state)."""

    model: Hy3Config
    parallel: ParallelSpec
    target: str  # recipe target: h20 | h200 | cpu
    device_type: str  # cpu | cuda
    quant: QuantSpec
    dtype: str  # model dtype name
    token_range: tuple[int, int]
    checkpoint_static_scales: bool = False  # the checkpoint carries FP8 input scales
    checkpoint_fp8: bool = False  # the checkpoint's linear weights are already FP8
    # provider families that cannot be used by this install, with the reason (e.g. Triton not installed):
    # `lower` skips them and reports every node that falls back to a later provider
    unavailable_providers: tuple[tuple[str, str], ...] = ()
    # debugging overrides of the kernel variants set while compiling (`hy3c.kernels.overrides`): variable
    # → on/off; `lower` takes them over the recipe's choice and records them
    variant_overrides: tuple[tuple[str, bool], ...] = ()

    @property
    def arch(self) -> str | None:
        """The target's GPU architecture ("sm_90"), None for the CPU."""
        return TARGET_ARCH[self.target]

    @property
    def heads_per_rank(self) -> int:
        """The q heads one rank's attention runs (all of them without tensor parallelism)."""
        return self.model.num_attention_heads // self.parallel.tp

    @property
    def kv_heads_per_rank(self) -> int:
        """The KV heads one rank holds and caches (`ParallelSpec.local_kv_heads`)."""
        return self.parallel.local_kv_heads(self.model.num_key_value_heads)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype at run time (the traced step's cache placeholder has the model dtype)."""
        return getattr(torch, self.quant.kv_dtype(self.dtype))


class Site(BaseModel):
    """One place a pass changed: the node it anchored on, its decoder layer, and what happened."""

    model_config = ConfigDict(frozen=True)
    node: str
    layer: int | None = None
    detail: str = ""


class PassResult(BaseModel):
    name: str
    stage: str
    status: str  # ran | skipped | failed
    skip_reason: str | None = None
    error: str | None = None
    matches: int = 0
    sites: list[Site] = Field(default_factory=list)
    ops_before: dict[str, int] = Field(default_factory=dict)
    ops_after: dict[str, int] = Field(default_factory=dict)
    ops_delta: dict[str, int] = Field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    time_ms: float = 0.0
    config: dict[str, Any] = Field(default_factory=dict)
    summary: dict[str, Any] = Field(default_factory=dict)  # pass-specific tables (e.g. lowering choices)


class PassConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Pass(ABC):
    name: ClassVar[str]
    stage: ClassVar[Stage]
    Config: ClassVar[type[PassConfig]] = PassConfig

    def gate(self, ctx: CompileCtx, config: PassConfig) -> str | None:
        """None to run; otherwise the human-readable reason the pass is skipped."""
        return None

    @abstractmethod
    def run(self, gm: fx.GraphModule, ctx: CompileCtx, config: PassConfig) -> list[Site]:
        """Rewrite gm in place; return the sites changed."""

    def summary(self) -> dict[str, Any]:
        """Optional extra table for the report, filled during run()."""
        return {}
