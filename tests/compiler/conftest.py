from __future__ import annotations

import pytest
import torch

from hy3c.checkpoint.loader import assemble_tensors, inspect_checkpoint
from hy3c.compiler.trace import trace_step
from hy3c.passes.base import CompileCtx
from hy3c.passes.graph_utils import set_attr
from hy3c.recipe import load_recipe


def make_ctx(config, recipe_name="cpu-reference", overrides=(), **extra) -> CompileCtx:
    recipe = load_recipe(recipe_name, list(overrides))
    return CompileCtx(
        model=config,
        parallel=recipe.parallel,
        target=recipe.target,
        device_type=recipe.device_type,
        quant=recipe.quant,
        dtype=recipe.dtype,
        token_range=recipe.token_range,
        **extra,
    )


def bind_weights(gm, checkpoint, dtype):
    """Fill a traced graph's meta parameters from a checkpoint (what packaging + loading do)."""
    layout = inspect_checkpoint(checkpoint)
    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in gm.named_parameters()}
    for name, tensor in assemble_tensors(layout, shapes, checkpoint):
        set_attr(gm, name, tensor)
    gm.recompile()
    return gm


@pytest.fixture
def traced(tiny_ckpt):
    """(gm, checkpoint) for the tiny checkpoint traced in fp32, weights not yet bound."""
    layout = inspect_checkpoint(tiny_ckpt)
    return trace_step(layout.config, torch.float32, layout.quant), tiny_ckpt
