"""Fixtures of the serving tests: the tiny checkpoint compiled once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe


@pytest.fixture(scope="session")
def tiny_artifact(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint compiled with the cpu-reference recipe (directory name `art`)."""
    out = tmp_path_factory.mktemp("served") / "art"
    return compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt).out
