"""Each pass on the traced Hy3 graph: matched sites as a formula of the layer count, op delta,
numerical equality with the unfused graph, graph lint."""

from __future__ import annotations

import copy

import pytest
import torch

from hy3c.checkpoint.loader import load_model
from hy3c.compiler.trace import trace_step
from hy3c.config import preset_config
from hy3c.model import SeqChunk, build_step_batch
from hy3c.ops.quant import quantize_int4_groups
from hy3c.passes.graph_utils import set_attr
from hy3c.passes.manager import PassError, PassManager
from hy3c.recipe import PassSpec

from .conftest import bind_weights, make_ctx


def _run(gm, ctx, *names, **configs):
    specs = [PassSpec(name=n, config=configs.get(n, {})) for n in names]
    return PassManager(specs, ctx).run(gm)


def _step(fn, config, dtype, lengths=(5, 1, 19)):
    kv = torch.zeros(config.num_kv_layers, 2, 16, 8, config.num_key_value_heads, config.head_dim, dtype=dtype)
    chunks, page = [], 0
    for n in lengths:
        pages = list(range(page, page + -(-n // 8)))
        page += len(pages)
        chunks.append(SeqChunk(list(range(3, 3 + n)), 0, pages, "all"))
    batch = build_step_batch(chunks, 8)
    with torch.no_grad():
        return fn(*batch.model_args(kv))


@pytest.mark.parametrize("layers", [1, 3, 4])
def test_fuse_add_rms_norm_sites_delta_and_numerics(make_ckpt, layers):
    ckpt = make_ckpt(seed=6, num_hidden_layers=layers)
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    gm = trace_step(model.config, torch.float32)
    unfused = bind_weights(copy.deepcopy(gm), ckpt, torch.float32)
    (result,) = _run(gm, make_ctx(model.config), "fuse_add_rms_norm")
    n = 2 * layers  # 2 per layer, minus the first layer's input norm, plus the final norm
    assert result.matches == n
    assert result.ops_delta == {
        "aten.add": -n,
        "hy3.rms_norm": -n,
        "hy3.add_rms_norm": n,
        "getitem": 2 * n - 1,
    }
    assert result.ops_after["hy3.rms_norm"] == 1  # the first layer's input norm has no residual add
    assert {s.layer for s in result.sites} == set(range(layers)) | {None}
    gm.graph.lint()
    fused = bind_weights(gm, ckpt, torch.float32)
    for out, ref in zip(
        _step(fused, model.config, torch.float32), _step(unfused, model.config, torch.float32)
    ):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for out, ref in zip(_step(fused, model.config, torch.float32), _step(model, model.config, torch.float32)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fuse_add_rms_norm_bf16_within_one_percent(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=torch.bfloat16, progress=False)
    gm = trace_step(model.config, torch.bfloat16)
    _run(gm, make_ctx(model.config, overrides=["dtype=bfloat16"]), "fuse_add_rms_norm")
    fused = bind_weights(gm, tiny_ckpt, torch.bfloat16)
    out = _step(fused, model.config, torch.bfloat16)[1].float()
    ref = _step(model, model.config, torch.bfloat16)[1].float()
    assert (out - ref).norm() / ref.norm() < 1e-2


def test_pattern_literals_are_revalidated(traced):
    gm, _ = traced
    config = preset_config("tiny", rms_norm_eps=1e-6)  # the graph was traced with eps 1e-5
    (result,) = _run(gm, make_ctx(config), "fuse_add_rms_norm")
    assert result.matches == 0
    from hy3c.passes.fuse_add_rms_norm import FuseAddRmsNorm

    norm = next(n for n in gm.graph.nodes if n.name == "rms_norm_1")
    assert "literal eps=1e-05 differs from the model's 1e-06" in FuseAddRmsNorm().rewriter(
        make_ctx(config)
    ).explain(norm)


def test_quantize_dynamic_fp8_sites_and_delta(traced):
    gm, _ = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=fp8", "quant.activations=dynamic"])
    (result,) = _run(gm, ctx, "quantize")
    layers = cfg.num_hidden_layers
    moe = cfg.layer_types.count("sparse")
    linears = 4 * layers  # qkv, o, gate_up, down (dense or shared expert) per layer; lm_head stays bf16
    assert result.matches == linears + moe
    assert result.ops_delta == {
        "aten.linear": -linears,
        "hy3.quant_fp8_per_token": linears,
        "hy3.scaled_mm": linears,
        "getitem": 2 * linears,
    }
    params = dict(gm.named_parameters())
    assert params["layers.1.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["layers.1.self_attn.qkv_proj.weight_scale"].shape == (cfg.q_size + 2 * cfg.kv_size,)
    assert params["layers.1.mlp.experts.w13_scale"].shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size)
    assert (
        params["lm_head.weight"].dtype == torch.float32
        and params["layers.1.mlp.router.weight"].dtype == torch.float32
    )


def test_quantize_per_tensor_scales(traced):
    gm, _ = traced
    ctx = make_ctx(
        preset_config("tiny"),
        overrides=["quant.weights=fp8", "quant.activations=dynamic", "quant.weight_scales=tensor"],
    )
    _run(gm, ctx, "quantize")
    params = dict(gm.named_parameters())
    assert params["layers.0.mlp.down_proj.weight_scale"].shape == (1,)
    assert params["layers.2.mlp.experts.w2_scale"].shape == (8, 1)


def test_quantize_w4a8_int4_experts_and_fp8_linears(traced):
    """quant.weights=w4a8: the same FP8 linears as fp8 (the same op delta), and each expert stack retyped
    to packed int4 with group scales (no op added: moe_experts reads them), planned for the packager."""
    gm, ckpt = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=w4a8", "quant.activations=dynamic", "quant.group_size=16"])
    unquantized = bind_weights(copy.deepcopy(gm), ckpt, torch.float32)
    (result,) = _run(gm, ctx, "quantize")
    linears, moe = 4 * cfg.num_hidden_layers, cfg.layer_types.count("sparse")
    assert result.matches == linears + moe
    assert result.ops_delta == {
        "aten.linear": -linears,
        "hy3.quant_fp8_per_token": linears,
        "hy3.scaled_mm": linears,
        "getitem": 2 * linears,
    }
    assert sum("int4 expert weights (groups of 16)" in site.detail for site in result.sites) == moe
    params = dict(gm.named_parameters())
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert params["layers.1.mlp.experts.w13"].dtype == torch.uint8
    assert params["layers.1.mlp.experts.w13"].shape == (e, 2 * i, h // 2)
    assert params["layers.1.mlp.experts.w2_scale"].shape == (e, h, i // 16)
    plan = gm.meta["hy3c.weight_plan"]["layers.2.mlp.experts.w2"]
    assert plan == {"kind": "w4a8", "scale": "layers.2.mlp.experts.w2_scale", "group": 16, "shape": [e, h, i]}
    from hy3c.checkpoint.loader import assemble_tensors, inspect_checkpoint
    from hy3c.compiler.package import derive_weights

    layout = inspect_checkpoint(ckpt)
    for name, tensor in derive_weights(
        gm, lambda shapes: assemble_tensors(layout, shapes, ckpt), torch.float32
    ):
        set_attr(gm, name, tensor)
    gm.recompile()
    gm.graph.lint()
    experts = load_model(ckpt, dtype=torch.float32, progress=False).layers[1].mlp.experts
    packed, scale = quantize_int4_groups(experts.w2, 16)
    assert torch.equal(gm.get_parameter("layers.1.mlp.experts.w2"), packed)
    assert torch.equal(gm.get_parameter("layers.1.mlp.experts.w2_scale"), scale)
    out = _step(gm, cfg, torch.float32)[1]
    ref = _step(unquantized, cfg, torch.float32)[1]
    assert (out - ref).norm() / ref.norm() < 0.25  # a random model's int4 experts: measured 12%


def test_static_activations_need_checkpoint_scales(traced):
    gm, _ = traced
    ctx = make_ctx(preset_config("tiny"), overrides=["quant.weights=fp8", "quant.activations=static"])
    with pytest.raises(PassError, match="quant.activations=static needs an FP8 checkpoint"):
        _run(gm, ctx, "quantize")


def test_lower_records_providers_and_honours_priority(traced, monkeypatch):
    from hy3c.kernels import registry

    gm, _ = traced
    fake = registry.Provider(
        "triton",
        "silu_and_mul",
        torch.ops.hy3.silu_and_mul.default,
        frozenset({"cpu"}),
        supports=lambda node: None if "layers.0" in str(node.meta.get("nn_module_stack")) else "only layer 0",
    )
    monkeypatch.setitem(registry._PROVIDERS, "silu_and_mul", [*registry._PROVIDERS["silu_and_mul"], fake])
    (result,) = _run(gm, make_ctx(preset_config("tiny")), "lower", lower={"priority": ["triton", "torch"]})
    providers = result.summary["providers"]
    assert providers["hy3.silu_and_mul"] == {"triton": 1, "torch": 2}
    assert providers["hy3.attention"] == {"torch": 3}
    assert result.matches == sum(sum(c.values()) for c in providers.values())
    assert any("triton: only layer 0" in s.detail for s in result.sites)


def test_lower_reports_ops_that_fall_back_for_a_missing_provider(traced):
    """Without Triton (the context says so) a GPU recipe's ops lower to torch, each counted as a fallback
    with the reason; the pass table summarises the lower row within 120 columns."""
    from hy3c.compiler.inspect_artifact import TABLE_WIDTH, format_pass_table

    gm, _ = traced
    ctx = make_ctx(preset_config("tiny"), unavailable_providers=(("triton", "Triton is not installed"),))
    (result,) = _run(gm, ctx, "lower", lower={"priority": ["triton", "cublas", "torch"]})
    summary = result.summary
    assert summary["unavailable"] == {"triton": "Triton is not installed"}
    assert summary["fallbacks"] == {op: sum(c.values()) for op, c in summary["providers"].items()}
    assert all(set(c) <= {"torch", "cublas"} for c in summary["providers"].values())
    assert all("triton: Triton is not installed" in site.detail for site in result.sites)
    table = format_pass_table({"passes": [result.model_dump(mode="json")]})
    assert f"{result.matches} fell back (triton: Triton is not installed)" in table
    assert max(len(line) for line in table.splitlines()) <= TABLE_WIDTH
    (unaffected,) = _run(traced[0], make_ctx(preset_config("tiny")), "lower", lower={"priority": ["torch"]})
    assert unaffected.summary["fallbacks"] == {}


def test_lower_rejects_unknown_provider(traced):
    gm, _ = traced
    with pytest.raises(PassError, match="unknown providers"):
        _run(gm, make_ctx(preset_config("tiny")), "lower", lower={"priority": ["cutlass"]})


def test_cleanup_removes_noop_casts(traced):
    gm, ckpt = traced
    before = bind_weights(copy.deepcopy(gm), ckpt, torch.float32)
    (result,) = _run(gm, make_ctx(preset_config("tiny")), "cleanup")
    assert result.ops_delta == {"aten.to": -1}  # fp32 logits: .float() is a no-op
    after = bind_weights(gm, ckpt, torch.float32)
    cfg = preset_config("tiny")
    for out, ref in zip(_step(after, cfg, torch.float32), _step(before, cfg, torch.float32)):
        assert torch.equal(out, ref)


def test_disabled_and_gated_passes_are_reported(traced):
    gm, _ = traced
    specs = [PassSpec(name="quantize"), PassSpec(name="fuse_add_rms_norm", enabled=False)]
    results = PassManager(specs, make_ctx(preset_config("tiny"))).run(gm)
    assert [(r.status, r.skip_reason) for r in results] == [
        ("skipped", "quant.weights is none"),
        ("skipped", "disabled in the recipe"),
    ]


def test_kv_store_survives_dead_code_elimination(traced):
    gm, _ = traced
    _run(gm, make_ctx(preset_config("tiny")), "fuse_add_rms_norm", "lower", "cleanup")
    assert sum(n.target is torch.ops.hy3.kv_store.default for n in gm.graph.nodes) == 3


@pytest.mark.parametrize("layers", [1, 3])
def test_fuse_qknorm_rope_kv_one_site_per_layer(make_ckpt, layers):
    ckpt = make_ckpt(seed=7, num_hidden_layers=layers)
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    gm = trace_step(model.config, torch.float32)
    (result,) = _run(gm, make_ctx(model.config), "fuse_qknorm_rope_kv")
    n = layers
    assert result.matches == n and sorted(s.layer for s in result.sites) == list(range(n))
    assert result.ops_delta == {
        "aten.reshape": -3 * n,
        "aten.split_with_sizes": -n,
        "getitem": -3 * n,
        "hy3.kv_store": -n,
        "hy3.qk_norm": -2 * n,
        "hy3.rope": -2 * n,
        "hy3.qknorm_rope_quant_kvstore": n,
    }
    gm.graph.lint()
    fused = bind_weights(gm, ckpt, torch.float32)
    for out, ref in zip(_step(fused, model.config, torch.float32), _step(model, model.config, torch.float32)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fuse_qknorm_rope_kv_hadamard_option_rotates_q_and_k_and_keeps_the_logits(make_ckpt):
    """Config `hadamard: true`: every fused op gets the flag, and the model's logits are those of the
    unrotated model (q·k is invariant under the same rotation of q and k)."""
    ckpt = make_ckpt(seed=7, num_hidden_layers=2)
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    gm = trace_step(model.config, torch.float32)
    (result,) = _run(
        gm, make_ctx(model.config), "fuse_qknorm_rope_kv", fuse_qknorm_rope_kv={"hadamard": True}
    )
    fused_ops = [n for n in gm.graph.nodes if n.target is torch.ops.hy3.qknorm_rope_quant_kvstore.default]
    assert result.matches == 2 and len(fused_ops) == 2 and all(n.args[12] is True for n in fused_ops)
    fused = bind_weights(gm, ckpt, torch.float32)
    for out, ref in zip(_step(fused, model.config, torch.float32), _step(model, model.config, torch.float32)):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_fuse_qknorm_rope_kv_checks_head_layout(traced):
    gm, _ = traced
    other = preset_config(
        "tiny", num_attention_heads=8, num_key_value_heads=1
    )  # not the traced model's heads
    (result,) = _run(gm, make_ctx(other), "fuse_qknorm_rope_kv")
    assert result.matches == 0


def test_plan_attention_one_plan_shared_by_all_layers(traced):
    gm, ckpt = traced
    cfg = preset_config("tiny")
    (result,) = _run(gm, make_ctx(cfg), "plan_attention")
    assert result.matches == cfg.num_hidden_layers
    assert result.ops_delta == {"hy3.attention": -3, "hy3.paged_attention": 3, "hy3.attention_plan": 1}
    plan = next(n for n in gm.graph.nodes if n.target is torch.ops.hy3.attention_plan.default)
    assert len(plan.users) == cfg.num_hidden_layers
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    out = _step(bind_weights(gm, ckpt, torch.float32), cfg, torch.float32)
    for a, b in zip(out, _step(model, cfg, torch.float32)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fuse_moe_one_site_per_moe_layer(traced):
    gm, ckpt = traced
    cfg = preset_config("tiny")
    moe_layers = cfg.layer_types.count("sparse")
    (result,) = _run(gm, make_ctx(cfg), "fuse_moe")
    assert result.matches == moe_layers and sorted(s.layer for s in result.sites) == [1, 2]
    assert result.ops_delta == {
        "aten.add": -moe_layers,
        "hy3.router": -moe_layers,
        "hy3.moe_experts": -moe_layers,
        "hy3.router_gemm": moe_layers,
        "hy3.topk_routing": moe_layers,
        "hy3.fused_moe": moe_layers,
    }
    from hy3c.passes.weight_plan import weight_plan

    assert weight_plan(gm)["layers.1.mlp.router.weight_hi"]["kind"] == "router_split"
    params = dict(gm.named_parameters())
    assert params["layers.2.mlp.router.weight_lo"].dtype == torch.bfloat16
    model = load_model(ckpt, dtype=torch.float32, progress=False)
    shapes = {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in gm.named_parameters()
        if "weight_hi" not in k and "weight_lo" not in k
    }
    from hy3c.checkpoint.loader import assemble_tensors, inspect_checkpoint
    from hy3c.ops.quant import split_router_weight
    from hy3c.passes.graph_utils import set_attr

    for name, tensor in assemble_tensors(inspect_checkpoint(ckpt), shapes, ckpt):
        set_attr(gm, name, tensor)
        if name.endswith("router.weight"):
            for half, part in zip(("hi", "lo"), split_router_weight(tensor)):
                set_attr(gm, f"{name}_{half}", part)
    gm.recompile()
    for out, ref in zip(_step(gm, cfg, torch.float32), _step(model, cfg, torch.float32)):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _random_weights(gm: torch.fx.GraphModule) -> None:
    """Real random values for every (meta) parameter: FP8 weights, positive scales, norms near 1."""
    gen = torch.Generator().manual_seed(0)
    for name, p in list(gm.named_parameters()):
        if "scale" in name:
            value = torch.rand(p.shape, generator=gen) * 0.01 + 1e-3
        elif "norm" in name:
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = 0.3 * torch.randn(p.shape, generator=gen)
        set_attr(gm, name, value.to(p.dtype))
    gm.recompile()


def test_fuse_norm_quant_folds_each_normed_fp8_input_and_keeps_the_numbers(traced):
    """After quantize (per-token FP8 activations) and fuse_add_rms_norm: every add+RMSNorm whose output
    is quantized for a GEMM becomes one add_rms_norm_quant — 2 per layer but the first layer's input
    norm (no residual add) — and the program computes exactly what it did."""
    import copy

    gm, _ = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=fp8", "quant.activations=dynamic"])
    _run(gm, ctx, "quantize", "fuse_add_rms_norm")
    _random_weights(gm)
    before = copy.deepcopy(gm)
    normed_only_quantized = sum(  # their bf16 output has no other reader: its getitem is dropped
        1
        for n in gm.graph.nodes
        if n.target is torch.ops.hy3.add_rms_norm.default
        for g in n.users
        if g.args[1] == 0 and len(g.users) == 1
    )
    (result,) = _run(gm, ctx, "fuse_norm_quant")
    layers = cfg.num_hidden_layers
    assert result.matches == 2 * layers - 1 and sorted({s.layer for s in result.sites}) == list(range(layers))
    assert result.ops_delta == {
        "hy3.add_rms_norm": -(2 * layers - 1),
        "hy3.quant_fp8_per_token": -(2 * layers - 1),
        "hy3.add_rms_norm_quant": 2 * layers - 1,
        "getitem": -normed_only_quantized,
    }
    gm.graph.lint()
    for out, ref in zip(_step(gm, cfg, torch.float32), _step(before, cfg, torch.float32)):
        assert torch.equal(out, ref)


def test_fuse_norm_quant_static_scales(traced):
    """The static form: `quant_fp8(normed, input_scale)` (an FP8 checkpoint's calibrated activation
    scale) folds the same way, the scale handed to the fused op, and the numbers do not move."""
    gm, _ = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=fp8", "quant.activations=dynamic"])
    _run(gm, ctx, "quantize", "fuse_add_rms_norm")
    _static_activation_scales(gm)
    hy3 = torch.ops.hy3
    _random_weights(gm)
    before = copy.deepcopy(gm)
    (result,) = _run(gm, ctx, "fuse_norm_quant")
    assert result.matches == 2 * cfg.num_hidden_layers - 1
    assert all(s.detail.startswith("static") for s in result.sites)
    assert result.ops_delta["hy3.quant_fp8"] == -result.matches
    fused = [n for n in gm.graph.nodes if n.target is hy3.add_rms_norm_quant.default]
    assert all(n.args[4].op == "get_attr" for n in fused)
    gm.graph.lint()
    for out, ref in zip(_step(gm, cfg, torch.float32), _step(before, cfg, torch.float32)):
        assert torch.equal(out, ref)


def _fuse_moe_input_quant_graph(traced, static_norm=False):
    """The tiny graph after quantize (per-token FP8), fuse_moe, fuse_add_rms_norm and fuse_norm_quant,
    random weights bound; with static_norm, every norm quantized with a calibrated scale instead."""
    gm, _ = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=fp8", "quant.activations=dynamic"])
    _run(gm, ctx, "quantize", "fuse_moe", "fuse_add_rms_norm")
    if static_norm:
        _static_activation_scales(gm)
    _run(gm, ctx, "fuse_norm_quant")
    _random_weights(gm)
    moes = [n for n in gm.graph.nodes if n.target is torch.ops.hy3.fused_moe.default]
    assert len(moes) == cfg.layer_types.count("sparse") == 2
    return gm, cfg, ctx, moes


def test_fuse_moe_input_quant_hands_the_norms_fp8_rows_to_the_experts(traced):
    """Each fused_moe (one per MoE layer) takes the post-attention norm's e4m3 rows and scales as its
    quantized input — no op added or removed, the same numbers."""
    gm, cfg, ctx, moes = _fuse_moe_input_quant_graph(traced)
    before = copy.deepcopy(gm)
    (result,) = _run(gm, ctx, "fuse_moe_input_quant")
    assert result.matches == 2 and sorted(s.layer for s in result.sites) == [1, 2]
    assert result.ops_delta == {}
    for moe in moes:
        x_q, x_q_scale = moe.args[10:]
        norm = moe.args[0].args[0]
        assert norm.target is torch.ops.hy3.add_rms_norm_quant.default and norm.args[4] is None
        assert (x_q.args, x_q_scale.args) == ((norm, 2), (norm, 3))
    gm.graph.lint()
    for out, ref in zip(_step(gm, cfg, torch.float32), _step(before, cfg, torch.float32)):
        assert torch.equal(out, ref)
    (again,) = _run(gm, ctx, "fuse_moe_input_quant")
    assert again.matches == 0


@pytest.mark.parametrize("case", ["static norm", "static expert scales", "bf16 experts"])
def test_fuse_moe_input_quant_leaves_other_quantizations_alone(traced, case):
    """No site where the norm's rows are not what the experts would make of x: a norm quantized with a
    calibrated (static) scale — its scale output kept alive here, so only that check can refuse it —,
    experts with a static activation scale, or bf16 experts."""
    import operator

    from hy3c.passes.graph_utils import add_attr, fake_mode_of

    gm, _, ctx, moes = _fuse_moe_input_quant_graph(traced, static_norm=case == "static norm")
    fake, graph = fake_mode_of(gm), gm.graph
    for i, moe in enumerate(moes):
        norm = moe.args[0].args[0]
        if case == "static norm":
            assert norm.args[4] is not None
            if not any(u.args[1] == 3 for u in norm.users):
                with graph.inserting_after(norm):
                    graph.call_function(operator.getitem, (norm, 3))
        if case == "static expert scales":
            scale = add_attr(gm, f"experts_input_scale_{i}", torch.tensor([0.05]), fake)
            moe.args = (*moe.args[:7], scale, *moe.args[8:])
        if case == "bf16 experts":
            w13 = moe.args[3].meta["val"]
            bf16 = add_attr(gm, f"bf16_w13_{i}", torch.zeros(w13.shape, dtype=torch.bfloat16), fake)
            moe.args = (*moe.args[:3], bf16, *moe.args[4:])
    (result,) = _run(gm, ctx, "fuse_moe_input_quant")
    assert result.matches == 0 and all(len(m.args) == 10 for m in moes)


def _static_activation_scales(gm: torch.fx.GraphModule) -> None:
    """Turn every per-token FP8 quantization into the static form an FP8 checkpoint's calibrated
    activation scales give: `quant_fp8(x, input_scale)`, the scale also going to the GEMM."""
    from hy3c.passes.graph_utils import add_attr, fake_mode_of, infer_val

    fake, graph, hy3 = fake_mode_of(gm), gm.graph, torch.ops.hy3
    for i, dynamic in enumerate([n for n in graph.nodes if n.target is hy3.quant_fp8_per_token.default]):
        scale = add_attr(gm, f"input_scale_{i}", torch.tensor([0.05]), fake)
        with graph.inserting_before(dynamic):
            static = graph.call_function(hy3.quant_fp8.default, (dynamic.args[0], scale))
        infer_val(static, fake)
        for getter in list(dynamic.users):
            getter.replace_all_uses_with(static if getter.args[1] == 0 else scale)
            graph.erase_node(getter)
        graph.erase_node(dynamic)


@pytest.mark.parametrize("static", [False, True])
def test_fuse_act_quant_folds_each_swiglu_fp8_input_and_keeps_the_numbers(traced, static):
    """After quantize: every SwiGLU whose only reader is the FP8 quantization of the down projection's
    input (the dense MLP and each shared expert: one per layer) becomes one silu_and_mul_quant, per-token
    or static, and the program computes exactly what it did."""
    gm, _ = traced
    cfg = preset_config("tiny")
    ctx = make_ctx(cfg, overrides=["quant.weights=fp8", "quant.activations=dynamic"])
    _run(gm, ctx, "quantize")
    if static:
        _static_activation_scales(gm)
    _random_weights(gm)
    before = copy.deepcopy(gm)
    (result,) = _run(gm, ctx, "fuse_act_quant")
    layers = cfg.num_hidden_layers
    quant = "hy3.quant_fp8" if static else "hy3.quant_fp8_per_token"
    assert result.matches == layers and sorted(s.layer for s in result.sites) == list(range(layers))
    expected = {"hy3.silu_and_mul": -layers, quant: -layers, "hy3.silu_and_mul_quant": layers}
    assert result.ops_delta == ({**expected, "getitem": layers} if static else expected)
    gm.graph.lint()
    for out, ref in zip(_step(gm, cfg, torch.float32), _step(before, cfg, torch.float32)):
        assert torch.equal(out, ref)
