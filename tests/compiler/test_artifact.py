"""hy3c compile → artifact → load → run, inspect, and every bad-input case."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch

import hy3c.runtime.artifact as artifact
from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.cli import main
from hy3c.compiler.driver import CompileError, compile_artifact
from hy3c.compiler.inspect_artifact import inspect_command
from hy3c.model import SeqChunk, allocate_kv_cache, build_step_batch
from hy3c.passes.registry import check_recipe_passes
from hy3c.program.artifact import ArtifactError, open_artifact
from hy3c.program.manifest import FORMAT_VERSION, json_sha256
from hy3c.recipe import RecipeError, load_recipe
from tests.greedy import greedy


@pytest.fixture(scope="module")
def cpu_art(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-cpu"
    compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt, dump_graphs=True)
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_artifact_layout_and_manifest(cpu_art):
    for name in (
        "manifest.json",
        "program/step.json",
        "weights/rank0.safetensors",
        "compile_report.json",
        "graphs/00_traced.txt",
        "graphs/13_cleanup.txt",
        "tokenizer.json",
    ):
        assert (cpu_art / name).is_file(), name
    manifest = json.loads((cpu_art / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["versions"]["torch"] == torch.__version__
    assert manifest["recipe"]["name"] == "cpu-reference" and manifest["kv_cache"]["dtype"] == "float32"
    assert set(manifest["cache_key"]["parts"]["passes"]) == {
        "shard_tp",
        "shard_sp",
        "shard_ep",
        "fuse_allreduce_add_rms_norm",
        "fuse_gemm_reduce_scatter",
        "fuse_allgather_gemm",
        "quantize",
        "fuse_qknorm_rope_kv",
        "plan_attention",
        "fuse_moe",
        "fuse_add_rms_norm",
        "lower",
        "cleanup",
    }
    program = (cpu_art / "program/step.json").read_text()
    assert "hy3.add_rms_norm.default" in program and "pickle" not in program
    assert manifest["shard_plan"] == {"world_size": 1, "kv_heads_per_rank": 2, "tensors": {}}
    assert all(f["rank"] == 0 for f in manifest["weights"]["files"])


def _greedy_ids(model, tokenizer, prompts, max_tokens):
    return [g.token_ids for g in greedy(model, tokenizer, prompts, max_tokens)]


def test_eager_artifact_generates_what_hy3c_generate_does(cpu_art, tiny_ckpt):
    """The engine over the artifact's program and over the eager model: the same greedy tokens."""
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    runner = artifact.load(cpu_art, compile=False)
    tok = Hy3Tokenizer.from_dir(cpu_art)
    prompts = [[5, 9, 100, 7], list(range(20, 51)), [3]]
    assert _greedy_ids(runner, tok, prompts, 8) == _greedy_ids(model, tok, prompts, 8)


