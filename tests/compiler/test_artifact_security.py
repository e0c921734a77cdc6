"""A crafted artifact runs no code (issue 24): every variant of a hostile `program/step.json` or
manifest is refused before anything of it runs, with an error naming the node or field.

Each hostile program here is written into a copy of a real compiled artifact with every hash over it
fixed (the program's sha256, its cache-key part, the key), so the integrity checks pass and only the
program checks (`hy3c.program.allowlist`, `hy3c.program.check`) stand in the way.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import shutil
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import hy3c.runtime.artifact as artifact
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.model import SeqChunk, build_step_batch
from hy3c.program import allowlist as op_allowlist
from hy3c.program import check as program_check
from hy3c.program.artifact import ArtifactError, open_artifact
from hy3c.program.manifest import file_sha256, files_sha256, json_sha256
from hy3c.program.serialize import ProgramError, graph_to_json, read_program
from hy3c.recipe import load_recipe


@pytest.fixture(scope="module")
def cpu_art(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-cpu"
    compile_artifact(load_recipe("cpu-reference"), out, checkpoint=tiny_ckpt)
    return out


@pytest.fixture
def art(cpu_art, tmp_path):
    """A private copy of the compiled tiny artifact, to damage."""
    return shutil.copytree(cpu_art, tmp_path / "art")


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, manifest):
    (path / "manifest.json").write_text(json.dumps(manifest))


def _program(path):
    return json.loads((path / "program/step.json").read_text())


def _write_program(path, data):
    """Write a program and fix every hash over it: only the program checks can refuse it."""
    _write_program_text(path, json.dumps(data))


def _write_program_text(path, text):
    """`_write_program` for a program file's text (JSON that json.dumps would not write)."""
    file = path / "program/step.json"
    file.write_text(text)
    manifest = _manifest(path)
    manifest["program"]["sha256"] = manifest["cache_key"]["parts"]["program"] = file_sha256(file)
    manifest["cache_key"]["key"] = json_sha256(manifest["cache_key"]["parts"])
    _write_manifest(path, manifest)


def _node(data, name):
    return next(n for n in data["nodes"] if n["name"] == name)


def _index(data, name):
    return next(i for i, n in enumerate(data["nodes"]) if n["name"] == name)


def _call(name, target, *args, **kwargs):
    return {
        "name": name,
        "op": "call_function",
        "target": target,
        "args": {"tuple": list(args)},
        "kwargs": kwargs,
    }


def _insert(data, *entries):
    """Insert nodes just before the output node."""
    data["nodes"][-1:-1] = list(entries)


# ---- the from_file chain of the issue ------------------------------------------------------------

_PAYLOAD = b"import os\n"  # a line of a .pth file runs at every interpreter start


def _from_file_chain(path):
    """aten.full (one byte each) → aten.cat → aten.from_file(path, shared=True) → aten.copy_: writes
    the payload into `path`."""
    u8 = {"dtype": {"dtype": "uint8"}}
    nodes = [_call(f"byte{i}", "aten.full.default", [1], b, **u8) for i, b in enumerate(_PAYLOAD)]
    nodes.append(_call("payload", "aten.cat.default", [{"node": f"byte{i}"} for i in range(len(_PAYLOAD))]))
    nodes.append(_call("pth", "aten.from_file.default", str(path), True, len(_PAYLOAD), **u8))
    nodes.append(_call("write", "aten.copy_.default", {"node": "pth"}, {"node": "payload"}))
    return nodes


def test_the_from_file_chain_writes_a_file_when_run_directly(tmp_path):
    """The payload is real: these ops, run by torch, write the file (so refusing them matters)."""
    target = tmp_path / "direct.pth"
    data = torch.cat([torch.full([1], b, dtype=torch.uint8) for b in _PAYLOAD])
    torch.ops.aten.copy_.default(
        torch.ops.aten.from_file.default(str(target), True, len(_PAYLOAD), dtype=torch.uint8), data
    )
    assert target.read_bytes() == _PAYLOAD


def test_from_file_chain_is_refused_by_the_allow_list(art, tmp_path):
    target = tmp_path / "site-packages" / "evil.pth"
    target.parent.mkdir()
    data = _program(art)
    _insert(data, *_from_file_chain(target))
    _write_program(art, data)
    with pytest.raises(
        ArtifactError, match=r"node byte0: target 'aten.full.default' is not an op hy3c programs"
    ):
        artifact.load(art, compile=False)
    assert not target.exists()


def test_from_file_chain_is_refused_by_the_schema_check_too(art, tmp_path, monkeypatch):
    """Defense in depth: with the allow-list widened to the chain's ops and uint8, the argument check
    still refuses from_file (a program never passes a string)."""
    chain = {"aten.full.default", "aten.cat.default", "aten.from_file.default", "aten.copy_.default"}
    monkeypatch.setattr(op_allowlist, "_ALLOWED", op_allowlist._ALLOWED | chain)
    monkeypatch.setitem(op_allowlist.DTYPES, "uint8", torch.uint8)
    target = tmp_path / "evil.pth"
    data = _program(art)
    _insert(data, *_from_file_chain(target))
    _write_program(art, data)
    with pytest.raises(
        ArtifactError, match=r"node pth \(aten.from_file.default\): argument 'filename' must be str"
    ):
        artifact.load(art, compile=False)
    assert not target.exists()


# ---- targets -------------------------------------------------------------------------------------


@torch.library.custom_op("hy3_test_evil::touch", mutates_args=())
def _evil_touch(x: torch.Tensor) -> torch.Tensor:
    """An op in a hy3_-prefixed namespace that hy3c does not register: a prefix check would accept it."""
    open(os.environ["HY3C_TEST_EVIL_FILE"], "w").close()
    return x.clone()


