"""The MTP layer compiled into the artifact as its own program (`program/mtp.json`, issue 27): its
outputs against the eager `mtp_forward`, its pass sites, the manifest and `inspect`, weights stored
once, `--no-mtp`, old manifests without it, and the step program left as it was."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from safetensors import safe_open

import hy3c.runtime.artifact as artifact
from hy3c.checkpoint.loader import load_model
from hy3c.compiler.driver import compile_artifact, compile_context, mtp_absent_reason
from hy3c.compiler.inspect_artifact import inspect_command
from hy3c.compiler.trace import trace_mtp
from hy3c.config import preset_config
from hy3c.model import SeqChunk, build_step_batch
from hy3c.model.layers import NO_QUANT
from hy3c.passes.manager import PassManager
from hy3c.program.artifact import ArtifactError, open_artifact
from hy3c.program.manifest import MTP_PROGRAM_FILE, json_sha256
from hy3c.recipe import load_recipe

PAGE = 4


@pytest.fixture(scope="module")
def mtp_art(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-mtp"
    compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt)
    return out


@pytest.fixture(scope="module")
def no_mtp_art(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-no-mtp"
    compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt, with_mtp=False)
    return out


@pytest.fixture(scope="module")
def eager(tiny_ckpt):
    return load_model(tiny_ckpt, torch.float32)


def _prefill_batch(prompts: list[list[int]], logits: str = "all"):
    """One prefill chunk per prompt, each on its own pages."""
    chunks, next_page = [], 0
    for tokens in prompts:
        pages = list(range(next_page, next_page + -(-len(tokens) // PAGE)))
        next_page += len(pages)
        chunks.append(SeqChunk(tokens, 0, pages, logits))
    return build_step_batch(chunks, PAGE)


def test_manifest_records_the_draft_program(mtp_art):
    manifest = json.loads((mtp_art / "manifest.json").read_text())
    programs = manifest["programs"]
    assert programs["names"] == ["step", "mtp"] and programs["mtp_absent"] is None
    assert programs["mtp"]["file"] == MTP_PROGRAM_FILE and programs["mtp"]["depth"] == 0
    assert programs["mtp"]["inputs"][:3] == ["input_ids", "positions", "hidden_prev"]
    assert (mtp_art / MTP_PROGRAM_FILE).is_file()
    assert manifest["cache_key"]["parts"]["programs"] == {"mtp": programs["mtp"]["sha256"]}
    sites = programs["pass_sites"]
    assert sites["mtp"]["fuse_qknorm_rope_kv"] == 1 and sites["step"]["fuse_qknorm_rope_kv"] == 3
    assert open_artifact(mtp_art).has_mtp


def test_inspect_passes_shows_each_program(mtp_art, no_mtp_art):
    text = inspect_command(mtp_art, "passes")
    step, mtp = text.split("program mtp")
    assert step.startswith("program step") and "fuse_qknorm_rope_kv" in step
    assert "(depth 0, program/mtp.json)" in mtp and "fuse_moe" in mtp
    assert "no draft program: compiled with --no-mtp" in inspect_command(no_mtp_art, "passes")


def test_shared_weights_are_stored_once(mtp_art):
    step = json.loads((mtp_art / "program/step.json").read_text())["params"]
    mtp = json.loads((mtp_art / MTP_PROGRAM_FILE).read_text())["params"]
    shared = set(step) & set(mtp)
    assert {"embed_tokens.weight", "lm_head.weight", "kv_scales"} <= shared
    assert all(not name.startswith("layers.") for name in mtp)
    names = []
    for file in sorted((mtp_art / "weights").glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names += list(f.keys())
    assert Counter(names).most_common(1)[0][1] == 1  # every tensor once
    assert set(names) == set(step) | set(mtp)


def test_draft_equals_eager_mtp_forward(mtp_art, eager):
    runner = artifact.load(mtp_art, "cpu", compile=False)
    assert runner.num_draft_layers == 1 and eager.num_draft_layers == 1
    batch = _prefill_batch([[5, 9, 2, 7, 11, 3], [4, 8, 1]])
    kv = runner.allocate_kv_cache(8, PAGE)
    kv_eager = eager.allocate_kv_cache(8, PAGE)
    logits, hidden = runner.step(batch, kv)
    want_logits, want_hidden = eager.step(batch, kv_eager)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    # the draft pass over the same positions: the successor tokens, the step's hidden rows
    draft_batch = _prefill_batch([[9, 2, 7, 11, 3, 6], [8, 1, 10]], logits="last")
    got = runner.draft(draft_batch, hidden, kv)
    with torch.no_grad():
        args = draft_batch.model_args(kv_eager)
        want = eager.mtp_forward(args[0], args[1], want_hidden, *args[2:])
    assert got[0].dtype == torch.float32 and got[0].shape == (2, eager.config.vocab_size)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager.draft(draft_batch, want_hidden, kv_eager)[0], want[0])
    # the MTP layer wrote its own KV layer (num_hidden_layers), in both caches alike
    layer = eager.config.num_hidden_layers
    assert kv[layer].abs().sum() > 0
    torch.testing.assert_close(kv, kv_eager, rtol=1e-5, atol=1e-5)


def test_step_program_unchanged_by_the_draft_program(mtp_art, no_mtp_art):
    with_mtp = json.loads((mtp_art / "program/step.json").read_text())
    without = json.loads((no_mtp_art / "program/step.json").read_text())
    assert with_mtp["nodes"] == without["nodes"]


def test_no_mtp_artifact_has_no_draft_program(no_mtp_art):
    manifest = json.loads((no_mtp_art / "manifest.json").read_text())
    assert manifest["programs"]["mtp"] is None and manifest["programs"]["names"] == ["step"]
    assert "programs" not in manifest["cache_key"]["parts"]
    assert not (no_mtp_art / MTP_PROGRAM_FILE).exists()
    runner = artifact.load(no_mtp_art, "cpu", compile=False)
    assert runner.num_draft_layers == 0
    with pytest.raises(RuntimeError, match="num_draft_layers is 0"):
        runner.draft(_prefill_batch([[1, 2]]), torch.zeros(2, runner.config.hidden_size), None)


def test_old_manifest_without_programs_opens(no_mtp_art, tmp_path):
    old = shutil.copytree(no_mtp_art, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["programs"]  # what an artifact written before the draft program holds
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert not open_artifact(old).has_mtp
    assert artifact.load(old, "cpu", compile=False).num_draft_layers == 0


def test_edited_draft_program_is_refused(mtp_art, tmp_path):
    art = shutil.copytree(mtp_art, tmp_path / "art")
    data = json.loads((art / MTP_PROGRAM_FILE).read_text())
    data["nodes"] = data["nodes"][:-1]
    (art / MTP_PROGRAM_FILE).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="mtp.json: sha256 differs"):
        artifact.load(art, "cpu", compile=False)


def test_draft_program_hash_is_part_of_the_cache_key(mtp_art, tmp_path):
    art = shutil.copytree(mtp_art, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["programs"]["mtp"]["sha256"] = "0" * 64
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="programs.mtp.sha256"):
        open_artifact(art)
    manifest["cache_key"]["parts"]["programs"]["mtp"] = "0" * 64  # parts agree, the key does not
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="cache_key.key"):
        open_artifact(art)
    manifest["cache_key"]["key"] = json_sha256(manifest["cache_key"]["parts"])
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="mtp.json: sha256 differs"):
        artifact.load(art, "cpu", compile=False)


def test_fp8_pass_sites_of_the_draft_program():
    """The FP8 recipe's passes over the MTP graph: every fusion the step program gets, per layer."""
    config = preset_config("tiny")
    recipe = load_recipe("h20-w8a8c8", ["quant.activations=dynamic"])
    ctx = compile_context(config, recipe, NO_QUANT)
    gm = trace_mtp(config, torch.bfloat16)
    results = {r.name: r for r in PassManager(recipe.passes, ctx, None).run(gm)}
    assert results["quantize"].matches == 6  # eh_proj, qkv, o, experts, shared gate_up and down
    assert results["fuse_qknorm_rope_kv"].matches == 1
    assert results["fuse_moe"].matches == 1
    assert results["fuse_add_rms_norm"].matches == 2
    assert results["fuse_norm_quant"].matches == 1 and results["fuse_act_quant"].matches == 1
    ops = Counter(
        str(n.target).split(".")[1]
        for n in gm.graph.nodes
        if n.op == "call_function" and "." in str(n.target)
    )
    for fused in (
        "qknorm_rope_quant_kvstore",
        "fused_moe",
        "scaled_mm",
        "add_rms_norm_quant",
        "paged_attention",
    ):
        assert ops[fused] >= 1, fused
    assert ops["attention"] == ops["kv_store"] == ops["moe_experts"] == 0
    kv_layer = next(n for n in gm.graph.nodes if "qknorm_rope_quant_kvstore" in str(n.target))
    assert config.num_hidden_layers in kv_layer.args  # the MTP layer's own KV layer


def test_sharded_recipes_compile_no_draft_program():
    config = preset_config("tiny")
    reason = mtp_absent_reason(config, load_recipe("h20-w8a8c8-tp8sp"), True)
    assert reason is not None and "sharded" in reason
    assert mtp_absent_reason(config, load_recipe("cpu-reference"), True) is None
    no_layers = config.model_copy(update={"num_nextn_predict_layers": 0})
    assert (
        mtp_absent_reason(no_layers, load_recipe("cpu-reference"), True) == "the checkpoint has no MTP layers"
    )
