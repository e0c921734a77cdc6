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

from hy3c.config import Hy3Config


class RecipeError(ValueError):
    """An invalid recipe, override or pass list; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantSpec(_Strict):
    # fp8: W8A8 everywhere but the router, embeddings, lm_head and norms; w4a8: the same with the routed
    # experts' weights in int4 (a scale per `group_size` input columns) and FP8 activations
    weights: Literal["none", "fp8", "w4a8"] = "none"
    # static: per-tensor activation scales from an FP8 checkpoint; dynamic: per-token scales at run time
    activations: Literal["static", "dynamic"] = "dynamic"
    # scales of weights the compiler quantizes (an FP8 checkpoint keeps its own)
    weight_scales: Literal["tensor", "channel"] = "channel"
    kv: Literal["auto", "bf16", "fp8"] = "auto"  # auto = the model dtype
    group_size: int = Field(128, ge=16)  # W4A8: input columns per int4 weight scale

    @model_validator(mode="after")
    def _check_group(self) -> QuantSpec:
        if self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size {self.group_size} must be a power of two")
        return self

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV cache's dtype: fp8 → float8_e4m3fn, bf16 → bfloat16, auto → the model's."""
        return {"fp8": "float8_e4m3fn", "bf16": "bfloat16"}.get(self.kv, model_dtype)


# process-group ids of the collectives a sharded program calls (`hy3.all_reduce(x, group, size)`, ...)
TP_GROUP = 0  # the ranks that split one layer's heads and widths
EP_GROUP = 1  # the ranks that split the routed experts: every rank of the world


class ParallelSpec(_Strict):
    """How the model is split over ranks (docs/ARCHITECTURE.md §9).

    rank = dp_rank × tp + tp_rank: `dp_attention` groups of `tp` ranks each run their own requests
    through replicated (dp) or head-split (tp) attention; the routed experts are split `ep` ways over
    all ranks (ep is 1 or the world size; ep alone, with tp = dp_attention = 1, runs the same tokens
    through whole attention on every rank). `sp` puts the residual stream of prefill on token shards.
    """

    tp: int = Field(1, ge=1)
    sp: bool = False
    ep: int = Field(1, ge=1)
    dp_attention: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> ParallelSpec:
        ranks = self.tp * self.dp_attention
        if self.ep not in (1, ranks) and ranks != 1:
            raise ValueError(
                f"ep={self.ep} must be 1 or tp × dp_attention = {ranks} (with tp = dp_attention = 1, any "
                "ep: the experts split over that many ranks)"
            )
        if self.sp and self.tp == 1:
            raise ValueError("sp=true needs tp > 1 (it shards the residual stream over the TP ranks)")
        if self.dp_attention > 1 and self.tp > 1:
            raise ValueError("dp_attention > 1 with tp > 1 is not supported; use tp=1 with dp_attention")
        if self.dp_attention > 1 and self.ep == 1:
            raise ValueError("dp_attention > 1 needs ep = the world size (the MoE runs over all ranks)")
        return self

    @property
    def world_size(self) -> int:
        return max(self.tp * self.dp_attention, self.ep)

    def group_size(self, group: int) -> int:
        return self.tp if group == TP_GROUP else self.world_size

    def groups(self) -> dict[int, list[list[int]]]:
        """group id → its rank sets (each rank is in exactly one set of each group)."""
        tp_sets = [list(range(first, first + self.tp)) for first in range(0, self.world_size, self.tp)]
        return {TP_GROUP: tp_sets, EP_GROUP: [list(range(self.world_size))]}

    def group_rank(self, group: int, rank: int) -> int:
        """`rank`'s index within its set of `group`."""
        return rank % self.tp if group == TP_GROUP else rank

    def check_model(self, config: Hy3Config) -> None:
        """ValueError naming the recipe key when the model's layout cannot be split this way."""
        tp, ep = self.tp, self.ep
        kv = config.num_key_value_heads
        widths = {
            "attention heads": config.num_attention_heads,
            "dense MLP width (intermediate_size)": config.intermediate_size,
            "vocabulary rows": config.vocab_size,
        }
        if config.num_shared_experts:
            widths["shared expert width"] = config.shared_intermediate_size
        if ep == 1:
            widths["routed expert width (moe_intermediate_size)"] = config.moe_intermediate_size
        for what, size in widths.items():
            if size % tp:
                raise ValueError(f"parallel.tp={tp} does not divide the model's {size} {what}")
        if kv % tp and tp % kv:
            raise ValueError(
                f"parallel.tp={tp}: the model's {kv} KV heads must split evenly (tp divides them) or be "
                f"replicated evenly (they divide tp)"
            )
        if config.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the model's {config.num_experts} experts")

    @property
    def token_multiple(self) -> int:
        """A step's token count must be a multiple of this (sequence parallelism splits the tokens over
        the TP ranks; the engine pads)."""
        return self.tp if self.sp else 1

    def local_kv_heads(self, kv_heads: int) -> int:
        """The KV heads each rank holds (and caches): split tp ways, or one each beyond kv_heads ranks."""
        return local_kv_heads(kv_heads, self.tp)


def local_kv_heads(kv_heads: int, parts: int) -> int:
    """KV heads on each of `parts` ranks: split when they divide, else one each (replicated)."""
    return kv_heads // parts if parts <= kv_heads else 1


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


SHIPPED = ("h20-w8a8c8", "h20-w4a8c8", "h200-bf16", "cpu-reference", "h20-w8a8c8-tp8sp", "h20-w8a8c8-dp8ep8")


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
