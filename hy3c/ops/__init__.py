"""The L1 canonical `hy3` op dialect (docs/ARCHITECTURE.md §4).

Importing this package registers every op as `torch.ops.hy3.<name>` (a `torch.library.custom_op` with
a fake implementation). Each op's eager implementation is its pure-torch reference; kernel providers
are chosen later by the `lower` pass (`hy3.sample`'s by the serving sampler, which runs it after the
step program). The collectives (`hy3c.ops.collectives`, `COLLECTIVE_OPS`) run over the process groups
bound at run time; their eager implementation is `torch.distributed`.
"""

from hy3c.ops import attention, collectives, fused, moe, norm, quant, rope, sample
from hy3c.ops.quant import FP8_DTYPE, FP8_MAX

L1_OPS = (
    "rms_norm",
    "qk_norm",
    "rope",
    "kv_store",
    "attention",
    "router",
    "moe_experts",
    "silu_and_mul",
    "quant_fp8",
    "quant_fp8_per_token",
    "dequant_fp8",
    "scaled_mm",
)
L2_OPS = (
    "add_rms_norm",
    "add_rms_norm_quant",
    "qknorm_rope_quant_kvstore",
    "attention_plan",
    "paged_attention",
    "router_gemm",
    "topk_routing",
    "fused_moe",
    "silu_and_mul_quant",
    "sample",  # the token sampler: after the step program, never in it
)
# the communication of sharded programs (hy3c.ops.collectives): functional, over a group id
COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_reduce_add_rms_norm",  # L2: all_reduce → residual add → RMSNorm
    "local_experts",  # expert parallelism: the router's top-k as this rank's experts see it
    "shard_tokens",  # sequence parallelism: this rank's rows of a replicated tensor (no communication)
    "gemm_reduce_scatter",  # L2: row-parallel GEMM → reduce-scatter of its token rows
    "allgather_gemm",  # L2: all-gather of token shards → column-parallel GEMM
)

__all__ = [
    "COLLECTIVE_OPS", "FP8_DTYPE", "FP8_MAX", "L1_OPS", "L2_OPS",
    "attention", "collectives", "fused", "moe", "norm", "quant", "rope", "sample",
]  # fmt: skip
