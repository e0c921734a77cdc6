"""NVIDIA ModelOpt's FP8 HF export, beside AngelSlim's layout: written by `convert-fp8 --layout
modelopt`, read back by `load_model` into the same model as the AngelSlim layout of the same
calibration, in both of ModelOpt's config spellings (config.json's `quantization_config`, or only
`hf_quant_config.json`), and each malformed field named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hy3c.checkpoint.fp8_convert import convert_to_fp8
from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.safetensors_io import CheckpointError
from hy3c.config import ConfigError
from hy3c.ops.quant import FP8_DTYPE


@pytest.fixture(scope="module")
def layouts(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint converted twice from one calibration: (angelslim dir, modelopt dir)."""
    root = tmp_path_factory.mktemp("layouts")
    angelslim = convert_to_fp8(tiny_ckpt, root / "angelslim", seed=5)
    modelopt = convert_to_fp8(tiny_ckpt, root / "modelopt", seed=5, layout="modelopt")
    return angelslim, modelopt


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in model.state_dict().items()}


def test_the_modelopt_export_holds_modelopts_names_shapes_and_config(layouts):
    _, modelopt = layouts
    config = json.loads((modelopt / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == "FP8"
    assert config["kv_cache_scheme"]["type"] == "float" and config["kv_cache_scheme"]["num_bits"] == 8
    assert "lm_head" in config["ignore"]
    legacy = json.loads((modelopt / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["quant_algo"] == "FP8" and legacy["kv_cache_quant_algo"] == "FP8"
    assert not (modelopt / "kv_cache_scales.safetensors").exists()
    raw = load_file(modelopt / "model.safetensors")
    attn = "model.layers.1.self_attn"
    assert raw[f"{attn}.q_proj.weight"].dtype == FP8_DTYPE
    for name in ("q_proj.weight_scale", "q_proj.input_scale", "k_proj.k_scale", "v_proj.v_scale"):
        assert raw[f"{attn}.{name}"].shape == () and raw[f"{attn}.{name}"].dtype == torch.float32, name
    assert raw["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == FP8_DTYPE
    assert raw["model.layers.1.mlp.router.gate.weight"].dtype == torch.float32
    assert raw["lm_head.weight"].dtype == torch.bfloat16


def test_both_layouts_load_into_the_same_model(layouts):
    angelslim, modelopt = layouts
    a = _state(load_model(angelslim, dtype=torch.bfloat16, progress=False))
    b = _state(load_model(modelopt, dtype=torch.bfloat16, progress=False))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert not torch.all(b["kv_scales"] == 1.0)  # the KV scales came from the shards' k/v_scale


def _legacy_export(src, dst):
    """A copy of the export whose config.json has no quantization_config (older ModelOpt exports)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_legacy_export_with_only_hf_quant_config_loads_the_same(layouts, tmp_path):
    _, modelopt = layouts
    legacy = _legacy_export(modelopt, tmp_path / "legacy")
    a = _state(load_model(modelopt, progress=False))
    b = _state(load_model(legacy, progress=False))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_older_exports_kv_cache_scheme_string_reads_as_fp8(layouts, tmp_path):
    _, modelopt = layouts
    _edited(modelopt, tmp_path / "older", lambda q: q.update(kv_cache_scheme="FP8"))
    a = _state(load_model(modelopt, progress=False))
    b = _state(load_model(tmp_path / "older", progress=False))
    assert torch.equal(a["kv_scales"], b["kv_scales"]) and not torch.all(b["kv_scales"] == 1.0)


def test_an_export_without_kv_scales_keeps_unit_kv_scales(layouts, tmp_path):
    _, modelopt = layouts
    path = shutil.copytree(modelopt, tmp_path / "no-kv")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))},
        str(path / "model.safetensors"),
    )
    assert torch.all(load_model(path, progress=False).kv_scales == 1.0)


def _edited(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q.update(quant_algo="W4A8_AWQ"), r"quantization_config.*quant_algo: 'W4A8_AWQ' is not"),
        (lambda q: q.pop("quant_algo"), r"quantization_config.*quant_algo: None is not"),
        (
            lambda q: q.update(kv_cache_scheme={"type": "int", "num_bits": 8}),
            r"quantization_config.*kv_cache_scheme: .* is not an FP8 KV cache",
        ),
        (lambda q: q.update(quant_method="awq"), r"quantization_config.*quant_method"),
        (
            lambda q: q.update(kv_cache_scheme="NVFP4"),
            r"quantization_config.*kv_cache_scheme: 'NVFP4' is not",
        ),
        (
            lambda q: q["kv_cache_scheme"].update(dynamic=True),
            r"quantization_config.*kv_cache_scheme: .* is not an FP8 KV cache",
        ),
    ],
    ids=["w4a8", "no-algo", "int8-kv", "method", "nvfp4-kv", "dynamic-kv"],
)
def test_a_quantization_config_hy3c_does_not_read_is_named(layouts, tmp_path, edit, message):
    _, modelopt = layouts
    _edited(modelopt, tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path / "bad", progress=False)


def test_a_missing_or_misshaped_kv_scale_is_named(layouts, tmp_path):
    _, modelopt = layouts
    path = shutil.copytree(modelopt, tmp_path / "kv")
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.2.self_attn.v_proj.v_scale")
    tensors["model.layers.0.self_attn.k_proj.k_scale"] = torch.ones(3)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as raised:
        load_model(path, progress=False)
    assert "model.layers.2.self_attn.v_proj.v_scale" in str(raised.value)
    assert "model.layers.0.self_attn.k_proj.k_scale: shape [3]" in str(raised.value)


def test_a_bad_hf_quant_config_is_named(layouts, tmp_path):
    _, modelopt = layouts
    path = _legacy_export(modelopt, tmp_path / "legacy")
    (path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}})
    )
    with pytest.raises(ConfigError, match=r"hf_quant_config.json: quantization.kv_cache_quant_algo: 'NVFP4'"):
        load_model(path, progress=False)


def test_a_legacy_block_hy3c_does_not_read_names_hf_quant_config(layouts, tmp_path):
    _, modelopt = layouts
    path = _legacy_export(modelopt, tmp_path / "legacy")
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(
        ConfigError, match=r"(?s)quantization_config from hf_quant_config.json.*'W4A8_AWQ' is not"
    ):
        load_model(path, progress=False)


def test_modelopt_layout_refuses_dynamic_activations(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="static activation scales only"):
        convert_to_fp8(tiny_ckpt, tmp_path / "x", activation_scheme="dynamic", layout="modelopt")
    assert not (tmp_path / "x").exists()