def test_compiled_artifact_matches_eager_without_recompiling(cpu_art, tiny_ckpt):
    from torch._dynamo.utils import counters

    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    runner = artifact.load(cpu_art, compile=True)
    counters.clear()
    for tokens in (7, 1, 64, 257):
        lengths = [tokens] if tokens < 64 else [tokens - 40, 30, 10]
        chunks, page = [], 0
        for n in lengths:
            pages = list(range(page, page + -(-n // 16)))
            page += len(pages)
            chunks.append(SeqChunk(list(range(1, n + 1)), 0, pages, "last"))
        batch = build_step_batch(chunks, 16)
        outs = [fn(*batch.model_args(fn.allocate_kv_cache(40, 16))) for fn in (runner, model)]
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # the first compiled step saved the warm-start cache in this user's cache directory, not the artifact
    assert runner.compile_cache is not None and any(runner.compile_cache.rglob("*.py"))
    assert cpu_art not in runner.compile_cache.parents and not (cpu_art / "compile_cache").exists()


def test_fp8_artifact_agrees_with_bf16_reference(tiny_ckpt, tmp_path):
    """FP8 W8A8 (dynamic per-token activations, per-channel weights). The tiny random model's top-1
    margins are small next to FP8's ~13% logit error, so agreement is required on positions the bf16
    reference decides with a margin >= 0.1 (about half of them); overall agreement is ~0.83."""
    recipe = load_recipe(
        "cpu-reference", ["dtype=bfloat16", "quant.weights=fp8", "quant.activations=dynamic"]
    )
    out = compile_artifact(recipe, tmp_path / "fp8", checkpoint=tiny_ckpt).out
    runner = artifact.load(out, compile=False)
    ids = torch.randint(0, 512, (8, 128))
    ref = model_logits(load_model(tiny_ckpt, dtype=torch.bfloat16, progress=False), ids).float()
    chunks = [SeqChunk(row.tolist(), 0, list(range(b * 8, (b + 1) * 8)), "all") for b, row in enumerate(ids)]
    logits = runner(*build_step_batch(chunks, 16).model_args(runner.allocate_kv_cache(64, 16)))[0].view(
        8, 128, -1
    )
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) >= 0.1
    hits = logits.argmax(-1) == ref.argmax(-1)
    assert hits[decided].float().mean() >= 0.95
    assert hits.float().mean() >= 0.75
    assert (logits - ref).norm() / ref.norm() < 0.2


@pytest.mark.parametrize("layout", ["angelslim", "modelopt"])
def test_static_fp8_checkpoint_compiles_with_fp8_kv(tiny_ckpt, tmp_path, layout):
    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    fp8 = convert_to_fp8(tiny_ckpt, tmp_path / "ck", layout=layout)
    recipe = load_recipe(
        "cpu-reference", ["dtype=bfloat16", "quant.weights=fp8", "quant.activations=static", "quant.kv=fp8"]
    )
    summary = compile_artifact(recipe, tmp_path / "art", checkpoint=fp8)
    quantize = next(r for r in summary.results if r.name == "quantize")
    assert quantize.status == "skipped" and "already FP8" in quantize.skip_reason
    runner = artifact.load(summary.out, compile=False)
    assert runner.kv_dtype == torch.float8_e4m3fn
    reference = load_model(fp8, dtype=torch.bfloat16, progress=False)
    assert len(_greedy_ids(runner, Hy3Tokenizer.from_dir(summary.out), [[1, 2, 3, 4]], 4)[0]) == 4
    batch = build_step_batch([SeqChunk(list(range(1, 20)), 0, [0, 1], "all")], 16)
    ours = runner(*batch.model_args(runner.allocate_kv_cache(4, 16)))[0]
    fp8_kv = allocate_kv_cache(reference.config, 4, 16, torch.float8_e4m3fn)
    with torch.no_grad():
        torch.testing.assert_close(ours, reference(*batch.model_args(fp8_kv))[0])  # same math, C8 cache
        assert not torch.allclose(ours, reference(*batch.model_args(reference.allocate_kv_cache(4, 16)))[0])


def test_dynamic_recipe_keeps_an_fp8_checkpoints_bf16_layers(tiny_ckpt, tmp_path):
    """An FP8 checkpoint's ignored_layers stay BF16: the dynamic rewrite only changes activation scales."""
    from safetensors.torch import load_file, save_file

    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    fp8 = convert_to_fp8(tiny_ckpt, tmp_path / "ck")
    tensors = load_file(fp8 / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.0.mlp.{proj}"
        scale = tensors.pop(f"{key}.weight_scale").float().reshape(-1, 1)
        tensors[f"{key}.weight"] = (tensors[f"{key}.weight"].float() * scale).to(torch.bfloat16)
        tensors.pop(f"{key}.input_scale")
    save_file(tensors, str(fp8 / "model.safetensors"))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["ignored_layers"].append("model.layers.0.mlp")
    (fp8 / "config.json").write_text(json.dumps(config))
    recipe = load_recipe(
        "cpu-reference", ["dtype=bfloat16", "quant.weights=fp8", "quant.activations=dynamic"]
    )
    summary = compile_artifact(recipe, tmp_path / "art", checkpoint=fp8)
    details = [site.detail for site in next(r for r in summary.results if r.name == "quantize").sites]
    assert details and all("static -> dynamic" in d for d in details)
    weights = load_file(summary.out / "weights/rank0.safetensors")
    assert weights["layers.0.mlp.gate_up_proj.weight"].dtype == torch.bfloat16
    assert weights["layers.1.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn


def _pass_table(report):
    return [
        {k: p[k] for k in ("name", "status", "matches", "ops_delta", "skip_reason")} for p in report["passes"]
    ]


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_golden_pass_table(preset, tmp_path, request):
    """The compile report's pass table for the tiny config and for the full 80-layer config (meta)."""
    from pathlib import Path

    recipe = load_recipe("h20-w8a8c8", ["quant.activations=dynamic"])
    out = compile_artifact(recipe, tmp_path / preset, preset=preset).out
    table = _pass_table(json.loads((out / "compile_report.json").read_text()))
    golden = Path(__file__).parent.parent / "golden" / f"pass_table_{preset}.json"
    if request.config.getoption("--update-golden", default=False):
        golden.write_text(json.dumps(table, indent=1) + "\n")
    assert table == json.loads(golden.read_text())
    layers = 3 if preset == "tiny" else 80
    fuse = next(p for p in table if p["name"] == "fuse_add_rms_norm")
    assert fuse["matches"] == 2 * layers


def test_preset_artifact_can_be_inspected_but_not_run(tmp_path):
    out = compile_artifact(load_recipe("cpu-reference"), tmp_path / "p", preset="tiny").out
    assert "fuse_add_rms_norm" in inspect_command(out, "passes")
    with pytest.raises(ArtifactError, match="without weights"):
        artifact.load(out)


def test_inspect_commands(cpu_art, capsys):
    assert main(["inspect", str(cpu_art), "passes"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^fuse_add_rms_norm +FUSE +ran +6 ", table, re.M) and "quant.weights is none" in table
    assert re.search(r"^fuse_qknorm_rope_kv +FUSE +ran +3 ", table, re.M)
    assert main(["inspect", str(cpu_art), "ops", "--after", "fuse_add_rms_norm"]) == 0
    assert re.search(r"^hy3.add_rms_norm +6$", capsys.readouterr().out, re.M)
    assert main(["inspect", str(cpu_art), "graph", "--after", "cleanup", "--layer", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and all(line.endswith("# layers.2") for line in lines)
    assert main(["inspect", str(cpu_art), "diff", "traced", "fuse_add_rms_norm"]) == 0
    diff = capsys.readouterr().out
    assert "hy3.add_rms_norm: 0 -> 6" in diff and "+%add_rms_norm" in diff
    assert main(["inspect", str(cpu_art), "why-not", "fuse_add_rms_norm", "--node", "rms_norm"]) == 0
    assert "function_mismatch: node=embedding" in capsys.readouterr().out
    assert main(["inspect", str(cpu_art), "cache-key"]) == 0
    assert '"passes"' in capsys.readouterr().out
    assert main(["inspect", str(cpu_art), "why-not", "fuse_add_rms_norm", "--node", "nope"]) == 2
    assert "no node 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["quant.kv=fp4"], "key 'quant.kv'"),
        (["quant.colour=red"], "unknown key 'quant.colour'"),
        (["passes.lower.priority=[cutlass]"], None),
        (["passes.lower.speed=11"], "invalid config of pass 'lower': unknown key 'speed'"),
        (["passes.nonexistent.enabled=false"], "no pass named 'nonexistent'"),
        (["noequals"], "expected KEY=VALUE"),
        (["parallel.tp=0"], "key 'parallel.tp'"),
        (["passes.lower.config=5"], "name a field of the pass config"),
    ],
)
def test_bad_recipe_overrides(overrides, message):
    if (
        message is None
    ):  # valid recipe, rejected when the lower pass runs (see test_lower_rejects_unknown_provider)
        check_recipe_passes(load_recipe("cpu-reference", overrides))
        return
    with pytest.raises(RecipeError, match=message):
        check_recipe_passes(load_recipe("cpu-reference", overrides))


def test_bad_recipe_files(tmp_path):
    with pytest.raises(RecipeError, match="unknown recipe 'h100'"):
        load_recipe("h100")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: cpu\npasses:\n  - name: fuse_everything\n")
    with pytest.raises(RecipeError, match="unknown pass 'fuse_everything'"):
        check_recipe_passes(load_recipe(bad))
    bad.write_text("name: x\ntarget: tpu\npasses: []\n")
    with pytest.raises(RecipeError, match="key 'target'"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")
    bad.write_text("name: x\ntarget: cpu\npasses:\n  - name: fuse_moe\n  - name: quantize\n")
    with pytest.raises(RecipeError, match="pass 'quantize' \\(QUANT stage\\) comes after 'fuse_moe'"):
        check_recipe_passes(load_recipe(bad))
    bad.write_text(
        "name: x\ntarget: cpu\npasses:\n  - {name: fuse_moe, enabled: false}\n  - name: quantize\n"
    )
    check_recipe_passes(load_recipe(bad))  # a disabled pass does not count


def test_unsupported_parallelism_and_failed_compile_leave_nothing(tiny_ckpt, tmp_path):
    with pytest.raises(CompileError, match="parallel.tp=3 does not divide"):
        compile_artifact(
            load_recipe("cpu-reference", ["parallel.tp=3"]), tmp_path / "a", checkpoint=tiny_ckpt
        )
    with pytest.raises(CompileError, match="quant.activations=static needs an FP8 checkpoint"):
        compile_artifact(load_recipe("h20-w8a8c8"), tmp_path / "b", checkpoint=tiny_ckpt)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "manifest.json").unlink(), "manifest.json: missing"),
        (lambda p: (p / "manifest.json").write_text("{"), "corrupt JSON"),
        (lambda p: _edit_manifest(p, format_version=99), "format version 99"),
        (lambda p: (p / "program/step.json").write_text('{"format": 1}'), "sha256 differs"),
        (lambda p: (p / "weights/rank0.safetensors").unlink(), "rank0.safetensors: missing"),
        (lambda p: _truncate(p / "weights/rank0.safetensors"), "truncated"),
        (lambda p: _flip_byte(p / "weights/rank0.safetensors"), "sha256 differs from manifest.json"),
        (lambda p: _edit_manifest(p, recipe={"target": "cpu"}), "field 'recipe.name': Field required"),
        (lambda p: _edit_manifest(p, kv_cache={"dtype": "int8"}), "field 'kv_cache.dtype': Input should be"),
        (lambda p: _edit_manifest(p, kv_cache=None), "field 'kv_cache': Input should be"),
        (lambda p: _edit_manifest(p, weights={}), "field 'weights.files': Field required"),
        (
            lambda p: _drop_key(p, "program", "sha256"),
            r"manifest.json: field 'program.sha256': Field required$",
        ),
        (
            lambda p: _drop_key(p, "cache_key", "parts", "model"),
            "field 'cache_key.parts.model': Field required",
        ),
        (lambda p: _drop_key(p, "cache_key"), "field 'cache_key': Field required"),
        (lambda p: _drop_key(p, "model_config"), "field 'model_config': Field required"),
        (
            lambda p: _drop_key(p, "model_config", "hidden_size"),
            "field 'model_config.hidden_size': Field required",
        ),
        (lambda p: _drop_key(p, "versions", "torch"), "field 'versions.torch': Field required"),
        (lambda p: _drop_key(p, "source", "quant_layout"), "field 'source.quant_layout': Field required"),
        (lambda p: _edit_manifest(p, program={"file": 5}), "field 'program.file': Input should be"),
        (lambda p: _edit_weight_name(p, "../../etc/passwd"), "not a path inside the artifact"),
        (lambda p: _edit_program(p, "placeholder", "target", _INJECTED), "not a plain identifier"),
        (lambda p: _edit_program(p, "call_function", "name", _INJECTED), "not a plain identifier"),
        (lambda p: _edit_program(p, "get_attr", "target", "training"), "not in the program's parameter"),
    ],
)
def test_corrupt_artifacts_are_named(cpu_art, tmp_path, damage, message):
    path = _copy(cpu_art, tmp_path / "art")
    damage(path)
    with pytest.raises(ArtifactError, match=message):
        artifact.load(path, compile=False)


def test_serving_a_checkpoint_instead_of_its_artifact_says_to_compile_it(tiny_ckpt):
    with pytest.raises(ArtifactError, match=f"manifest.json: missing .* hy3c compile --model {tiny_ckpt}"):
        open_artifact(tiny_ckpt)


def test_artifact_for_another_device_is_refused(tiny_ckpt, tmp_path):
    out = compile_artifact(load_recipe("h200-bf16"), tmp_path / "gpu", checkpoint=tiny_ckpt).out
    with pytest.raises(ArtifactError, match="compiled for target 'h200'"):
        artifact.load(out, device="cpu")


def _drop_key(path, *keys):
    data = json.loads((path / "manifest.json").read_text())
    parent = data
    for key in keys[:-1]:
        parent = parent[key]
    del parent[keys[-1]]
    (path / "manifest.json").write_text(json.dumps(data))


def _edit_manifest(path, **changes):
    data = json.loads((path / "manifest.json").read_text())
    data.update(changes)
    (path / "manifest.json").write_text(json.dumps(data))


_INJECTED = 'x=__import__("os").system("touch /tmp/hy3c-pwned")'


def _edit_program(path, op, field, value):
    """Change the first `op` node's field and re-hash: a hostile edit that passes the integrity check."""
    program = path / "program/step.json"
    data = json.loads(program.read_text())
    next(n for n in data["nodes"] if n["op"] == op)[field] = value
    program.write_text(json.dumps(data))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["program"]["sha256"] = manifest["cache_key"]["parts"]["program"] = hashlib.sha256(
        program.read_bytes()
    ).hexdigest()
    manifest["cache_key"]["key"] = json_sha256(manifest["cache_key"]["parts"])
    (path / "manifest.json").write_text(json.dumps(manifest))


def _edit_weight_name(path, name):
    data = json.loads((path / "manifest.json").read_text())
    data["weights"]["files"][0]["name"] = name
    (path / "manifest.json").write_text(json.dumps(data))


def _truncate(file):
    file.write_bytes(file.read_bytes()[:-10])


def _flip_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def test_artifact_with_triton_kernels_generates_like_eager(tiny_ckpt, tmp_path, monkeypatch):
    """The Triton providers (run by the CPU interpreter here) inside a compiled artifact: greedy output
    equals the eager model's and the program calls the kernels."""
    from dataclasses import replace

    from hy3c.kernels import registry

    triton_ops = ("paged_attention", "qknorm_rope_quant_kvstore", "router_gemm", "topk_routing", "fused_moe")
    for op in (*triton_ops, "add_rms_norm", "rms_norm", "silu_and_mul", "attention_plan"):
        patched = [
            replace(p, devices=p.devices | {"cpu"}) if p.name == "triton" else p
            for p in registry._PROVIDERS[op]
        ]
        monkeypatch.setitem(registry._PROVIDERS, op, patched)
    recipe = load_recipe("cpu-reference", ["passes.lower.priority=[triton, torch]"])
    summary = compile_artifact(recipe, tmp_path / "triton", checkpoint=tiny_ckpt)
    lowered = next(r for r in summary.results if r.name == "lower").summary["providers"]
    assert lowered["hy3.paged_attention"] == {"triton": 3}
    assert lowered["hy3.qknorm_rope_quant_kvstore"] == {"triton": 3}
    assert lowered["hy3.fused_moe"] == {"triton": 2} and lowered["hy3.topk_routing"] == {"triton": 2}
    assert lowered["hy3.add_rms_norm"] == {"triton": 6} and lowered["hy3.rms_norm"] == {"triton": 1}
    assert lowered["hy3.silu_and_mul"] == {"triton": 3} and lowered["hy3.attention_plan"] == {"triton": 1}
    runner = artifact.load(summary.out, compile=False)
    model = load_model(tiny_ckpt, dtype=torch.float32, progress=False)
    prompts = [[5, 9, 100, 7], list(range(20, 51)), [3]]
    tok = Hy3Tokenizer.from_dir(summary.out)
    assert _greedy_ids(runner, tok, prompts, 6) == _greedy_ids(model, tok, prompts, 6)


def _interrupt(monkeypatch, step):
    """Interrupt safetensors_io's rename of the new output into place ("replace"), or its removal of the
    old output ("rmtree": cut short after deleting the old manifest)."""
    import os

    from hy3c.checkpoint import safetensors_io

    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst):
        if step == "replace" and ".tmp-" in str(src):
            raise KeyboardInterrupt
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if step == "rmtree" and ".tmp-" not in str(path):
            (path / "manifest.json").unlink()
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_io.os, "replace", replace)
    monkeypatch.setattr(safetensors_io.shutil, "rmtree", rmtree)


@pytest.mark.parametrize(
    ("step", "survivor"),
    [("rmtree", "h200-bf16"), ("replace", "cpu-reference")],
    ids=["interrupted-deleting-the-old", "interrupted-renaming-the-new"],
)
def test_interrupted_overwrite_leaves_the_old_or_the_new_artifact(tmp_path, monkeypatch, step, survivor):
    """compile --overwrite moves the old artifact aside, renames the new one into place, then deletes
    the old: interrupted while deleting, the new one is in place; while renaming, the old one is back."""
    out = tmp_path / "art"
    compile_artifact(load_recipe("cpu-reference"), out, preset="tiny")
    _interrupt(monkeypatch, step)
    with pytest.raises(KeyboardInterrupt):
        compile_artifact(load_recipe("h200-bf16"), out, preset="tiny", overwrite=True)
    monkeypatch.undo()
    assert open_artifact(out).recipe.name == survivor
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the new one never lingers half-done
    leftovers = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert len(leftovers) == (step == "rmtree")  # the old one, moved aside, where the delete was cut short


def test_overwrite_replaces_a_file_and_leaves_nothing_beside_it(tmp_path):
    from hy3c.checkpoint.safetensors_io import atomic_output_dir

    out = tmp_path / "out"
    out.write_text("a file in the way")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert (out / "new").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _checkpoint_copy(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer.json", "", r"tokenizer.json: not a valid tokenizer \(EOF while parsing"),
        ("tokenizer.json", '{"version": "1.0", "model": ', r"tokenizer.json: not a valid tokenizer"),
        ("tokenizer.json", "[]", r"tokenizer.json: not a valid tokenizer"),
        ("tokenizer.json", b"\xff\xfe", r"tokenizer.json: not a valid tokenizer"),
        ("tokenizer_config.json", "{", r"tokenizer_config.json: corrupt JSON"),
        ("tokenizer_config.json", "[]", r"tokenizer_config.json: expected a JSON object"),
        ("chat_template.jinja", "{% for %}", r"chat_template.jinja: invalid chat template"),
    ],
)
def test_corrupt_tokenizer_files_are_named_at_compile_and_load(
    tiny_ckpt, tmp_path, capsys, name, content, message
):
    from hy3c.checkpoint.tokenizer import TokenizerError

    ckpt = _checkpoint_copy(tiny_ckpt, tmp_path)
    if isinstance(content, bytes):
        (ckpt / name).write_bytes(content)
    else:
        (ckpt / name).write_text(content)
    with pytest.raises(TokenizerError, match=message):
        Hy3Tokenizer.from_dir(ckpt)
    out = tmp_path / "out"
    with pytest.raises(TokenizerError, match=message):
        compile_artifact(load_recipe("cpu-reference"), out, checkpoint=ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written, nothing copied
    assert main(["compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(f"error: {re.escape(str(ckpt))}/{message}", err[0]), err


def test_a_corrupt_tokenizer_in_an_artifact_is_named_on_load(cpu_art, tmp_path, capsys):
    from hy3c.checkpoint.tokenizer import TokenizerError

    path = _copy(cpu_art, tmp_path / "art")
    (path / "tokenizer.json").write_text("")
    with pytest.raises(TokenizerError, match=f"{path / 'tokenizer.json'}: not a valid tokenizer"):
        Hy3Tokenizer.from_dir(path)
    assert main(["generate", "--artifact", str(path), "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert f"error: {path / 'tokenizer.json'}: not a valid tokenizer" in capsys.readouterr().err
