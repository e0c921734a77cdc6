"""hy3c: a compiler-driven inference engine for Tencent Hy3 (`hy_v3`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    import torch


def reference_logits(
    model_dir, input_ids, dtype: torch.dtype | None = None, device: str = "cpu"
) -> torch.Tensor:
    """Eager hy3c logits [B, T, vocab] of a checkpoint over input_ids [B, T]; fp32 by default."""
    import torch

    from hy3c.checkpoint.reference import reference_logits as _reference_logits

    return _reference_logits(model_dir, input_ids, dtype or torch.float32, device)


__all__ = ["__version__", "reference_logits"]
