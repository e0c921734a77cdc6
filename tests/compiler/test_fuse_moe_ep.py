"""fuse_moe under expert parallelism: router → local_experts → experts (+ shared → add) still fuses, with
`hy3.local_experts` kept between `topk_routing` and `fused_moe`; an EP program for a GPU recipe lowers to
the Triton FusedMoE (which skips the −1 ids) and passes the program checks; the Triton FusedMoE (CPU
interpreter) in an ep = 2 program on 2 gloo ranks gives the single-rank artifact's logits."""

from __future__ import annotations

import json
import operator

import pytest
import torch

from hy3c.compiler.driver import compile_artifact
from hy3c.config import preset_config
from hy3c.passes.manager import PassManager
from hy3c.program.artifact import open_artifact, read_program_file
from hy3c.recipe import PassSpec, load_recipe
from tests.dist import run_ranks

from .conftest import make_ctx

hy3 = torch.ops.hy3
MOE_LAYERS = preset_config("tiny").layer_types.count("sparse")  # 2 of the tiny model's 3 layers

# layout → (recipe overrides, the collective between the routed experts and the shared add, or None)
EP_LAYOUTS = {
    "ep2": (["parallel.ep=2"], hy3.all_reduce.default),  # tp = 1: the routed parts all-reduced first
    "tp2_ep2": (["parallel.tp=2", "parallel.ep=2"], None),  # the TP all-reduce after the add sums them
    "dp2_ep2": (["parallel.dp_attention=2", "parallel.ep=2"], hy3.reduce_scatter.default),
}


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_fuse_moe_keeps_local_experts_between_the_routing_and_the_fused_experts(traced, layout):
    """One site per MoE layer; router_gemm → topk_routing → local_experts → fused_moe. The shared expert's
    output is folded in where the add reads the experts directly, and added after the collective that
    combines the ranks' parts otherwise (fused_moe without it; the collective and the add stay)."""
    gm, _ = traced
    sets, combine = EP_LAYOUTS[layout]
    ctx = make_ctx(preset_config("tiny"), overrides=sets)
    specs = [PassSpec(name=n) for n in ("shard_tp", "shard_ep", "fuse_moe")]
    result = PassManager(specs, ctx).run(gm)[-1]
    assert result.name == "fuse_moe" and result.matches == MOE_LAYERS
    assert sorted(s.layer for s in result.sites) == [1, 2]
    folded = {"aten.add": -MOE_LAYERS} if combine is None else {}
    assert result.ops_delta == {
        **folded,
        "hy3.router": -MOE_LAYERS,
        "hy3.moe_experts": -MOE_LAYERS,
        "hy3.router_gemm": MOE_LAYERS,
        "hy3.topk_routing": MOE_LAYERS,
        "hy3.fused_moe": MOE_LAYERS,
    }
    assert result.ops_after["hy3.local_experts"] == MOE_LAYERS
    gm.graph.lint()
    for fused in [n for n in gm.graph.nodes if n.target is hy3.fused_moe.default]:
        weights, ids = fused.args[1:3]
        assert weights.target is ids.target is operator.getitem and (weights.args[1], ids.args[1]) == (0, 1)
        local = ids.args[0]
        assert weights.args[0] is local and local.target is hy3.local_experts.default
        routing = {a.args[0] for a in local.args[:2]}
        assert len(routing) == 1 and next(iter(routing)).target is hy3.topk_routing.default
        assert next(iter(routing)).args[0].target is hy3.router_gemm.default
        shared = fused.args[9]
        if combine is None:
            assert shared is not None and shared.target is torch.ops.aten.linear.default
        else:
            assert shared is None
            (collective,) = fused.users
            assert collective.target is combine
            (add,) = collective.users
            assert add.target is torch.ops.aten.add.Tensor and add.args[0] is collective
            assert add.args[1].target is torch.ops.aten.linear.default  # the shared expert's down GEMM