@pytest.mark.parametrize(
    "target",
    [
        "aten.__class__.__init__",
        "aten.linear.default.__call__",
        "aten.linear.__dict__",
        "aten.linear",
        "aten.linear.out",  # a real overload of a listed op, but not the listed one
        "aten.add.Scalar",
        "aten.from_file.default",
        "aten._copy_from.default",
        "aten.set_.source_Storage",
        "aten.save.default",
        "torch.ops.aten.linear.default",
        "os.system",
        "builtins.eval",
        "aten..default",
        "hy3.dequant_fp8.default",  # registered by hy3c.ops, emitted by nothing, so not listed
        "hy3_test_evil.touch.default",
        "hy3_triton.kv_store.default",
        "",
        5,
        None,
        ["aten", "linear", "default"],
    ],
)
def test_targets_outside_the_list_are_refused(cpu_art, target, tmp_path, monkeypatch):
    monkeypatch.setenv("HY3C_TEST_EVIL_FILE", str(tmp_path / "touched"))
    data = _program(cpu_art)
    _node(data, "linear")["target"] = target
    with pytest.raises(ProgramError, match=r"^node linear: target .* is not an op hy3c programs may call"):
        read_program(data)
    assert not (tmp_path / "touched").exists()


def test_a_listed_op_whose_kernels_are_missing_is_named(cpu_art, monkeypatch):
    monkeypatch.setattr(op_allowlist, "_ALLOWED", op_allowlist._ALLOWED | {"hy3_absent.op.default"})
    data = _program(cpu_art)
    _node(data, "linear")["target"] = "hy3_absent.op.default"
    with pytest.raises(ProgramError, match="node linear: op 'hy3_absent.op.default' is not registered here"):
        read_program(data)


def test_the_compiler_refuses_to_write_an_unlisted_op(cpu_art):
    data = _program(cpu_art)
    program = read_program(data)
    params = {
        fqn: torch.empty(shape, dtype=dtype, device="meta") for fqn, (shape, dtype) in program.params.items()
    }
    gm = program.bind(params)
    next(n for n in gm.graph.nodes if n.name == "linear").target = torch.ops.aten.linear.out
    with pytest.raises(
        ProgramError, match=r"node linear: 'aten.linear.out' is not in the ops a program may call"
    ):
        graph_to_json(gm)


# ---- names and structure -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: _node(d, "linear").update(name="a-b"), r"node \?: name 'a-b' is not a plain identifier"),
        (lambda d: _node(d, "linear").update(name="1x"), "name '1x' is not a plain identifier"),
        (lambda d: _node(d, "linear").update(name="class"), "name 'class' is not a plain identifier"),
        (lambda d: _node(d, "linear").update(name="x y"), "name 'x y' is not a plain identifier"),
        (lambda d: _node(d, "linear").update(name="lïnear"), "name 'lïnear' is not a plain identifier"),
        (
            lambda d: _node(d, "linear")["kwargs"].update({"a b": 1}),
            "node linear: keyword 'a b' is not a plain",
        ),
        (lambda d: d["params"].update({"a..b": {"shape": [1], "dtype": "float32"}}), "parameter name 'a..b'"),
        (lambda d: _node(d, "linear").update(name="rms_norm"), "node rms_norm: defined twice"),
        (
            lambda d: _node(d, "input_ids").update(target="positions"),
            "node input_ids: the program's inputs must be",
        ),
        (
            lambda d: d["nodes"].insert(0, d["nodes"].pop(_index(d, "kv_scales"))),
            "node kv_scales: the program's",
        ),
        (
            lambda d: d["nodes"].append(_call("late", "aten.sym_size.int", {"node": "input_ids"}, 0)),
            "comes after",
        ),
        (lambda d: d["nodes"].pop(), "no output node"),
        (
            lambda d: _node(d, "linear").update(op="call_module"),
            "node linear: unsupported op kind 'call_module'",
        ),
        (lambda d: _node(d, "linear").update(extra=1), "node entries must be objects with keys"),
        (lambda d: _node(d, "linear").update(args=[1]), "node linear: args must be a tuple"),
        (lambda d: _node(d, "linear").update(args={"tuple": [{"node": "nope"}]}), "undefined node 'nope'"),
        (lambda d: _node(d, "linear").update(args={"tuple": [{"code": "x"}]}), "unknown argument encoding"),
        (
            lambda d: _node(d, "rms_norm")["args"]["tuple"].__setitem__(2, {"float": "1e-5"}),
            "non-finite float",
        ),
        (
            lambda d: d["params"]["norm.weight"].update(dtype="object"),
            "parameter norm.weight: dtype 'object'",
        ),
        (lambda d: d["params"]["norm.weight"].update(shape=[-1]), "parameter norm.weight: shape"),
        (
            lambda d: d["params"].update({"training": {"shape": [1], "dtype": "float32"}}),
            "parameter training",
        ),
        (lambda d: d.update(format=2), "program format 2"),
    ],
)
def test_malformed_programs_are_refused(cpu_art, edit, message):
    data = _program(cpu_art)
    edit(data)
    with pytest.raises(ProgramError, match=message):
        read_program(data)


# ---- arguments against the schema ----------------------------------------------------------------


def _arg(name, index, value):
    return lambda d: _node(d, name)["args"]["tuple"].__setitem__(index, value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _arg("reshape_3", 1, "11"),
            r"node reshape_3 \(aten.reshape.default\): argument 'shape' must be List\[int\], got '11'",
        ),
        (
            _arg("reshape_3", 1, [{"node": "embedding"}, 128]),
            "argument 'shape' must be List\\[int\\], got \\[embedding, 128\\]",
        ),
        (
            _arg("rms_norm", 2, {"node": "embedding"}),
            r"node rms_norm \(hy3.rms_norm.default\): argument 'eps' must",
        ),
        (_arg("rms_norm", 0, 3), "argument 'x' must be Tensor, got 3"),
        (_arg("rms_norm", 0, None), "argument 'x' must be Tensor, got None"),
        (_arg("rms_norm", 2, "1e-5"), "argument 'eps' must be float"),
        (
            _arg("rms_norm", 0, {"node": "sym_size_int_1"}),
            "argument 'x' must be Tensor, got node sym_size_int_1",
        ),
        (_arg("paged_attention_default", 3, 2**70), "argument 'layer' must be int"),
        (_arg("paged_attention_default", 3, True), "argument 'layer' must be int"),
        (_arg("qknorm_rope_quant_kvstore_default", 12, 1), "argument 'hadamard' must be bool"),
        (_arg("getitem_17", 1, 5), "getitem index 5 is outside node add_rms_norm_default's outputs"),
        (_arg("getitem_17", 0, {"node": "embedding"}), "node getitem_17: getitem needs"),
        (_arg("linear_1", 0, {"node": "kv_store_result"}), "undefined node"),
        (lambda d: _node(d, "linear")["kwargs"].update(bogus=1), "unexpected keyword argument 'bogus'"),
        (lambda d: _node(d, "linear")["kwargs"].update(input=1), "argument 'input' given twice"),
        (
            lambda d: _node(d, "linear")["args"]["tuple"].extend([None, 1]),
            "4 positional arguments, the op takes 3",
        ),
        (lambda d: _node(d, "linear")["args"]["tuple"].clear(), "missing argument 'input'"),
        (
            lambda d: _insert(d, _call("cast", "aten.to.dtype", {"node": "embedding"}, {"dtype": "uint8"})),
            "'uint8'",
        ),
        (
            lambda d: _insert(d, _call("cast", "aten.to.dtype", {"node": "embedding"}, 5)),
            "'dtype' must be ScalarType",
        ),
        (
            lambda d: _node(d, "output").update(args={"tuple": [{"tuple": [{"node": "linear_12"}]}]}),
            "two tensors",
        ),
    ],
)
def test_wrong_argument_types_are_refused(cpu_art, edit, message):
    data = _program(cpu_art)
    edit(data)
    with pytest.raises(ProgramError, match=message):
        read_program(data)


