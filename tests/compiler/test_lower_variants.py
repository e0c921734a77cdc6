"""The kernel variants are compile-time choices: `lower` writes each Triton node's `pdl` and `gluon`
arguments from the recipe, the target and the node, records them in the compile report (each site's
detail, the summary, `inspect passes` / `ops`), and an override set while compiling is recorded in the
manifest. At run time an override replaces what the program says, logged once."""

from __future__ import annotations

import json

import pytest
import torch

import hy3c.kernels  # noqa: F401
from hy3c.compiler.driver import compile_artifact
from hy3c.compiler.inspect_artifact import inspect_command
from hy3c.compiler.trace import trace_step
from hy3c.config import preset_config
from hy3c.kernels import devices, overrides
from hy3c.kernels.pdl import pdl_launch
from hy3c.passes.manager import PassManager
from hy3c.recipe import load_recipe

from .conftest import make_ctx

# Hy3's shapes where the Gluon kernels care: head_dim 128, 128 query rows per prefill block (a GQA group
# of 2 × 64 tokens), expert widths that are multiples of 128
GLUON_SIZED = {
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "expert_hidden_dim": 128,
}


def _lowered(recipe: str, sizes: dict | None = None, sets=(), **extra):
    """The tiny model (with `sizes`) traced in bf16 and run through a recipe's passes (with `--set`
    overrides): (graph, lower's result)."""
    config = preset_config("tiny").model_copy(update=sizes or {})
    ctx = make_ctx(config, recipe, sets, **extra)
    gm = trace_step(config, getattr(torch, ctx.dtype))
    results = PassManager(load_recipe(recipe, list(sets)).passes, ctx).run(gm)
    return gm, next(r for r in results if r.name == "lower")


def _kwargs(gm, op: str) -> list[dict]:
    return [dict(n.kwargs) for n in gm.graph.nodes if n.op == "call_function" and str(n.target) == op]


def test_an_sm90_target_runs_gluon_where_the_kernels_take_the_node_and_pdl_everywhere():
    gm, lower = _lowered("h200-bf16", GLUON_SIZED)
    assert _kwargs(gm, "hy3_triton.paged_attention.default") == [{"gluon": True, "pdl": True}] * 3
    assert _kwargs(gm, "hy3_triton.fused_moe.default") == [{"gluon": True, "pdl": True}] * 2
    triton = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("hy3_triton")]
    assert triton and all(n.kwargs["pdl"] is True for n in triton)
    variants = lower.summary["variants"]
    assert variants["gluon"]["on"] == {"hy3.fused_moe": 2, "hy3.paged_attention": 3}
    assert variants["gluon"]["off"] == {}
    assert variants["pdl"]["on"]["hy3.paged_attention"] == 3 and "sm_90" in variants["pdl"]["rule"]
    assert lower.summary["config_tables"] == {"hy3.fused_moe": "fused_moe_h200.json"}
    moe = next(s for s in lower.sites if s.detail.startswith("hy3.fused_moe"))
    assert moe.detail == "hy3.fused_moe -> triton [pdl; gluon; configs: fused_moe_h200.json]"


def test_nodes_the_gluon_kernels_cannot_take_keep_triton_and_say_why():
    """The tiny model's head_dim 32 and 64-wide experts; the FP8 KV cache of an h20 target (the traced
    cache placeholder has the model dtype: the recipe says what the cache holds)."""
    gm, lower = _lowered("h200-bf16")
    assert {k["gluon"] for k in _kwargs(gm, "hy3_triton.paged_attention.default")} == {False}
    off = lower.summary["variants"]["gluon"]["off"]
    assert off["hy3.paged_attention"] == {"head_dim 32: 128 only": 3}
    assert "multiples of 128" in next(iter(off["hy3.fused_moe"]))
    gm, lower = _lowered("h20-w8a8c8", GLUON_SIZED, ["quant.activations=dynamic"])
    assert {k["gluon"] for k in _kwargs(gm, "hy3_triton.paged_attention.default")} == {False}
    assert lower.summary["variants"]["gluon"]["off"]["hy3.paged_attention"] == {
        "float8_e4m3fn KV cache (bfloat16 q): bf16 only": 3
    }
    assert lower.summary["variants"]["gluon"]["on"] == {"hy3.fused_moe": 2}  # e4m3 experts in a bf16 model
    assert lower.summary["config_tables"]["hy3.fused_moe"].startswith(
        "untuned defaults (no fused_moe_h20.json"
    )


