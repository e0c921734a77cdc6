"""Reading a compiled artifact: its files, manifest, hashes and program, checked (docs/ARCHITECTURE.md,
"The artifact contract"). The runtime loads the weights on top of this (`hy3c.runtime.artifact.load`).

    art = open_artifact("art/")            # manifest.json validated, hashes recomputed; nothing else read
    program = read_program_file(art)      # program/step.json rebuilt and checked node by node

An artifact directory holds `manifest.json` (format version, versions, model config, recipe, cache key,
file hashes), `program/step.json` (the graph after passes, JSON), `weights/rank0*.safetensors`,
`compile_report.json`, optional `graphs/` dumps and the tokenizer files. (Inductor's caches live in a
per-user directory, never in the artifact: see `hy3c.runtime.runner`.)

Everything read from an artifact is untrusted. Every file loading (or `hy3c inspect`, or the
tokenizer) reads from it must be a regular file whose real path lies inside the artifact's real path
(`artifact_file`): a symlink within the artifact is followed, one leading outside it (the file, or a
directory on its way) is refused, and so are FIFOs and devices, whose reads could block or never end.
Loading checks, before any weight is read:
* the manifest: its format version, every field loading relies on (a missing or mistyped one is an
  error naming it), and its hashes: the model config, the recipe, the program, the weight list and the
  versions must match the cache key's parts, and the key its parts (`hy3c.program.manifest`), so a
  config or recipe edited without recompiling is refused;
* the program: its sha256, then every node (`hy3c.program.serialize.read_program`: only ops of the
  allow-list, arguments that fit each op's schema) and the shapes through the whole graph on meta
  tensors from the config (`Program.check_shapes`);
then (in `hy3c.runtime.artifact`) the weights: each file's size and sha256 (streamed, several files at
once), then the parameter shapes against the program. Any failure is an `ArtifactError` naming the
file, field or node. Nothing is unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hy3c.config import Hy3Config
from hy3c.program.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    cache_key_parts,
    json_sha256,
    kv_cache_dtype,
)
from hy3c.recipe import Recipe

if TYPE_CHECKING:
    from hy3c.program.serialize import Program


class ArtifactError(ValueError):
    """A missing, corrupt or incompatible artifact; the message names the file (and field or node)."""


def artifact_file(path: Path, name: str | Path) -> Path:
    """The real path of the file `name` of the artifact directory `path`, to read it by; ArtifactError
    naming `path / name` when it is missing, resolves (through a symlink) outside the artifact, or is
    not a regular file. Symlinks that stay inside the artifact are allowed (they reach nothing a copy of
    the file could not). It checks the files as they lie: an artifact rewritten while it loads is not
    what this guards against."""
    file = path / name
    try:
        root = path.resolve(strict=True)
        real = file.resolve(strict=True)
        mode = real.stat().st_mode
    except FileNotFoundError:
        raise ArtifactError(f"{file}: missing") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13), no permission
        raise ArtifactError(f"{file}: unreadable ({exc})") from None
    if not real.is_relative_to(root):
        raise ArtifactError(f"{file}: is a link outside the artifact (to {real})")
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{file}: not a regular file (a FIFO, device or directory cannot be read safely)")
    return real


@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    config: Hy3Config
    recipe: Recipe

    @property
    def has_weights(self) -> bool:
        return self.manifest.get("weights") is not None

    @property
    def has_mtp(self) -> bool:
        """Whether the artifact holds the draft program (MTP depth 0; speculative decoding needs it)."""
        return self.manifest.get("programs", {}).get("mtp") is not None

    @property
    def world_size(self) -> int:
        """The ranks that run the program together (1: one process)."""
        return self.recipe.parallel.world_size

    @property
    def kv_heads(self) -> int:
        """The KV heads each rank's cache holds."""
        return self.recipe.parallel.local_kv_heads(self.config.num_key_value_heads)

    def weight_files(self, rank: int) -> list[dict[str, Any]]:
        """The manifest entries of the weight files rank `rank` loads."""
        return [e for e in self.manifest["weights"]["files"] if e.get("rank", 0) == rank]

    def file(self, name: str | Path) -> Path:
        """The real path of one of the artifact's files, checked by `artifact_file`."""
        return artifact_file(self.path, name)

    def read_json(self, name: str) -> Any:
        return _read_json(self.path, name)


def _read_json(path: Path, name: str) -> Any:
    """The JSON file `name` of the artifact at `path`; any decoding failure (bad UTF-8, too deep, an
    integer past Python's digit limit: all ValueError or RecursionError) is an ArtifactError naming it."""
    real = artifact_file(path, name)
    try:
        return json.loads(real.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path / name}: corrupt JSON ({str(exc)[:200]})") from None


def _field_error(file: Path, exc: ValidationError, prefix: str = "") -> ArtifactError:
    """One line naming the first bad field: `manifest.json: field 'program.sha256': Field required`."""
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in (prefix, *first["loc"]) if p != "") or "(top level)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ArtifactError(f"{file}: field '{loc}': {first['msg']}{more}")