# ---- shapes and the hy3 ops' contracts -----------------------------------------------------------


def _constant_rows_as_queries(data):
    """Queries cut from a weight: 11 rows whatever the step's token count (equal to it at 11 tokens)."""
    data["nodes"][_index(data, "paged_attention_default") : _index(data, "paged_attention_default")] = [
        _call("cut", "aten.split_with_sizes.default", {"node": "embed_tokens_weight"}, [22, 490]),
        _call("rows", "getitem", {"node": "cut"}, 0),
        _call("fake_q", "aten.reshape.default", {"node": "rows"}, [11, 4, 32]),
    ]
    _node(data, "paged_attention_default")["args"]["tuple"][0] = {"node": "fake_q"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _arg("reshape_3", 1, [{"node": "sym_size_int_1"}, 100]),
            r"node reshape_3 \(aten.reshape.default\): incons",
        ),
        (
            _arg("linear", 1, {"node": "lm_head_weight"}),
            r"node qknorm_rope_quant_kvstore_default .*qkv width 512",
        ),
        (
            _arg("rms_norm", 1, {"node": "layers_0_self_attn_q_norm_weight"}),
            r"node rms_norm .*'weight' has shape \[32\]",
        ),
        (
            _arg("paged_attention_default", 3, 99),
            r"node paged_attention_default .*'layer' is 99, outside \[0, 4\)",
        ),
        (_arg("paged_attention_default", 3, -1), r"'layer' is -1, outside \[0, 4\)"),
        (_arg("qknorm_rope_quant_kvstore_default", 10, 8), "qkv width 256 is not"),
        (_arg("qknorm_rope_quant_kvstore_default", 11, 1), r"'num_kv_heads' is 1, outside \[2, 3\)"),
        (
            _arg("qknorm_rope_quant_kvstore_default", 6, {"node": "kv_scales"}),
            "'kv_cache' must be the step input",
        ),
        (
            _arg("qknorm_rope_quant_kvstore_default", 9, {"node": "positions"}),
            "'slot_mapping' must be the step input",
        ),
        (
            _arg("paged_attention_default", 5, {"node": "attention_plan_default"}),
            "'seq_lens' must be the step input",
        ),
        (
            _arg("paged_attention_default", 8, {"node": "linear"}),
            "argument 'plan' must be an attention_plan node",
        ),
        (_arg("attention_plan_default", 2, 0), r"'kv_tile' is 0, outside \[1"),
        (
            _arg("paged_attention_default", 3, {"node": "sym_size_int_1"}),
            "'layer' must be a constant, not node",
        ),
        (
            _constant_rows_as_queries,
            r"node paged_attention_default .*'q' has shape \[11, 4, 32\], expected \[T Hq D\] \(T=13",
        ),
        (_arg("topk_routing_default", 2, 9), r"node topk_routing_default .*'top_k' is 9, outside \[1, 9\)"),
        (
            _arg("fused_moe_default", 2, {"node": "getitem_13"}),
            "'topk_ids' is torch.float32, expected torch.int32",
        ),
        (_arg("fused_moe_default", 3, {"node": "layers_2_mlp_experts_w2"}), "'w13' has shape"),
        (
            _arg("fused_moe_default", 9, {"node": "embedding"}),
            None,
        ),  # accepted: [T, H] like the experts' output
        (
            lambda d: (
                d["nodes"].insert(
                    _index(d, "fused_moe_default"),
                    _call("ids", "aten.to.dtype", {"node": "getitem_13"}, {"dtype": "int32"}),
                ),
                _node(d, "fused_moe_default")["args"]["tuple"].__setitem__(2, {"node": "ids"}),
            ),
            "topk_ids must be the ids of a router",
        ),
        (
            lambda d: _node(d, "output").update(
                args={"tuple": [{"tuple": [{"node": "getitem_27"}, {"node": "linear_12"}]}]}
            ),
            r"node output: output logits is torch.float32\[11, 64\], expected torch.float32\[7, 512\]",
        ),
    ],
)
def test_inconsistent_shapes_are_refused(art, edit, message):
    """Loading runs the program on meta tensors first: each op's shape checks and the hy3 contracts."""
    data = _program(art)
    edit(data)
    _write_program(art, data)
    if message is None:
        artifact.load(art, compile=False)
        return
    with pytest.raises(ArtifactError, match=message):
        artifact.load(art, compile=False)


# ---- the gathers' indices ------------------------------------------------------------------------


