"""Hy3 (`hy_v3`) model configuration: read, validated, and named presets.

`Hy3Config.from_dir(path)` reads a checkpoint's `config.json`. Every architecture field of the real
Hy3 config is modelled; a missing required field, a wrong type or a value hy3c does not implement is a
`ConfigError` naming the field and the file. Unknown extra keys (HF bookkeeping such as
`_name_or_path`) are kept but ignored.

Presets (`preset_config(name)`):
  * `tiny`           few layers, few experts, small widths; keeps GQA, QK-norm, a dense first layer and MTP.
  * `real-shapes:N`  the true Hy3 widths with only the first N decoder layers (GPU benchmarks).
  * `full`           the real 80-layer model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config.json (or preset name) that hy3c cannot use; the message names the field."""


class RopeParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rope_theta: float = Field(gt=0)
    rope_type: Literal["default"] = "default"


MAX_CONFIG_BYTES = 16 << 20  # a config file larger than this is refused, not read
MODELOPT_FP8_KV = {"type": "float", "num_bits": 8}  # ModelOpt's `kv_cache_scheme` of an FP8 KV cache
# compressed-tensors' W4AFP8 scheme (what AngelSlim's Hy3 `w4afp8` preset names, and vLLM reads as its
# W4A8-FP8 MoE): int4 weights in symmetric groups, FP8 activations per token with dynamic scales
W4AFP8_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True, "dynamic": False}
W4AFP8_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}


class QuantizationConfig(BaseModel):
    """The `quantization_config` block of an FP8 (W8A8[C8]) Hy3 checkpoint (docs/ARCHITECTURE.md §1.7),
    in either producer's layout:

    * AngelSlim's (`quant_method: fp8`): `activation_scheme`, `ignored_layers`, `kv_cache_scheme:
      static` with the KV scales in `kv_cache_scales.safetensors`;
    * NVIDIA ModelOpt's HF export (`quant_method: modelopt`, `quant_algo: FP8`): static per-tensor
      activation scales beside the weights, `ignore`, and `kv_cache_scheme` {type: float, num_bits: 8}
      with each layer's `k_proj.k_scale` / `v_proj.v_scale` in the shards. (An export that keeps this
      block in `hf_quant_config.json` instead is read through `Hy3Config.from_dir`.)

    and, for W4A8 experts, compressed-tensors' `pack-quantized` format with the W4AFP8 scheme
    (`quant_method: compressed-tensors`; one config group: int4 weights in symmetric groups of
    `group_size`, dynamic per-token FP8 activations) on the routed experts; every other layer is left
    in high precision (`ignore`) for the compiler to quantize.
    """

    model_config = ConfigDict(extra="allow")
    quant_method: Literal["fp8", "modelopt", "compressed-tensors"]
    activation_scheme: Literal["static", "dynamic"] = "dynamic"
    ignored_layers: list[str] = Field(default_factory=list)
    kv_cache_scheme: str | dict[str, Any] | None = None
    quant_algo: str | None = None
    ignore: list[str] = Field(default_factory=list)

    format: str | None = None
    config_groups: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_producer(self) -> QuantizationConfig:
        if self.quant_method == "compressed-tensors":
            return self._check_w4afp8()
        if self.quant_method == "fp8":
            if self.kv_cache_scheme not in (None, "static"):
                raise ValueError(
                    f"kv_cache_scheme: {self.kv_cache_scheme!r}; with quant_method 'fp8' only 'static' is understood"
                )
            return self
        if (self.quant_algo or "").upper() != "FP8":
            raise ValueError(
                f"quant_algo: {self.quant_algo!r} is not a ModelOpt format hy3c reads (only 'FP8': per-tensor"
                " FP8 weights and static activation scales)"
            )
        kv = self.kv_cache_scheme
        if isinstance(kv, str) and kv.upper() == "FP8":  # what exports of ModelOpt 0.29 wrote
            self.kv_cache_scheme = dict(MODELOPT_FP8_KV)
        elif kv is not None and (
            not isinstance(kv, dict)
            or {k: kv.get(k) for k in MODELOPT_FP8_KV} != MODELOPT_FP8_KV
            or kv.get("dynamic", False) is not False  # static per-tensor scales in the shards, or nothing
        ):
            raise ValueError(f"kv_cache_scheme: {kv!r} is not an FP8 KV cache ({MODELOPT_FP8_KV})")
        self.activation_scheme = "static"  # ModelOpt's FP8 always calibrates its input scales
        return self

    def _check_w4afp8(self) -> QuantizationConfig:
        if self.format != "pack-quantized":
            raise ValueError(
                f"format: {self.format!r}; hy3c reads compressed-tensors' 'pack-quantized' (W4A8)"
            )
        groups = self.config_groups or {}
        if len(groups) != 1:
            raise ValueError(
                f"config_groups: {len(groups)} groups; hy3c reads one (the routed experts' W4AFP8)"
            )
        ((name, group),) = groups.items()
        if not isinstance(group, dict):
            raise ValueError(f"config_groups.{name}: expected an object")
        for key, scheme in (("weights", W4AFP8_WEIGHTS), ("input_activations", W4AFP8_ACTIVATIONS)):
            given = group.get(key)
            if not isinstance(given, dict) or {k: given.get(k) for k in scheme} != scheme:
                raise ValueError(f"config_groups.{name}.{key}: {given!r} is not W4AFP8's ({scheme})")
        size = group["weights"].get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 16 or size & (size - 1):
            raise ValueError(
                f"config_groups.{name}.weights.group_size: {size!r} is not a power of two of at least 16"
            )
        if group["weights"].get("actorder") not in (None, False):
            raise ValueError(
                f"config_groups.{name}.weights.actorder: {group['weights']['actorder']!r}; hy3c reads groups"
                " in column order only"
            )
        if self.kv_cache_scheme is not None:
            raise ValueError(
                "kv_cache_scheme: a W4A8 checkpoint's KV cache scheme is not read (the recipe picks it)"
            )
        return self

    @property
    def w4a8_group_size(self) -> int | None:
        """Input columns per int4 scale of a compressed-tensors W4A8 checkpoint (None otherwise)."""
        if self.quant_method != "compressed-tensors":
            return None
        return next(iter(self.config_groups.values()))["weights"]["group_size"]

    @property
    def kv_scales_file(self) -> bool:
        """Whether static KV scales come in `kv_cache_scales.safetensors` (AngelSlim's layout)."""
        return self.quant_method == "fp8" and self.kv_cache_scheme == "static"

    @property
    def kv_scales_in_shards(self) -> bool:
        """Whether each layer's `k_proj.k_scale` / `v_proj.v_scale` is in the shards (ModelOpt's)."""
        return self.quant_method == "modelopt" and self.kv_cache_scheme is not None


