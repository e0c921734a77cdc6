"""Fixtures the engine tests share: the tiny checkpoint's eager model (fp32) and tokenizer."""

from __future__ import annotations

import gc

import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.tokenizer import Hy3Tokenizer


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    return Hy3Tokenizer.from_dir(tiny_ckpt)


@pytest.fixture(scope="module")
def cuda_artifact(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint compiled for the H200 (GPU tests)."""
    from hy3c.compiler.driver import compile_artifact
    from hy3c.recipe import load_recipe

    return compile_artifact(
        load_recipe("h200-bf16"), tmp_path_factory.mktemp("art") / "h200", checkpoint=tiny_ckpt
    ).out


def speculative_engine(artifact, k: int):
    """The engine `hy3c serve --speculative-config` builds over `artifact` (K drafts; CUDA graphs
    captured), with a 1 GiB KV cache so that several fit on the GPU one after another."""
    from hy3c.serve.http.server import ServeOptions, build_engine

    config = f'{{"method": "mtp", "num_speculative_tokens": {k}}}'
    options = ServeOptions(artifact=artifact, max_num_seqs=8, kv_memory_gib=1.0, speculative_config=config)
    return build_engine(options)[0]


def free_cuda_memory() -> None:
    """Give back the GPU memory of engines no longer referenced (before the next takes its KV cache)."""
    gc.collect()
    torch.cuda.empty_cache()
