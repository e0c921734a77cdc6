"""Hy3 building blocks written with the canonical `hy3` ops (docs/ARCHITECTURE.md §1.2–§1.4).

Every block works on a flat token batch x [T, hidden]: tokens of many requests, prefill chunks and
decodes mixed, described by `AttnMetadata`. Weights are parameters with requires_grad=False; a linear
layer is either high precision (bf16/fp32) or FP8 e4m3 with per-channel weight scales and a static
([1]) or dynamic (per-token) activation scale, as decided by the checkpoint (`QuantLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hy3c.ops  # noqa: F401  (registers torch.ops.hy3)
from hy3c.config import Hy3Config
from hy3c.ops.quant import FP8_DTYPE

hy3 = torch.ops.hy3


@dataclass(frozen=True)
class QuantLayout:
    """Which linear layers hold FP8 weights, and whether their activation scales are static.

    `fp8_modules` holds module paths of the hy3c model (`layers.3.self_attn.qkv_proj`,
    `layers.3.mlp.experts`, `mtp.0.eh_proj`, ...).
    """

    fp8_modules: frozenset[str] = field(default_factory=frozenset)
    static_activations: bool = False
    # expert stacks (`layers.3.mlp.experts`) holding W4A8 weights: int4 packed two per byte along the
    # input columns, a scale per `group_size` of them (`hy3c.ops.moe`)
    int4_experts: frozenset[str] = field(default_factory=frozenset)
    group_size: int = 0

    def is_fp8(self, module: str) -> bool:
        return module in self.fp8_modules


NO_QUANT = QuantLayout()


@dataclass
class AttnMetadata:
    """Per-step batch description shared by all layers (see hy3c.ops.attention)."""

    positions: Tensor  # [T] int64
    slot_mapping: Tensor  # [T] int64
    page_table: Tensor  # [B, max_pages] int32
    seq_lens: Tensor  # [B] int32
    query_start_loc: Tensor  # [B + 1] int32


def frozen_param(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None
) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen_param((size,), dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return hy3.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x Wᵀ (no bias). FP8: x is quantized (static or per-token) and multiplied by `hy3.scaled_mm`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device=None,
        fp8: bool = False,
        static_input: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = frozen_param((out_features, in_features), FP8_DTYPE if fp8 else dtype, device)
        self.weight_scale = frozen_param((out_features,), torch.float32, device) if fp8 else None
        self.input_scale = frozen_param((1,), torch.float32, device) if fp8 and static_input else None

    @property
    def is_fp8(self) -> bool:
        return self.weight_scale is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight)
        if self.input_scale is not None:
            xq, x_scale = hy3.quant_fp8(x, self.input_scale), self.input_scale
        else:
            xq, x_scale = hy3.quant_fp8_per_token(x)
        return hy3.scaled_mm(xq, self.weight, x_scale, self.weight_scale, x.dtype)


def _linear(cfg_in: int, cfg_out: int, name: str, dtype, device, quant: QuantLayout) -> Linear:
    return Linear(cfg_in, cfg_out, dtype, device, quant.is_fp8(name), quant.static_activations)


class Attention(nn.Module):
    """qkv GEMM → per-head QK RMSNorm → RoPE → paged KV store → paged causal GQA attention → o GEMM."""

    def __init__(
        self, config: Hy3Config, kv_layer: int, prefix: str, dtype, device, quant: QuantLayout
    ) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.theta = config.rope_theta
        self.sm_scale = config.head_dim**-0.5
        self.qkv_proj = _linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, f"{prefix}.qkv_proj", dtype, device, quant
        )
        self.o_proj = _linear(config.q_size, config.hidden_size, f"{prefix}.o_proj", dtype, device, quant)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, h: Tensor, meta: AttnMetadata, kv_cache: Tensor, kv_scales: Tensor) -> Tensor:
        num_tokens = h.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q = hy3.qk_norm(q, self.q_norm.weight, self.eps)
        k = hy3.qk_norm(k, self.k_norm.weight, self.eps)
        q = hy3.rope(q, meta.positions, self.theta)
        k = hy3.rope(k, meta.positions, self.theta)
        hy3.kv_store(k, v, kv_cache, kv_scales, self.kv_layer, meta.slot_mapping)
        o = hy3.attention(
            q,
            kv_cache,
            kv_scales,
            self.kv_layer,
            meta.page_table,
            meta.seq_lens,
            meta.query_start_loc,
            self.sm_scale,
        )
        return self.o_proj(o.reshape(num_tokens, q_size))


class DenseMLP(nn.Module):
    """SwiGLU FFN: down(silu(gate x) * up x), gate and up fused into one GEMM (gate rows first)."""

    def __init__(
        self, hidden: int, intermediate: int, prefix: str, dtype, device, quant: QuantLayout
    ) -> None:
        super().__init__()
        self.gate_up_proj = _linear(hidden, 2 * intermediate, f"{prefix}.gate_up_proj", dtype, device, quant)
        self.down_proj = _linear(intermediate, hidden, f"{prefix}.down_proj", dtype, device, quant)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(hy3.silu_and_mul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked: w13 [E, 2I, H], w2 [E, H, I] (+ FP8 scales); W4A8
    (`group_size` > 0): packed int4 w13 [E, 2I, H/2], w2 [E, H, I/2] with group scales [E, 2I, H/g],
    [E, H, I/g]."""

    def __init__(
        self, config: Hy3Config, dtype, device, fp8: bool, static_input: bool, group_size: int = 0
    ) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if group_size:
            self.w13 = frozen_param((e, 2 * i, h // 2), torch.uint8, device)
            self.w2 = frozen_param((e, h, i // 2), torch.uint8, device)
            self.w13_scale = frozen_param((e, 2 * i, h // group_size), torch.float32, device)
            self.w2_scale = frozen_param((e, h, i // group_size), torch.float32, device)
            self.a13_scale = self.a2_scale = None
            return
        wdtype = FP8_DTYPE if fp8 else dtype
        self.w13 = frozen_param((e, 2 * i, h), wdtype, device)
        self.w2 = frozen_param((e, h, i), wdtype, device)
        self.w13_scale = frozen_param((e, 2 * i), torch.float32, device) if fp8 else None
        self.w2_scale = frozen_param((e, h), torch.float32, device) if fp8 else None
        self.a13_scale = frozen_param((1,), torch.float32, device) if fp8 and static_input else None
        self.a2_scale = frozen_param((1,), torch.float32, device) if fp8 and static_input else None

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return hy3.moe_experts(
            x,
            topk_weights,
            topk_ids,
            self.w13,
            self.w2,
            self.w13_scale,
            self.w2_scale,
            self.a13_scale,
            self.a2_scale,
        )


class Router(nn.Module):
    def __init__(self, config: Hy3Config, device) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.router_scaling_factor
        self.weight = frozen_param((config.num_experts, config.hidden_size), torch.float32, device)

    def forward(self, x: Tensor, expert_bias: Tensor) -> tuple[Tensor, Tensor]:
        return hy3.router(x, self.weight, expert_bias, self.top_k, self.scaling)


class MoE(nn.Module):
    """fp32 sigmoid router → routed experts → + shared expert (docs/ARCHITECTURE.md §1.3)."""

    def __init__(self, config: Hy3Config, prefix: str, dtype, device, quant: QuantLayout) -> None:
        super().__init__()
        self.fp32_combine = config.enable_moe_fp32_combine
        self.router = Router(config, device)
        self.expert_bias = frozen_param((config.num_experts,), torch.float32, device)
        self.experts = Experts(
            config,
            dtype,
            device,
            quant.is_fp8(f"{prefix}.experts"),
            quant.static_activations,
            quant.group_size if f"{prefix}.experts" in quant.int4_experts else 0,
        )
        self.shared_mlp = (
            DenseMLP(
                config.hidden_size,
                config.shared_intermediate_size,
                f"{prefix}.shared_mlp",
                dtype,
                device,
                quant,
            )
            if config.num_shared_experts
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        topk_weights, topk_ids = self.router(x, self.expert_bias)
        routed = self.experts(x, topk_weights, topk_ids)
        if self.shared_mlp is None:
            return routed
        shared = self.shared_mlp(x)
        if self.fp32_combine:
            return (routed.float() + shared.float()).to(x.dtype)
        return routed + shared


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(
        self, config: Hy3Config, kv_layer: int, sparse: bool, prefix: str, dtype, device, quant: QuantLayout
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, kv_layer, f"{prefix}.self_attn", dtype, device, quant)
        self.mlp: nn.Module = (
            MoE(config, f"{prefix}.mlp", dtype, device, quant)
            if sparse
            else DenseMLP(config.hidden_size, config.intermediate_size, f"{prefix}.mlp", dtype, device, quant)
        )

    def forward(self, x: Tensor, meta: AttnMetadata, kv_cache: Tensor, kv_scales: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, kv_cache, kv_scales)
        return x + self.mlp(self.post_attention_layernorm(x))
