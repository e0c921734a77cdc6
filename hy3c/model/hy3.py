"""The Hy3 causal LM (main model + MTP layers) over a flat, paged token batch.

`forward` is the step function the compiler traces: one call runs any mix of prefill chunks and decode
tokens of many requests. It returns the fp32 logits of the rows selected by `logits_indices` and the
post-final-norm hidden states of every token (what the MTP layer consumes).

`mtp_forward` runs MTP depth `depth` (docs/ARCHITECTURE.md §1.5): it embeds the *next* tokens, concatenates
enorm(embedding) with hnorm(previous hidden), projects with eh_proj, runs one MoE decoder layer with its
own KV cache layer (num_hidden_layers + depth) and shares embed_tokens and lm_head with the main model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hy3c.config import Hy3Config
from hy3c.model.layers import NO_QUANT, AttnMetadata, DecoderLayer, Linear, QuantLayout, RMSNorm, frozen_param


class MTPLayer(nn.Module):
    def __init__(self, config: Hy3Config, depth: int, dtype, device, quant: QuantLayout) -> None:
        super().__init__()
        prefix = f"mtp.{depth}"
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.eh_proj = Linear(
            2 * h, h, dtype, device, quant.is_fp8(f"{prefix}.eh_proj"), quant.static_activations
        )
        self.layer = DecoderLayer(
            config, config.num_hidden_layers + depth, True, f"{prefix}.layer", dtype, device, quant
        )
        self.final_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)

    def forward(
        self, embedded: Tensor, hidden_prev: Tensor, meta: AttnMetadata, kv_cache: Tensor, kv_scales: Tensor
    ) -> Tensor:
        """The layer's output before its final norm: the next tokens' embeddings (zero at position 0)
        and the previous hidden states, normed, joined and projected, through the decoder layer."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden_prev)], dim=-1))
        return self.layer(x, meta, kv_cache, kv_scales)


class Hy3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: Hy3Config,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        quant: QuantLayout = NO_QUANT,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quant = quant
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kind == "sparse", f"layers.{i}", dtype, device, quant)
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.lm_head = Linear(h, config.vocab_size, dtype, device)
        self.mtp = nn.ModuleList(
            MTPLayer(config, d, dtype, device, quant) for d in range(config.num_nextn_predict_layers)
        )
        # per-tensor K/V dequant scales of every KV layer (used when the cache is FP8)
        self.kv_scales = frozen_param((config.num_kv_layers, 2), torch.float32, device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def kv_heads(self) -> int:
        """The KV heads the cache holds (all of them: the eager model runs on one rank)."""
        return self.config.num_key_value_heads

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> Tensor:
        return allocate_kv_cache(self.config, num_pages, page_size, self.kv_dtype, self.device)

    def step(self, batch, kv_cache: Tensor, query_len: int | None = None) -> tuple[Tensor, Tensor]:
        """One step over a `StepBatch` (the engine's interface, shared with the compiled Runner;
        `query_len`, the Runner's hint for its CUDA graphs, changes nothing here)."""
        with torch.no_grad():
            return self(*batch.model_args(kv_cache))

    @property
    def num_draft_layers(self) -> int:
        """MTP layers `draft` can run (depth 0 only, as the compiled draft program; 0: none)."""
        return min(len(self.mtp), 1)

    def draft(
        self, batch, hidden_prev: Tensor, kv_cache: Tensor, query_len: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """MTP depth 0 over a `StepBatch` (the engine's interface, shared with the compiled Runner):
        `hidden_prev[t]` the post-norm hidden at `batch.positions[t]`, `batch.input_ids[t]` the token
        after it. Returns (fp32 logits of `logits_indices`, the MTP layer's hidden of every token).
        `query_len` (the Runner's CUDA-graph hint) changes nothing here."""
        if not self.mtp:
            raise RuntimeError("the model has no MTP layers (num_draft_layers is 0)")
        input_ids, positions, *rest = batch.model_args(kv_cache)
        with torch.no_grad():
            return self.mtp_forward(input_ids, positions, hidden_prev, *rest)

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head in the model dtype, returned as fp32 (docs/ARCHITECTURE.md §1.9)."""
        return self.lm_head(hidden).float()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: Tensor,
        page_table: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        slot_mapping: Tensor,
        logits_indices: Tensor,
    ) -> tuple[Tensor, Tensor]:
        meta = AttnMetadata(positions, slot_mapping, page_table, seq_lens, query_start_loc)
        x = F.embedding(input_ids, self.embed_tokens.weight)
        for layer in self.layers:
            x = layer(x, meta, kv_cache, self.kv_scales)
        hidden = self.norm(x)
        return self.logits(hidden.index_select(0, logits_indices)), hidden

    def mtp_forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        hidden_prev: Tensor,
        kv_cache: Tensor,
        page_table: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        slot_mapping: Tensor,
        logits_indices: Tensor,
        depth: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """input_ids[t] is the token after position t; hidden_prev[t] the (post-norm) hidden at t."""
        mtp = self.mtp[depth]
        meta = AttnMetadata(positions, slot_mapping, page_table, seq_lens, query_start_loc)
        embedded = F.embedding(input_ids, self.embed_tokens.weight)
        embedded = embedded.masked_fill((positions == 0)[:, None], 0)  # position 0 has no previous token
        hidden = mtp.final_layernorm(mtp(embedded, hidden_prev, meta, kv_cache, self.kv_scales))
        return self.logits(hidden.index_select(0, logits_indices)), hidden


def allocate_kv_cache(
    config: Hy3Config,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    kv_heads: int | None = None,
) -> Tensor:
    """Zeroed paged KV cache [num_kv_layers, 2, num_pages, page_size, kv_heads, head_dim] (`kv_heads`:
    those of one rank of a sharded program; by default the model's)."""
    heads = config.num_key_value_heads if kv_heads is None else kv_heads
    shape = (config.num_kv_layers, 2, num_pages, page_size, heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