def _computed_token_ids(data):
    """The embedding's indices computed from the token ids (input_ids + input_ids: still int64 [T])."""
    data["nodes"].insert(
        _index(data, "embedding"),
        _call("ids", "aten.add.Tensor", {"node": "input_ids"}, {"node": "input_ids"}),
    )
    _node(data, "embedding")["args"]["tuple"][1] = {"node": "ids"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _arg("embedding", 1, {"node": "positions"}),
            r"node embedding \(aten.embedding.default\): argument 'indices' must be the step input "
            r"input_ids, not positions$",
        ),
        (_arg("embedding", 1, {"node": "slot_mapping"}), "'indices' must be the step input input_ids"),
        (_computed_token_ids, "node embedding .*'indices' must be the step input input_ids, not ids"),
        (
            _arg("embedding", 0, {"node": "layers_1_mlp_router_weight"}),
            r"node embedding .*'weight' has 8 rows, expected the vocabulary's 512",
        ),
        (
            _arg("index_select", 2, {"node": "input_ids"}),
            r"node index_select \(aten.index_select.default\): argument 'index' must be the step input "
            "logits_indices, not input_ids",
        ),
        (_arg("index_select", 2, {"node": "positions"}), "'index' must be the step input logits_indices"),
        (
            _arg("index_select", 0, {"node": "embed_tokens_weight"}),
            r"node index_select .*'self' has shape \[512, 64\], expected \[T H\]",
        ),
        (_arg("index_select", 1, 1), r"node index_select .*'dim' is 1, outside \[0, 1\)"),
    ],
)
def test_gathers_index_with_what_the_compiler_passes(art, edit, message):
    """aten.embedding and aten.index_select read rows at the values of their index tensor: only the step
    input whose values the engine bounds (token ids, logits rows), over a table with those rows, passes
    (positions, say, run past a 512-row table at a 600-token prompt)."""
    data = _program(art)
    edit(data)
    _write_program(art, data)
    with pytest.raises(ArtifactError, match=message):
        artifact.load(art, compile=False)


def test_the_positions_swap_reads_past_the_table_when_unchecked(art, monkeypatch):
    """The swap is real: with the gather checks off, it loads and a 600-token prompt fails at run time
    (on CUDA it could read out of bounds instead)."""
    data = _program(art)
    _arg("embedding", 1, {"node": "positions"})(data)
    _write_program(art, data)
    monkeypatch.setattr(program_check, "GATHER_CONTRACTS", {})
    runner = artifact.load(art, compile=False)
    batch = build_step_batch([SeqChunk([1] * 600, 0, list(range(38)), "last")], 16)
    with pytest.raises(IndexError):
        runner(*batch.model_args(torch.zeros(4, 2, 38, 16, 2, 32)))


def test_every_listed_gather_has_a_contract():
    """An ATen op of the allow-list with an index tensor argument has a gather contract (so an op
    added to the list later cannot gather unchecked)."""
    gathers = {
        name
        for name in op_allowlist.ALLOWED_OPS
        if name.startswith("aten.")
        and any(a.name in ("index", "indices") for a in op_allowlist.resolve_op(name)._schema.arguments)
    }
    assert gathers == set(program_check.GATHER_CONTRACTS)


# ---- the manifest's hashes -----------------------------------------------------------------------


def _edit(path, change):
    manifest = _manifest(path)
    change(manifest)
    _write_manifest(path, manifest)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: m["model_config"].update(rms_norm_eps=1e-6),
            "field 'model_config' does not match cache_key",
        ),
        (
            lambda m: m["model_config"].update(num_hidden_layers=2, mlp_layer_types=["dense", "sparse"]),
            "'model_config'",
        ),
        (
            lambda m: m["recipe"]["serving"].update(page_size=32),
            "field 'recipe' does not match cache_key.parts.recipe",
        ),
        (lambda m: m["recipe"].update(dtype="bfloat16"), "field 'recipe' does not match"),
        (lambda m: m["versions"].update(hy3c="9.9"), "field 'versions' does not match"),
        (lambda m: m["program"].update(sha256="0" * 64), "field 'program.sha256' does not match"),
        (lambda m: m["weights"]["files"][0].update(sha256="0" * 64), "field 'weights.files' does not match"),
        (lambda m: m["kv_cache"].update(dtype="bfloat16"), "field 'kv_cache.dtype' does not match"),
        (
            lambda m: m["cache_key"]["parts"]["passes"].pop("cleanup"),
            "field 'cache_key.parts.passes' does not",
        ),
        (
            lambda m: m["cache_key"].update(key="0" * 64),
            "field 'cache_key.key' is not the hash of cache_key.parts",
        ),
        (
            lambda m: m["cache_key"]["parts"]["passes"].update(lower="x"),
            "field 'cache_key.parts.passes.lower'",
        ),
    ],
)
def test_manifest_edited_without_its_hashes_is_refused(art, change, message):
    _edit(art, change)
    with pytest.raises(ArtifactError, match=message):
        artifact.load(art, compile=False)


def test_manifest_edited_with_its_hashes_passes_the_integrity_check(art):
    """The hashes are integrity, not authenticity: a consistent edit loads (and the program checks,
    which trust no hash, are what refuse a hostile one)."""

    def change(m):
        m["recipe"]["serving"]["page_size"] = 32
        m["cache_key"]["parts"]["recipe"] = json_sha256(m["recipe"])
        m["cache_key"]["key"] = json_sha256(m["cache_key"]["parts"])

    _edit(art, change)
    assert artifact.load(art, compile=False).recipe.serving.page_size == 32


def test_weights_over_2_gib_are_hashed(art):
    """A weight file past the old 2 GiB verification limit (sparse: no disk space) with a wrong sha256
    is refused; before, only its size was checked."""
    big = art / "weights" / "big.bin"
    with open(big, "wb") as f:
        f.truncate((2 << 30) + 1)

    def change(m):
        m["weights"]["files"].append({"name": "weights/big.bin", "bytes": (2 << 30) + 1, "sha256": "0" * 64})
        m["cache_key"]["parts"]["weights"] = json_sha256([f["sha256"] for f in m["weights"]["files"]])
        m["cache_key"]["key"] = json_sha256(m["cache_key"]["parts"])

    _edit(art, change)
    with pytest.raises(ArtifactError, match=r"big.bin: sha256 differs from manifest.json"):
        artifact.load(art, compile=False)


def test_files_are_hashed_concurrently_in_order(tmp_path):
    import hashlib

    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(os.urandom(1000 + i))
    assert files_sha256(paths) == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


