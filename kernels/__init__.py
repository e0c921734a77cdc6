"""`hy3c.kernels` (the top-level folder `kernels/`, mapped into the `hy3c` namespace: a top-level
`kernels` would collide with Hugging Face's hub-kernels package, which transformers probes for): the
kernel providers of the hy3 ops (see `hy3c.kernels.registry`), by family.

    attention/   paged attention (decode, chunked prefill, its Gluon prefill), the per-step plan, and the
                 attention input path: QK-norm + RoPE + FP8 + KV store
    moe/         router GEMM and top-k routing, expert alignment, FusedMoE (Triton, one-token Gluon) and
                 its tuned config tables (`moe/configs/`)
    rowwise/     one pass over each row: RMSNorm (+ residual add, + FP8 quantization), SwiGLU (+ FP8
                 quantization), FP8 activation quantization
    sampler/     the fused token sampler (`hy3.sample`: temperature, min-p, top-k, top-p, Gumbel-max draw)
    collectives/ fused collectives over peer-to-peer buffers (never NVLink multicast): all-reduce +
                 residual add + RMSNorm over symmetric memory (Triton), GEMM + reduce-scatter and
                 all-gather + GEMM through torch's micro-pipeline TP ops (`cublas`)
    cublas.py    vendor GEMMs through torch (`cublas` providers)
    registry.py  providers, their compile-time variants (`pdl`, `gluon`) and their lookup
    pdl.py       programmatic dependent launch
    overrides.py the HY3C_PDL / HY3C_GLUON debugging overrides (the one module reading the environment)
    devices.py   what a launch asks of its GPU, and the log of launches that fall back from their variant

Importing this package registers the torch reference providers, the `cublas` providers (vendor GEMMs, and
torch's micro-pipeline TP ops) and, when Triton is installed, the Triton kernels (usable on CUDA; under
TRITON_INTERPRET=1 they also run on CPU tensors for tests). The family packages import nothing
themselves, so their pure-Python modules (the attention plan's constants, the MoE configs, the
collectives' thresholds) load without Triton.
"""

from hy3c.kernels import cublas  # noqa: F401
from hy3c.kernels.collectives import micro_pipeline  # noqa: F401
from hy3c.kernels.registry import Provider, provider_by_target, providers_for, register_provider

try:
    import triton  # noqa: F401
except ImportError:  # a CPU-only install without triton: the torch providers remain
    HAVE_TRITON = False
else:
    HAVE_TRITON = True
    from hy3c.kernels.attention import paged_attention, plan_kernel, qknorm_rope_kvstore  # noqa: F401
    from hy3c.kernels.collectives import all_reduce  # noqa: F401
    from hy3c.kernels.moe import fused_moe, router  # noqa: F401
    from hy3c.kernels.rowwise import activation, quant, rms_norm  # noqa: F401
    from hy3c.kernels.sampler import fused_sampler  # noqa: F401

__all__ = ["HAVE_TRITON", "Provider", "provider_by_target", "providers_for", "register_provider"]