class Hy3Config(BaseModel):
    """Every field of the Hy3 config.json that influences inference (docs/ARCHITECTURE.md §1.1)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    architectures: list[str] = Field(default_factory=lambda: ["HYV3ForCausalLM"])
    model_type: Literal["hy_v3"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    expert_hidden_dim: int | None = None
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    num_shared_experts: int = Field(ge=0)
    first_k_dense_replace: int | None = Field(default=None, ge=0)
    mlp_layer_types: list[Literal["dense", "sparse"]] | None = None
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = Field(gt=0)
    rope_parameters: RopeParameters
    max_position_embeddings: int = Field(gt=0)
    qk_norm: Literal[True] = True
    moe_router_use_sigmoid: Literal[True] = True
    moe_router_enable_expert_bias: Literal[True] = True
    route_norm: Literal[True] = True
    router_scaling_factor: float = Field(gt=0)
    tie_word_embeddings: Literal[False] = False
    attention_bias: Literal[False] = False
    mlp_bias: Literal[False] = False
    enable_attention_fp32_softmax: bool = False
    enable_lm_head_fp32: bool = True
    enable_moe_fp32_combine: bool = False
    use_grouped_mm: bool = False
    output_router_logits: bool = False
    num_nextn_predict_layers: int = Field(default=0, ge=0)
    initializer_range: float = Field(default=0.006, gt=0)
    use_cache: bool = True
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    transformers_version: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    sep_token_id: int | None = None
    eod_token_id: int | None = None
    quantization_config: QuantizationConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _accept_legacy_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        _reject_unsupported_features(data)
        data.pop("rope_scaling", None)  # legacy key; only "default" (no scaling) gets past the check above
        if "rope_parameters" not in data and "rope_theta" in data:
            data["rope_parameters"] = {"rope_theta": data.pop("rope_theta"), "rope_type": "default"}
        elif "rope_theta" in data:
            theta, params = data.pop("rope_theta"), data["rope_parameters"]
            given = params.get("rope_theta") if isinstance(params, dict) else None
            if given is not None and given != theta:
                raise ValueError(f"rope_theta ({theta}) disagrees with rope_parameters.rope_theta ({given})")
        if "dtype" not in data and "torch_dtype" in data:
            data["dtype"] = data.pop("torch_dtype")
        if data.get("dtype") is None:
            data.pop("dtype", None)
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> Hy3Config:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        if self.expert_hidden_dim is not None and self.expert_hidden_dim != self.moe_intermediate_size:
            raise ValueError(
                f"expert_hidden_dim ({self.expert_hidden_dim}) differs from moe_intermediate_size "
                f"({self.moe_intermediate_size})"
            )
        if self.mlp_layer_types is not None:
            if len(self.mlp_layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                    f"num_hidden_layers is {self.num_hidden_layers}"
                )
            if self.first_k_dense_replace is not None:
                derived = _layer_types_from_first_k(self.first_k_dense_replace, self.num_hidden_layers)
                if derived != list(self.mlp_layer_types):
                    raise ValueError(
                        f"mlp_layer_types disagrees with first_k_dense_replace={self.first_k_dense_replace}"
                    )
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        for name, value in (
            ("bos_token_id", self.bos_token_id),
            ("pad_token_id", self.pad_token_id),
            *(("eos_token_id", e) for e in eos),
        ):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} ({value}) is outside the vocabulary (vocab_size {self.vocab_size})")
        return self

    # ---- derived shape helpers -------------------------------------------------------------------
    @property
    def layer_types(self) -> list[str]:
        """`dense` or `sparse` for every main decoder layer (mlp_layer_types, else first_k_dense_replace)."""
        if self.mlp_layer_types is not None:
            return list(self.mlp_layer_types)
        first_k = 1 if self.first_k_dense_replace is None else self.first_k_dense_replace
        return _layer_types_from_first_k(first_k, self.num_hidden_layers)

    @property
    def num_kv_layers(self) -> int:
        """Layers with an attention KV cache: the main layers plus the MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters.rope_theta

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # ---- IO ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> Hy3Config:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, source)) from None

    @classmethod
    def from_dir(cls, path: str | Path) -> Hy3Config:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"{file}: not found (a Hy3 checkpoint directory needs config.json)")
        data = _read_json_object(file)
        legacy = Path(path) / "hf_quant_config.json"
        source = str(file)
        if "quantization_config" not in data and legacy.is_file():
            data = {**data, "quantization_config": _modelopt_legacy_block(legacy)}
            source = f"{file} (its quantization_config from {legacy.name})"
        return cls.from_dict(data, source=source)

    def to_json_dict(self) -> dict[str, Any]:
        """The config as written to config.json (HF-compatible, `mlp_layer_types` explicit)."""
        out = self.model_dump(mode="json", exclude_none=True)
        out["mlp_layer_types"] = self.layer_types
        return out


