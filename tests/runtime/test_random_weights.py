"""Random weights for artifacts compiled from a config preset (`hy3c.runtime.random_weights`): every
program parameter at its recorded shape and dtype, the values each kind gets, seeds (reproducible; ranks
differ on their slices and agree on replicated tensors), a preset artifact that loads and runs one step
(one rank, and tp 2 on gloo ranks), and the loader's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx

from hy3c.compiler.driver import compile_artifact
from hy3c.ops.quant import FP8_DTYPE
from hy3c.program.artifact import ArtifactError, open_artifact, read_program_file
from hy3c.program.serialize import Program
from hy3c.recipe import load_recipe
from hy3c.runtime import random_weights as rw
from hy3c.runtime.random_weights import (
    STATIC_INPUT_SCALE,
    WEIGHT_STD,
    RandomWeightsError,
    artifact_random_parameters,
    random_parameters,
    random_weights_tokenizer,
)
from tests.dist import run_ranks, run_step

PRESETS = {  # name → (recipe, overrides)
    "ref": ("cpu-reference", []),
    "ref_tp2": ("cpu-reference", ["parallel.tp=2"]),
    "fp8": ("h20-w8a8c8", ["quant.activations=dynamic"]),
    "fp8_tp2_channel": (
        "h20-w8a8c8",
        ["quant.activations=dynamic", "quant.weight_scales=channel", "parallel.tp=2"],
    ),
    "w4a8": ("h20-w4a8c8", ["target=cpu", "passes.lower.priority=[torch]", "quant.group_size=16"]),
}


@pytest.fixture(scope="module")
def presets(tmp_path_factory) -> dict[str, Path]:
    """The tiny preset compiled (no weights) with each recipe of PRESETS."""
    root = tmp_path_factory.mktemp("presets")
    for name, (recipe, sets) in PRESETS.items():
        compile_artifact(load_recipe(recipe, sets), root / name, preset="tiny", progress=False)
    return {name: root / name for name in PRESETS}


def _params(path: Path, seed: int = 0, rank: int = 0) -> tuple[Program, dict[str, torch.Tensor]]:
    art = open_artifact(path)
    program = read_program_file(art)
    return program, artifact_random_parameters(art, program, seed, rank, "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable as exact values whatever the dtype (FP8 has no equality on every build)."""
    return t.contiguous().view(torch.uint8)


def _dequantized(params: dict[str, torch.Tensor], fqn: str) -> torch.Tensor:
    scale = params[rw._fp8_scale_name(fqn)]
    return params[fqn].float() * scale.unsqueeze(-1)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_parameter_has_the_programs_shape_and_dtype_on_every_rank(presets, name):
    world = open_artifact(presets[name]).world_size
    for rank in range(world):
        program, params = _params(presets[name], rank=rank)
        assert list(params) == list(program.params)
        for fqn, (shape, dtype) in program.params.items():
            assert (list(params[fqn].shape), params[fqn].dtype) == (shape, dtype), fqn
            assert params[fqn].device.type == "cpu"
        program.bind(params)  # the loader's own check


