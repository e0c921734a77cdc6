"""What the artifact writer (`hy3c.compiler.driver`) and reader (`hy3c.artifact`) share about manifest.json:
the format version, the hashes and the cache key, computed by one set of functions so they cannot drift.

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
(`hy3c.compiler.program_check`), which does not trust the manifest's hashes.

Only the standard library and the recipe model are imported: `hy3c inspect` and loading need no compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hy3c.recipe import Recipe

FORMAT_VERSION = 2  # 2: hy3.fused_moe takes the norm's FP8 rows (x_q, x_q_scale)
HASH_THREADS = 8  # files hashed at once on load (hashlib and file reads release the GIL)


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
) -> dict[str, Any]:
    """The hashed parts of an artifact's cache key (manifest.json `cache_key.parts`).

    `model_config` and `recipe` are the JSON dicts the manifest holds, `weight_files` its weight entries
    ({name, bytes, sha256}; none for a preset compiled without weights)."""
    return {
        "model": json_sha256(model_config),
        "recipe": json_sha256(recipe),
        "passes": passes,
        "weights": json_sha256([f["sha256"] for f in weight_files]) if weight_files else None,
        "program": program_sha256,
        **versions,
    }


def kv_cache_dtype(recipe: Recipe) -> str:
    """The KV cache dtype a recipe compiles for (manifest.json `kv_cache.dtype`)."""
    if recipe.quant.kv == "fp8":
        return "float8_e4m3fn"
    if recipe.quant.kv == "bf16":
        return "bfloat16"
    return recipe.dtype