def _read_json_object(file: Path) -> dict[str, Any]:
    """A config file's JSON object (at most MAX_CONFIG_BYTES), or a ConfigError naming the file."""
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    return data


def _modelopt_legacy_block(file: Path) -> dict[str, Any]:
    """The `quantization_config` of an export whose config.json has none, from ModelOpt's
    `hf_quant_config.json` (`{"producer": …, "quantization": {quant_algo, kv_cache_quant_algo,
    exclude_modules}}`)."""
    quant = _read_json_object(file).get("quantization")
    if not isinstance(quant, dict):
        raise ConfigError(f"{file}: quantization: expected an object")
    kv = quant.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() != "FP8":
        raise ConfigError(f"{file}: quantization.kv_cache_quant_algo: {kv!r} is not FP8")
    exclude = quant.get("exclude_modules", [])
    if not isinstance(exclude, list):
        raise ConfigError(f"{file}: quantization.exclude_modules: expected a list")
    return {
        "quant_method": "modelopt",
        "quant_algo": quant.get("quant_algo"),
        "kv_cache_scheme": dict(MODELOPT_FP8_KV) if kv is not None else None,
        "ignore": exclude,
    }


# config.json keys of architecture features Hy3 does not have (docs/ARCHITECTURE.md §1.1): a checkpoint
# that turns one on is not a Hy3 model hy3c can run, so it is an error rather than an ignored key
_UNSUPPORTED: dict[str, Any] = {
    "use_sliding_window": lambda v, d: v is True,
    "sliding_window": lambda v, d: v is not None and d.get("use_sliding_window") is not False,
    "attention_bias": lambda v, d: v is True,
    "mlp_bias": lambda v, d: v is True,
    "use_cla": lambda v, d: v is True,
    "partial_rotary_factor": lambda v, d: v not in (None, 1, 1.0),
    "q_lora_rank": lambda v, d: v is not None,
    "kv_lora_rank": lambda v, d: v is not None,
    "attn_logit_softcapping": lambda v, d: v is not None,
    "final_logit_softcapping": lambda v, d: v is not None,
    "n_group": lambda v, d: v not in (None, 1),
    "topk_group": lambda v, d: v not in (None, 1),
    "rope_scaling": lambda v, d: (
        isinstance(v, dict) and v.get("rope_type", v.get("type", "default")) != "default"
    ),
}


