"""Checkpoint loading: sharding, both naming schemes, FP8, memory, and every error with its message."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.checkpoint.safetensors_io import CheckpointError
from hy3c.ops.quant import FP8_DTYPE


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _state(model):
    return {k: v.float() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_equals_single_file(make_ckpt):
    single = make_ckpt(seed=3)
    sharded = make_ckpt(seed=3, max_shard_bytes=64 << 10)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    a, b = _state(load_model(single, progress=False)), _state(load_model(sharded, progress=False))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_transformers_naming_loads_the_same_model(make_ckpt):
    hub = load_model(make_ckpt(seed=4), progress=False)
    converted = make_ckpt(seed=4, scheme="transformers")
    names = load_file(converted / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.1.mlp.gate.weight" in names
    a, b = _state(hub), _state(load_model(converted, progress=False))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fp8_checkpoint_keeps_fp8_weights_and_scales(tiny_ckpt, tmp_path):
    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    bf16 = load_model(tiny_ckpt, dtype=torch.bfloat16, progress=False)
    out = convert_to_fp8(tiny_ckpt, tmp_path / "fp8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["activation_scheme"] == "static"
    raw = load_file(out / "model.safetensors")
    assert raw["model.layers.1.self_attn.q_proj.weight"].dtype == FP8_DTYPE
    assert raw["model.layers.1.mlp.router.gate.weight"].dtype == torch.float32
    assert raw["lm_head.weight"].dtype == torch.bfloat16

    fp8 = load_model(out, dtype=torch.bfloat16, progress=False)
    attn = fp8.layers[1].self_attn.qkv_proj
    assert attn.weight.dtype == FP8_DTYPE and attn.input_scale is not None
    q, k = fp8.config.q_size, fp8.config.kv_size
    assert torch.all(attn.weight_scale[:q] == raw["model.layers.1.self_attn.q_proj.weight_scale"])
    assert torch.all(attn.weight_scale[q : q + k] == raw["model.layers.1.self_attn.k_proj.weight_scale"])
    experts = fp8.layers[1].mlp.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale.shape == (8, 64)
    assert fp8.mtp[0].eh_proj.is_fp8 and not fp8.lm_head.is_fp8
    kv_raw = load_file(out / "kv_cache_scales.safetensors")
    assert fp8.kv_scales[2, 1] == kv_raw["model.layers.2.self_attn.v_cache.scale"]

    ids = torch.randint(0, 512, (2, 48))
    ref, quant = model_logits(bf16, ids), model_logits(fp8, ids)
    assert not torch.equal(ref, quant)
    assert (ref.argmax(-1) == quant.argmax(-1)).float().mean() > 0.75
    assert (quant - ref).norm() / ref.norm() < 0.25


def test_missing_unexpected_misshaped_and_mistyped_are_listed_together(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "bad")

    def edit(t):
        del t["model.layers.2.mlp.experts.3.up_proj.weight"]
        t["model.layers.0.mlp.bogus.weight"] = torch.zeros(2)
        t["model.layers.1.self_attn.k_norm.weight"] = torch.zeros(31)
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError) as err:
        load_model(path, progress=False)
    msg = str(err.value)
    assert "1 missing tensor(s):\n    model.layers.2.mlp.experts.3.up_proj.weight" in msg
    assert "1 unexpected tensor(s):\n    model.layers.0.mlp.bogus.weight" in msg
    assert "model.layers.1.self_attn.k_norm.weight: shape [31], expected [32]" in msg
    assert "model.norm.weight: dtype I32" in msg


def test_unexpected_tensors_can_be_allow_listed(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "extra")
    _rewrite(path, lambda t: t.update({"model.layers.3.shared_head.weight": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(path, progress=False)
    model = load_model(path, ignore_unexpected=["model.layers.3.shared_head.*"], progress=False)
    assert len(model.mtp) == 1


def test_checkpoint_without_mtp_loads_with_mtp_disabled(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "nomtp")
    _rewrite(path, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.3.")])
    with pytest.raises(CheckpointError, match="missing"):
        load_model(path, progress=False)
    assert len(load_model(path, with_mtp=False, progress=False).mtp) == 0


def test_partially_quantized_expert_stack_is_an_error(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "mixed")

    def edit(t):
        name = "model.layers.1.mlp.experts.0.gate_proj.weight"
        t[name] = t[name].float().to(FP8_DTYPE)
        t[name + "_scale"] = torch.ones(1)

    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=r"experts\.1\.gate_proj\.weight: dtype BF16, expected F8_E4M3"):
        load_model(path, progress=False)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00garbage"),
            "not a readable safetensors file",
        ),
        (
            lambda p: (p / "model.safetensors").unlink(),
            "no model.safetensors or model.safetensors.index.json",
        ),
        (lambda p: (p / "config.json").unlink(), "config.json: not found"),
        (
            lambda p: (p / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": "b.safetensors"}})
            ),
            "references b.safetensors, which does not exist",
        ),
        (lambda p: (p / "model.safetensors.index.json").write_text("[]"), "not a valid safetensors index"),
        (
            lambda p: (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]})),
            "weight_map must map tensor names",
        ),
        (
            lambda p: _rewrite(
                p, lambda t: t.update({"model.layers.1.self_attn.weight": torch.zeros(2, dtype=FP8_DTYPE)})
            ),
            "FP8 tensor 'model.layers.1.self_attn.weight' is not a linear weight",
        ),
        (
            lambda p: _rewrite(
                p, lambda t: t.update({"model.layers.x.mlp.weight": torch.zeros(2, dtype=FP8_DTYPE)})
            ),
            "FP8 tensor 'model.layers.x.mlp.weight' is not a linear weight",
        ),
    ],
)
def test_unreadable_checkpoints(tiny_ckpt, tmp_path, damage, message):
    path = _copy(tiny_ckpt, tmp_path / "damaged")
    damage(path)
    with pytest.raises((CheckpointError, ValueError), match=message):
        load_model(path, progress=False)


def test_bad_kv_scales_file_is_named(tiny_ckpt, tmp_path):
    path = _copy(tiny_ckpt, tmp_path / "kv")
    save_file(
        {"model.layers.0.self_attn.k_cache.scale": torch.ones(3)}, str(path / "kv_cache_scales.safetensors")
    )
    with pytest.raises(
        CheckpointError,
        match=r"kv_cache_scales.safetensors: model.layers.0.self_attn.k_cache.scale: shape \[3\]",
    ):
        load_model(path, progress=False)


def test_static_kv_scales_must_be_complete_and_skip_an_unloaded_mtp_layer(tiny_ckpt, tmp_path):
    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    c8 = convert_to_fp8(tiny_ckpt, tmp_path / "c8")
    without_mtp = load_model(c8, with_mtp=False, progress=False)
    assert without_mtp.kv_scales.shape[0] == without_mtp.config.num_hidden_layers
    kv_file = c8 / "kv_cache_scales.safetensors"
    scales = load_file(kv_file)
    scales.pop("model.layers.1.self_attn.v_cache.scale")
    save_file(scales, str(kv_file))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.v_cache\.scale"):
        load_model(c8, progress=False)
    kv_file.unlink()
    with pytest.raises(CheckpointError, match="kv_cache_scales.safetensors: missing"):
        load_model(c8, progress=False)


def test_peak_memory_is_the_model_plus_about_one_tensor(make_ckpt):
    """Load in a fresh process while sampling anonymous RSS: the peak stays near the model's own bytes."""
    path = make_ckpt(
        seed=5, hidden_size=256, num_experts=96, moe_intermediate_size=256, max_shard_bytes=32 << 20
    )
    script = textwrap.dedent(
        f"""
        import threading, time, torch
        from hy3c.checkpoint.loader import load_model
        def anon():
            for line in open('/proc/self/status'):
                if line.startswith('RssAnon:'):
                    return int(line.split()[1]) * 1024
        peak, stop = [0], []
        def sample():
            while not stop:
                peak[0] = max(peak[0], anon()); time.sleep(0.002)
        base = anon(); t = threading.Thread(target=sample); t.start()
        model = load_model({str(path)!r}, progress=False)
        stop.append(1); t.join()
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        print(size, peak[0] - base)
        """
    )
    # a fixed mmap threshold makes freed tensors leave the heap at once, so RSS tracks live memory
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    model_bytes, peak = map(int, out.stdout.split())
    assert model_bytes > 100 << 20  # large next to the slack below
    assert peak < model_bytes + (48 << 20), (model_bytes, peak)