def _program_nodes(path) -> list[dict]:
    manifest = json.loads((path / "manifest.json").read_text())
    return json.loads((path / manifest["program"]["file"]).read_text())["nodes"]


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_an_ep_program_for_a_gpu_recipe_lowers_to_the_triton_fused_moe(tiny_ckpt, tmp_path, layout):
    """h20-w8a8c8 with dynamic activation scales (compile only, on the CPU): fuse_moe at every MoE layer,
    hy3_triton.fused_moe reading local_experts' ids, and a program that passes the checks (which let
    only the ops that skip −1 ids take them). With ep alone the experts also read the norm's FP8 rows
    (fuse_moe_input_quant); with tp > 1 the norm is fused with the TP all-reduce and with attention data
    parallelism the experts read the all-gathered rows, so neither has the norm's FP8 rows to hand on."""
    sets = ["quant.activations=dynamic", *EP_LAYOUTS[layout][0]]
    summary = compile_artifact(load_recipe("h20-w8a8c8", sets), tmp_path / "a", tiny_ckpt, progress=False)
    report = {r.name: r for r in summary.results}
    assert report["fuse_moe"].matches == MOE_LAYERS
    assert report["fuse_moe_input_quant"].matches == (MOE_LAYERS if layout == "ep2" else 0)
    providers = report["lower"].summary["providers"]
    assert providers["hy3.fused_moe"] == {"triton": MOE_LAYERS}
    assert providers["hy3.local_experts"] == {"torch": MOE_LAYERS}
    nodes = _program_nodes(tmp_path / "a")
    by_name = {n["name"]: n for n in nodes}
    fused = [n for n in nodes if n.get("target") == "hy3_triton.fused_moe.default"]
    assert len(fused) == MOE_LAYERS
    for node in fused:
        ids = by_name[node["args"]["tuple"][2]["node"]]
        assert by_name[ids["args"]["tuple"][0]["node"]]["target"] == "hy3.local_experts.default"
    read_program_file(open_artifact(tmp_path / "a"))  # the program checks: ArtifactError if refused


def _triton_rank_logits(rank: int, world_size: int, path: str) -> torch.Tensor:
    """One rank of an ep = 2 artifact whose FusedMoE is the Triton provider, run by the CPU interpreter."""
    from hy3c.runtime.artifact import load
    from hy3c.runtime.distributed import bind_process_groups
    from tests.compiler.test_sharding import run_step
    from tests.kernels.interp_shim import install

    install()
    runner = load(path, "cpu", compile=False, rank=rank)
    bind_process_groups(runner.recipe.parallel, rank)
    return run_step(runner, seed=0)


@pytest.mark.slow  # ~20-25 s on 2 busy cores: two spawned ranks import torch and triton and load the artifact
def test_the_triton_fused_moe_skips_other_ranks_experts_on_two_ranks(tiny_ckpt, tmp_path, monkeypatch):
    """cpu-reference at ep = 2 with the Triton FusedMoE (the provider let onto the CPU, as the
    interpreter runs it): each rank's kernels see −1 for the other rank's experts, and the all-reduced
    logits equal the single-rank artifact's."""
    from dataclasses import replace

    from hy3c.kernels import registry
    from hy3c.runtime.artifact import load
    from tests.compiler.test_sharding import run_step

    patched = [
        replace(p, devices=p.devices | {"cpu"}) if p.name == "triton" else p
        for p in registry._PROVIDERS["fused_moe"]
    ]
    monkeypatch.setitem(registry._PROVIDERS, "fused_moe", patched)
    recipe = load_recipe("cpu-reference", ["parallel.ep=2", "passes.lower.priority=[triton, torch]"])
    summary = compile_artifact(recipe, tmp_path / "ep2", tiny_ckpt, progress=False)
    lowered = next(r for r in summary.results if r.name == "lower").summary["providers"]
    assert lowered["hy3.fused_moe"] == {"triton": MOE_LAYERS}
    single = compile_artifact(load_recipe("cpu-reference"), tmp_path / "tp1", tiny_ckpt, progress=False)
    expected = run_step(load(single.out, "cpu", compile=False), seed=0)
    for logits in run_ranks(_triton_rank_logits, 2, str(tmp_path / "ep2"), timeout=120):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
