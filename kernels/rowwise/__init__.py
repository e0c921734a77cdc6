"""`hy3c.kernels.rowwise`: kernels that make one pass over each row of activations, memory-bound, one
launch where eager torch takes several.

    rms_norm     `hy3.rms_norm`, `hy3.add_rms_norm` (residual add + RMSNorm) and `hy3.add_rms_norm_quant`
                 (… + FP8 quantization of the normed row for the next GEMM)
    activation   `hy3.silu_and_mul` (SwiGLU) and `hy3.silu_and_mul_quant` (… + FP8 quantization)
    quant        `hy3.quant_fp8` (static scale) and `hy3.quant_fp8_per_token`
"""
