"""Seeded random weights for an artifact compiled from a config preset (no weights on disk): the
benchmark mode of the full model, whose FP8 weights (~300 GB) do not fit the GPU machines' disks.

    runner = hy3c.runtime.artifact.load("art/", device="cuda", rank=r, random_weights=0)
    for fqn, tensor in random_parameters(program, seed=0, rank=r, device="cuda", ...): ...

Each rank builds its own parameters directly on its device, one at a time, at the shapes and dtypes the
program records (already one rank's slice of a sharded layout): nothing is read or written on disk and
no CPU copy of the model is made. What each parameter gets, by its name and dtype (`parameter_rule`):

* norm weights (`*norm*.weight`) and `kv_scales`: ones; `*expert_bias`: zeros (routing by the scores);
* router weights (fp32): normal, std `WEIGHT_STD`; the bf16 `weight_hi` / `weight_lo` halves that
  `fuse_moe` adds are split from that same fp32 tensor (`split_router_weight`), so every provider of
  the router GEMM computes the same scores;
* embeddings, lm_head and the high-precision linear weights: normal, std `WEIGHT_STD`;
* FP8 (e4m3) weights: normal values `z` stored as `z * FP8_MAX / FP8_CLIP_SIGMAS` (saturating past
  `FP8_CLIP_SIGMAS` standard deviations), their scale parameters (`<module>.weight_scale`,
  `experts.w13_scale`, `experts.w2_scale`, per channel or per tensor) all `WEIGHT_STD *
  FP8_CLIP_SIGMAS / FP8_MAX`, so the dequantized weights have std `WEIGHT_STD` too. A constant scale needs
  no absmax over the tensor, so a large tensor is generated in chunks (`CHUNK_ELEMENTS`);
* W4A8 experts' int4 weights (uint8, two values per byte): every value in [-7, 7] equally likely (zero
  mean) and their group scales (`experts.w13_scale`, `experts.w2_scale` of a uint8 weight) all
  `WEIGHT_STD / INT4_UNIFORM_STD`, so the dequantized weights have std `WEIGHT_STD` too;
* static activation scales (`input_scale`, `a13_scale`, `a2_scale`): `STATIC_INPUT_SCALE` (inputs up
  to ±8 before saturating: normalized hidden states and the expert activations of std-0.02 weights).

A parameter with no rule is a RandomWeightsError naming it (a new kind of parameter needs a rule
here, not a silent guess).

Seeds: every parameter draws from its own generator, seeded from (seed, name, slice): `slice` is the
rank's index in the parameter's group where the shard plan splits it, nothing where it is replicated.
So a run is reproducible (on the same kind of device), ranks holding different slices of a tensor get
different values, and ranks holding a replicated tensor hold the same one — as in a real checkpoint cut
by the packager: attention-DP replicas are one model and TP ranks route a token alike.
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from hy3c.config import Hy3Config
from hy3c.logs import log_event
from hy3c.ops.quant import FP8_DTYPE, FP8_MAX, pack_int4, split_router_weight
from hy3c.recipe import ParallelSpec

if TYPE_CHECKING:
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.program.artifact import Artifact
    from hy3c.program.serialize import Program

log = logging.getLogger("hy3c.runtime.random_weights")


class RandomWeightsError(ValueError):
    """A program parameter that no random-weights rule fits; the message names it."""


WEIGHT_STD = 0.02  # every random matrix (dequantized, for FP8)
FP8_CLIP_SIGMAS = 6.0  # an FP8 weight's standard normal value saturates at ±448 beyond this
INT4_UNIFORM_STD = math.sqrt((15**2 - 1) / 12)  # of the 15 values in [-7, 7] drawn uniformly
STATIC_INPUT_SCALE = 8.0 / FP8_MAX  # static activation scales: inputs up to ±8
CHUNK_ELEMENTS = 1 << 26  # an FP8 weight is drawn this many fp32 values at a time (256 MiB)
_STATIC_INPUT_SCALES = ("input_scale", "a13_scale", "a2_scale")
_NORMAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

__all__ = [
    "WEIGHT_STD",
    "RandomWeightsError",
    "artifact_random_parameters",
    "expected_bytes",
    "parameter_rule",
    "parameter_seed",
    "random_parameters",
    "random_weights_tokenizer",
]


def _fp8_scale_name(fqn: str) -> str:
    """The scale parameter of an FP8 weight: `<module>.weight` → `<module>.weight_scale`, and a stacked
    expert weight `<module>.w13` → `<module>.w13_scale` (the quantize pass's and the checkpoint's names)."""
    module, _, leaf = fqn.rpartition(".")
    return f"{module}.weight_scale" if leaf == "weight" else f"{fqn}_scale"


def _scale_rules(params: Mapping[str, tuple[list[int], torch.dtype]]) -> dict[str, str]:
    """scale fqn → its rule: "fp8_scale" for an FP8 weight's, "int4_scale" for a packed int4 weight's;
    RandomWeightsError when such a weight has no scale in the program."""
    rules = {}
    for fqn, (_, dtype) in params.items():
        if dtype in (FP8_DTYPE, torch.uint8):
            scale = _fp8_scale_name(fqn)
            if scale not in params:
                raise RandomWeightsError(
                    f"parameter {fqn}: {'FP8' if dtype == FP8_DTYPE else 'int4'}, but the program has no "
                    f"scale parameter {scale}"
                )
            rules[scale] = "fp8_scale" if dtype == FP8_DTYPE else "int4_scale"
    return rules


def parameter_rule(fqn: str, dtype: torch.dtype, scale_rules: Mapping[str, str]) -> str:
    """How parameter `fqn` of `dtype` is filled (see the module docstring): one of "ones", "zeros",
    "normal", "router", "router_hi", "router_lo", "fp8", "fp8_scale", "int4", "int4_scale",
    "input_scale". `scale_rules` holds the rules of the program's weight scales (`_scale_rules`).
    RandomWeightsError naming the parameter when no rule fits."""
    module, _, leaf = fqn.rpartition(".")
    owner = module.rpartition(".")[2]
    if dtype == FP8_DTYPE:
        return "fp8"
    if dtype == torch.uint8 and owner == "experts" and leaf in ("w13", "w2"):
        return "int4"
    if not dtype.is_floating_point:
        raise RandomWeightsError(f"parameter {fqn}: no random-weights rule for dtype {dtype}")
    if fqn in scale_rules:
        return scale_rules[fqn]
    if leaf in _STATIC_INPUT_SCALES:
        return "input_scale"
    if leaf == "kv_scales":
        return "ones"
    if leaf.endswith("expert_bias"):
        return "zeros"
    if owner == "router" and leaf in ("weight_hi", "weight_lo"):
        return "router_" + leaf.removeprefix("weight_")
    if owner == "router" and leaf == "weight":
        return "router"
    if leaf == "weight" and "norm" in owner:
        return "ones"
    if "scale" in leaf:
        raise RandomWeightsError(f"parameter {fqn}: a scale of no FP8 weight; no random-weights rule fits it")
    return "normal"


def parameter_seed(seed: int, fqn: str, index: int | None) -> int:
    """The generator seed of parameter `fqn`: from the run's seed, the name and the rank's slice index
    (None for a replicated parameter, the same on every rank); 63 bits of a sha256."""
    text = f"{seed}/{fqn}/{'' if index is None else index}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _normal(
    shape: list[int], dtype: torch.dtype, std: float, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """N(0, std²) drawn in place in `dtype` (no fp32 copy of the tensor)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if dtype in _NORMAL_DTYPES:
        return out.normal_(0.0, std, generator=gen)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):  # other float dtypes: through fp32 chunks
        n = min(CHUNK_ELEMENTS, flat.numel() - start)
        flat[start : start + n] = torch.empty(n, device=device).normal_(0.0, std, generator=gen).to(dtype)
    return out