@pytest.mark.parametrize("name", ["ref", "fp8", "fp8_tp2_channel"])
def test_each_kind_of_parameter_gets_its_values(presets, name):
    program, p = _params(presets[name])
    fp8 = [fqn for fqn, (_, dtype) in program.params.items() if dtype == FP8_DTYPE]
    assert bool(fp8) == name.startswith("fp8")
    for fqn in program.params:
        leaf = fqn.rpartition(".")[2]
        if fqn == "kv_scales" or (leaf == "weight" and "norm" in fqn.rpartition(".")[0].rpartition(".")[2]):
            assert torch.equal(p[fqn], torch.ones_like(p[fqn])), fqn
        elif leaf == "expert_bias":
            assert torch.equal(p[fqn], torch.zeros_like(p[fqn])), fqn
    for fqn in fp8:  # dequantized: std WEIGHT_STD, as the bf16 weights
        assert abs(_dequantized(p, fqn).std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD, fqn
    for fqn in ("embed_tokens.weight", "lm_head.weight", "layers.2.mlp.router.weight"):
        assert abs(p[fqn].float().std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD, fqn
    router = "layers.2.mlp.router"  # the dual-BF16 halves are split from the fp32 weight
    assert p[f"{router}.weight"].dtype == torch.float32
    hi, lo = p[f"{router}.weight_hi"].float(), p[f"{router}.weight_lo"].float()
    torch.testing.assert_close(hi + lo / 256, p[f"{router}.weight"], atol=1e-6, rtol=0)


def test_w4a8_experts_get_uniform_int4_values_and_scales_of_the_same_std(presets):
    """Packed int4 experts: every value in [-7, 7] about equally often, group scales that make the
    dequantized weights' std WEIGHT_STD; a step runs on them."""
    from hy3c.ops.quant import dequantize_int4_groups, unpack_int4
    from hy3c.runtime.artifact import load

    _, p = _params(presets["w4a8"])
    for stack in ("layers.1.mlp.experts", "layers.2.mlp.experts"):
        for which in ("w13", "w2"):
            packed, scale = p[f"{stack}.{which}"], p[f"{stack}.{which}_scale"]
            assert packed.dtype == torch.uint8 and scale.shape[-1] * 16 == 2 * packed.shape[-1]
            counts = torch.bincount((unpack_int4(packed).long() + 8).flatten(), minlength=16)
            assert counts[0] == 0 and counts[1:].min() > 0.8 * counts[1:].float().mean()  # [-7, 7]
            weights = dequantize_int4_groups(packed, scale)
            assert abs(weights.std().item() - WEIGHT_STD) < 0.1 * WEIGHT_STD
    assert run_step(load(presets["w4a8"], "cpu", compile=False, random_weights=0)).isfinite().all()


def test_the_same_seed_gives_the_same_tensors_and_another_seed_others(presets):
    _, a = _params(presets["fp8"], seed=7)
    _, b = _params(presets["fp8"], seed=7)
    _, c = _params(presets["fp8"], seed=8)
    for fqn in a:
        assert torch.equal(_bits(a[fqn]), _bits(b[fqn])), fqn
    drawn = [fqn for fqn in a if a[fqn].float().unique().numel() > 1]  # not ones, zeros, constant scales
    assert drawn and all(not torch.equal(_bits(a[fqn]), _bits(c[fqn])) for fqn in drawn)


@pytest.mark.parametrize("name", ["ref_tp2", "fp8_tp2_channel"])
def test_ranks_differ_on_their_slices_and_agree_on_replicated_tensors(presets, name):
    split = set(open_artifact(presets[name]).manifest["shard_plan"]["tensors"])
    assert split
    _, r0 = _params(presets[name], rank=0)
    _, r1 = _params(presets[name], rank=1)
    for fqn in r0:
        same = torch.equal(_bits(r0[fqn]), _bits(r1[fqn]))
        if fqn in split:
            assert not same, f"{fqn}: the ranks' slices are the same"
        else:
            assert same, f"{fqn}: replicated, but the ranks hold different values"


def _program(params: dict[str, tuple[list[int], torch.dtype]]) -> Program:
    """A program of nothing but a parameter table (all random_parameters reads)."""
    return Program(fx.Graph(), params)


def test_static_input_scales_and_chunked_fp8_weights(monkeypatch):
    monkeypatch.setattr(rw, "CHUNK_ELEMENTS", 1000)  # the 8 x 64 x 64 stack in 33 chunks
    program = _program(
        {
            "layers.1.mlp.experts.w13": ([8, 64, 64], FP8_DTYPE),
            "layers.1.mlp.experts.w13_scale": ([8, 1], torch.float32),
            "layers.1.mlp.experts.a13_scale": ([1], torch.float32),
            "layers.1.mlp.experts.a2_scale": ([1], torch.float32),
            "layers.0.self_attn.qkv_proj.weight": ([256, 64], FP8_DTYPE),
            "layers.0.self_attn.qkv_proj.weight_scale": ([256], torch.float32),
            "layers.0.self_attn.qkv_proj.input_scale": ([1], torch.float32),
        }
    )
    p = dict(random_parameters(program, seed=0))
    for leaf in ("experts.a13_scale", "experts.a2_scale", "self_attn.qkv_proj.input_scale"):
        (fqn,) = [f for f in p if f.endswith(leaf)]
        assert p[fqn].tolist() == [pytest.approx(STATIC_INPUT_SCALE)]
    w13 = _dequantized(p, "layers.1.mlp.experts.w13")
    assert abs(w13.std().item() - WEIGHT_STD) < 0.05 * WEIGHT_STD
    assert w13.std(dim=(1, 2)).min() > 0.8 * WEIGHT_STD  # every chunk drawn, none left empty


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"layers.0.mlp.down_proj.weight": ([4, 4], FP8_DTYPE)}, "no scale parameter"),
        ({"layers.0.mlp.down_proj.smooth_scale": ([4], torch.float32)}, "a scale of no FP8 weight"),
        ({"layers.0.mlp.counts": ([4], torch.int64)}, "no random-weights rule for dtype"),
    ],
)
def test_a_parameter_no_rule_fits_is_an_error_naming_it(params, message):
    with pytest.raises(RandomWeightsError, match=message) as info:
        dict(random_parameters(_program(params), seed=0))
    assert next(iter(params)) in str(info.value)


