"""Calibration through NVIDIA ModelOpt (`convert-fp8`'s default), one block of the checkpoint in memory
at a time: its FP8 recipe over hy3c's own modules gives the amaxes the whole-model forward-hook
reference (`calibrate`) takes, and writes the same checkpoint; the hook-based layer-by-layer
calibration gives them too; only one block is ever loaded; without ModelOpt installed, one error says
how to get it."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from hy3c.checkpoint import layerwise
from hy3c.checkpoint.calibration_data import calibration_windows
from hy3c.checkpoint.fp8_convert import calibrate, convert_to_fp8
from hy3c.checkpoint.loader import inspect_checkpoint, load_model
from hy3c.checkpoint.tokenizer import Hy3Tokenizer

pytest.importorskip("modelopt.torch.quantization", reason="the test command installs nvidia-modelopt")


@pytest.fixture(scope="module")
def windows(trained_ckpt) -> list[list[int]]:
    return calibration_windows(Hy3Tokenizer.from_dir(trained_ckpt), None, max_tokens=2048)


@pytest.fixture(scope="module")
def reference(trained_ckpt, windows) -> dict[str, float]:
    """The whole model in memory (in its checkpoint's dtype, as the layers are calibrated), forward hooks
    on its modules."""
    return calibrate(load_model(trained_ckpt, progress=False), windows)


@pytest.mark.parametrize("calibrator", ["modelopt", "absmax"])
def test_layer_by_layer_calibration_equals_the_whole_model_reference(
    trained_ckpt, windows, reference, calibrator
):
    stats = layerwise.calibrate_layerwise(
        inspect_checkpoint(trained_ckpt), trained_ckpt, windows, layerwise.fp8_ranges(calibrator)
    )
    assert stats.keys() == reference.keys()
    assert {k for k in stats if k.endswith(".a2")} == {
        "layers.1.mlp.experts.a2",
        "layers.2.mlp.experts.a2",
        "mtp.0.layer.mlp.experts.a2",
    }
    assert "mtp.0.eh_proj" in stats and "lm_head" not in stats  # Hy3's FP8 quantizes the MTP layer
    assert {"kv.0.k", "kv.2.v", "kv.3.k"} <= stats.keys()  # the MTP layer's cache is layer 3
    for key, value in reference.items():
        assert value > 0 and stats[key] == pytest.approx(value, rel=1e-6), key


def test_calibration_holds_one_block_of_the_checkpoint_at_a_time(trained_ckpt, windows, monkeypatch):
    """Every block is read from the checkpoint when its turn comes and released after it: at most the
    largest block's parameters are ever materialized (the embedding and an MTP layer are loaded alone)."""
    loaded: list[int] = []
    live = [0]
    original = layerwise._Blocks.loaded

    def counting(self, *paths):
        manager = original(self, *paths)

        class Counted:
            def __enter__(inner):
                manager.__enter__()
                live[0] += sum(
                    self.skeleton.get_submodule(p).get_parameter(n).numel()
                    for p in paths
                    for n, _ in self.skeleton.get_submodule(p).named_parameters()
                )
                loaded.append(live[0])

            def __exit__(inner, *exc):
                live[0] = 0
                return manager.__exit__(*exc)

        return Counted()

    monkeypatch.setattr(layerwise._Blocks, "loaded", counting)
    layerwise.calibrate_layerwise(
        inspect_checkpoint(trained_ckpt), trained_ckpt, windows, layerwise.fp8_ranges("absmax")
    )
    model = load_model(trained_ckpt, progress=False)
    whole = sum(p.numel() for p in model.parameters())
    largest = max(
        sum(p.numel() for p in block.parameters())
        for block in (*model.layers, *model.mtp, model.embed_tokens)
    )
    assert len(loaded) == 1 + len(model.layers) + 1 + 1 + len(
        model.mtp
    )  # embedding, layers, norm, embedding, MTP
    assert max(loaded) == largest < whole / 2


def test_convert_with_modelopt_writes_the_reference_calibrations_checkpoint(trained_ckpt, windows, tmp_path):
    a = convert_to_fp8(trained_ckpt, tmp_path / "modelopt", calibration=windows)
    b = convert_to_fp8(trained_ckpt, tmp_path / "absmax", calibration=windows, calibrator="absmax")
    ours, reference = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert [k for k in ours if not torch.equal(ours[k], reference[k])] == []
    assert (
        load_file(a / "kv_cache_scales.safetensors").keys()
        == load_file(b / "kv_cache_scales.safetensors").keys()
    )


def test_without_modelopt_the_error_says_how_to_install_it(trained_ckpt, windows, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"needs nvidia-modelopt: pip install -e \"\.\[quant\]\""):
        convert_to_fp8(trained_ckpt, tmp_path / "x", calibration=windows)
    assert not (tmp_path / "x").exists()
