import json

import pytest

from hy3c.config import ConfigError, Hy3Config, preset_config


def test_presets_have_the_real_architecture_fields():
    full = preset_config("full")
    assert (full.num_hidden_layers, full.num_experts, full.num_experts_per_tok) == (80, 192, 8)
    assert full.layer_types == ["dense"] + ["sparse"] * 79
    assert full.num_kv_layers == 81 and full.rope_theta == 11158840.0
    real = preset_config("real-shapes:4")
    assert real.num_hidden_layers == 4 and real.hidden_size == 4096 and real.num_nextn_predict_layers == 1
    tiny = preset_config("tiny")
    assert tiny.num_attention_heads > tiny.num_key_value_heads  # GQA kept
    assert tiny.layer_types[0] == "dense" and "sparse" in tiny.layer_types
    assert tiny.num_nextn_predict_layers == 1


@pytest.mark.parametrize("name", ["small", "real-shapes:", "real-shapes:0", "real-shapes:x"])
def test_unknown_preset_is_an_error(name):
    with pytest.raises(ConfigError, match="preset"):
        preset_config(name)


def _write(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_round_trip_through_config_json(tmp_path):
    cfg = preset_config("tiny")
    loaded = Hy3Config.from_dir(_write(tmp_path, cfg.to_json_dict()))
    assert loaded == cfg


def test_missing_field_is_named(tmp_path):
    data = preset_config("tiny").to_json_dict()
    del data["num_key_value_heads"]
    with pytest.raises(ConfigError, match="'num_key_value_heads' is required"):
        Hy3Config.from_dir(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("qk_norm", False, "qk_norm"),
        ("hidden_act", "gelu", "hidden_act"),
        ("tie_word_embeddings", True, "tie_word_embeddings"),
        ("hidden_size", -1, "hidden_size"),
        ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
        ("num_experts_per_tok", 99, "exceeds num_experts"),
        ("mlp_layer_types", ["dense"], "mlp_layer_types has 1 entries"),
        ("mlp_layer_types", ["sparse", "sparse", "sparse"], "disagrees with first_k_dense_replace"),
        ("rope_parameters", {"rope_theta": 1e4, "rope_type": "yarn"}, "rope_parameters.rope_type"),
        ("eos_token_id", 100000, "eos_token_id"),
        ("model_type", "llama", "model_type"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
        ("rope_theta", 5000.0, "disagrees with rope_parameters"),
        ("use_sliding_window", True, "use_sliding_window"),
        ("sliding_window", 4096, "sliding_window"),
        ("attention_bias", True, "attention_bias"),
        ("kv_lora_rank", 512, "kv_lora_rank"),
    ],
)
def test_bad_value_is_named(tmp_path, field, value, message):
    data = preset_config("tiny").to_json_dict()
    data[field] = value
    with pytest.raises(ConfigError, match=message):
        Hy3Config.from_dir(_write(tmp_path, data))


def test_legacy_rope_theta_and_first_k_dense_replace(tmp_path):
    data = preset_config("tiny").to_json_dict()
    data.pop("rope_parameters")
    data.pop("mlp_layer_types")
    data["rope_theta"] = 5000.0
    data["first_k_dense_replace"] = 2
    cfg = Hy3Config.from_dir(_write(tmp_path, data))
    assert cfg.rope_theta == 5000.0
    assert cfg.layer_types == ["dense", "dense", "sparse"]


def test_inactive_legacy_keys_are_accepted(tmp_path):
    data = preset_config("tiny").to_json_dict()
    data |= {
        "rope_scaling": None,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "attention_bias": False,
    }
    data["rope_theta"] = data["rope_parameters"]["rope_theta"]
    assert Hy3Config.from_dir(_write(tmp_path, data)).rope_theta == data["rope_theta"]


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        Hy3Config.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Hy3Config.from_dir(tmp_path)