def test_building_logs_one_event(presets, hy3c_log):
    _params(presets["ref"], seed=3)
    (record,) = [r for r in hy3c_log.records if "random_weights_built" in r.getMessage()]
    assert "seed=3" in record.getMessage() and "rank=0" in record.getMessage()


def test_a_preset_artifact_runs_a_step_with_random_weights(presets):
    from hy3c.runtime.artifact import load

    logits = run_step(load(presets["ref"], "cpu", compile=False, random_weights=0))
    assert logits.shape == (2, 512) and logits.isfinite().all() and logits.std() > 0
    again = run_step(load(presets["ref"], "cpu", compile=False, random_weights=0))
    other = run_step(load(presets["ref"], "cpu", compile=False, random_weights=1))
    assert torch.equal(logits, again) and not torch.allclose(logits, other)


def rank_logits(rank: int, world_size: int, path: str) -> torch.Tensor:
    from hy3c.runtime.artifact import load
    from hy3c.runtime.distributed import bind_process_groups

    runner = load(path, "cpu", compile=False, rank=rank, random_weights=0)
    bind_process_groups(runner.recipe.parallel, rank)
    return run_step(runner)


def test_a_tp2_preset_artifact_runs_a_step_on_two_ranks(presets):
    results = run_ranks(rank_logits, 2, str(presets["ref_tp2"]), timeout=120)
    for logits in results:
        assert logits.shape == (2, 512) and logits.isfinite().all() and logits.std() > 0
    torch.testing.assert_close(results[0], results[1])  # the gathered logits of one model


def test_random_weights_on_an_artifact_with_weights_is_refused(tiny_ckpt, tmp_path):
    from hy3c.runtime.artifact import load

    out = tmp_path / "art"
    compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt, progress=False)
    with pytest.raises(ArtifactError, match="has weights; random weights are for an artifact compiled from"):
        load(out, "cpu", compile=False, random_weights=0)
    assert run_step(load(out, "cpu", compile=False)).isfinite().all()  # without: its own weights


def test_a_preset_artifact_without_random_weights_still_cannot_run(presets):
    from hy3c.runtime.artifact import load

    with pytest.raises(ArtifactError, match="it can be inspected, not run .*--random-weights SEED"):
        load(presets["ref"], "cpu", compile=False)


def test_a_preset_artifact_is_served_with_the_tiny_tokenizer_padded_to_the_vocabulary(presets):
    config = open_artifact(presets["ref"]).config
    tokenizer = random_weights_tokenizer(presets["ref"], config)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


@pytest.mark.slow
def test_every_parameter_of_the_full_model_at_tp8_has_a_rule(tmp_path):
    """The full 80-layer FP8 program of `hy3c compile --preset full --recipe h20-w8a8c8 --set
    quant.activations=dynamic --set parallel.tp=8` (~20 s to compile): a rule for each of its parameters,
    and one rank's share of the ~300 GB."""
    out = tmp_path / "full"
    sets = ["quant.activations=dynamic", "parallel.tp=8"]
    compile_artifact(load_recipe("h20-w8a8c8", sets), out, preset="full", progress=False)
    program = read_program_file(open_artifact(out))
    scales = rw._scale_rules(program.params)
    rules = {fqn: rw.parameter_rule(fqn, dtype, scales) for fqn, (_, dtype) in program.params.items()}
    assert {"fp8", "fp8_scale", "router", "router_hi", "router_lo", "ones", "zeros", "normal"} == set(
        rules.values()
    )
    assert 30 < rw.expected_bytes(program) / 2**30 < 45  # GiB on each of the 8 ranks


def test_generate_runs_a_preset_artifact_with_random_weights_from_the_command_line(presets, capsys):
    """The benchmark mode as a user runs it: `hy3c generate --artifact PRESET_ART --random-weights SEED`
    (a preset's artifact has no tokenizer: the placeholder one is built before any rank starts)."""
    from hy3c.cli import main

    argv = ["generate", "--artifact", str(presets["ref"]), "--random-weights", "0", "--prompt", "hi"]
    assert main([*argv, "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