def _reject_unsupported_features(data: dict[str, Any]) -> None:
    for key, enabled in _UNSUPPORTED.items():
        if key in data and enabled(data[key], data):
            raise ValueError(
                f"{key}={data[key]!r}: this feature is not part of Hy3 and hy3c does not support it"
            )


def _layer_types_from_first_k(first_k: int, num_layers: int) -> list[str]:
    return ["dense"] * min(first_k, num_layers) + ["sparse"] * max(num_layers - first_k, 0)


def _describe(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "missing":
            lines.append(f"field '{loc}' is required but missing")
        elif err["type"] == "literal_error":
            lines.append(f"field '{loc}': {msg}; got {err.get('input')!r} (hy3c implements only this value)")
        else:
            lines.append(f"field '{loc}': {msg}")
    return f"{source}: invalid Hy3 config:\n  " + "\n  ".join(lines)


# ---- presets ---------------------------------------------------------------------------------------

_FULL: dict[str, Any] = {
    "architectures": ["HYV3ForCausalLM"],
    "model_type": "hy_v3",
    "vocab_size": 120832,
    "hidden_size": 4096,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 13312,
    "moe_intermediate_size": 1536,
    "expert_hidden_dim": 1536,
    "num_experts": 192,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"},
    "max_position_embeddings": 262144,
    "qk_norm": True,
    "moe_router_use_sigmoid": True,
    "moe_router_enable_expert_bias": True,
    "route_norm": True,
    "router_scaling_factor": 2.826,
    "tie_word_embeddings": False,
    "enable_attention_fp32_softmax": False,
    "enable_lm_head_fp32": True,
    "enable_moe_fp32_combine": False,
    "use_grouped_mm": False,
    "output_router_logits": True,
    "num_nextn_predict_layers": 1,
    "initializer_range": 0.006,
    "use_cache": True,
    "dtype": "bfloat16",
    "transformers_version": "5.6.0",
    "bos_token_id": 120000,
    "eos_token_id": 120025,
    "pad_token_id": 120002,
    "sep_token_id": 120007,
    "eod_token_id": 120026,
}

_TINY_OVERRIDES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "expert_hidden_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
    # ids of the special tokens of the tiny tokenizer (hy3c.checkpoint.tokenizer.SPECIAL_TOKENS order)
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "sep_token_id": None,
    "eod_token_id": 1,
}

PRESET_NAMES = ("tiny", "real-shapes:N", "full")


def preset_config(name: str, **overrides: Any) -> Hy3Config:
    """Build a named preset; `overrides` replace fields (e.g. token ids matching a tokenizer)."""
    data = dict(_FULL)
    if name == "full":
        pass
    elif name == "tiny":
        data.update(_TINY_OVERRIDES)
    elif name.startswith("real-shapes:"):
        count = name.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"preset '{name}': expected real-shapes:N with N a positive layer count")
        data["num_hidden_layers"] = int(count)
    else:
        raise ConfigError(f"unknown preset '{name}'; choose one of {', '.join(PRESET_NAMES)}")
    data.update(overrides)
    if "moe_intermediate_size" in overrides and "expert_hidden_dim" not in overrides:
        data["expert_hidden_dim"] = data["moe_intermediate_size"]
    data["mlp_layer_types"] = _layer_types_from_first_k(
        data["first_k_dense_replace"], data["num_hidden_layers"]
    )
    return Hy3Config.from_dict(data, source=f"preset '{name}'")
