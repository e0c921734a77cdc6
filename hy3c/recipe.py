"""Compile recipes: validated YAML saying what to build and how (`recipes/*.yaml`).

    recipe = load_recipe("h20-w8a8c8", overrides=["quant.kv=bf16", "passes.lower.priority=[torch]"])

A recipe names the target, model dtype, quantization, parallelism, the ordered pass list with
per-pass config, CUDA-graph batch sizes and serving defaults. Every level forbids unknown keys; pass
names and pass configs are checked against the pass registry (`hy3c.passes`). `--set a.b=c` overrides
are applied to the YAML data before validation (values parsed as YAML); `passes.<name>.<field>`
addresses a pass by name.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class RecipeError(ValueError):
    """An invalid recipe, override or pass list; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantSpec(_Strict):
    weights: Literal["none", "fp8"] = "none"
    # static: per-tensor activation scales from an FP8 checkpoint; dynamic: per-token scales at run time
    activations: Literal["static", "dynamic"] = "dynamic"
    # scales of weights the compiler quantizes (an FP8 checkpoint keeps its own)
    weight_scales: Literal["tensor", "channel"] = "channel"
    kv: Literal["auto", "bf16", "fp8"] = "auto"  # auto = the model dtype

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV cache's dtype: fp8 → float8_e4m3fn, bf16 → bfloat16, auto → the model's."""
        return {"fp8": "float8_e4m3fn", "bf16": "bfloat16"}.get(self.kv, model_dtype)


class ParallelSpec(_Strict):
    tp: int = Field(1, ge=1)
    sp: bool = False
    ep: int = Field(1, ge=1)
    dp_attention: bool = False


# the GPU architecture of each target (None: the CPU): `lower` turns on the kernel variants it runs
TARGET_ARCH: dict[str, str | None] = {"h20": "sm_90", "h200": "sm_90", "cpu": None}


class PassSpec(_Strict):
    name: str
    enabled: bool = True
    config: dict[str, Any] = Field(default_factory=dict)


class CudaGraphSpec(_Strict):
    decode_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])

    @field_validator("decode_batch_sizes")
    @classmethod
    def _positive_sorted(cls, sizes: list[int]) -> list[int]:
        if any(s < 1 for s in sizes):
            raise ValueError("batch sizes must be positive")
        return sorted(set(sizes))


class ServingSpec(_Strict):
    page_size: int = Field(64, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    kv_memory_fraction: float = Field(0.9, gt=0, le=1)


class Recipe(_Strict):
    name: str
    description: str = ""
    target: Literal["h20", "h200", "cpu"]
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    quant: QuantSpec = Field(default_factory=QuantSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    passes: list[PassSpec]
    token_range: tuple[int, int] = (1, 1 << 20)
    cuda_graphs: CudaGraphSpec = Field(default_factory=CudaGraphSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        names = [p.name for p in self.passes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"pass(es) listed twice: {duplicates}")
        lo, hi = self.token_range
        if not 1 <= lo <= hi:
            raise ValueError(f"token_range {list(self.token_range)} must satisfy 1 <= min <= max")
        return self

    @property
    def device_type(self) -> str:
        return "cpu" if self.target == "cpu" else "cuda"

    def pass_spec(self, name: str) -> PassSpec | None:
        return next((p for p in self.passes if p.name == name), None)


SHIPPED = ("h20-w8a8c8", "h200-bf16", "cpu-reference")


def recipe_text(name_or_file: str | Path) -> tuple[str, str]:
    """(source label, YAML text) of a shipped recipe name or a YAML file path."""
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError(f"{path}: recipe file not found")
        return str(path), path.read_text()
    name = str(name_or_file)
    if name not in SHIPPED:
        raise RecipeError(
            f"unknown recipe '{name}'; shipped recipes: {', '.join(SHIPPED)} (or pass a .yaml file)"
        )
    return f"recipe '{name}'", resources.files("hy3c.recipes").joinpath(f"{name}.yaml").read_text()


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(f"override '{text}': expected KEY=VALUE (e.g. quant.kv=bf16)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"override '{text}': value is not valid YAML ({exc})") from None
    return path, value


def apply_override(data: dict[str, Any], text: str) -> None:
    """Set one dotted key in the recipe data; `passes.<name>.<field>` addresses a pass's config."""
    keys, value = _parse_override(text)
    node: dict[str, Any] = data
    if keys[0] == "passes":
        if len(keys) < 3:
            raise RecipeError(f"override '{text}': use passes.<name>.enabled or passes.<name>.<config field>")
        spec = next(
            (p for p in data.get("passes", []) if isinstance(p, dict) and p.get("name") == keys[1]), None
        )
        if spec is None:
            raise RecipeError(f"override '{text}': no pass named '{keys[1]}' in the recipe")
        if keys[2:] == ["enabled"]:
            spec["enabled"] = value
            return
        node = spec.setdefault("config", {})
        keys = keys[3:] if keys[2] == "config" else keys[2:]
        if not keys:
            raise RecipeError(f"override '{text}': name a field of the pass config (passes.<name>.<field>)")
    for depth, part in enumerate(keys[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override '{text}': '{'.'.join(keys[: depth + 1])}' is not a mapping")
        node = child
    node[keys[-1]] = value


def load_recipe(name_or_file: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load, override and validate a recipe. Its pass names and pass configs are checked against the
    pass registry by the compiler (`hy3c.passes.registry.check_recipe_passes`): this module does not
    import the passes, the passes import its models."""
    source, text = recipe_text(name_or_file)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: expected a mapping at the top level")
    for item in overrides:
        apply_override(data, item)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{source}: invalid recipe: " + "; ".join(describe_errors(exc))) from None
    return recipe


def describe_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
        elif err["type"] == "missing":
            lines.append(f"key '{loc}' is required")
        else:
            lines.append(f"key '{loc}': {err['msg']} (got {err.get('input')!r})")
    return lines
