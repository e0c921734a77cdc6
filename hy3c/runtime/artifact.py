"""Loading a compiled artifact into a `Runner`: the checks of `hy3c.program.artifact` (manifest, hashes,
program), then every weight file's size and sha256, then the weights bound to the program.

    runner = hy3c.runtime.artifact.load("art/", device="cuda")
    logits, hidden = runner(*batch.model_args(runner.allocate_kv_cache(num_pages, page_size)))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hy3c.program.artifact import Artifact, ArtifactError, open_artifact, read_program_file
from hy3c.program.manifest import files_sha256
from hy3c.program.serialize import ProgramError
from hy3c.runtime.random_weights import artifact_random_parameters
from hy3c.runtime.runner import Runner


def check_weight_files(art: Artifact) -> None:
    """Every rank's weight files are there, regular files inside the artifact, of the recorded size (what
    the process that starts the ranks checks before any of them loads anything)."""
    for entry in art.manifest["weights"]["files"]:
        real = art.file(entry["name"])
        if real.stat().st_size != entry["bytes"]:
            raise ArtifactError(
                f"{art.path / entry['name']}: {real.stat().st_size} bytes, manifest.json says {entry['bytes']} "
                "(truncated?)"
            )


def _load_weights(art: Artifact, device: str, rank: int = 0) -> dict[str, torch.Tensor]:
    """Every weight file of `rank`: size and sha256 checked (all files hashed concurrently), then loaded."""
    entries = art.weight_files(rank)
    files = [art.path / entry["name"] for entry in entries]  # as named, for messages
    reals = [art.file(entry["name"]) for entry in entries]  # every file checked before any is read
    for file, real, entry in zip(files, reals, entries):
        if real.stat().st_size != entry["bytes"]:
            raise ArtifactError(
                f"{file}: {real.stat().st_size} bytes, manifest.json says {entry['bytes']} (truncated?)"
            )
    for file, entry, digest in zip(files, entries, files_sha256(reals)):
        if digest != entry["sha256"]:
            raise ArtifactError(f"{file}: sha256 differs from manifest.json (corrupt weights)")
    tensors: dict[str, torch.Tensor] = {}
    for file, real in zip(files, reals):
        if file.suffix != ".safetensors":
            continue
        try:
            tensors.update(load_file(str(real), device=device))
        except SafetensorError as exc:
            raise ArtifactError(f"{file}: unreadable safetensors ({exc})") from None
    return tensors


def load(
    path: str | Path,
    device: str | None = None,
    compile: bool = True,
    rank: int = 0,
    random_weights: int | None = None,
) -> Runner:
    """Load an artifact and return a `Runner` over its program (see the module docstring); for a sharded
    artifact, over rank `rank`'s weights (only its files are read). `random_weights=SEED` runs an
    artifact compiled from a config preset (no weights) with seeded random weights built on `device`
    (`hy3c.runtime.random_weights`; benchmarks of models larger than a disk); an artifact with weights
    refuses it."""
    art = open_artifact(path)
    if random_weights is not None and art.has_weights:
        raise ArtifactError(
            f"{art.path}: has weights; random weights are for an artifact compiled from a config preset "
            "(drop --random-weights)"
        )
    if not art.has_weights and random_weights is None:
        raise ArtifactError(
            f"{art.path}: compiled from a config preset without weights; it can be inspected, not run "
            "(or run with random weights: --random-weights SEED)"
        )
    if not 0 <= rank < art.world_size:
        raise ArtifactError(f"{art.path}: rank {rank} of an artifact compiled for {art.world_size} rank(s)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != art.recipe.device_type:
        raise ArtifactError(
            f"{art.path}: compiled for target '{art.recipe.target}' ({art.recipe.device_type}); cannot run on {device}"
        )
    program = read_program_file(art)
    mtp_program = read_program_file(art, "mtp") if art.has_mtp else None
    if random_weights is None:
        tensors = _load_weights(art, device, rank)
    else:
        both = program  # the parameter table of both programs: one random tensor for a shared name
        if mtp_program is not None:
            both = dataclasses.replace(program, params={**mtp_program.params, **program.params})
        tensors = artifact_random_parameters(art, both, random_weights, rank, device)
    try:
        gm = program.bind(tensors)
    except ProgramError as exc:
        raise ArtifactError(f"{art.path / art.manifest['program']['file']}: {exc}") from None
    mtp_gm = None
    if mtp_program is not None:  # bound to the same tensors: embed_tokens and lm_head are shared
        try:
            mtp_gm = mtp_program.bind(tensors)
        except ProgramError as exc:
            raise ArtifactError(f"{art.path / art.manifest['programs']['mtp']['file']}: {exc}") from None
    return Runner(
        art.path,
        art.manifest,
        art.config,
        art.recipe,
        gm,
        torch.device(device),
        compile,
        art.kv_heads,
        rank,
        mtp_gm=mtp_gm,
    )
