"""The Hy3 model written with the canonical hy3 ops."""

from hy3c.model.batch import SeqChunk, StepBatch, build_step_batch
from hy3c.model.hy3 import Hy3ForCausalLM, allocate_kv_cache
from hy3c.model.layers import NO_QUANT, AttnMetadata, QuantLayout

__all__ = [
    "NO_QUANT",
    "AttnMetadata",
    "Hy3ForCausalLM",
    "QuantLayout",
    "SeqChunk",
    "StepBatch",
    "allocate_kv_cache",
    "build_step_batch",
]
