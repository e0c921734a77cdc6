"""Triton paged GQA attention over the hy3c KV cache (bf16 or FP8 e4m3 with per-tensor scales).

`hy3_triton::paged_attention` implements `hy3::paged_attention` and picks, from shapes alone (no host
sync, so CUDA graphs capture it), with the program's variants (`gluon`: the Gluon prefill kernel over
bf16 KV; `pdl`: programmatic dependent launch):
  * a pure decode step (one query per request): **dynamic split-KV** decode. The step's KV tiles
    (`plan`'s row 0) are dealt in equal contiguous ranges to a fixed grid of CTAs × KV heads;
    each CTA walks its range, emitting one partial softmax result (o, lse) per request it touches into
    slot `cta + request`; a combine kernel merges each request's partials. All 8 query heads of a KV
    head share each K/V load (GQA).
  * anything else (prefill chunks over a cached prefix, mixed batches): a causal flash-attention
    kernel over query blocks (`plan`'s row 1) × KV heads, the query block's tokens × the
    group's heads forming the MMA rows.

FP8 K/V go into the MMAs as loaded: q is quantized per row to e4m3 (scale absmax / 448), QKᵀ is an
e4m3 × e4m3 product, and so is PV, with P scaled into e4m3's range and V read K-major (keys contiguous)
from its pages, which FP8 caches store transposed ([kv_heads, head_dim, page], `hy3c.ops.attention`):
Hopper's FP8 wgmma takes its B operand only K-major. No conversion or shared-memory round trip is left
in the key loop, so FP8 decode streams its half-size KV like bf16 decode (widening K/V to f16 in the
loop instead was slower). Decode has only 16
query rows (one KV head's 8, padded) — too few for a wgmma (64 rows), and Triton lowers an e4m3 dot
with 16 rows to an f16 `mma.sync` with converted operands — so FP8 decode makes the keys, then the
head dims, the MMA's rows: Sᵀ = K·qᵀ, accᵀ += Vᵀ·Pᵀ (both e4m3 wgmma m64n16k32). The cost is P's
3-bit mantissa: a relative error of a few 1e-2 on the output, the size of the C8 cache's own
quantization error (the FA3 / TensorRT-LLM FP8 attention choice).

K/V blocks are gathered through the page table either with per-row pointer loads or — `LaunchConfig.tma`,
when a block lies inside one page (its size divides the page size) — as one TMA bulk copy per operand
from tensor descriptors over the layer's pages (`blocks.page_descriptors`). A tail block's keys past the
sequence then come from the page's unused slots: their V is zeroed and their scores masked. Prefill
uses TMA where the page size allows (faster than the pointer loads), FP8 decode too (64-key page
slices); bf16 decode uses 128-key pointer loads (faster there than 64-key TMA blocks).

Key blocks that every query row sees whole (all of a decode range but its tail; the keys before a
prefill block's first query) take an unmasked path; only the tail / diagonal blocks pay for masks.
The softmax runs in base 2 with the scale folded into the exponent. With `LaunchConfig.lazy_rescale`
(a prefill option) the accumulator is rescaled only when some row's max grows by more than 2^8
(slower for bf16 prefill, for decode and for FP8 prefill with its e4m3 P·V, so it is off in every
shipped config).

The kernels live in `decode` and `prefill` (`prefill_gluon`), what they share in `blocks`, their
launch configs in `config`; this module is the op and its provider.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hy3c.kernels.attention import prefill_gluon
from hy3c.kernels.attention.decode import decode_attention_dynamic
from hy3c.kernels.attention.plan import prefill_q_block
from hy3c.kernels.attention.prefill import prefill_attention
from hy3c.kernels.registry import HOPPER, PDL, Provider, Target, Variant, register_provider


@torch.library.custom_op("hy3_triton::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    kv_scales: Tensor,
    layer: int,
    page_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sm_scale: float,
    plan: Tensor,
    *,
    gluon: bool = True,
    pdl: bool = True,
) -> Tensor:
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if q.shape[0] == seq_lens.shape[0]:  # one query per request: a decode step
        args = (q, kv_cache, kv_scales, layer, page_table, seq_lens, sm_scale, plan)
        return decode_attention_dynamic(*args, pdl=pdl)
    args = (q, kv_cache, kv_scales, layer, page_table, seq_lens, query_start_loc, sm_scale, plan)
    return prefill_attention(*args, gluon=gluon, pdl=pdl)


@paged_attention.register_fake
def _(
    q,
    kv_cache,
    kv_scales,
    layer,
    page_table,
    seq_lens,
    query_start_loc,
    sm_scale,
    plan,
    *,
    gluon=True,
    pdl=True,
):
    return torch.empty_like(q)


def _supports(node) -> str | None:
    q = node.args[0].meta.get("val")
    cache = node.args[1].meta.get("val")
    if q is None or cache is None:
        return None
    head_dim, group = q.shape[-1], q.shape[1] // cache.shape[4]
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    if group & (group - 1):
        return f"GQA group {group} is not a power of two"
    return None


def _gluon_supports(node, target: Target) -> str | None:
    """The Gluon prefill's conditions on the node's shapes and the target's KV dtype
    (`prefill_gluon.unsupported_inputs`)."""
    q, cache = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if q is None or cache is None:
        return "no shapes recorded"
    group = q.shape[1] // cache.shape[4]
    return prefill_gluon.unsupported_inputs(
        q.dtype, target.kv_dtype, q.shape[2], prefill_q_block(group) * group
    )


register_provider(
    Provider(
        "triton",
        "paged_attention",
        torch.ops.hy3_triton.paged_attention.default,
        frozenset({"cuda"}),
        cuda_graph_safe=True,
        supports=_supports,
        variants=(PDL, Variant("gluon", HOPPER, _gluon_supports)),
    )
)
