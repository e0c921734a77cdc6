"""Where every checkpoint tensor goes in the hy3c model.

Two naming schemes are understood (docs/ARCHITECTURE.md §1.6):
  * `hub`          what tencent/Hy3 ships: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`,
                   `mlp.router.gate.weight`, `mlp.expert_bias`, `mlp.shared_mlp.*`; FP8 checkpoints add
                   `*.weight_scale` and `*.input_scale` (§1.7); ModelOpt's FP8 export also puts each
                   layer's KV scales there, as `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`;
                   W4A8 experts (compressed-tensors) are `*.weight_packed` / `*.weight_scale` /
                   `*.weight_shape` (`hy3c.checkpoint.int4_format`).
  * `transformers` what HF `HYV3ForCausalLM` holds after conversion: stacked `mlp.experts.gate_up_proj`
                   [E, 2I, H] and `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`,
                   `mlp.e_score_correction_bias`, `mlp.shared_experts.*`.
The MTP layer `model.layers.{L + d}` maps to `mtp.{d}` (its decoder block to `mtp.{d}.layer`).

`expected_tensors` returns, for one scheme, every checkpoint name with its `Placement`: the model
tensor it fills, the region of that tensor, the expected source shape, and how it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hy3c.config import Hy3Config

Scheme = Literal["hub", "transformers"]
Region = tuple[int | tuple[int, int], ...]  # per leading dim: an index, or a [start, stop) range


@dataclass(frozen=True)
class Placement:
    """A checkpoint tensor's destination.

    mode `copy`: the source (of `shape`) is copied into target[region].
    mode `scale`: an FP8 dequant scale; a per-tensor source (1 element) is broadcast over the region, a
                  per-channel source (as many elements as the region) is copied.
    mode `max`:   a per-tensor scale shared by several sources (q/k/v input scales, the experts'
                  activation scales); the target keeps the maximum.
    mode `int4`:  compressed-tensors' int32 words of int4 values, repacked two per byte into target[region].
    mode `shape`: compressed-tensors' `weight_shape` of a packed weight; its values must be `values`, it
                  writes nothing.
    """

    target: str
    region: Region
    shape: tuple[int, ...]
    mode: Literal["copy", "scale", "max", "int4", "shape"] = "copy"
    values: tuple[int, ...] = ()

    def index(self) -> tuple[int | slice, ...]:
        return tuple(slice(*r) if isinstance(r, tuple) else r for r in self.region)

    def region_numel(self, target_shape: tuple[int, ...]) -> int:
        n = 1
        for i, size in enumerate(target_shape):
            if i < len(self.region):
                r = self.region[i]
                n *= (r[1] - r[0]) if isinstance(r, tuple) else 1
            else:
                n *= size
        return n


def detect_scheme(names: set[str]) -> Scheme:
    markers = (
        ".mlp.experts.gate_up_proj",
        ".mlp.gate.weight",
        ".mlp.e_score_correction_bias",
        ".shared_experts.",
    )
    return "transformers" if any(m in n for n in names for m in markers) else "hub"


@dataclass(frozen=True)
class _Ctx:
    config: Hy3Config
    scheme: Scheme
    fp8: frozenset[str]  # our module paths with FP8 weights
    static: bool
    kv_in_shards: bool  # ModelOpt's k_scale / v_scale beside the k / v projections
    int4: frozenset[str] = frozenset()  # expert stacks with W4A8 weights (compressed-tensors)
    group_size: int = 0


def _linear(
    ctx: _Ctx,
    out: dict[str, Placement],
    src: str,
    module: str,
    rows: tuple[int, int],
    full_rows: int,
    cols: int,
) -> None:
    """A (possibly fused) linear: `src` fills rows[0]:rows[1] of `module`'s weight [full_rows, cols]."""
    n = rows[1] - rows[0]
    whole = rows == (0, full_rows)
    out[f"{src}.weight"] = Placement(f"{module}.weight", () if whole else (rows,), (n, cols))
    if module in ctx.fp8:
        out[f"{src}.weight_scale"] = Placement(f"{module}.weight_scale", (rows,), (n,), "scale")
        if ctx.static:
            out[f"{src}.input_scale"] = Placement(f"{module}.input_scale", (), (1,), "max")