# ---- files outside the artifact ------------------------------------------------------------------


def _link_out(art, name, outside):
    """Move the artifact's file or directory `name` to `outside` and link it back (its content is what
    was compiled, so every hash matches: only the link check stands in the way)."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(art / name, outside)
    (art / name).symlink_to(outside)


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("program/step.json", "program/step.json"),
        ("program", "program/step.json"),
        ("weights/rank0.safetensors", "weights/rank0.safetensors"),
        ("weights", "weights/rank0.safetensors"),
        ("manifest.json", "manifest.json"),
    ],
)
def test_links_out_of_the_artifact_are_refused(art, tmp_path, name, refused):
    _link_out(art, name, tmp_path / "outside" / name)
    with pytest.raises(
        ArtifactError, match=rf"art/{re.escape(refused)}: is a link outside the artifact \(to "
    ):
        artifact.load(art, compile=False)


def test_a_weight_entry_linked_to_a_file_elsewhere_is_refused_before_any_read(art, tmp_path, monkeypatch):
    """An extra weights entry `weights/extra.bin` → a file outside (/etc/passwd, say), its size and
    sha256 right: refused before any weight file is hashed or read."""
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (art / "weights/extra.bin").symlink_to(secret)

    def change(m):
        entry = {"name": "weights/extra.bin", "bytes": secret.stat().st_size, "sha256": file_sha256(secret)}
        m["weights"]["files"].append(entry)
        m["cache_key"]["parts"]["weights"] = json_sha256([f["sha256"] for f in m["weights"]["files"]])
        m["cache_key"]["key"] = json_sha256(m["cache_key"]["parts"])

    _edit(art, change)
    hashed = []
    monkeypatch.setattr(artifact, "files_sha256", lambda paths: hashed.append(paths) or [])
    with pytest.raises(
        ArtifactError, match=r"weights/extra.bin: is a link outside the artifact \(to .*passwd\)"
    ):
        artifact.load(art, compile=False)
    assert hashed == []


def test_links_within_the_artifact_are_followed(art):
    """Symlinks are allowed while they stay inside: they reach nothing a copy of the file could not
    (the artifact's root may itself be a link, too)."""
    (art / "program/step.json").rename(art / "program/real.json")
    (art / "program/step.json").symlink_to("real.json")
    (art / "shards").mkdir()
    (art / "weights/rank0.safetensors").rename(art / "shards/rank0.safetensors")
    (art / "weights/rank0.safetensors").symlink_to("../shards/rank0.safetensors")
    (art.parent / "linked").symlink_to(art)
    assert artifact.load(art.parent / "linked", compile=False).config.vocab_size == 512


@pytest.mark.parametrize("name", ["program/step.json", "weights/rank0.safetensors", "manifest.json"])
def test_fifos_and_directories_are_refused_without_reading(art, name):
    """A FIFO would block the read forever; a directory is no file either."""
    (art / name).unlink()
    os.mkfifo(art / name)
    with pytest.raises(ArtifactError, match=rf"{re.escape(name)}: not a regular file"):
        artifact.load(art, compile=False)
    (art / name).unlink()
    (art / name).mkdir()
    with pytest.raises(ArtifactError, match=rf"{re.escape(name)}: not a regular file"):
        artifact.load(art, compile=False)


def test_a_symlink_loop_is_named(art):
    (art / "program/step.json").unlink()
    (art / "program/step.json").symlink_to("step.json")
    with pytest.raises(ArtifactError, match=r"program/step.json: unreadable \("):
        artifact.load(art, compile=False)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_tokenizer_files_linked_out_of_the_artifact_are_refused(art, tmp_path, name):
    _link_out(art, name, tmp_path / "outside" / name)
    with pytest.raises(ArtifactError, match=rf"{re.escape(name)}: is a link outside the artifact"):
        Hy3Tokenizer.from_dir(art)


def test_a_checkpoints_tokenizer_may_link_elsewhere(tiny_ckpt, tmp_path):
    """A checkpoint is not an artifact: a Hugging Face cache snapshot links its files to blobs."""
    snapshot = shutil.copytree(tiny_ckpt, tmp_path / "snapshot")
    _link_out(snapshot, "tokenizer.json", tmp_path / "blobs" / "0123abcd")
    assert Hy3Tokenizer.from_dir(snapshot).vocab_size > 0


def test_inspect_reads_nothing_linked_out_of_the_artifact(art, tmp_path):
    from hy3c.compiler.inspect_artifact import inspect_command

    _link_out(art, "compile_report.json", tmp_path / "outside" / "report.json")
    with pytest.raises(ArtifactError, match=r"compile_report.json: is a link outside the artifact"):
        inspect_command(art, "passes")
    shutil.move(tmp_path / "outside" / "report.json", art / "compile_report.json")
    (tmp_path / "outside" / "dump.txt").write_text("secret\n")
    (art / "graphs").mkdir()
    (art / "graphs/00_traced.txt").symlink_to(tmp_path / "outside" / "dump.txt")
    with pytest.raises(ArtifactError, match=r"graphs/00_traced.txt: is a link outside the artifact"):
        inspect_command(art, "graph", after="traced")


# ---- values past the limits ----------------------------------------------------------------------


def _nested(value, depth):
    for _ in range(depth):
        value = [value]
    return value


_HUGE_DIGITS = "9" * 5000  # past Python's 4300-digit limit for int(str)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _arg("reshape_3", 1, _nested(11, 600)),
            r"step.json: node reshape_3: arguments nested more than 4 lists or tuples deep$",
        ),
        (_arg("reshape_3", 1, _nested(11, 4)), "node reshape_3: arguments nested more than 4"),
        (
            lambda d: d["params"]["norm.weight"].update(shape=[2**39, 2**39]),
            r"step.json: parameter norm.weight: shape \[549755813888, 549755813888\] has more than "
            r"1099511627776 elements$",
        ),
        (
            lambda d: d["params"]["norm.weight"].update(shape=[2**41]),
            r"parameter norm.weight: shape \[2199023255552\] is not a list of at most 8 sizes "
            r"in \[0, 1099511627776\]",
        ),
        (lambda d: d["params"]["norm.weight"].update(shape=[1] * 9), "is not a list of at most 8 sizes"),
        (
            _arg("reshape_3", 1, [2**62, 2**62]),
            r"node reshape_3 \(aten.reshape.default\): inconsistent arguments",
        ),
    ],
)
def test_values_past_the_limits_are_refused(art, edit, message):
    """Limits checked before anything is made of the values: a RecursionError or a torch overflow
    would otherwise surface as such, naming neither file nor node."""
    data = _program(art)
    edit(data)
    _write_program(art, data)
    with pytest.raises(ArtifactError, match=message):
        artifact.load(art, compile=False)


