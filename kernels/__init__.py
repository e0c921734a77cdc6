"""`hy3c.kernels` (the top-level folder `kernels/`, mapped into the `hy3c` namespace: a top-level
`kernels` would collide with Hugging Face's hub-kernels package, which transformers probes for): the
kernel providers of the hy3 ops (see `hy3c.kernels.registry`).

Importing this package registers the torch reference providers, the `cublas` providers (vendor GEMMs
through torch) and, when Triton is installed, the Triton kernels (usable on CUDA; under TRITON_INTERPRET=1 they also run on CPU tensors for tests).
"""

from hy3c.kernels import torch_cuda  # noqa: F401
from hy3c.kernels.registry import Provider, provider_by_target, providers_for, register_provider

try:
    import triton  # noqa: F401
except ImportError:  # a CPU-only install without triton: the torch providers remain
    HAVE_TRITON = False
else:
    HAVE_TRITON = True
    from hy3c.kernels import (  # noqa: F401
        activation,
        fused_moe,
        paged_attention,
        plan_kernel,
        qknorm_rope_kvstore,
        quant,
        rms_norm,
        router,
    )

__all__ = ["HAVE_TRITON", "Provider", "provider_by_target", "providers_for", "register_provider"]
