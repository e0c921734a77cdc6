"""Runner: executes the compiled step program (eagerly, or through torch.compile / Inductor).

A runner has the same calling convention as `Hy3ForCausalLM.forward` (the eight step inputs →
(logits, hidden)) plus `config`, `device`, `kv_dtype`, `allocate_kv_cache` and `step`, so the serving
engine (`hy3c serve` and `hy3c generate`) drives either one.

Compilation marks every batch-dependent dimension (tokens, requests, page-table width, KV page count,
logits rows) as unbacked, so one compiled graph serves every batch shape: no recompilation, no 0/1
specialization. Inductor's caches (FX graph, AOT autograd, generated kernels and their compiled
binaries) go to a per-user directory, `$HY3C_CACHE_DIR` or `~/.cache/hy3c` (`$XDG_CACHE_HOME/hy3c`), under
`inductor/<key>` keyed by the artifact's cache key, the device and the torch version: the first run on a
device fills it, later starts reuse it (warm start). They hold pickles and shared objects, so they are
never read from an artifact (a file someone else sent) and never from a directory another user owns.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.fx.experimental import _config as fx_config

from hy3c.config import Hy3Config
from hy3c.logs import log_event
from hy3c.model.batch import StepBatch
from hy3c.model.hy3 import allocate_kv_cache
from hy3c.recipe import Recipe
from hy3c.runtime.cuda_graphs import DecodeGraphs

log = logging.getLogger("hy3c.runtime.runner")

# step input index → dims that vary from step to step
_DYNAMIC_DIMS = {0: (0,), 1: (0,), 2: (2,), 3: (0, 1), 4: (0,), 5: (0,), 6: (0,), 7: (0,)}


def compile_cache_root() -> Path:
    """This user's directory for Inductor's caches."""
    if os.environ.get("HY3C_CACHE_DIR"):
        return Path(os.environ["HY3C_CACHE_DIR"]) / "inductor"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hy3c" / "inductor"


class Runner:
    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        config: Hy3Config,
        recipe: Recipe,
        gm: fx.GraphModule,
        device: torch.device,
        compile: bool,
        kv_heads: int | None = None,
        rank: int = 0,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.config = config
        self.recipe = recipe
        self.gm = gm
        self.device = device
        self.dtype = getattr(torch, recipe.dtype)
        self.kv_dtype = getattr(torch, manifest["kv_cache"]["dtype"])
        self.kv_heads = config.num_key_value_heads if kv_heads is None else kv_heads  # this rank's
        self.rank = rank
        self.world_size = recipe.parallel.world_size
        self.compiled = compile
        self.decode_graphs: DecodeGraphs | None = None
        self.compile_cache: Path | None = self._use_compile_cache() if compile else None
        self._fn = torch.compile(gm, dynamic=False, fullgraph=True) if compile else gm
        self._compiled_once = False

    def _cache_key(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        parts = [self.manifest["cache_key"]["key"], self.device.type, name, torch.__version__, str(self.rank)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]

    def _use_compile_cache(self) -> Path | None:
        directory = compile_cache_root() / self._cache_key()
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            owner = directory.stat().st_uid
        except OSError as exc:
            log_event(log, "compile_cache_unavailable", level=logging.WARNING, reason=str(exc))
            return None
        if owner != os.getuid():
            log_event(
                log, "compile_cache_unavailable", level=logging.WARNING, reason=f"{directory} is not ours"
            )
            return None
        warm = any(directory.iterdir())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
        log_event(log, "compile_cache", dir=str(directory), warm=warm)
        return directory

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        return allocate_kv_cache(self.config, num_pages, page_size, self.kv_dtype, self.device, self.kv_heads)

    def capture_decode_graphs(
        self, kv_cache: torch.Tensor, max_pages: int, batch_sizes: list[int] | None = None
    ) -> str | None:
        """Capture CUDA graphs for decode steps over `kv_cache` (the recipe's batch sizes by default).
        Returns None on success, else why nothing was captured (steps then run uncaptured)."""
        sizes = batch_sizes if batch_sizes is not None else self.recipe.cuda_graphs.decode_batch_sizes
        if not sizes:
            return "the recipe lists no decode batch sizes"
        result = DecodeGraphs.capture(self._run, self.gm, kv_cache, sizes, max_pages)
        if isinstance(result, str):
            log_event(log, "cuda_graphs_skipped", reason=result)
            return result
        self.decode_graphs = result
        return None

    def step(self, batch: StepBatch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step, replaying a captured decode graph when one covers the batch."""
        if self.decode_graphs is not None:
            out = self.decode_graphs.run(batch, kv_cache)
            if out is not None:
                return out
        return self(*batch.model_args(kv_cache))

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(*args)

    def _run(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        multiple = self.recipe.parallel.token_multiple
        tokens = args[0].shape[0]
        if tokens % multiple:
            logits, hidden = self._run_padded(*pad_tokens(args, multiple))
            return logits, hidden[:tokens]
        return self._run_padded(*args)

    def _run_padded(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.compiled:
            with torch.no_grad():
                return self._fn(*args)
        for index, dims in _DYNAMIC_DIMS.items():
            for dim in dims:
                torch._dynamo.decorators.mark_unbacked(args[index], dim)
        first = not self._compiled_once
        if first:  # the first call compiles: say so, it takes seconds to minutes
            log_event(log, "inductor_compile_started", cache=str(self.compile_cache))
            started = time.monotonic()
        # the step's index inputs are views at varying offsets of two shared tensors (build_step_batch):
        # without duck sizing, equal-sized inputs do not make Dynamo guard on equal storage offsets
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            out = self._fn(*args)
        if first:
            self._compiled_once = True
            log_event(log, "inductor_compile_done", seconds=round(time.monotonic() - started, 1))
        return out


def pad_tokens(args: tuple[torch.Tensor, ...], multiple: int) -> tuple[torch.Tensor, ...]:
    """The step inputs with tokens appended up to a multiple of `multiple` (a sequence-parallel program
    splits the tokens over its ranks): token 0 at position 0, slot −1 (no KV written), in no sequence
    (past query_start_loc's end: never attended, never a logits row)."""
    input_ids, positions, kv_cache, page_table, seq_lens, query_start_loc, slot_mapping, rows = args
    extra = -input_ids.shape[0] % multiple

    def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([values, values.new_full((extra,), fill)])

    return (
        padded(input_ids, 0),
        padded(positions, 0),
        kv_cache,
        page_table,
        seq_lens,
        query_start_loc,
        padded(slot_mapping, -1),
        rows,
    )
