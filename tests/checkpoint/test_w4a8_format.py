"""W4A8 checkpoints: compressed-tensors' pack-quantized experts written by `convert-w4a8` and read by the
loader (a round trip), compiled with and without the w4a8 recipe, and the errors of bad ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hy3c.checkpoint.int4_format import packed_to_words, words_to_packed
from hy3c.checkpoint.loader import inspect_checkpoint, load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.checkpoint.safetensors_io import CheckpointError
from hy3c.cli import main
from hy3c.compiler.driver import compile_artifact
from hy3c.config import ConfigError
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.ops.quant import pack_int4, quantize_int4_groups, unpack_int4
from hy3c.recipe import load_recipe
from hy3c.runtime.artifact import load
from tests.dist import run_step

GROUP = 16


@pytest.fixture(scope="module")
def w4a8_ckpt(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("w4a8") / "ckpt"
    args = ["convert-w4a8", "--model", str(tiny_ckpt), "--out", str(out), "--calibrator", "rtn"]
    assert main([*args, "--group-size", str(GROUP)]) == 0
    return out


def _shard(ckpt):
    (file,) = ckpt.glob("*.safetensors")
    return file


def test_compressed_tensors_words_hold_offset_nibbles_column_by_column():
    values = torch.tensor([[-8, -1, 0, 7, 3, -5, 1, 2, 6, -6, -7, 5, 0, 0, 4, -2]], dtype=torch.int8)
    words = packed_to_words(pack_int4(values))
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    for w in range(2):
        bits = int(words[0, w]) & 0xFFFFFFFF
        assert [(bits >> (4 * j)) & 0xF for j in range(8)] == [
            int(v) + 8 for v in values[0, 8 * w : 8 * w + 8]
        ]
    assert torch.equal(unpack_int4(words_to_packed(words)), values)


def test_convert_w4a8_writes_compressed_tensors_and_the_loader_reads_it_back(tiny_ckpt, w4a8_ckpt):
    config = json.loads((w4a8_ckpt / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    scheme = config["config_groups"]["group_0"]
    assert scheme["weights"] == {
        "num_bits": 4, "type": "int", "strategy": "group", "symmetric": True, "dynamic": False, "group_size": GROUP
    }  # fmt: skip
    assert (
        scheme["input_activations"]["type"] == "float" and scheme["input_activations"]["strategy"] == "token"
    )
    tensors = load_file(_shard(w4a8_ckpt))
    gate = "model.layers.1.mlp.experts.3.gate_proj"
    assert tensors[f"{gate}.weight_packed"].dtype == torch.int32
    assert tensors[f"{gate}.weight_packed"].shape == (32, 64 // 8)
    assert tensors[f"{gate}.weight_scale"].shape == (32, 64 // GROUP)
    assert tensors[f"{gate}.weight_shape"].tolist() == [32, 64]
    assert f"{gate}.weight" not in tensors and "model.layers.1.self_attn.q_proj.weight" in tensors
    bf16 = load_model(tiny_ckpt, progress=False)
    w4a8 = load_model(w4a8_ckpt, progress=False)
    layout = inspect_checkpoint(w4a8_ckpt)
    assert layout.quant.group_size == GROUP and len(layout.quant.int4_experts) == 3  # 2 MoE layers + MTP
    for name in ("layers.1.mlp.experts", "layers.2.mlp.experts", "mtp.0.layer.mlp.experts"):
        ours, theirs = w4a8.get_submodule(name), bf16.get_submodule(name)
        for weight in ("w13", "w2"):  # round-to-nearest, as the compiler quantizes a BF16 checkpoint
            packed, scale = quantize_int4_groups(getattr(theirs, weight), GROUP)
            assert torch.equal(getattr(ours, weight), packed)
            torch.testing.assert_close(getattr(ours, f"{weight}_scale"), scale, atol=0, rtol=0)
    assert torch.equal(w4a8.layers[1].self_attn.qkv_proj.weight, bf16.layers[1].self_attn.qkv_proj.weight)


def test_the_w4a8_checkpoint_compiles_and_runs_as_the_eager_model(w4a8_ckpt, tmp_path):
    """cpu-reference keeps the rest in high precision: the artifact's int4 experts (FP8 activations)
    are the eager model's, logits for logits; with the w4a8 recipe the other linears become FP8."""
    art = compile_artifact(load_recipe("cpu-reference"), tmp_path / "ref", w4a8_ckpt, progress=False).out
    runner = load(art, "cpu", compile=False)
    params = dict(runner.gm.named_parameters())
    assert params["layers.1.mlp.experts.w13"].dtype == torch.uint8
    ids = torch.arange(3, 24)[None]
    eager = model_logits(load_model(w4a8_ckpt, dtype=torch.float32, progress=False), ids)[0, -1]
    batch = build_step_batch([SeqChunk(ids[0].tolist(), 0, [1, 2], "last")], 16, "cpu")
    logits, _ = runner(*batch.model_args(runner.allocate_kv_cache(3, 16)))
    torch.testing.assert_close(logits[0].float(), eager.float(), atol=1e-4, rtol=1e-4)
    recipe = load_recipe("h20-w4a8c8", ["target=cpu", "passes.lower.priority=[torch]"])
    summary = compile_artifact(recipe, tmp_path / "w4a8", w4a8_ckpt, progress=False)
    quantize = next(r for r in summary.results if r.name == "quantize")
    assert quantize.matches == 4 * 3  # the linears of 3 layers; the experts are int4 already
    assert next(r for r in summary.results if r.name == "fuse_moe_input_quant").matches == 2
    params = dict(load(summary.out, "cpu", compile=False).gm.named_parameters())
    assert params["layers.1.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["layers.1.mlp.experts.w2_scale"].shape == (8, 64, 32 // GROUP)
    assert run_step(load(summary.out, "cpu", compile=False)).isfinite().all()


def _edit(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        data = load_file(_shard(dst))
        tensors(data)
        save_file(data, _shard(dst))
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        config(data["quantization_config"])
        (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        (
            "scale of another shape",
            CheckpointError,
            r"model.layers.1.mlp.experts.0.up_proj.weight_scale: shape \[32, 2\], expected \[32, 4\]",
        ),
        (
            "weight_shape that disagrees",
            CheckpointError,
            r"model.layers.2.mlp.experts.5.down_proj.weight_shape: \[64, 64\], expected \[64, 32\]",
        ),
        (
            "packed weight outside the experts",
            CheckpointError,
            r"int4 tensor 'model.layers.1.self_attn.o_proj.weight_packed' is not a routed expert's weight",
        ),
        ("8-bit weights", ConfigError, r"config_groups.group_0.weights: .* is not W4AFP8's"),
        ("channel strategy", ConfigError, r"config_groups.group_0.weights: .* is not W4AFP8's"),
        ("group that does not divide", CheckpointError, r"group_size 128 .* does not divide hidden_size 64"),
        (
            "group not a power of two",
            ConfigError,
            r"weights.group_size: 48 is not a power of two of at least 16",
        ),
        ("act order", ConfigError, r"weights.actorder: 'group'; hy3c reads groups in column order only"),
        (
            "another format",
            ConfigError,
            r"format: 'float-quantized'; hy3c reads compressed-tensors' 'pack-quantized'",
        ),
    ],
)
def test_a_bad_w4a8_checkpoint_is_one_error_naming_the_tensor_or_field(
    w4a8_ckpt, tmp_path, case, error, message
):
    tensors = config = None
    if case == "scale of another shape":

        def tensors(data):
            data["model.layers.1.mlp.experts.0.up_proj.weight_scale"] = torch.ones(32, 2)
    elif case == "weight_shape that disagrees":

        def tensors(data):
            data["model.layers.2.mlp.experts.5.down_proj.weight_shape"] = torch.tensor([64, 64])
    elif case == "packed weight outside the experts":

        def tensors(data):
            data["model.layers.1.self_attn.o_proj.weight_packed"] = torch.zeros(64, 16, dtype=torch.int32)
    else:

        def config(block):
            weights = block["config_groups"]["group_0"]["weights"]
            if case == "8-bit weights":
                weights["num_bits"] = 8
            elif case == "channel strategy":
                weights["strategy"] = "channel"
            elif case == "group that does not divide":
                weights["group_size"] = 128
            elif case == "group not a power of two":
                weights["group_size"] = 48
            elif case == "act order":
                weights["actorder"] = "group"
            else:
                block["format"] = "float-quantized"

    bad = _edit(w4a8_ckpt, tmp_path / "bad", tensors, config)
    with pytest.raises(error, match=message):
        load_model(bad, progress=False)


def test_convert_w4a8_refuses_a_group_that_does_not_divide_the_widths(tiny_ckpt, tmp_path, capsys):
    args = ["convert-w4a8", "--model", str(tiny_ckpt), "--out", str(tmp_path / "o"), "--calibrator", "rtn"]
    assert main([*args, "--group-size", "48"]) == 2
    assert (
        "group size 48 must be a power of two of at least 16 and divide the 64 input columns"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


def test_compile_time_w4a8_refuses_widths_the_group_does_not_divide(tiny_ckpt, tmp_path):
    from hy3c.compiler.driver import CompileError

    recipe = load_recipe("h20-w4a8c8", ["target=cpu", "passes.lower.priority=[torch]"])  # groups of 128
    with pytest.raises(CompileError, match=r"layers.1.mlp.experts.w13: W4A8 group size 128 must .* 64 input"):
        compile_artifact(recipe, tmp_path / "a", tiny_ckpt, progress=False)


def test_compile_time_w4a8_equals_the_round_to_nearest_checkpoint(tiny_ckpt, w4a8_ckpt, tmp_path):
    """The two ways to int4 experts — the compiler's quantization of the BF16 checkpoint, and the
    converter's checkpoint read back by the loader — give the same program, logits for logits."""
    sets = ["target=cpu", "passes.lower.priority=[torch]", f"quant.group_size={GROUP}"]
    recipe = load_recipe("h20-w4a8c8", sets)
    arts = [
        compile_artifact(recipe, tmp_path / name, ckpt, progress=False).out
        for name, ckpt in (("a", tiny_ckpt), ("b", w4a8_ckpt))
    ]
    runners = [load(art, "cpu", compile=False) for art in arts]
    weights = [dict(r.gm.named_parameters()) for r in runners]
    for name in ("layers.2.mlp.experts.w13", "layers.2.mlp.experts.w13_scale"):
        assert torch.equal(weights[0][name], weights[1][name]), name
    assert torch.equal(run_step(runners[0]), run_step(runners[1]))


def test_a_w4a8_artifact_serves_a_completion_equal_to_offline_greedy_decoding(w4a8_ckpt, tmp_path):
    """`hy3c serve` end to end with the W4A8 recipe: the greedy completion over HTTP is the offline
    engine's tokens (the same program, scheduler and sampler)."""
    import httpx

    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.serve.engine.core import GenerationRequest
    from hy3c.serve.engine.offline import generate
    from hy3c.serve.engine.sampler import SamplingParams
    from hy3c.serve.http.demo import BackgroundServer
    from hy3c.serve.http.server import ServeOptions

    recipe = load_recipe("h20-w4a8c8", ["target=cpu", "passes.lower.priority=[torch]"])
    art = compile_artifact(recipe, tmp_path / "art", w4a8_ckpt, progress=False).out
    tokenizer = Hy3Tokenizer.from_dir(art)
    runner = load(art, "cpu", compile=False)
    request = GenerationRequest(
        "0", tokenizer.encode("The quick brown fox"), SamplingParams(temperature=0.0), 12
    )
    (offline,) = generate(runner, tokenizer, [request], runner.recipe.serving)
    with BackgroundServer(ServeOptions(art, port=0, kv_memory_gib=0.02)) as server:
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).json()
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["choices"][0]["text"] == offline.text


def test_groups_below_an_fp8_mma_lower_to_the_reference_on_the_gpu(tiny_ckpt, tmp_path):
    """For a CUDA target the Triton W4A8 GEMMs take groups of 32 columns or more (an FP8 MMA's K); the
    experts of groups of 16 are lowered to the torch reference instead, the reason recorded."""
    targets = {}
    for group in (16, 32):
        recipe = load_recipe("h20-w4a8c8", [f"quant.group_size={group}"])
        out = compile_artifact(recipe, tmp_path / f"g{group}", tiny_ckpt, progress=False).out
        program = (out / "program" / "step.json").read_text()
        targets[group] = {
            t for t in ("hy3.fused_moe.default", "hy3_triton.fused_moe.default") if f'"{t}"' in program
        }
        report = json.loads((out / "compile_report.json").read_text())
        notes = json.dumps(report["passes"])
        assert ("W4A8 groups of 16 columns (the Triton GEMMs need at least 32)" in notes) == (group == 16)
    assert targets == {16: {"hy3.fused_moe.default"}, 32: {"hy3_triton.fused_moe.default"}}