@pytest.mark.parametrize("name", ["program/step.json", "manifest.json"])
def test_an_integer_past_the_digit_limit_is_corrupt_json(art, name):
    """json.loads raises ValueError (not JSONDecodeError) for a 5000-digit integer."""
    if name == "manifest.json":
        text = (art / name).read_text().replace('"format_version": 2', f'"format_version": {_HUGE_DIGITS}')
        (art / name).write_text(text)
    else:
        data = _program(art)
        _arg("reshape_3", 1, "HUGE")(data)
        _write_program_text(art, json.dumps(data).replace('"HUGE"', _HUGE_DIGITS))
    with pytest.raises(ArtifactError, match=rf"{re.escape(name)}: corrupt JSON \(Exceeds the limit"):
        artifact.load(art, compile=False)


def test_an_overflow_from_the_model_config_is_named(art):
    """A head_dim that overflows the KV cache's size (the config's validation bounds no size): the
    step inputs of the shape check fail inside torch, refused as a ProgramError all the same."""

    def change(m):
        m["model_config"]["head_dim"] = 2**58
        m["cache_key"]["parts"]["model"] = json_sha256(m["model_config"])
        m["cache_key"]["key"] = json_sha256(m["cache_key"]["parts"])

    _edit(art, change)
    with pytest.raises(
        ArtifactError, match=r"step.json: the step inputs \(from model_config\): refused \(RuntimeError: "
    ):
        artifact.load(art, compile=False)


def test_unforeseen_exceptions_name_the_node(cpu_art, monkeypatch):
    """Reading, checking and binding: whatever goes wrong inside is a ProgramError naming the node or
    stage (the specific refusals keep their own messages)."""
    from hy3c.program import serialize

    data = _program(cpu_art)
    real_check_call = serialize.check_call

    def failing_check_call(node, *args):
        if node == "linear":
            raise KeyError("boom")
        return real_check_call(node, *args)

    with monkeypatch.context() as patch:
        patch.setattr(serialize, "check_call", failing_check_call)
        with pytest.raises(ProgramError, match=r"^node linear: refused \(KeyError: 'boom'\)$"):
            read_program(data)
    program = read_program(data)
    with monkeypatch.context() as patch:
        patch.setattr(program_check, "_check_outputs", lambda *a: 1 / 0)
        with pytest.raises(
            ProgramError, match=r"^node output: refused \(ZeroDivisionError: division by zero\)$"
        ):
            program.check_shapes(open_artifact(cpu_art).config, torch.float32, torch.float32)
    params = {f: torch.empty(s, dtype=d, device="meta") for f, (s, d) in program.params.items()}

    def failing_module_tree(tensors):
        raise RuntimeError("torch says no")

    with monkeypatch.context() as patch:
        patch.setattr(serialize, "_module_tree", failing_module_tree)
        with pytest.raises(
            ProgramError, match=r"^the program's graph module: refused \(RuntimeError: torch says no\)$"
        ):
            program.bind(params)


# ---- the allow-list itself -----------------------------------------------------------------------

_FUSIONS = ("fuse_qknorm_rope_kv", "plan_attention", "fuse_moe", "fuse_add_rms_norm", "fuse_norm_quant")
_FUSIONS += ("fuse_moe_input_quant", "fuse_act_quant")


def _unfused(recipe):
    names = [p.name for p in load_recipe(recipe).passes]
    return [f"passes.{name}.enabled=false" for name in names if name in _FUSIONS]


# (recipe, overrides, source): what the shipped recipes compile to, with each provider family and the
# unfused graph (a recipe may turn any fusion off); "fp8" is an FP8 checkpoint with static scales
_EMITTERS = [
    ("cpu-reference", [], "tiny"),
    ("cpu-reference", _unfused("cpu-reference"), "tiny"),
    ("h200-bf16", [], "tiny"),
    ("h200-bf16", _unfused("h200-bf16"), "tiny"),
    ("h20-w8a8c8", [], "fp8"),
    ("h20-w8a8c8", ["passes.lower.priority=[torch]"], "fp8"),
    ("h20-w8a8c8", ["quant.activations=dynamic"], "tiny"),
    ("h20-w8a8c8", ["quant.activations=dynamic", "passes.lower.priority=[torch]"], "tiny"),
    ("h20-w8a8c8", ["quant.activations=dynamic"], "full"),
]


def _targets(program_data):
    return {n["target"] for n in program_data["nodes"] if n["op"] == "call_function"}


@pytest.fixture(scope="module")
def emitted(tiny_ckpt, tmp_path_factory):
    """recipe description → the call targets of its compiled programs, the step's and the draft's (each
    program also passes the load-time checks: the checks refuse nothing the compiler writes)."""
    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    root = tmp_path_factory.mktemp("emit")
    fp8 = convert_to_fp8(tiny_ckpt, root / "fp8")
    out = {}
    for i, (recipe, overrides, source) in enumerate(_EMITTERS):
        where = {"checkpoint": fp8} if source == "fp8" else {"preset": source}
        art_dir = compile_artifact(load_recipe(recipe, overrides), root / f"a{i}", **where).out
        data = _program(art_dir)
        opened = open_artifact(art_dir)
        dtype, kv = getattr(torch, opened.recipe.dtype), getattr(torch, opened.manifest["kv_cache"]["dtype"])
        read_program(data).check_shapes(opened.config, dtype, kv)
        targets = _targets(data)
        if opened.has_mtp:  # the draft program (MTP depth 0) is a program the compiler writes too
            mtp = json.loads((art_dir / opened.manifest["programs"]["mtp"]["file"]).read_text())
            read_program(mtp, program_check.MTP_INPUTS).check_shapes(opened.config, dtype, kv)
            targets |= _targets(mtp)
        out[f"{recipe} {overrides} ({source})"] = targets
    return out


