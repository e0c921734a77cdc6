"""`hy3c.model`: the Hy3 model written with the canonical hy3 ops — the causal LM and its MTP layers
(`hy3`), its building blocks (`layers`) and the flat paged step batch the engine builds (`batch`). Run
eagerly it is the numerical reference of every compiled program; the compiler traces its `forward`."""

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
