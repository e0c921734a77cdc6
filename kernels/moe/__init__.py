"""`hy3c.kernels.moe`: the mixture-of-experts family.

router           `hy3.router_gemm` (dual-BF16 router GEMM) and `hy3.topk_routing`
align            the (token, slot) pairs grouped by expert for the GEMMs' M blocks
fused_moe        `hy3.fused_moe`: routed experts + the shared expert's output (bf16, FP8 W8A8); at one
                 token on sm_90 its GEMMs run as the Gluon kernels of `fused_moe_gluon`
config           FusedMoE launch configs, from the tuned tables in `configs/` or built-in defaults
"""
