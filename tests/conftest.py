"""Shared fixtures: tiny random Hy3 checkpoints (written once per session) and the gpu marker."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch

# Triton kernels run in the CPU interpreter when there is no GPU; this must happen before any
# @triton.jit function is defined, i.e. before hy3c.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.kernels.interp_shim import install as _install_interpreter_fixes

    _install_interpreter_fixes()

# compiled runs keep Inductor's caches in a directory of this test session, not in ~/.cache
os.environ.setdefault("HY3C_CACHE_DIR", tempfile.mkdtemp(prefix="hy3c-test-cache-"))

import pytest

from hy3c.checkpoint.random_checkpoint import init_checkpoint
from hy3c.checkpoint.train_tiny import cache_key, train_tiny


def _import_hub_kernels_first() -> None:
    """transformers (5.25 on) imports Hugging Face's `kernels` package, a dependency of it. Under pytest
    the repository's root is on sys.path, and its `kernels/` folder (installed as `hy3c.kernels`) would
    be found under that name instead: import the installed package before the root can shadow it."""
    root = Path(__file__).resolve().parents[1]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if Path(entry or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:  # not installed (older transformers): nothing to shadow
        pass
    finally:
        sys.path[:] = saved


_import_hub_kernels_first()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny preset, hub naming, seed 0."""
    return init_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """Factory: write (and cache) a tiny checkpoint with config overrides."""
    cache: dict[tuple, Path] = {}

    def make(seed: int = 0, scheme: str = "hub", max_shard_bytes: int = 4 << 30, **overrides) -> Path:
        key = (seed, scheme, max_shard_bytes, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt") / "model"
            cache[key] = init_checkpoint("tiny", out, seed, scheme, max_shard_bytes, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def trained_ckpt() -> Path:
    """The trained tiny checkpoint (hy3c.checkpoint.train_tiny), trained once per hash of its sources and
    torch version and kept in `$HY3C_TRAINED_CACHE` (default ~/.cache/hy3c/trained-tiny), so later
    sessions reuse it; it is written atomically, so a directory there is always a whole checkpoint."""
    root = Path(os.environ.get("HY3C_TRAINED_CACHE") or Path.home() / ".cache" / "hy3c" / "trained-tiny")
    out = root / cache_key()
    if not out.is_dir():
        train_tiny(out, progress=False)
    return out


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.json from this run")


@pytest.fixture
def hy3c_log(caplog, monkeypatch):
    """caplog for hy3c's loggers, whose records `setup_logging` (run by CLI tests) keeps from the root."""
    import logging

    monkeypatch.setattr(logging.getLogger("hy3c"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="hy3c"):
        yield caplog
