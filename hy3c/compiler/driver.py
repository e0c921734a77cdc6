"""`hy3c compile`: checkpoint (or a config preset) + recipe → artifact directory (docs/ARCHITECTURE.md
§2, §6).

    summary = compile_artifact(recipe, out, checkpoint="ckpt/")       # or preset="full" (no weights)

Steps: read the checkpoint's config and headers → trace the step function on the meta device → run the
recipe's passes → write `program/step.json`, the weights (converted as the passes planned),
`compile_report.json`, optional `graphs/` dumps, the tokenizer files and `manifest.json`, all inside a
temporary directory renamed into place at the end. Where the checkpoint has MTP layers (and not with
`--no-mtp`), the draft program (`mtp_forward` of depth 0) is traced and run through the same passes too,
written to `program/mtp.json` and recorded under `programs` in manifest.json; the weights of both
programs are written once (embed_tokens, lm_head and kv_scales are shared). Sharded recipes compile no
draft program yet: manifest.json `programs.mtp_absent` says so.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from tqdm import tqdm

import hy3c
from hy3c.checkpoint.loader import CheckpointLayout, inspect_checkpoint
from hy3c.checkpoint.safetensors_io import atomic_output_dir, check_output_dir
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.package import derive_weights, merge_programs, write_weights
from hy3c.compiler.trace import trace_mtp, trace_step
from hy3c.config import Hy3Config, preset_config
from hy3c.logs import log_event
from hy3c.model.hy3 import Hy3ForCausalLM
from hy3c.model.layers import NO_QUANT, QuantLayout
from hy3c.passes.base import CompileCtx, PassResult
from hy3c.passes.graph_utils import set_attr
from hy3c.passes.manager import PassError, PassManager
from hy3c.passes.registry import PASS_REGISTRY, check_recipe_passes
from hy3c.passes.shard_plan import shard_plan
from hy3c.program.check import MTP_INPUTS, STEP_INPUTS, STEP_OUTPUTS
from hy3c.program.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MTP_PROGRAM_FILE,
    PROGRAM_FILE,
    REPORT_FILE,
    TOKENIZER_FILES,
    Manifest,
    cache_key_parts,
    json_sha256,
    kv_cache_dtype,
)
from hy3c.program.serialize import graph_to_json
from hy3c.recipe import Recipe, RecipeError
from hy3c.runtime.runner import Runner

log = logging.getLogger("hy3c.compile")


class CompileError(ValueError):
    """A compile request that cannot be satisfied; the message names the recipe key or file."""


@dataclass
class CompileSummary:
    out: Path
    results: list[PassResult]
    timings: dict[str, float]
    weights_bytes: int


def pass_source_hashes(recipe: Recipe) -> dict[str, str]:
    """sha256 of the source module of every pass in the recipe (editing a pass changes the cache key)."""
    out = {}
    for spec in recipe.passes:
        module = inspect.getmodule(PASS_REGISTRY[spec.name])
        out[spec.name] = hashlib.sha256(inspect.getsource(module).encode()).hexdigest()
    return out


def _check_supported(recipe: Recipe, config: Hy3Config, layout: CheckpointLayout | None) -> None:
    check_recipe_passes(recipe)
    par = recipe.parallel
    try:
        par.check_model(config)
    except ValueError as exc:
        raise CompileError(f"recipe key {exc}") from None
    for key, active, name in (("tp", par.tp > 1, "shard_tp"), ("ep", par.ep > 1, "shard_ep")):
        spec = recipe.pass_spec(name)
        if active and (spec is None or not spec.enabled):
            raise CompileError(
                f"recipe key parallel.{key}={getattr(par, key)}: the recipe's passes must include {name}"
            )
    if layout is not None and layout.quant.fp8_modules and recipe.quant.weights == "none":
        raise CompileError(
            "recipe key quant.weights=none, but the checkpoint's weights are FP8 (use quant.weights=fp8)"
        )


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"hy3c": hy3c.__version__, "torch": torch.__version__, "triton": triton_version}


def unavailable_providers() -> tuple[tuple[str, str], ...]:
    """Provider families this install cannot lower to, with the reason (the `lower` pass skips them)."""
    from hy3c.kernels import HAVE_TRITON

    return () if HAVE_TRITON else (("triton", "Triton is not installed"),)


def compile_context(config: Hy3Config, recipe: Recipe, quant: QuantLayout) -> CompileCtx:
    from hy3c.kernels import overrides

    return CompileCtx(
        model=config,
        parallel=recipe.parallel,
        target=recipe.target,
        device_type=recipe.device_type,
        quant=recipe.quant,
        dtype=recipe.dtype,
        token_range=recipe.token_range,
        checkpoint_static_scales=quant.static_activations,
        checkpoint_fp8=bool(quant.fp8_modules),
        unavailable_providers=unavailable_providers(),
        variant_overrides=tuple(sorted(overrides.active().items())),
    )


def trace_and_run_passes(
    ctx: CompileCtx,
    recipe: Recipe,
    quant: QuantLayout,
    dump_dir: Path | None,
    timings: dict[str, float],
    progress: bool | None = None,
    program: str = "step",
) -> tuple[fx.GraphModule, list[PassResult]]:
    """Trace the step function (`program="mtp"`: the draft program, MTP depth 0) on the meta device and
    run the recipe's passes over it in `ctx`, with one progress bar over the trace and each pass (shown
    on a terminal; `progress` forces it on or off). Timings of the draft program are `mtp_`-prefixed."""
    config = ctx.model
    prefix = "" if program == "step" else f"{program}_"
    if program == "step":
        _warn_unavailable(recipe, ctx)
    if ctx.variant_overrides and program == "step":
        log_event(
            log,
            "kernel_variant_overrides",
            level=logging.WARNING,
            overrides=" ".join(f"{name}={int(on)}" for name, on in ctx.variant_overrides),
            effect="the lower pass takes them over the recipe (recorded in manifest.json)",
        )
    with tqdm(
        total=1 + len(recipe.passes),
        desc="compile" if program == "step" else f"compile {program}",
        unit="step",
        disable=None if progress is None else not progress,
    ) as bar:
        dtype, multiple = getattr(torch, recipe.dtype), recipe.parallel.token_multiple
        start = time.perf_counter()
        if program == "step":
            bar.set_postfix_str(f"trace ({config.num_hidden_layers} layers)")
            gm = trace_step(config, dtype, quant, multiple)
        else:
            bar.set_postfix_str("trace (MTP depth 0)")
            gm = trace_mtp(config, dtype, quant, multiple, depth=0)
        timings[f"{prefix}trace_s"] = time.perf_counter() - start
        bar.update()

        def advance(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()

        start = time.perf_counter()
        try:
            results = PassManager(recipe.passes, ctx, dump_dir, program).run(gm, on_pass=advance)
        except PassError as exc:
            raise CompileError(str(exc)) from None
        timings[f"{prefix}passes_s"] = time.perf_counter() - start
    return gm, results


def mtp_absent_reason(config: Hy3Config, recipe: Recipe, with_mtp: bool) -> str | None:
    """Why an artifact of `config` and `recipe` gets no draft program (None: it gets one)."""
    if not with_mtp:
        return "compiled with --no-mtp"
    if config.num_nextn_predict_layers == 0:
        return "the checkpoint has no MTP layers"
    if recipe.parallel.world_size > 1:
        return (
            f"sharded recipes (world size {recipe.parallel.world_size}) compile no draft program yet: "
            "the shard passes are not run over the MTP layer"
        )
    return None


def pass_sites(results: list[PassResult]) -> dict[str, int]:
    """pass name → sites it matched (manifest.json `programs.pass_sites`)."""
    return {r.name: r.matches for r in results}


def _warn_unavailable(recipe: Recipe, ctx: CompileCtx) -> None:
    """One warning when the recipe asks for kernels this install lacks (its ops fall back to torch)."""
    lower = recipe.pass_spec("lower")
    priority = (lower.config.get("priority") if lower is not None else None) or []
    missing = [(name, why) for name, why in ctx.unavailable_providers if name in priority]
    if missing and recipe.device_type == "cuda":
        log_event(
            log,
            "providers_unavailable",
            level=logging.WARNING,
            recipe=recipe.name,
            missing="; ".join(f"{name}: {why}" for name, why in missing),
            effect="its ops fall back to later providers (see `hy3c inspect ART passes` / `ops`)",
        )


def compile_model(
    model: Hy3ForCausalLM, recipe: Recipe, compile: bool = True, cache_dir: Path | None = None
) -> tuple[Runner, list[PassResult]]:
    """Compile a model already in memory (e.g. random weights at real shapes for benchmarks) into a
    Runner, without writing an artifact: same trace, passes and weight derivation as `compile_artifact`."""
    _check_supported(recipe, model.config, None)
    if recipe.parallel.world_size > 1:
        raise CompileError(
            "compile_model builds one rank's runner; compile a sharded recipe with compile_artifact"
        )
    ctx = compile_context(model.config, recipe, model.quant)
    gm, results = trace_and_run_passes(ctx, recipe, model.quant, None, {})
    programs = [gm]
    mtp_gm = None
    if mtp_absent_reason(model.config, recipe, True) is None:
        mtp_gm, _ = trace_and_run_passes(ctx, recipe, model.quant, None, {}, program="mtp")
        programs.append(mtp_gm)
    params = dict(model.named_parameters())
    device = model.device

    def sources(shapes):
        for fqn in shapes:
            yield fqn, params[fqn]

    owners = [dict(p.named_parameters()) for p in programs]
    with torch.no_grad():
        for fqn, tensor in derive_weights(merge_programs(programs), sources, getattr(torch, recipe.dtype)):
            tensor = tensor.to(device)
            for program, names in zip(programs, owners):
                if fqn in names:
                    set_attr(program, fqn, tensor)  # one tensor for a weight both programs read
    for program in programs:
        program.recompile()
    key = json_sha256(
        [model.config.to_json_dict(), recipe.model_dump(mode="json"), pass_source_hashes(recipe)]
    )
    manifest = {"cache_key": {"key": key}, "kv_cache": {"dtype": kv_cache_dtype(recipe)}}
    cache_dir = cache_dir or Path(tempfile.mkdtemp(prefix="hy3c-compile-"))
    runner = Runner(cache_dir, manifest, model.config, recipe, gm, device, compile, mtp_gm=mtp_gm)
    return runner, results


def compile_artifact(
    recipe: Recipe,
    out: str | Path,
    checkpoint: str | Path | None = None,
    preset: str | None = None,
    dump_graphs: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_bytes: int = 4 << 30,
    with_mtp: bool = True,
    ignore_unexpected: Iterable[str] = (),
) -> CompileSummary:
    """Compile a checkpoint (or a config preset, for inspection) into an artifact directory at `out`.

    `with_mtp=False` compiles a checkpoint without its MTP layer (its tensors are then not required);
    `ignore_unexpected` lists fnmatch patterns of checkpoint tensors to leave unused."""
    if (checkpoint is None) == (preset is None):
        raise CompileError(
            "give exactly one of a checkpoint directory (--model) or a config preset (--preset)"
        )
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if checkpoint is not None:
        check_output_dir(out, overwrite, inputs=[checkpoint])
        if (Path(checkpoint) / "tokenizer.json").is_file():
            Hy3Tokenizer.from_dir(checkpoint)  # a corrupt tokenizer fails here, before anything is written
    layout = inspect_checkpoint(checkpoint, with_mtp, ignore_unexpected) if checkpoint is not None else None
    config: Hy3Config = layout.config if layout is not None else preset_config(preset)
    if not with_mtp:
        config = config.model_copy(update={"num_nextn_predict_layers": 0})
    _check_supported(recipe, config, layout)
    dtype = getattr(torch, recipe.dtype)
    quant = layout.quant if layout is not None else NO_QUANT
    out = Path(out)
    with atomic_output_dir(out, overwrite, inputs=[checkpoint] if checkpoint is not None else []) as tmp:
        ctx = compile_context(config, recipe, quant)
        gm, results = trace_and_run_passes(
            ctx, recipe, quant, tmp / "graphs" if dump_graphs else None, timings, progress
        )
        mtp_absent = mtp_absent_reason(config, recipe, with_mtp)
        mtp_gm, mtp_results = None, []
        if mtp_absent is None:
            mtp_dump = tmp / "graphs" / "mtp" if dump_graphs else None
            mtp_gm, mtp_results = trace_and_run_passes(
                ctx, recipe, quant, mtp_dump, timings, progress, program="mtp"
            )
        t0 = time.perf_counter()
        (tmp / "program").mkdir()
        program = json.dumps(graph_to_json(gm))
        (tmp / PROGRAM_FILE).write_text(program)
        mtp_program = json.dumps(graph_to_json(mtp_gm)) if mtp_gm is not None else None
        if mtp_program is not None:
            (tmp / MTP_PROGRAM_FILE).write_text(mtp_program)
        weight_files: list[dict[str, Any]] = []
        if layout is not None:
            try:
                weights_of = merge_programs([gm] if mtp_gm is None else [gm, mtp_gm])
            except ValueError as exc:
                raise CompileError(f"the step and MTP programs cannot share weights: {exc}") from None
            weight_files = write_weights(
                weights_of, layout, Path(checkpoint), dtype, tmp, recipe.parallel, max_shard_bytes, progress
            )
            for name in TOKENIZER_FILES:
                if (Path(checkpoint) / name).is_file():
                    shutil.copy2(Path(checkpoint) / name, tmp / name)
        timings["package_s"] = time.perf_counter() - t0
        timings["total_s"] = time.perf_counter() - start
        versions = _versions()
        program_sha256 = hashlib.sha256(program.encode()).hexdigest()
        mtp_sha256 = hashlib.sha256(mtp_program.encode()).hexdigest() if mtp_program is not None else None
        parts = cache_key_parts(
            config.to_json_dict(),
            recipe.model_dump(mode="json"),
            pass_source_hashes(recipe),
            weight_files,
            program_sha256,
            versions,
            {"mtp": mtp_sha256} if mtp_sha256 is not None else None,
        )
        report = {
            "recipe": recipe.name,
            "source": str(checkpoint) if checkpoint is not None else f"preset:{preset}",
            "num_layers": config.num_hidden_layers,
            "passes": [r.model_dump(mode="json") for r in results],
            "programs": {"mtp": {"passes": [r.model_dump(mode="json") for r in mtp_results]}}
            if mtp_gm is not None
            else {},
            "timings": timings,
        }
        programs = {
            "names": ["step"] if mtp_gm is None else ["step", "mtp"],
            "mtp": None
            if mtp_sha256 is None
            else {
                "file": MTP_PROGRAM_FILE,
                "sha256": mtp_sha256,
                "inputs": list(MTP_INPUTS),
                "outputs": list(STEP_OUTPUTS),
                "depth": 0,
            },
            "mtp_absent": mtp_absent,
            "pass_sites": {
                "step": pass_sites(results),
                **({"mtp": pass_sites(mtp_results)} if mtp_gm else {}),
            },
        }
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2))
        manifest = Manifest.model_validate(
            {
                "format_version": FORMAT_VERSION,
                "versions": versions,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "model_config": config.to_json_dict(),
                "recipe": recipe.model_dump(mode="json"),
                "source": {
                    "checkpoint": str(checkpoint) if checkpoint is not None else None,
                    "preset": preset,
                    "scheme": layout.scheme if layout is not None else None,
                    "fp8_checkpoint": bool(quant.fp8_modules),
                    "quant_layout": {
                        "fp8_modules": sorted(quant.fp8_modules),
                        "static_activations": quant.static_activations,
                        "int4_experts": sorted(quant.int4_experts),
                        "group_size": quant.group_size,
                    },
                },
                "program": {
                    "file": PROGRAM_FILE,
                    "sha256": program_sha256,
                    "inputs": list(STEP_INPUTS),
                    "outputs": list(STEP_OUTPUTS),
                },
                "programs": programs,
                "weights": {"files": weight_files} if layout is not None else None,
                "kv_cache": {"dtype": kv_cache_dtype(recipe)},
                "shard_plan": {
                    "world_size": recipe.parallel.world_size,
                    "kv_heads_per_rank": recipe.parallel.local_kv_heads(config.num_key_value_heads),
                    "tensors": shard_plan(gm),
                },
                "overrides": {name: str(int(on)) for name, on in ctx.variant_overrides},
                "cache_key": {"key": json_sha256(parts), "parts": parts},
            }
        )  # the reader's model: what it would refuse is never written
        (tmp / MANIFEST_FILE).write_text(
            json.dumps(manifest.model_dump(mode="json", by_alias=True), indent=2)
        )
    weights_bytes = sum(int(f["bytes"]) for f in weight_files)
    log_event(
        log,
        "artifact_written",
        path=str(out),
        recipe=recipe.name,
        seconds=timings["total_s"],
        weights_gib=weights_bytes / 2**30,
        passes=len(results),
    )
    return CompileSummary(out, results, timings, weights_bytes)


__all__ = ["CompileError", "CompileSummary", "RecipeError", "compile_artifact"]
