"""Calibration through NVIDIA ModelOpt (`convert-fp8`'s default): its FP8 recipe over hy3c's own
modules gives the amaxes the forward-hook reference (`calibrate`) takes, leaves the model as it was,
and writes the same checkpoint; without ModelOpt installed, one error says how to get it."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from hy3c.checkpoint.calibration_data import calibration_windows
from hy3c.checkpoint.fp8_convert import calibrate, convert_to_fp8
from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.tokenizer import Hy3Tokenizer

pytest.importorskip("modelopt.torch.quantization", reason="the test command installs nvidia-modelopt")
from hy3c.checkpoint.modelopt_calibration import modelopt_calibrate


@pytest.fixture(scope="module")
def windows(trained_ckpt) -> list[list[int]]:
    return calibration_windows(Hy3Tokenizer.from_dir(trained_ckpt), None, max_tokens=2048)


def test_modelopt_calibrates_every_module_as_the_reference_does(trained_ckpt, windows):
    model = load_model(trained_ckpt, dtype=torch.bfloat16, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {name: type(m) for name, m in model.named_modules()}
    ours = modelopt_calibrate(model, windows)
    reference = calibrate(model, windows)
    assert ours.keys() == reference.keys()
    assert {k for k in ours if k.endswith(".a2")} == {
        "layers.1.mlp.experts.a2",
        "layers.2.mlp.experts.a2",
        "mtp.0.layer.mlp.experts.a2",
    }
    assert "mtp.0.eh_proj" in ours and "lm_head" not in ours  # Hy3's FP8 quantizes the MTP layer
    for key, value in reference.items():
        assert value > 0 and ours[key] == pytest.approx(value, rel=1e-6), key
    assert {name: type(m) for name, m in model.named_modules()} == classes  # calibrated on a copy
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_convert_with_modelopt_writes_the_reference_calibrations_checkpoint(trained_ckpt, windows, tmp_path):
    model = load_model(trained_ckpt, dtype=torch.bfloat16, progress=False)
    a = convert_to_fp8(model, trained_ckpt, tmp_path / "modelopt", calibration=windows)
    b = convert_to_fp8(model, trained_ckpt, tmp_path / "absmax", calibration=windows, calibrator="absmax")
    ours, reference = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ours.keys() == reference.keys()
    assert [k for k in ours if not torch.equal(ours[k], reference[k])] == []
    assert (
        load_file(a / "kv_cache_scales.safetensors").keys()
        == load_file(b / "kv_cache_scales.safetensors").keys()
    )


def test_without_modelopt_the_error_says_how_to_install_it(trained_ckpt, windows, monkeypatch, tmp_path):
    model = load_model(trained_ckpt, dtype=torch.bfloat16, progress=False)
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"needs nvidia-modelopt: pip install -e \"\.\[quant\]\""):
        convert_to_fp8(model, trained_ckpt, tmp_path / "x", calibration=windows)
    assert not (tmp_path / "x").exists()
