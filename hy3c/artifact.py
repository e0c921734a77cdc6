"""Compiled artifacts: validation and loading (DESIGN §5).

    runner = hy3c.artifact.load("art/", device="cuda")
    logits, hidden = runner(*batch.model_args(runner.allocate_kv_cache(num_pages, page_size)))

An artifact directory holds `manifest.json` (format version, versions, model config, recipe, cache key,
file hashes), `program/step.json` (the graph after passes, JSON), `weights/rank0*.safetensors`,
`compile_report.json`, optional `graphs/` dumps and the tokenizer files. (Inductor's caches live in a
per-user directory, never in the artifact: see `hy3c.runner`.)
Loading checks the format version, the program hash, the weight files' sizes (and their sha256 for
artifacts under `VERIFY_LIMIT` bytes, or when asked) and the parameter shapes against the program; any
mismatch is an `ArtifactError` naming the file. Nothing is unpickled: JSON and safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import SafetensorError
from safetensors.torch import load_file

from hy3c.compiler.driver import FORMAT_VERSION
from hy3c.compiler.package import file_sha256
from hy3c.compiler.serialize import ProgramError, graph_from_json
from hy3c.config import ConfigError, Hy3Config
from hy3c.recipe import Recipe
from hy3c.runner import Runner

log = logging.getLogger("hy3c.artifact")

VERIFY_LIMIT = 2 << 30


class ArtifactError(ValueError):
    """A missing, corrupt or incompatible artifact; the message names the file."""


def _inside(name: str) -> str:
    """A file name of the manifest must stay inside the artifact directory."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{name!r} is not a path inside the artifact")
    return name


class _ProgramEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    _inside = field_validator("file")(_inside)


class _WeightFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    _inside = field_validator("name")(_inside)


class _Weights(BaseModel):
    files: list[_WeightFile]


class _KvCache(BaseModel):
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]


class _Manifest(BaseModel):
    """The parts of manifest.json that loading relies on (the config and recipe have their own models)."""

    model_config = ConfigDict(extra="allow")
    program: _ProgramEntry
    weights: _Weights | None
    kv_cache: _KvCache


@dataclass
class Artifact:
    path: Path
    manifest: dict[str, Any]
    config: Hy3Config
    recipe: Recipe

    @property
    def has_weights(self) -> bool:
        return self.manifest.get("weights") is not None

    def read_json(self, name: str) -> Any:
        file = self.path / name
        if not file.is_file():
            raise ArtifactError(f"{file}: missing")
        try:
            return json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{file}: corrupt JSON ({exc})") from None


def open_artifact(path: str | Path) -> Artifact:
    """Read and validate manifest.json (no weights are touched)."""
    path = Path(path)
    file = path / "manifest.json"
    if not file.is_file():
        raise ArtifactError(f"{file}: missing (is {path} a hy3c artifact?)")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{file}: corrupt JSON ({exc})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{file}: artifact format version {version!r}; this hy3c reads version {FORMAT_VERSION} (recompile it)"
        )
    try:
        _Manifest.model_validate(manifest)
        config = Hy3Config.from_dict(manifest["model_config"], source=f"{file}: model_config")
        recipe = Recipe.model_validate(manifest["recipe"])
    except (KeyError, ConfigError, ValidationError) as exc:
        raise ArtifactError(f"{file}: invalid manifest ({exc})") from None
    return Artifact(path, manifest, config, recipe)


def _check_program(art: Artifact) -> dict[str, Any]:
    info = art.manifest["program"]
    file = art.path / info["file"]
    if not file.is_file():
        raise ArtifactError(f"{file}: missing")
    text = file.read_bytes()
    if hashlib.sha256(text).hexdigest() != info.get("sha256"):
        raise ArtifactError(f"{file}: sha256 differs from manifest.json (corrupt or edited program)")
    return json.loads(text)


def _load_weights(art: Artifact, device: str, verify: bool | None) -> dict[str, torch.Tensor]:
    files = art.manifest["weights"]["files"]
    total = sum(int(f["bytes"]) for f in files)
    verify = total <= VERIFY_LIMIT if verify is None else verify
    tensors: dict[str, torch.Tensor] = {}
    for entry in files:
        file = art.path / entry["name"]
        if not file.is_file():
            raise ArtifactError(f"{file}: missing")
        if file.stat().st_size != entry["bytes"]:
            raise ArtifactError(
                f"{file}: {file.stat().st_size} bytes, manifest.json says {entry['bytes']} (truncated?)"
            )
        if verify and file_sha256(file) != entry["sha256"]:
            raise ArtifactError(f"{file}: sha256 differs from manifest.json (corrupt weights)")
        if file.suffix != ".safetensors":
            continue
        try:
            tensors.update(load_file(str(file), device=device))
        except SafetensorError as exc:
            raise ArtifactError(f"{file}: unreadable safetensors ({exc})") from None
    return tensors


def load(
    path: str | Path, device: str | None = None, compile: bool = True, verify_weights: bool | None = None
) -> Runner:
    """Load an artifact and return a `Runner` over its program (see the module docstring)."""
    art = open_artifact(path)
    if not art.has_weights:
        raise ArtifactError(
            f"{art.path}: compiled from a config preset without weights; it can be inspected, not run"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != art.recipe.device_type:
        raise ArtifactError(
            f"{art.path}: compiled for target '{art.recipe.target}' ({art.recipe.device_type}); cannot run on {device}"
        )
    program = _check_program(art)
    tensors = _load_weights(art, device, verify_weights)
    try:
        gm = graph_from_json(program, tensors)
    except ProgramError as exc:
        raise ArtifactError(f"{art.path}: {exc}") from None
    return Runner(art.path, art.manifest, art.config, art.recipe, gm, torch.device(device), compile)