def _decoder_layer(
    ctx: _Ctx, out: dict[str, Placement], src: str, dst: str, sparse: bool, kv_row: int
) -> None:
    c = ctx.config
    h, q, kv = c.hidden_size, c.q_size, c.kv_size
    out[f"{src}.input_layernorm.weight"] = Placement(f"{dst}.input_layernorm.weight", (), (h,))
    out[f"{src}.post_attention_layernorm.weight"] = Placement(
        f"{dst}.post_attention_layernorm.weight", (), (h,)
    )
    attn, qkv = f"{src}.self_attn", f"{dst}.self_attn.qkv_proj"
    total = q + 2 * kv
    _linear(ctx, out, f"{attn}.q_proj", qkv, (0, q), total, h)
    _linear(ctx, out, f"{attn}.k_proj", qkv, (q, q + kv), total, h)
    _linear(ctx, out, f"{attn}.v_proj", qkv, (q + kv, total), total, h)
    _linear(ctx, out, f"{attn}.o_proj", f"{dst}.self_attn.o_proj", (0, h), h, q)
    if ctx.kv_in_shards:
        for which, kind in enumerate("kv"):
            out[f"{attn}.{kind}_proj.{kind}_scale"] = Placement(
                "kv_scales", (kv_row, (which, which + 1)), (1,), "max"
            )
    for norm in ("q_norm", "k_norm"):
        out[f"{attn}.{norm}.weight"] = Placement(f"{dst}.self_attn.{norm}.weight", (), (c.head_dim,))
    mlp = f"{src}.mlp"
    if not sparse:
        _mlp(ctx, out, mlp, f"{dst}.mlp", c.intermediate_size)
        return
    e, i = c.num_experts, c.moe_intermediate_size
    experts = f"{dst}.mlp.experts"
    if ctx.scheme == "hub":
        out[f"{mlp}.router.gate.weight"] = Placement(f"{dst}.mlp.router.weight", (), (e, h))
        out[f"{mlp}.expert_bias"] = Placement(f"{dst}.mlp.expert_bias", (), (e,))
        fp8 = experts in ctx.fp8
        for x in range(e):
            for proj, target, rows, shape in (
                ("gate_proj", "w13", (0, i), (i, h)),
                ("up_proj", "w13", (i, 2 * i), (i, h)),
                ("down_proj", "w2", (0, h), (h, i)),
            ):
                name = f"{mlp}.experts.{x}.{proj}"
                region: Region = (x, rows) if target == "w13" else (x,)
                if experts in ctx.int4:
                    _int4_weight(ctx, out, name, f"{experts}.{target}", region, shape)
                    continue
                out[f"{name}.weight"] = Placement(f"{experts}.{target}", region, shape)
                if fp8:
                    out[f"{name}.weight_scale"] = Placement(
                        f"{experts}.{target}_scale", (x, rows), (rows[1] - rows[0],), "scale"
                    )
                    if ctx.static:
                        act = "a13_scale" if target == "w13" else "a2_scale"
                        out[f"{name}.input_scale"] = Placement(f"{experts}.{act}", (), (1,), "max")
        shared_src = f"{mlp}.shared_mlp"
    else:
        out[f"{mlp}.gate.weight"] = Placement(f"{dst}.mlp.router.weight", (), (e, h))
        out[f"{mlp}.e_score_correction_bias"] = Placement(f"{dst}.mlp.expert_bias", (), (e,))
        out[f"{mlp}.experts.gate_up_proj"] = Placement(f"{experts}.w13", (), (e, 2 * i, h))
        out[f"{mlp}.experts.down_proj"] = Placement(f"{experts}.w2", (), (e, h, i))
        shared_src = f"{mlp}.shared_experts"
    if c.num_shared_experts:
        _mlp(ctx, out, shared_src, f"{dst}.mlp.shared_mlp", c.shared_intermediate_size)


