"""Runner: executes the compiled step program (eagerly, or through torch.compile / Inductor).

A runner has the same calling convention as `Hy3ForCausalLM.forward` (the eight step inputs →
(logits, hidden)) plus `config`, `device`, `kv_dtype`, `allocate_kv_cache` and `step`, so the serving
engine (`hy3c serve` and `hy3c generate`) drives either one. Where the artifact holds the draft program
(MTP depth 0), `num_draft_layers` is 1 and `draft(batch, hidden_prev, kv_cache)` runs it, as
`Hy3ForCausalLM.draft` runs the eager `mtp_forward`; the MTP layer's KV lives in cache layer
`num_hidden_layers` (the cache has `num_kv_layers` layers).

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
from hy3c.runtime.cuda_graphs import DecodeGraphs, capture_blockers
from hy3c.runtime.spec_graphs import SpecDecodeSteps, StepRule

log = logging.getLogger("hy3c.runtime.runner")

# step input index → dims that vary from step to step
_DYNAMIC_DIMS = {0: (0,), 1: (0,), 2: (2,), 3: (0, 1), 4: (0,), 5: (0,), 6: (0,), 7: (0,)}
# the draft program's: hidden_prev (index 2) is [tokens, hidden], the step's inputs after it
_DRAFT_DYNAMIC_DIMS = {0: (0,), 1: (0,), 2: (0,), **{i + 1: d for i, d in _DYNAMIC_DIMS.items() if i >= 2}}


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
        mtp_gm: fx.GraphModule | None = None,
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
        self.mtp_gm = mtp_gm
        self.step_graphs: dict[int, DecodeGraphs] = {}  # tokens per request → the step's graphs
        self.draft_graphs: dict[int, DecodeGraphs] = {}  # tokens per request → the draft program's
        self.spec_steps: SpecDecodeSteps | None = None  # whole greedy speculative decode steps
        self.sampled_spec_steps: SpecDecodeSteps | None = None  # the same for batches that sample
        self.compile_cache: Path | None = self._use_compile_cache() if compile else None
        self._fn = torch.compile(gm, dynamic=False, fullgraph=True) if compile else gm
        self._draft_fn = None
        if mtp_gm is not None:
            self._draft_fn = torch.compile(mtp_gm, dynamic=False, fullgraph=True) if compile else mtp_gm
        self._compiled_once = False
        self._draft_compiled_once = False

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The step program's graphs at one token per request (plain decode), if captured."""
        return self.step_graphs.get(1)

    @property
    def num_draft_layers(self) -> int:
        """MTP layers the artifact's draft program runs (0: no draft program, no speculative decoding)."""
        return 0 if self.mtp_gm is None else 1

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
        self,
        kv_cache: torch.Tensor,
        max_pages: int,
        batch_sizes: list[int] | None = None,
        query_lens: tuple[int, ...] = (1,),
        sample: bool = True,
    ) -> str | None:
        """Capture CUDA graphs of the step program over `kv_cache` (the recipe's batch sizes by default)
        at each of `query_lens` tokens per request, every token a logits row (q = 1: decode; q = K+1: a
        speculative verify step). Each q's graphs have their own memory pool: a replay's outputs stay
        valid until the next replay at the same q (of this program), whatever runs between. With
        `sample`, the decode graphs (q = 1) draw the next tokens too, with the Triton fused sampler
        (`step_sampled`). Returns None on success, else why nothing was captured (steps then run
        uncaptured)."""
        sizes = batch_sizes if batch_sizes is not None else self.recipe.cuda_graphs.decode_batch_sizes
        sampler = _graph_sampler() if sample else None
        return self._capture(
            self.step_graphs, self._run, self.gm, kv_cache, max_pages, sizes, query_lens, sampler=sampler
        )

    @property
    def sampling_width(self) -> int | None:
        """The columns of the parameter block `step_sampled` takes (None: no decode graph samples)."""
        graphs = self.step_graphs.get(1)
        return None if graphs is None else graphs.sampling_width

    def step_sampled(
        self, batch: StepBatch, kv_cache: torch.Tensor, block: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step whose graph draws the next token of every request with the fused sampler's
        parameters `block` (`hy3c.serve.engine.sampler.sampling_block`, `sampling_width` columns):
        (logits rows, hidden, tokens int64, [requests, 2] float64 tokens and logprobs), valid until
        the next decode replay; None when no sampling graph covers the batch (run `step`, then sample)."""
        graphs = self.step_graphs.get(1)
        return None if graphs is None else graphs.run_sampled(batch, kv_cache, block)

    def step_written(
        self, b: int, table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode step of b requests written into the sampled decode graphs' inputs
        (`decode_graphs.inputs`, a `hy3c.runtime.cuda_graphs.DecodeInputs`), replayed with its draws, its
        page-table rows gathered from `table` (`DecodeGraphs.replay_written`): (logits rows, hidden,
        tokens int64, [b, 2] float64 draws), valid until the next decode replay."""
        return self.step_graphs[1].replay_written(b, table)

    def capture_draft_graphs(
        self,
        kv_cache: torch.Tensor,
        max_pages: int,
        batch_sizes: list[int] | None,
        query_lens: tuple[int, ...],
    ) -> str | None:
        """Capture CUDA graphs of the draft program at each of `query_lens` tokens per request with one
        logits row per request (its index copied in per replay: it may be any token of the request),
        `hidden_prev` a static input. Returns None on success, else why nothing was captured."""
        if self.mtp_gm is None:
            return "the artifact has no draft program (compiled without MTP layers)"
        sizes = batch_sizes if batch_sizes is not None else self.recipe.cuda_graphs.decode_batch_sizes
        return self._capture(
            self.draft_graphs, self._run_draft, self.mtp_gm, kv_cache, max_pages, sizes, query_lens, True
        )

    def capture_spec_steps(
        self,
        kv_cache: torch.Tensor,
        max_pages: int,
        batch_sizes: list[int] | None,
        k: int,
        page_size: int,
        rule: StepRule,
        graphs: bool = True,
        sampled: bool = False,
    ) -> str | None:
        """Capture whole speculative decode steps with K drafts (`hy3c.runtime.spec_graphs`: the chained
        correction, verify and acceptance by `rule`, the MTP passes) per batch size, as `spec_steps`,
        or with `sampled` (a rule that reads sampling parameters) as `sampled_spec_steps`;
        `graphs=False` builds them uncaptured (off CUDA: tests). Returns None on success, else why
        nothing was captured."""
        if self.mtp_gm is None:
            return "the artifact has no draft program (compiled without MTP layers)"
        sizes = batch_sizes if batch_sizes is not None else self.recipe.cuda_graphs.decode_batch_sizes
        blockers = capture_blockers(self.gm) + capture_blockers(self.mtp_gm) if graphs else []
        if blockers:
            return f"ops without a CUDA-graph-safe provider: {', '.join(blockers)}"
        result = SpecDecodeSteps.capture(
            self._run, self._run_draft, kv_cache, sizes, max_pages, k, page_size, rule, graphs
        )
        if isinstance(result, str):
            log_event(log, "cuda_graphs_skipped", reason=result, program="speculative step")
            return result
        if sampled:
            self.sampled_spec_steps = result
        else:
            self.spec_steps = result
        return None

    def spec_step(
        self,
        batch: StepBatch,
        kv_cache: torch.Tensor,
        chained_from: torch.Tensor | None = None,
        params: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A whole speculative decode step (`SpecDecodeSteps.run`): `sampled_spec_steps` with the rule's
        parameter block `params`, else `spec_steps`. Returns the packed [b, 1 + (K+1) + K] accepted
        counts, emitted tokens and next drafts; None when no captured step covers the batch."""
        steps = self.spec_steps if params is None else self.sampled_spec_steps
        if steps is None or not steps.fits(batch, kv_cache):
            return None
        return steps.run(batch, chained_from, params)

    def _capture(
        self,
        into: dict[int, DecodeGraphs],
        fn,
        gm: fx.GraphModule,
        kv_cache: torch.Tensor,
        max_pages: int,
        sizes: list[int],
        query_lens: tuple[int, ...],
        draft: bool = False,
        sampler=None,
    ) -> str | None:
        if not sizes:
            return "the recipe lists no decode batch sizes"
        for q in query_lens:
            result = DecodeGraphs.capture(
                fn,
                gm,
                kv_cache,
                sizes,
                max_pages,
                query_len=q,
                rows_per_request=1 if draft else q,
                extra_widths=(self.config.hidden_size,) if draft else (),
                extra_dtype=self.dtype,
                sampler=sampler if q == 1 else None,
            )
            if isinstance(result, str):
                log_event(log, "cuda_graphs_skipped", reason=result, program="mtp" if draft else "step")
                return result
            into[q] = result
        return None

    def step(
        self, batch: StepBatch, kv_cache: torch.Tensor, query_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one step, replaying a captured graph when one covers the batch (`query_len`: the caller
        vouches that every request feeds that many tokens). Returns (fp32 logits of the
        `logits_indices` rows, post-norm hidden of every fed token: the draft program's input)."""
        for graphs in self.step_graphs.values():
            out = graphs.run(batch, kv_cache, (), query_len)
            if out is not None:
                return out
        return self(*batch.model_args(kv_cache))

    def draft(
        self,
        batch: StepBatch,
        hidden_prev: torch.Tensor,
        kv_cache: torch.Tensor,
        query_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft program (MTP depth 0) over `batch`: `batch.input_ids[t]` is the token after
        position `batch.positions[t]`, `hidden_prev[t]` the post-norm hidden state at that position
        ([tokens, hidden], model dtype: a step's hidden rows, or the draft program's own for the
        recursion); its KV goes to cache layer `num_hidden_layers`. Returns (fp32 logits of the
        `logits_indices` rows, the MTP layer's post-norm hidden of every token), replaying a captured
        draft graph when one covers the batch."""
        if self.mtp_gm is None:
            raise RuntimeError(f"{self.path}: the artifact has no draft program (num_draft_layers is 0)")
        for graphs in self.draft_graphs.values():
            out = graphs.run(batch, kv_cache, (hidden_prev,), query_len)
            if out is not None:
                return out
        b = batch
        return self._run_draft(
            b.input_ids,
            b.positions,
            hidden_prev,
            kv_cache,
            b.page_table,
            b.seq_lens,
            b.query_start_loc,
            b.slot_mapping,
            b.logits_indices,
        )

    def _run_draft(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft program over its nine inputs (compiled like the step, its dims unbacked)."""
        if not self.compiled:
            with torch.no_grad():
                return self._draft_fn(*args)
        for index, dims in _DRAFT_DYNAMIC_DIMS.items():
            for dim in dims:
                torch._dynamo.decorators.mark_unbacked(args[index], dim)
        first = not self._draft_compiled_once
        if first:
            log_event(log, "inductor_compile_started", cache=str(self.compile_cache), program="mtp")
            started = time.monotonic()
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            out = self._draft_fn(*args)
        if first:
            self._draft_compiled_once = True
            log_event(
                log, "inductor_compile_done", seconds=round(time.monotonic() - started, 1), program="mtp"
            )
        return out

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


def _graph_sampler():
    """The fused sampler a decode graph captures (`hy3c.kernels.sampler.fused_sampler.draw_pair`);
    None where Triton is not installed."""
    try:
        from hy3c.kernels.sampler.fused_sampler import draw_pair
    except ImportError:
        return None
    return draw_pair