@pytest.mark.parametrize("value", ["off", False])  # YAML reads a bare off as false
def test_the_recipe_turns_a_variant_off(value):
    gm, lower = _lowered("h200-bf16", GLUON_SIZED, [f"passes.lower.gluon={value}"])
    assert {k["gluon"] for k in _kwargs(gm, "hy3_triton.paged_attention.default")} == {False}
    assert {k["gluon"] for k in _kwargs(gm, "hy3_triton.fused_moe.default")} == {False}
    gluon = lower.summary["variants"]["gluon"]
    assert gluon["rule"] == "off (passes.lower.gluon)" and gluon["on"] == {}
    assert lower.summary["variants"]["pdl"]["on"]["hy3.fused_moe"] == 2


def test_a_compile_time_override_replaces_the_recipe():
    gm, lower = _lowered("h200-bf16", GLUON_SIZED, variant_overrides=((overrides.PDL, False),))
    assert lower.summary["variants"]["pdl"]["rule"] == "HY3C_PDL=0 at compile time"
    assert {k["pdl"] for k in _kwargs(gm, "hy3_triton.fused_moe.default")} == {False}
    assert {k["gluon"] for k in _kwargs(gm, "hy3_triton.fused_moe.default")} == {True}


def test_a_cpu_target_lowers_to_torch_without_variants():
    gm, lower = _lowered("cpu-reference")
    assert set().union(*map(set, lower.summary["providers"].values())) == {"torch"}
    assert lower.summary["variants"] == {} and lower.summary["config_tables"] == {}
    assert all(not n.kwargs for n in gm.graph.nodes if str(n.target).startswith("hy3."))


def test_the_report_inspect_and_the_manifest_tell_the_variants(tmp_path, monkeypatch):
    """Compiled with HY3C_GLUON=0 set: the program's nodes say gluon=False, manifest.json records the
    override, `inspect passes` and `ops` show the rule and what each op runs."""
    monkeypatch.setenv(overrides.GLUON, "0")
    art = compile_artifact(load_recipe("h200-bf16"), tmp_path / "art", preset="tiny", progress=False).out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["overrides"] == {"HY3C_GLUON": "0"}
    program = json.loads((art / "program" / "step.json").read_text())
    attention = [n for n in program["nodes"] if n.get("target") == "hy3_triton.paged_attention.default"]
    assert attention and all(n["kwargs"] == {"gluon": False, "pdl": True} for n in attention)
    passes = inspect_command(art, "passes")
    assert "gluon on×0 off×5; pdl on×" in " ".join(passes.split())
    ops = inspect_command(art, "ops")
    assert "gluon: HY3C_GLUON=0 at compile time" in ops
    moe = "hy3.fused_moe: triton×2  [pdl×2; gluon off×2: HY3C_GLUON=0 at compile time; configs: fused_moe_h200.json]"
    assert moe in ops
    monkeypatch.delenv(overrides.GLUON)
    plain = compile_artifact(load_recipe("h200-bf16"), tmp_path / "plain", preset="tiny", progress=False).out
    assert json.loads((plain / "manifest.json").read_text())["overrides"] == {}


def test_a_runtime_override_replaces_the_programs_choice_logged_once(monkeypatch, hy3c_log):
    monkeypatch.setattr(overrides, "_logged", set())
    monkeypatch.setenv(overrides.GLUON, "0")
    assert [overrides.variant(overrides.GLUON, True) for _ in range(3)] == [False] * 3
    logged = [r.getMessage() for r in hy3c_log.records if "kernel_variant_override" in r.getMessage()]
    assert len(logged) == 1 and "variable=HY3C_GLUON value=0" in logged[0]
    monkeypatch.delenv(overrides.GLUON)
    assert overrides.variant(overrides.GLUON, True)


def test_a_gpu_older_than_hopper_launches_without_pdl_logged_once(monkeypatch, hy3c_log):
    """The safety fallback for a program compiled for an sm_90 target run on another GPU (faked here)."""
    monkeypatch.delenv(overrides.PDL, raising=False)
    monkeypatch.setattr(devices, "_capability", lambda index: (8, 0))
    monkeypatch.setattr(devices, "_name", lambda index: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(devices, "_reported", set())
    a100 = torch.device("cuda", 0)
    assert pdl_launch(a100, True) == {"PDL": False, "launch_pdl": False}
    assert pdl_launch(a100, True) == {"PDL": False, "launch_pdl": False}
    logged = [r.getMessage() for r in hy3c_log.records if "kernel_variant_fallback" in r.getMessage()]
    assert len(logged) == 1 and "kernel=pdl" in logged[0] and "A100" in logged[0]