def test_the_allow_list_is_what_the_compiler_emits(emitted):
    every = set().union(*emitted.values())
    assert every - set(op_allowlist.ALLOWED_OPS) - {op_allowlist.GETITEM} == set()
    sharded = set(op_allowlist.COLLECTIVES) | set(op_allowlist.SHARDED_KERNELS)
    never = set(op_allowlist.ALLOWED_OPS) - every - sharded
    assert never == set(), f"listed but emitted by no recipe (remove them to keep the list minimal): {never}"
    # the collectives and their kernel providers: listed for sharded programs, which none of these compiles
    # (single-rank recipes); tests/compiler/test_collective_programs.py checks and runs a sharded program
    # calling each collective, tests/kernels/test_collective_kernels.py compiles sharded programs that
    # lower them to the providers
    assert every & sharded == set()
    assert set(op_allowlist.SHARDED_KERNELS) <= set(op_allowlist.ALLOWED_OPS)
    full = next(v for k, v in emitted.items() if k.endswith("(full)"))
    tiny = next(
        v for k, v in emitted.items() if k.startswith("h20-w8a8c8 ['quant.activations=dynamic'] (tiny)")
    )
    assert full == tiny  # 80 layers call what 3 do


def test_the_listed_collectives_are_the_dialects():
    from hy3c.ops import COLLECTIVE_OPS

    assert sorted(op_allowlist.COLLECTIVES) == sorted(f"hy3.{op}.default" for op in COLLECTIVE_OPS)
    assert set(op_allowlist.COLLECTIVES) <= set(op_allowlist.ALLOWED_OPS)


def test_listed_ops_are_specific_overloads_that_touch_no_files():
    io_words = ("file", "save", "load", "storage", "set_", "copy_from", "mmap", "pickle", "open", "write")
    io_words += ("read", "print", "system", "exec", "eval", "script", "source")
    mutating = set()
    for name in op_allowlist.ALLOWED_OPS:
        _, op, overload = name.split(".")
        assert overload and not any(word in op.lower() for word in io_words), name
        target = op_allowlist.resolve_op(name)
        assert isinstance(target, torch._ops.OpOverload) and op_allowlist.op_name(target) == name
        for arg in target._schema.arguments:
            kinds = str(arg.real_type)
            assert not any(t in kinds for t in ("str", "Storage", "Generator", "Device", "Any", "Layout")), (
                name,
                arg,
            )
        if target._schema.is_mutable:
            mutating.add(op)
    assert mutating == {"kv_store", "qknorm_rope_quant_kvstore"}  # they write the KV cache, nothing else


def test_listed_custom_ops_are_the_ones_hy3c_registers():
    """The hy3 and provider ops come from hy3c's own modules (not from whatever shares a prefix), and
    each has a contract."""
    from torch._library.custom_ops import CustomOpDef

    registered = set()
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(("hy3c.ops", "hy3c.kernels")):
            for value in vars(module).values():
                if isinstance(value, CustomOpDef):
                    registered.add(value._qualname.replace("::", ".") + ".default")
    listed = {n for n in op_allowlist.ALLOWED_OPS if not n.startswith("aten.")}
    # in the dialect, emitted by nothing; the sampler runs after the program, which may not call it
    assert registered - listed == {
        "hy3.dequant_fp8.default",
        "hy3.sample.default",
        "hy3_triton.sample.default",
    }
    assert listed - registered == set()
    assert {n.split(".")[1] for n in listed} == set(program_check.CONTRACTS)


def test_step_convention_matches_the_trace():
    from hy3c.compiler.trace import example_step_inputs
    from hy3c.config import preset_config
    from hy3c.program.check import STEP_INPUTS, STEP_OUTPUTS

    assert program_check.STEP_INPUTS == STEP_INPUTS and program_check.STEP_OUTPUTS == STEP_OUTPUTS
    config = preset_config("tiny")
    ours, traced = (
        program_check.step_inputs(config, torch.bfloat16),
        example_step_inputs(config, torch.bfloat16),
    )
    assert [(t.dim(), t.dtype) for t in ours] == [(t.dim(), t.dtype) for t in traced]


# ---- fuzzing -------------------------------------------------------------------------------------


class _TopLevelCalls(TorchFunctionMode):
    """Every torch function and op the graph's code calls, before any decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[object] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


class _Dispatched(TorchDispatchMode):
    """Every op that reaches the dispatcher from the graph's level (a composite op: its decomposition)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[object] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _all_aten_overloads():
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::"):
            op, _, overload = qualified.removeprefix("aten::").partition(".")
            names.append(f"aten.{op}.{overload or 'default'}")
    return sorted(names)


_ODD_VALUES = [-1, 0, 1, 2, 3, 7, 64, 2**31, -(2**63), 2**64, 0.5, -1.0, float("nan"), True, None, "x", [1]]


def _mutate(data, rng, aten_ops):
    """One random edit of a call node: its target swapped for any ATen overload (mostly) or a listed op,
    or one of its scalar arguments replaced by an odd value."""
    node = rng.choice([n for n in data["nodes"] if n["op"] == "call_function"])
    args = node["args"]["tuple"]
    scalars = [i for i, a in enumerate(args) if not isinstance(a, dict)]
    roll = rng.random()
    if roll < 0.6:
        node["target"] = rng.choice(aten_ops)
        return "aten"
    if roll < 0.8 or not scalars:
        node["target"] = rng.choice(op_allowlist.ALLOWED_OPS)
        return "listed"
    value = rng.choice(_ODD_VALUES)
    args[rng.choice(scalars)] = {"float": "nan"} if isinstance(value, float) and value != value else value
    return "argument"