def _fp8_normal(shape: list[int], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Standard normal values × FP8_MAX / FP8_CLIP_SIGMAS in e4m3 (a scale of std × FP8_CLIP_SIGMAS /
    FP8_MAX dequantizes them to std), drawn CHUNK_ELEMENTS fp32 values at a time."""
    out = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    flat = out.view(-1)
    factor = FP8_MAX / FP8_CLIP_SIGMAS
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, flat.numel() - start)
        z = torch.empty(n, device=device).normal_(generator=gen)
        flat[start : start + n] = z.mul_(factor).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return out


def random_parameters(
    program: Program,
    seed: int,
    rank: int = 0,
    device: str | torch.device = "cpu",
    *,
    parallel: ParallelSpec | None = None,
    shard_plan: Mapping[str, Mapping[str, Any]] | None = None,
    std: float = WEIGHT_STD,
    progress: bool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, tensor) for every parameter of `program`, at its recorded shape and dtype, made on `device`
    one at a time (see the module docstring for what each gets).

    `shard_plan` (the manifest's `shard_plan.tensors`: fqn → spec with its `group`) and `parallel` (the
    recipe's layout) say which parameters rank `rank` holds a slice of, and which slice: those are
    seeded by the slice index, the others are the same on every rank; without them every parameter is
    taken as replicated. The values need nothing of the model's config: the program's parameter table
    holds every shape. The progress bar shows on a terminal, on rank 0 only unless `progress` says."""
    device = torch.device(device)
    params = program.params
    scales = _scale_rules(params)
    rules = {fqn: parameter_rule(fqn, dtype, scales) for fqn, (_, dtype) in params.items()}  # all, first
    plan = shard_plan or {}
    layout = parallel or ParallelSpec()

    def index(fqn: str) -> int | None:
        spec = plan.get(fqn)
        if spec is None:
            return None
        group = spec.get("group") if isinstance(spec, Mapping) else None
        return layout.group_rank(group, rank) if isinstance(group, int) else rank

    def router_source(fqn: str) -> torch.Tensor:
        source = fqn.rpartition(".")[0] + ".weight"
        gen = _generator(parameter_seed(seed, source, index(source)), device)
        return _normal(params[fqn][0], torch.float32, std, gen, device)

    if progress is None:
        disable: bool | None = True if rank != 0 else None  # None: tqdm shows it on a terminal only
    else:
        disable = not progress
    start, total_bytes = time.perf_counter(), 0
    with tqdm(total=len(params), desc=f"random weights (rank {rank})", unit="tensor", disable=disable) as bar:
        for fqn, (shape, dtype) in params.items():
            rule = rules[fqn]
            gen = _generator(parameter_seed(seed, fqn, index(fqn)), device)
            if rule == "ones":
                tensor = torch.ones(shape, dtype=dtype, device=device)
            elif rule == "zeros":
                tensor = torch.zeros(shape, dtype=dtype, device=device)
            elif rule == "fp8":
                tensor = _fp8_normal(shape, gen, device)
            elif rule == "fp8_scale":
                tensor = torch.full(shape, std * FP8_CLIP_SIGMAS / FP8_MAX, dtype=dtype, device=device)
            elif rule == "int4":  # zero-mean: [-7, 7] (uniform bytes would average -0.5)
                values = torch.randint(-7, 8, (*shape[:-1], 2 * shape[-1]), generator=gen, device=device)
                tensor = pack_int4(values.to(torch.int8))
            elif rule == "int4_scale":
                tensor = torch.full(shape, std / INT4_UNIFORM_STD, dtype=dtype, device=device)
            elif rule == "input_scale":
                tensor = torch.full(shape, STATIC_INPUT_SCALE, dtype=dtype, device=device)
            elif rule in ("router_hi", "router_lo"):
                hi, lo = split_router_weight(router_source(fqn))
                tensor = (hi if rule == "router_hi" else lo).to(dtype)
            elif rule == "router":
                tensor = _normal(shape, torch.float32, std, gen, device).to(dtype)
            else:
                tensor = _normal(shape, dtype, std, gen, device)
            total_bytes += tensor.numel() * tensor.element_size()
            bar.update(1)
            yield fqn, tensor
    log_event(
        log,
        "random_weights_built",
        seed=seed,
        rank=rank,
        device=str(device),
        tensors=len(params),
        gib=round(total_bytes / 2**30, 3),
        seconds=round(time.perf_counter() - start, 2),
    )


def artifact_random_parameters(
    art: Artifact, program: Program, seed: int, rank: int, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s random parameters of an artifact's program, sliced as its manifest's shard plan
    says (what `hy3c.runtime.artifact.load(..., random_weights=seed)` binds). A parameter no rule fits
    is an ArtifactError naming the program file and the parameter."""
    from hy3c.program.artifact import ArtifactError

    if type(seed) is not int:
        raise ArtifactError(f"{art.path}: random weights need an integer seed, not {seed!r}")
    plan = art.manifest.get("shard_plan") or {}
    try:
        return dict(
            random_parameters(
                program,
                seed,
                rank,
                device,
                parallel=art.recipe.parallel,
                shard_plan=plan.get("tensors") or {},
            )
        )
    except RandomWeightsError as exc:
        raise ArtifactError(f"{art.path / art.manifest['program']['file']}: {exc}") from None


def random_weights_tokenizer(path: str | Path, config: Hy3Config) -> Hy3Tokenizer:
    """The tokenizer to serve an artifact with random weights: the artifact's own when it has one, else
    the tiny tokenizer of random checkpoints, padded with placeholder tokens up to the model's
    vocabulary (`hy3c.checkpoint.tiny_tokenizer`: every id decodes to text), built in a temporary
    directory (an artifact compiled from a preset has no tokenizer files)."""
    from hy3c.checkpoint.tiny_tokenizer import write_tokenizer_files
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return Hy3Tokenizer.from_dir(path)
    with tempfile.TemporaryDirectory(prefix="hy3c-tokenizer-") as tmp:
        write_tokenizer_files(Path(tmp), config.vocab_size, config.max_position_embeddings)
        tokenizer = Hy3Tokenizer.from_dir(tmp)
    log_event(
        log,
        "random_weights_tokenizer",
        path=str(path),
        vocab=config.vocab_size,
        note="the artifact has no tokenizer: the tiny one, padded with placeholder tokens",
    )
    return tokenizer


def expected_bytes(program: Program) -> int:
    """The bytes `random_parameters` will allocate on the device for `program` (one rank's weights)."""
    return sum(
        math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in program.params.values()
    )


def artifact_tokenizer(path: str | Path, random_weights: int | None) -> Hy3Tokenizer:
    """The tokenizer `hy3c generate --artifact` and `hy3c serve` use: the artifact's own, or with
    `--random-weights` (a preset's artifact has none) the placeholder one of `random_weights_tokenizer`."""
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.runtime.distributed import check_ranks

    art = check_ranks(path, random_weights=random_weights)  # a preset's artifact without it: that error
    if random_weights is None:
        return Hy3Tokenizer.from_dir(path)
    return random_weights_tokenizer(path, art.config)
