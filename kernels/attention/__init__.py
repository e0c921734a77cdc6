"""`hy3c.kernels.attention`: the attention family — everything between a layer's packed qkv projection
and its attention output.

    qknorm_rope_kvstore  `hy3.qknorm_rope_quant_kvstore`: per-head QK RMSNorm, RoPE, FP8 quantization and
                         the paged KV store, in one pass over qkv
    plan_kernel          `hy3.attention_plan`: the step's work plan (schedule math: `plan`)
    paged_attention      `hy3.paged_attention`: dynamic split-KV decode (`decode`) and chunked prefill
                         (`prefill`; over bf16 KV on sm_90 the Gluon kernel, `prefill_gluon`), sharing the
                         key-block loop of `blocks` and the launch configs of `config`

The fused QK-norm/RoPE/KV-store kernel lives here, not with the row-wise norms, because it is the
attention input path: it writes the KV cache in the page layout the attention kernels read (FP8 caches
with V pages transposed), with the same per-layer scales, and its launch shapes are tuned together with
them (`bench/attention_bench.py`). A change to the cache layout touches this package only.
"""