def test_fuzzed_programs_are_refused_or_run_only_listed_ops(cpu_art, tiny_ckpt):
    """A few hundred seeded mutations of the real program: each is refused with a ProgramError, or
    loads into a graph whose every call target is a listed op, and then — run on a real batch under a
    torch-function mode that sees each op the graph's code calls, before any decomposition — calls
    nothing outside the list, and nothing dispatched below it touches files or storages."""
    base = _program(cpu_art)
    opened = open_artifact(cpu_art)
    tensors = artifact._load_weights(opened, "cpu")
    allowed = {op_allowlist.resolve_op(n) for n in op_allowlist.ALLOWED_OPS}
    aten_ops = _all_aten_overloads()
    assert len(aten_ops) > 2000
    batch = build_step_batch([SeqChunk(list(range(1, 20)), 0, [0, 1], "all")], 16)
    kv = torch.zeros(4, 2, 4, 16, 2, 32)

    def run(gm):
        args = batch.model_args(kv.clone())
        # an accepted mutant may still fail at run time; what matters is what it ran
        with (
            torch.no_grad(),
            _TopLevelCalls() as calls,
            _Dispatched() as dispatched,
            contextlib.suppress(Exception),
        ):
            gm(*args)
        return calls.ops, dispatched.ops

    # the recorder sees every op the unmutated program calls (so an empty record proves nothing)
    gm = read_program(base).bind(tensors)
    calls, _ = run(gm)
    assert calls == {n.target for n in gm.graph.nodes if n.op == "call_function"} - {
        op_allowlist.resolve_op("getitem")
    }

    rng = random.Random(24)
    outcome: dict[str, int] = {}
    for _ in range(300):
        data = copy.deepcopy(base)
        kind = _mutate(data, rng, aten_ops)
        try:
            program = read_program(data)
            program.check_shapes(opened.config, torch.float32, torch.float32)
            gm = program.bind(tensors)
        except ProgramError as exc:
            stage = "allow-list" if "is not an op hy3c programs may call" in str(exc) else "checks"
            outcome[f"{kind}: refused by the {stage}"] = outcome.get(f"{kind}: refused by the {stage}", 0) + 1
            continue
        outcome[f"{kind}: accepted"] = outcome.get(f"{kind}: accepted", 0) + 1
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert all(op_allowlist.is_allowed(t) for t in targets)
        calls, dispatched = run(gm)
        assert calls <= allowed, calls - allowed
        touching = {
            str(op)
            for op in dispatched
            if any(w in str(op) for w in ("file", "storage", "save", "load", "set_"))
        }
        assert not touching
    # every layer of the checks was exercised, and some mutants were accepted and run
    assert outcome.get("aten: refused by the allow-list", 0) > 100, outcome
    assert outcome.get("listed: refused by the checks", 0) > 10, outcome
    assert outcome.get("argument: refused by the checks", 0) > 5, outcome
    assert sum(v for k, v in outcome.items() if k.endswith("accepted")) >= 5, outcome


# a JSON text spliced in for a placeholder string: what json.dumps would not write
_RAW = {
    '"RAW_DIGITS"': _HUGE_DIGITS,
    '"RAW_DEEP"': "[" * 5000 + "]" * 5000,  # past json.loads' recursion limit
    '"RAW_INF"': "1e999",
}


def _odd_argument(rng):
    """An argument value past some limit: deep lists, ints past int64, huge or odd shapes, long lists,
    or a placeholder for raw JSON (`_RAW`)."""
    return rng.choice(
        [
            lambda: _nested(rng.choice([0, 1, {"node": "input_ids"}]), rng.choice([3, 5, 60, 600])),
            lambda: rng.choice([2**63, -(2**63) - 1, 2**64, 10**30, -(10**40), 2**62]),
            lambda: rng.choice([1e308, -1e308, 5e-324]),
            lambda: [rng.choice([2**39, 2**62, 2**63 - 1, -1, 0, 2**31]) for _ in range(rng.randint(1, 9))],
            lambda: [1] * rng.choice([100, 10_000]),
            lambda: [{"node": "input_ids"}] * 200,
            lambda: rng.choice(list(_RAW)).strip('"'),
        ]
    )()


def _mutate_value(data, rng):
    """One argument of a random call (mostly a value, not a node), or a parameter's shape, replaced by
    an odd value."""
    if rng.random() < 0.15:
        spec = rng.choice(list(data["params"].values()))
        spec["shape"] = rng.choice(
            [
                [2**39, 2**39],
                [2**62],
                [2**20] * 3,
                [1] * rng.randint(9, 64),
                [-(2**63)],
                _nested(1, 600),
                "RAW_DIGITS",
            ]
        )
        return
    node = rng.choice([n for n in data["nodes"] if n["op"] in ("call_function", "output")])
    args = node["args"]["tuple"]
    values = [i for i, a in enumerate(args) if not (isinstance(a, dict) and "node" in a)]
    if values and rng.random() < 0.7:  # mostly an int, float or list argument: the checks past the schema
        args[rng.choice(values)] = _odd_argument(rng)
    elif args:
        args[rng.randrange(len(args))] = _odd_argument(rng)
    else:
        node["kwargs"]["x"] = _odd_argument(rng)


def test_fuzzed_argument_values_raise_only_artifact_errors(art):
    """Seeded argument and shape mutations past every limit, each written into the artifact with its
    hashes fixed and loaded: each loads or is refused with a one-line ArtifactError naming the program
    file and the node, parameter or JSON error; no other exception escapes `hy3c.runtime.artifact.load`."""
    base = _program(art)
    rng = random.Random(2024)
    outcome: dict[str, int] = {}
    for _ in range(150):
        data = copy.deepcopy(base)
        _mutate_value(data, rng)
        text = json.dumps(data)
        for placeholder, raw in _RAW.items():
            text = text.replace(placeholder, raw)
        _write_program_text(art, text)
        try:
            artifact.load(art, compile=False)
        except ArtifactError as exc:
            message = str(exc)
            assert "\n" not in message and len(message) < 800, message[:800]
            assert message.startswith(f"{art / 'program/step.json'}: "), message
            what = re.match(r"\S+: (node|parameter|corrupt JSON|the step inputs)", message)
            assert what is not None, message
            outcome[what.group(1)] = outcome.get(what.group(1), 0) + 1
            continue
        outcome["accepted"] = outcome.get("accepted", 0) + 1
    assert outcome.get("node", 0) > 50 and outcome.get("parameter", 0) > 5, outcome
    assert outcome.get("corrupt JSON", 0) > 3, outcome
