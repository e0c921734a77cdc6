"""Sharded programs: the sharding and collective-fusion passes (sites as a formula of the layer count, op
deltas), each rank's weights, and the logits of every layout on 2–4 gloo ranks against the single-rank
artifact; the layouts that cannot be built are one clear error before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hy3c.compiler.driver import CompileError, compile_artifact
from hy3c.program.artifact import ArtifactError, open_artifact
from hy3c.recipe import RecipeError, load_recipe
from tests.dist import run_ranks, run_step

LAYOUTS = {  # name → (overrides, world size)
    "tp2": (["parallel.tp=2"], 2),
    "tp4": (["parallel.tp=4"], 4),  # 2 KV heads: each replicated on 2 ranks
    "tp2_sp": (["parallel.tp=2", "parallel.sp=true"], 2),  # 7 tokens: the step is padded to 8
    "ep2": (["parallel.ep=2"], 2),
    "tp2_ep2": (["parallel.tp=2", "parallel.ep=2"], 2),
    "dp2_ep2": (["parallel.dp_attention=2", "parallel.ep=2"], 2),
}


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, tmp_path_factory) -> dict[str, tuple[Path, list]]:
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for name, (sets, _) in {"tp1": ([], 1), **LAYOUTS}.items():
        summary = compile_artifact(load_recipe("cpu-reference", sets), root / name, tiny_ckpt, progress=False)
        out[name] = (root / name, summary.results)
    return out


def rank_logits(rank: int, world_size: int, path: str, data_parallel: bool) -> torch.Tensor:
    from hy3c.runtime.artifact import load
    from hy3c.runtime.distributed import bind_process_groups

    runner = load(path, "cpu", compile=False, rank=rank)
    bind_process_groups(runner.recipe.parallel, rank)
    return run_step(runner, seed=rank if data_parallel else 0)  # DP ranks run their own requests


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_logits_equal_the_single_rank_artifact(artifacts, name):
    from hy3c.runtime.artifact import load

    single = load(artifacts["tp1"][0], "cpu", compile=False)
    world = LAYOUTS[name][1]
    data_parallel = name.startswith("dp")
    results = run_ranks(rank_logits, world, str(artifacts[name][0]), data_parallel, timeout=120)
    for rank, logits in enumerate(results):
        expected = run_step(single, seed=rank if data_parallel else 0)
        assert logits.shape == expected.shape == (2, 512)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    if data_parallel:  # the ranks really ran different requests
        assert not torch.allclose(results[0], results[1])


def _result(results, name):
    return next(r for r in results if r.name == name)


def test_pass_sites_are_a_formula_of_the_layer_count(artifacts, tiny_ckpt):
    layers, moe_layers = 3, 2  # the tiny config: 1 dense layer, then MoE layers
    tp = _result(artifacts["tp2"][1], "shard_tp")
    assert tp.matches == layers + 1  # every decoder layer, and lm_head
    assert tp.ops_delta == {"hy3.all_reduce": 2 * layers, "hy3.all_gather": 1}
    fused = _result(artifacts["tp2"][1], "fuse_allreduce_add_rms_norm")
    assert fused.matches == 2 * layers
    assert fused.ops_delta == {
        "hy3.add_rms_norm": -2 * layers,
        "hy3.all_reduce": -2 * layers,
        "hy3.all_reduce_add_rms_norm": 2 * layers,
    }
    sp = _result(artifacts["tp2_sp"][1], "shard_sp")
    assert sp.matches == 2 * layers + 2  # every norm on the residual stream, the final one, the embedding
    assert sp.ops_delta == {
        "hy3.all_reduce": -2 * layers,
        "hy3.reduce_scatter": 2 * layers,
        "hy3.all_gather": 2 * layers + 1,
        "hy3.shard_tokens": 1,
    }
    dense = 1
    overlap = _result(artifacts["tp2_sp"][1], "fuse_gemm_reduce_scatter")
    assert overlap.matches == layers + dense  # o_proj everywhere, down_proj of the dense layers
    assert overlap.ops_delta == {
        "aten.linear": -(layers + dense),
        "hy3.reduce_scatter": -(layers + dense),
        "hy3.gemm_reduce_scatter": layers + dense,
    }
    gathered = _result(artifacts["tp2_sp"][1], "fuse_allgather_gemm")
    assert gathered.matches == 2 * layers  # q|k|v and the (shared) gate|up of every layer
    assert gathered.ops_delta == {
        "aten.linear": -2 * layers,
        "hy3.all_gather": -2 * layers,
        "hy3.allgather_gemm": 2 * layers,
        "getitem": 2 * layers + moe_layers,  # the gathered rows kept where the MoE reads them
    }
    ep = _result(artifacts["ep2"][1], "shard_ep")
    assert ep.matches == moe_layers
    assert ep.ops_delta == {
        "getitem": 2 * moe_layers,
        "hy3.local_experts": moe_layers,
        "hy3.all_reduce": moe_layers,
    }
    both = _result(artifacts["tp2_ep2"][1], "shard_ep")  # the TP all-reduce sums the experts' parts too
    assert both.ops_delta == {"getitem": 2 * moe_layers, "hy3.local_experts": moe_layers}
    dp = _result(artifacts["dp2_ep2"][1], "shard_ep")
    assert dp.ops_delta == {
        "getitem": 2 * moe_layers,
        "hy3.all_gather": moe_layers,
        "hy3.local_experts": moe_layers,
        "hy3.reduce_scatter": moe_layers,
    }
    single = artifacts["tp1"][1]
    assert {
        r.name: r.status
        for r in single
        if r.name.startswith(("shard", "fuse_allreduce", "fuse_gemm", "fuse_allgather"))
    } == {
        "shard_tp": "skipped",
        "shard_sp": "skipped",
        "fuse_gemm_reduce_scatter": "skipped",
        "fuse_allgather_gemm": "skipped",
        "shard_ep": "skipped",
        "fuse_allreduce_add_rms_norm": "skipped",
    }


def _safetensors_bytes(path: Path) -> dict[str, int]:
    """tensor name → data bytes of one safetensors file (from its header)."""
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("name", ["tp2", "tp4", "ep2"])
def test_each_rank_holds_its_share_of_the_split_tensors_and_all_replicated_ones(artifacts, name):
    whole = _safetensors_bytes(artifacts["tp1"][0] / "weights" / "rank0.safetensors")
    path = artifacts[name][0]
    plan = json.loads((path / "manifest.json").read_text())["shard_plan"]
    world = LAYOUTS[name][1]
    assert plan["world_size"] == world
    split = plan["tensors"]
    assert split and all(spec["parts"] == world for spec in split.values())
    for rank in range(world):
        held = _safetensors_bytes(path / "weights" / f"rank{rank}.safetensors")
        assert set(split) <= held.keys()
        for tensor, size in held.items():
            if tensor in whole:
                assert size == _share(whole[tensor], split.get(tensor)), tensor
        replicated = sum(size for t, size in held.items() if t not in split)
        assert sum(held.values()) == replicated + sum(_share(whole[t], split[t]) for t in split)


def _share(whole_bytes: int, spec: dict | None) -> int:
    """The bytes one rank holds of a tensor: all of it (replicated), a 1/parts split, or its q heads' share
    and its KV heads (split, or one each when they are replicated)."""
    if spec is None:
        return whole_bytes
    if spec["kind"] == "split":
        return whole_bytes // spec["parts"]
    heads, kv, parts = spec["heads"], spec["kv_heads"], spec["parts"]
    local_kv = kv // parts if parts <= kv else 1
    return whole_bytes * (heads // parts + 2 * local_kv) // (heads + 2 * kv)


def test_rank_slices_reassemble_the_whole_tensor(artifacts):
    from safetensors.torch import load_file

    whole = load_file(str(artifacts["tp1"][0] / "weights" / "rank0.safetensors"))
    ranks = [load_file(str(artifacts["tp2"][0] / "weights" / f"rank{r}.safetensors")) for r in range(2)]
    o_proj = "layers.0.self_attn.o_proj.weight"  # split by input columns
    torch.testing.assert_close(torch.cat([r[o_proj] for r in ranks], 1), whole[o_proj], rtol=0, atol=0)
    gate_up = "layers.0.mlp.gate_up_proj.weight"  # each of gate | up split by rows
    halves = [r[gate_up].chunk(2) for r in ranks]
    rebuilt = torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]])
    torch.testing.assert_close(rebuilt, whole[gate_up], rtol=0, atol=0)
    head = "lm_head.weight"
    torch.testing.assert_close(torch.cat([r[head] for r in ranks]), whole[head], rtol=0, atol=0)
    router = "layers.1.mlp.router.weight"
    assert all(torch.equal(r[router], whole[router]) for r in ranks)


@pytest.mark.parametrize(
    "sets, message",
    [
        (["parallel.tp=3"], "parallel.tp=3 does not divide the model's 4 attention heads"),
        (["parallel.ep=3"], "parallel.ep=3 does not divide the model's 8 experts"),
        (["parallel.tp=8"], "parallel.tp=8 does not divide the model's 4 attention heads"),
    ],
)
def test_a_layout_the_model_cannot_take_is_one_error_before_any_weight(tiny_ckpt, tmp_path, sets, message):
    with pytest.raises(CompileError, match=message):
        compile_artifact(load_recipe("cpu-reference", sets), tmp_path / "a", tiny_ckpt, progress=False)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "sets, message",
    [
        (["parallel.tp=2", "parallel.ep=4"], r"ep=4 must be 1 or tp × dp_attention = 2 \(with tp = "),
        (["parallel.sp=true"], "sp=true needs tp > 1"),
        (["parallel.dp_attention=2"], "dp_attention > 1 needs ep"),
    ],
)
def test_an_inconsistent_parallel_block_is_a_recipe_error(sets, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe("cpu-reference", sets)


def test_a_recipe_without_the_shard_pass_is_refused(tiny_ckpt, tmp_path):
    recipe = load_recipe("cpu-reference", ["parallel.tp=2", "passes.shard_tp.enabled=false"])
    with pytest.raises(CompileError, match="passes must include shard_tp"):
        compile_artifact(recipe, tmp_path / "a", tiny_ckpt, progress=False)


def test_a_missing_rank_file_or_rank_is_refused(artifacts, tmp_path):
    import shutil

    from hy3c.runtime.artifact import check_weight_files, load

    copy = tmp_path / "tp2"
    shutil.copytree(artifacts["tp2"][0], copy)
    with pytest.raises(ArtifactError, match="rank 2 of an artifact compiled for 2 rank"):
        load(copy, "cpu", compile=False, rank=2)
    (copy / "weights" / "rank1.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"weights/rank1.safetensors: missing"):
        check_weight_files(open_artifact(copy))


@pytest.mark.slow  # ~40 s: the 80-layer model traced and sharded twice
@pytest.mark.parametrize("recipe", ["h20-w8a8c8-tp8sp", "h20-w8a8c8-dp8ep8"])
def test_the_shipped_layouts_of_the_hy3_stack_compile_the_full_model_on_the_meta_device(tmp_path, recipe):
    layers, moe_layers = 80, 79  # layer 0 is dense
    sets = ["quant.activations=dynamic"]  # a BF16 checkpoint's layout (the preset has no FP8 tensors)
    summary = compile_artifact(load_recipe(recipe, sets), tmp_path / "art", preset="full", progress=False)
    art = open_artifact(tmp_path / "art")
    assert art.world_size == 8
    report = {r.name: r for r in summary.results}
    if recipe.endswith("tp8sp"):
        assert report["shard_tp"].matches == layers + 1 and report["shard_sp"].matches == 2 * layers + 2
        assert art.kv_heads == 1 and art.recipe.parallel.token_multiple == 8
    else:
        assert report["shard_ep"].matches == moe_layers
        assert art.kv_heads == 8 and art.recipe.parallel.token_multiple == 1


def test_why_not_replays_a_sequence_parallel_artifact(artifacts, capsys):
    """`inspect ART why-not` traces the step as the compiler did (its token count a multiple of tp)."""
    from hy3c.cli import main

    path = str(artifacts["tp2_sp"][0])
    assert main(["inspect", path, "why-not", "fuse_allreduce_add_rms_norm", "--node", "embedding"]) == 0
    assert "skipped: parallel.sp: the TP all-reduces are reduce-scatters" in capsys.readouterr().out
