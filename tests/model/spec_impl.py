"""An independent implementation of the model of docs/ARCHITECTURE.md §1.2–§1.5 (whole sequences, no
cache, the hub tensor names of §1.6), written from that description with plain torch — the oracle for
the MTP layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hy3c.config import Hy3Config


def load_hub_tensors(path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(f"{path}/model.safetensors").items()}


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def decoder_layer(x, pos, W, p, cfg: Hy3Config, sparse: bool):
    t, eps = x.shape[0], cfg.rms_norm_eps
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rms(x, W[f"{p}.input_layernorm.weight"], eps)
    q = (h @ W[f"{p}.self_attn.q_proj.weight"].T).view(t, nh, d)
    k = (h @ W[f"{p}.self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (h @ W[f"{p}.self_attn.v_proj.weight"].T).view(t, nkv, d)
    q = rope(rms(q, W[f"{p}.self_attn.q_norm.weight"], eps), pos, cfg.rope_theta)
    k = rope(rms(k, W[f"{p}.self_attn.k_norm.weight"], eps), pos, cfg.rope_theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * d)
    x = x + a @ W[f"{p}.self_attn.o_proj.weight"].T
    h = rms(x, W[f"{p}.post_attention_layernorm.weight"], eps)

    def mlp(prefix, inp):
        return (
            F.silu(inp @ W[f"{prefix}.gate_proj.weight"].T) * (inp @ W[f"{prefix}.up_proj.weight"].T)
        ) @ W[f"{prefix}.down_proj.weight"].T

    if not sparse:
        return x + mlp(f"{p}.mlp", h)
    s = torch.sigmoid(h @ W[f"{p}.mlp.router.gate.weight"].T)
    idx = torch.topk(s + W[f"{p}.mlp.expert_bias"], cfg.num_experts_per_tok).indices
    w = s.gather(-1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.router_scaling_factor
    y = torch.zeros_like(h)
    for tok in range(t):
        for j in range(cfg.num_experts_per_tok):
            y[tok] += w[tok, j] * mlp(f"{p}.mlp.experts.{int(idx[tok, j])}", h[tok])
    return x + y + mlp(f"{p}.mlp.shared_mlp", h)


def main_model(ids, W, cfg: Hy3Config):
    pos = torch.arange(len(ids))
    x = W["model.embed_tokens.weight"][ids]
    for layer, kind in enumerate(cfg.layer_types):
        x = decoder_layer(x, pos, W, f"model.layers.{layer}", cfg, kind == "sparse")
    h = rms(x, W["model.norm.weight"], cfg.rms_norm_eps)
    return h @ W["lm_head.weight"].T, h


def mtp(next_ids, pos, h_prev, W, cfg: Hy3Config):
    p, eps = f"model.layers.{cfg.num_hidden_layers}", cfg.rms_norm_eps
    e = W["model.embed_tokens.weight"][next_ids].clone()
    e[pos == 0] = 0
    x = torch.cat([rms(e, W[f"{p}.enorm.weight"], eps), rms(h_prev, W[f"{p}.hnorm.weight"], eps)], -1)
    x = decoder_layer(x @ W[f"{p}.eh_proj.weight"].T, pos, W, p, cfg, True)
    h = rms(x, W[f"{p}.final_layernorm.weight"], eps)
    return h @ W["lm_head.weight"].T, h
