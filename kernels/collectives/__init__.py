"""`hy3c.kernels.collectives`: the CUDA providers of the fused collectives (docs/ARCHITECTURE.md §4),
over peer-to-peer buffers only — never NVLink multicast (no multimem, NVLS or multicast objects; the
machines hy3c is measured on forbid it).

    all_reduce      `hy3.all_reduce_add_rms_norm`: a Triton all-reduce over torch symmetric memory
                    with the residual add and RMSNorm in its epilogue (one-shot below a token
                    threshold, two-shot above)
    symmetric       the symmetric-memory buffers those kernels read their peers through: allocated once
                    per (group, capacity, hidden, dtype), multicast kept off, peer and signal-pad
                    pointers as device tensors
    micro_pipeline  `hy3.gemm_reduce_scatter` and `hy3.allgather_gemm` through torch's micro-pipeline TP
                    ops (cuBLAS GEMMs overlapped with P2P copies of finished chunks)
    config          the one-shot / two-shot thresholds per GPU and world size (untuned defaults)

Like the other families, the package imports nothing itself: `hy3c.kernels` registers the providers
(the Triton one only where Triton is installed).
"""