def _int4_weight(
    ctx: _Ctx, out: dict[str, Placement], src: str, target: str, region: Region, shape: tuple[int, int]
) -> None:
    """One expert projection in compressed-tensors' pack-quantized layout: its int32 words, its group
    scales and its recorded shape."""
    rows, columns = shape
    out[f"{src}.weight_packed"] = Placement(target, region, (rows, columns // 8), "int4")
    out[f"{src}.weight_scale"] = Placement(f"{target}_scale", region, (rows, columns // ctx.group_size))
    out[f"{src}.weight_shape"] = Placement(target, region, (2,), "shape", shape)


def _mlp(ctx: _Ctx, out: dict[str, Placement], src: str, dst: str, inter: int) -> None:
    h = ctx.config.hidden_size
    _linear(ctx, out, f"{src}.gate_proj", f"{dst}.gate_up_proj", (0, inter), 2 * inter, h)
    _linear(ctx, out, f"{src}.up_proj", f"{dst}.gate_up_proj", (inter, 2 * inter), 2 * inter, h)
    _linear(ctx, out, f"{src}.down_proj", f"{dst}.down_proj", (0, h), h, inter)


def expected_tensors(
    config: Hy3Config,
    scheme: Scheme,
    fp8_modules: frozenset[str] = frozenset(),
    static_activations: bool = False,
    with_mtp: bool = True,
    int4_experts: frozenset[str] = frozenset(),
    group_size: int = 0,
) -> dict[str, Placement]:
    quant = config.quantization_config
    in_shards = quant is not None and quant.kv_scales_in_shards
    ctx = _Ctx(config, scheme, fp8_modules, static_activations, in_shards, int4_experts, group_size)
    c = config
    out: dict[str, Placement] = {
        "model.embed_tokens.weight": Placement("embed_tokens.weight", (), (c.vocab_size, c.hidden_size)),
        "model.norm.weight": Placement("norm.weight", (), (c.hidden_size,)),
        "lm_head.weight": Placement("lm_head.weight", (), (c.vocab_size, c.hidden_size)),
    }
    for layer, kind in enumerate(c.layer_types):
        _decoder_layer(ctx, out, f"model.layers.{layer}", f"layers.{layer}", kind == "sparse", layer)
    for depth in range(c.num_nextn_predict_layers if with_mtp else 0):
        src, dst = f"model.layers.{c.num_hidden_layers + depth}", f"mtp.{depth}"
        _decoder_layer(ctx, out, src, f"{dst}.layer", True, c.num_hidden_layers + depth)
        for norm in ("enorm", "hnorm", "final_layernorm"):
            out[f"{src}.{norm}.weight"] = Placement(f"{dst}.{norm}.weight", (), (c.hidden_size,))
        _linear(
            ctx, out, f"{src}.eh_proj", f"{dst}.eh_proj", (0, c.hidden_size), c.hidden_size, 2 * c.hidden_size
        )
    return out


def kv_scale_tensors(config: Hy3Config) -> dict[str, Placement]:
    """Names in `kv_cache_scales.safetensors` (C8 checkpoints) → kv_scales[layer, k|v].

    Per-tensor ([1]) scales are used as they are; per-head ([num_kv_heads]) scales are reduced to their
    maximum (never clips, costs a little resolution on the smaller heads)."""
    out = {}
    for layer in range(config.num_kv_layers):
        for which, kind in enumerate(("k", "v")):
            out[f"model.layers.{layer}.self_attn.{kind}_cache.scale"] = Placement(
                "kv_scales", (layer, (which, which + 1)), (config.num_key_value_heads,), "max"
            )
    return out


def fp8_module_of(name: str, config: Hy3Config) -> str | None:
    """The hy3c module path a hub-named FP8 `.weight` (or int4 `.weight_packed`) belongs to (None for
    non-linear tensors)."""
    parts = name.removesuffix("_packed").split(".")
    if parts[-1] != "weight" or len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    if not parts[2].isdigit() or int(parts[2]) >= config.num_hidden_layers + config.num_nextn_predict_layers:
        return None
    layer = int(parts[2])
    prefix = (
        f"layers.{layer}"
        if layer < config.num_hidden_layers
        else f"mtp.{layer - config.num_hidden_layers}.layer"
    )
    rest = parts[3:-1]
    if rest == ["eh_proj"]:
        return f"mtp.{layer - config.num_hidden_layers}.eh_proj"
    if rest in (["self_attn", "q_proj"], ["self_attn", "k_proj"], ["self_attn", "v_proj"]):
        return f"{prefix}.self_attn.qkv_proj"
    if rest == ["self_attn", "o_proj"]:
        return f"{prefix}.self_attn.o_proj"
    if rest[:2] == ["mlp", "experts"]:
        return f"{prefix}.mlp.experts"
    if rest[:1] == ["mlp"] and rest[-1] in ("gate_proj", "up_proj", "down_proj"):
        owner = ".".join(rest[:-1]).replace("shared_experts", "shared_mlp")
        fused = "down_proj" if rest[-1] == "down_proj" else "gate_up_proj"
        return f"{prefix}.{owner}.{fused}"
    return None