def open_artifact(path: str | Path) -> Artifact:
    """Read and validate manifest.json, its fields and its hashes (no program or weights are read)."""
    path = Path(path)
    file = path / MANIFEST_FILE
    if not os.path.lexists(file):
        hint = (
            f"; a checkpoint is compiled first: hy3c compile --model {path} --out ART"
            if (path / "config.json").is_file()
            else ""
        )
        raise ArtifactError(f"{file}: missing (is {path} a hy3c artifact?){hint}")
    manifest = _read_json(path, MANIFEST_FILE)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{file}: artifact format version {version!r}; this hy3c reads version {FORMAT_VERSION} (recompile it)"
        )
    try:
        checked = Manifest.model_validate(manifest)
    except ValidationError as exc:
        raise _field_error(file, exc) from None
    try:
        config = Hy3Config.model_validate(checked.config)
    except ValidationError as exc:
        raise _field_error(file, exc, "model_config") from None
    try:
        recipe = Recipe.model_validate(checked.recipe)
    except ValidationError as exc:
        raise _field_error(file, exc, "recipe") from None
    _check_hashes(file, manifest, checked, recipe)
    _check_ranks(file, checked, config, recipe)
    return Artifact(path, manifest, config, recipe)


def _check_ranks(file: Path, checked: Manifest, config: Hy3Config, recipe: Recipe) -> None:
    """The shard plan's world and KV heads are the recipe's; every weight file belongs to one of its
    ranks and every rank has weights."""
    world = recipe.parallel.world_size
    if checked.shard_plan.world_size != world:
        raise ArtifactError(
            f"{file}: field 'shard_plan.world_size' is {checked.shard_plan.world_size}, the recipe's "
            f"parallel layout needs {world}"
        )
    kv_heads = recipe.parallel.local_kv_heads(config.num_key_value_heads)
    if checked.shard_plan.kv_heads_per_rank not in (None, kv_heads):
        raise ArtifactError(f"{file}: field 'shard_plan.kv_heads_per_rank' is not {kv_heads}")
    if checked.weights is None:
        return
    ranks = {entry.rank for entry in checked.weights.files}
    if max(ranks) >= world:
        raise ArtifactError(f"{file}: field 'weights.files' names rank {max(ranks)} of a world of {world}")
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise ArtifactError(f"{file}: field 'weights.files' has no weights for rank {missing[0]}")


# the manifest field each part of the cache key is computed from
_PART_SOURCES = {
    "model": "model_config",
    "recipe": "recipe",
    "weights": "weights.files",
    "program": "program.sha256",
    "programs": "programs.mtp.sha256",
    "hy3c": "versions",
    "torch": "versions",
    "triton": "versions",
}


def _check_hashes(file: Path, manifest: dict[str, Any], checked: Manifest, recipe: Recipe) -> None:
    """The cache key's parts recomputed from the manifest by the writer's function, and the key from
    its parts; the recorded pass-source hashes must cover the recipe's passes."""
    recorded = manifest["cache_key"]["parts"]
    recomputed = cache_key_parts(
        manifest["model_config"],
        manifest["recipe"],
        recorded["passes"],  # the sources of the hy3c that compiled it: recorded, not recomputable
        manifest["weights"]["files"] if checked.weights is not None else [],
        checked.program.sha256,
        manifest["versions"],
        {"mtp": checked.programs.mtp.sha256} if checked.programs.mtp is not None else None,
    )
    for part in sorted(recorded.keys() | recomputed.keys()):
        if recorded.get(part) != recomputed.get(part):
            source = _PART_SOURCES.get(part, f"cache_key.parts.{part}")
            raise ArtifactError(
                f"{file}: field '{source}' does not match cache_key.parts.{part} "
                "(edited after compiling? recompile it)"
            )
    if sorted(recorded["passes"]) != sorted(p.name for p in recipe.passes):
        raise ArtifactError(f"{file}: field 'cache_key.parts.passes' does not match the recipe's passes")
    if json_sha256(recorded) != checked.cache_key.key:
        raise ArtifactError(f"{file}: field 'cache_key.key' is not the hash of cache_key.parts (edited?)")
    if checked.kv_cache.dtype != kv_cache_dtype(recipe):
        raise ArtifactError(
            f"{file}: field 'kv_cache.dtype' does not match the recipe's quant.kv and dtype "
            f"({kv_cache_dtype(recipe)})"
        )


def read_program_file(art: Artifact, name: str = "step") -> Program:
    """The program file of program `name` ("step", or "mtp" where `art.has_mtp`), its hash against the
    manifest, rebuilt and checked node by node and by shapes."""
    import torch

    # the op registrations: not for inspect
    from hy3c.program.check import MTP_INPUTS, STEP_INPUTS
    from hy3c.program.serialize import ProgramError, read_program

    entry = art.manifest["program"] if name == "step" else art.manifest["programs"][name]
    file = art.path / entry["file"]
    text = art.file(entry["file"]).read_bytes()
    if hashlib.sha256(text).hexdigest() != entry["sha256"]:
        raise ArtifactError(f"{file}: sha256 differs from manifest.json (corrupt or edited program)")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # see _read_json
        raise ArtifactError(f"{file}: corrupt JSON ({str(exc)[:200]})") from None
    try:
        program = read_program(data, STEP_INPUTS if name == "step" else MTP_INPUTS)
        kv_dtype = getattr(torch, art.manifest["kv_cache"]["dtype"])
        program.check_shapes(
            art.config,
            getattr(torch, art.recipe.dtype),
            kv_dtype,
            art.kv_heads,
            art.recipe.parallel.token_multiple,
        )
    except ProgramError as exc:
        raise ArtifactError(f"{file}: {exc}") from None
    return program
