"""What the artifact writer (`hy3c.compiler.driver`) and reader (`hy3c.program.artifact`) share about
manifest.json: the format version, the file names, the `Manifest` model, the hashes and the cache key,
computed by one set of functions so they cannot drift.

    parts = cache_key_parts(config_json, recipe_json, pass_hashes, weight_files, program_sha, versions)
    key = json_sha256(parts)

The cache key's parts are the sha256 of the model config, of the recipe (after overrides), of each pass's
source module, of the weight files' hashes and of the program, plus the hy3c/torch/triton versions. The
reader recomputes every part it can from what the artifact holds and refuses any difference, so an
edited config, recipe, program or weight list is caught even when the edit kept the JSON valid. The
pass-source hashes cannot be recomputed by another hy3c version (its passes differ): they are recorded,
and the versions part says which hy3c wrote them.

These are integrity checks (a corrupt or hand-edited artifact), not authenticity: whoever can write an
artifact can also rewrite its hashes. What makes a crafted artifact harmless is the program check
(`hy3c.program.check`), which does not trust the manifest's hashes.

Only the standard library, pydantic and the recipe model are imported: `hy3c inspect` and loading need
no compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hy3c.recipe import Recipe

FORMAT_VERSION = 2  # 2: hy3.fused_moe takes the norm's FP8 rows (x_q, x_q_scale)
MANIFEST_FILE = "manifest.json"
PROGRAM_FILE = "program/step.json"
MTP_PROGRAM_FILE = "program/mtp.json"  # the draft program (MTP depth 0), where the artifact has one
REPORT_FILE = "compile_report.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
HASH_THREADS = 8  # files hashed at once on load (hashlib and file reads release the GIL)


_SHA256 = r"^[0-9a-f]{64}$"
_Sha256 = Annotated[str, Field(pattern=_SHA256)]


def _inside(name: str) -> str:
    """A file name of the manifest must stay inside the artifact directory."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{name!r} is not a path inside the artifact")
    return name


class _Strict(BaseModel):
    """Strict types (the reader takes no coercions); fields a newer writer adds are kept, not refused."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class Versions(_Strict):
    hy3c: str
    torch: str
    triton: str | None


class ProgramEntry(_Strict):
    file: str
    sha256: str = Field(pattern=_SHA256)
    inputs: list[str]
    outputs: list[str]
    _inside = field_validator("file")(_inside)


class MtpProgramEntry(ProgramEntry):
    """The draft program: `Hy3ForCausalLM.mtp_forward` of MTP depth `depth` after the same passes."""

    depth: int = Field(0, ge=0)


class Programs(_Strict):
    """Which programs the artifact holds besides the step program (`program`), and each one's pass
    summary (pass name → matched sites). An artifact written before the draft program existed has
    none of this: its `Programs()` default says there is no draft program (no speculative decoding)."""

    names: list[str] = Field(default_factory=lambda: ["step"])
    mtp: MtpProgramEntry | None = None
    mtp_absent: str | None = None  # why there is no draft program (None where there is one)
    pass_sites: dict[str, dict[str, int]] = Field(default_factory=dict)


class WeightFile(_Strict):
    name: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256)
    rank: int = Field(0, ge=0)  # the rank that loads it
    _inside = field_validator("name")(_inside)


class Weights(_Strict):
    files: list[WeightFile] = Field(min_length=1)


class ShardPlan(_Strict):
    """How the program is split over ranks: the world it needs, the KV heads each rank caches, and for
    every split parameter how each rank's slice was cut (`hy3c.passes.shard_plan`; others replicated)."""

    world_size: int = Field(1, ge=1)
    kv_heads_per_rank: int | None = Field(None, ge=1)
    tensors: dict[str, dict[str, Any]] = Field(default_factory=dict)


class KvCache(_Strict):
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn"]


class CacheKeyParts(_Strict):
    model: str = Field(pattern=_SHA256)
    recipe: str = Field(pattern=_SHA256)
    passes: dict[str, _Sha256]
    weights: str | None = Field(pattern=_SHA256)
    program: str = Field(pattern=_SHA256)
    hy3c: str
    torch: str
    triton: str | None


class CacheKey(_Strict):
    key: str = Field(pattern=_SHA256)
    parts: CacheKeyParts


class QuantLayoutEntry(_Strict):
    fp8_modules: list[str]
    static_activations: bool
    int4_experts: list[str] = Field(default_factory=list)  # W4A8 expert stacks of the checkpoint
    group_size: int = Field(0, ge=0)


class Source(_Strict):
    checkpoint: str | None
    preset: str | None
    scheme: str | None
    fp8_checkpoint: bool
    quant_layout: QuantLayoutEntry


class Manifest(_Strict):
    """manifest.json: the compiler writes it from this model (`model_dump(mode="json", by_alias=True)`)
    and loading and inspection validate it with the same model (the config and the recipe have their own
    models, `Hy3Config` and `Recipe`)."""

    format_version: int
    versions: Versions
    created: str
    config: dict[str, Any] = Field(alias="model_config")
    recipe: dict[str, Any]
    source: Source
    program: ProgramEntry
    programs: Programs = Field(default_factory=Programs)
    weights: Weights | None
    kv_cache: KvCache
    shard_plan: ShardPlan = Field(default_factory=ShardPlan)
    # debugging overrides of the kernel variants set while compiling (`hy3c.kernels.overrides`):
    # variable → "0" / "1"; the program's kernel arguments already carry them
    overrides: dict[str, Literal["0", "1"]] = Field(default_factory=dict)
    cache_key: CacheKey


def json_sha256(data: object) -> str:
    """sha256 of a JSON value with sorted keys (dict order and whitespace do not change it)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path, chunk: int = 16 << 20) -> str:
    """sha256 of a file, streamed in `chunk`-byte reads (memory stays flat for files of any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_sha256(paths: Sequence[Path]) -> list[str]:
    """sha256 of each file, several files at a time in threads; in the order given."""
    if len(paths) <= 1:
        return [file_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), HASH_THREADS, os.cpu_count() or 1)) as pool:
        return list(pool.map(file_sha256, paths))


def cache_key_parts(
    model_config: dict[str, Any],
    recipe: dict[str, Any],
    passes: dict[str, str],
    weight_files: list[dict[str, Any]],
    program_sha256: str,
    versions: dict[str, str | None],
    other_programs: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The hashed parts of an artifact's cache key (manifest.json `cache_key.parts`).

    `model_config` and `recipe` are the JSON dicts the manifest holds, `weight_files` its weight entries
    ({name, bytes, sha256}; none for a preset compiled without weights), `other_programs` the sha256 of
    each program besides the step program (name → hash; the part is absent where there is none, so the
    keys of artifacts without a draft program are as before)."""
    extra = {"programs": dict(other_programs)} if other_programs else {}
    return {
        **extra,
        "model": json_sha256(model_config),
        "recipe": json_sha256(recipe),
        "passes": passes,
        "weights": json_sha256([f["sha256"] for f in weight_files]) if weight_files else None,
        "program": program_sha256,
        **versions,
    }


def kv_cache_dtype(recipe: Recipe) -> str:
    """The KV cache dtype a recipe compiles for (manifest.json `kv_cache.dtype`)."""
    return recipe.quant.kv_dtype(recipe.dtype)
