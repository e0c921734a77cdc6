"""Fixtures the engine tests share: the tiny checkpoint's eager model (fp32) and tokenizer."""

from __future__ import annotations

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
