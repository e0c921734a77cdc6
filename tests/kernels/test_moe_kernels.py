"""Router GEMM (dual-BF16), fused routing and FusedMoE against their references; under TRITON_INTERPRET=1
on CPU at small shapes (the router accuracy test at the real N=192, K=4096)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

import hy3c.kernels
import hy3c.ops
from hy3c.kernels.moe import router
from hy3c.kernels.moe.align import moe_align_torch, moe_align_triton
from hy3c.kernels.moe.config import MoeConfig, config_kind, select_config
from hy3c.kernels.moe.fused_moe import fit_to_widths, fused_moe_triton
from hy3c.kernels.moe.router import router_gemm_dual_bf16
from hy3c.ops.quant import FP8_DTYPE, split_router_weight

hy3 = torch.ops.hy3


@pytest.mark.parametrize("rows", [1, 2, 16, 208])
def test_dual_bf16_router_gemm_accuracy(rows):
    """N=192, K=4096: max abs error vs an fp64 reference <= 2e-3; a bf16-only weight fails that bound."""
    w = torch.randn(192, 4096) * 0.02 * 4
    x = torch.randn(rows, 4096).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    hi, lo = split_router_weight(w)
    out = router_gemm_dual_bf16(x, hi, lo, splits=4)
    assert (out.double() - ref).abs().max() <= 2e-3
    bf16_only = x.float() @ hi.float().t()
    assert (bf16_only.double() - ref).abs().max() > 2e-3


@pytest.mark.parametrize("splits", [1, 3, 4])
def test_router_gemm_split_k_partials_sum_to_the_product(splits):
    """Each K split writes its own partial sums (uneven last split with 3); the last split of each of the
    four output tiles to arrive adds them, and leaves its arrival counter at zero for the next launch.
    The interpreter runs programs in order, so this checks the sums and the reset, not the arrival race
    (the GPU test repeats launches and graph replays for that)."""
    w = 0.02 * torch.randn(24, 512)
    x = torch.randn(20, 512).to(torch.bfloat16)
    hi, lo = split_router_weight(w)
    for _ in range(2):  # the second launch reuses the counters the first one left
        out = router_gemm_dual_bf16(x, hi, lo, splits=splits, block_m=16, block_n=16)
        assert (out.double() - x.double() @ w.double().t()).abs().max() <= 1e-4
    for buffers in router._COUNTERS.values():
        assert all(int(buffer.abs().sum()) == 0 for buffer in buffers)


def test_router_weight_split_reconstructs_fp32():
    w = torch.randn(64, 256)
    hi, lo = split_router_weight(w)
    assert ((hi.float() + lo.float() / 256 - w).abs() / w.abs().clamp_min(1e-3)).max() < 2e-5


@pytest.mark.parametrize(("rows", "experts", "top_k"), [(1, 192, 8), (5, 8, 2), (9, 16, 16)])
def test_topk_routing_matches_reference(rows, experts, top_k):
    logits, bias = torch.randn(rows, experts), 0.05 * torch.randn(experts)
    w, ids = torch.ops.hy3_triton.topk_routing(logits, bias, top_k, 2.826)
    ref_w, ref_ids = hy3.topk_routing(logits, bias, top_k, 2.826)
    order, ref_order = ids.long().sort(-1), ref_ids.long().sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_moe_align_pads_each_expert_and_keeps_every_pair():
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]], dtype=torch.int32)
    sorted_ids, expert_ids, padded = moe_align_torch(ids, num_experts=5, block_m=4)
    assert int(padded) == 12  # experts 0, 1, 3 → one block of 4 each
    blocks = sorted_ids[:12].view(3, 4)
    assert expert_ids[:3].tolist() == [0, 1, 3]
    flat = ids.reshape(-1)
    for block, expert in zip(blocks, expert_ids[:3]):
        real = block[block < 6]
        assert all(int(flat[p]) == int(expert) for p in real)
    assert sorted(sorted_ids[sorted_ids < 6].tolist()) == list(range(6))


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m", "case"),
    [
        (1, 192, 8, 16, "decode, Hy3 experts"),
        (128, 192, 8, 16, "1024 pairs, the one-program limit"),
        (128, 192, 8, 2, "more M blocks than one chunk of the block pass"),
        (30, 192, 2, 16, "few pairs among many experts (most empty)"),
        (40, 192, 8, 64, "large blocks"),
        (9, 4, 1, 16, "all to one expert"),
        (6, 5, 5, 4, "top-k = experts"),
        (11, 7, 3, 8, "expert count not a power of two"),
    ],
)
def test_triton_moe_align_equals_torch_align(tokens, experts, top_k, block_m, case):
    """Same sorted ids (stable order), block experts and padded total as the torch ops."""
    gen = torch.Generator().manual_seed(tokens * experts)
    if case == "all to one expert":
        ids = torch.full((tokens, top_k), 2, dtype=torch.int32)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    triton_out = moe_align_triton(ids, experts, block_m)
    torch_out = moe_align_torch(ids, experts, block_m)
    for name, got, want in zip(("sorted_ids", "expert_ids", "padded"), triton_out, torch_out):
        assert torch.equal(got, want), name


def _ids_with_no_expert(tokens, experts, top_k, seed):
    """Top-k ids as `hy3.local_experts` gives them on one rank: distinct per token, about half −1
    (experts of other ranks), token 0's row all −1 and, with more than two tokens, the last row too."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[torch.rand(tokens, top_k, generator=gen) < 0.5] = -1
    ids[0] = -1
    if tokens > 2:
        ids[-1] = -1
    return ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m", "case"),
    [
        (1, 8, 2, 16, "one token, every id -1"),
        (9, 8, 2, 4, "some -1"),
        (128, 192, 8, 16, "1024 pairs, the one-program limit"),
        (8, 4, 1, 4, "all to one expert, blocks full to the boundary"),
        (9, 4, 1, 4, "all to one expert, one past the boundary"),
        (6, 5, 5, 4, "every row -1"),
    ],
)
def test_moe_align_drops_pairs_without_an_expert(tokens, experts, top_k, block_m, case):
    """Ids of −1 (no expert on this rank): the Triton and the torch alignment equal each other, list
    every other pair exactly once in its expert's blocks, and pad as if the −1 pairs did not exist."""
    ids = _ids_with_no_expert(tokens, experts, top_k, tokens * experts)
    if case.startswith("all to one expert"):  # block_m pairs of expert 2 (or one more), the rest −1
        ids = torch.full((tokens + 3, top_k), -1, dtype=torch.int32)
        ids[:tokens] = 2
    if case == "every row -1":
        ids.fill_(-1)
    triton_out = moe_align_triton(ids, experts, block_m)
    torch_out = moe_align_torch(ids, experts, block_m)
    for name, got, want in zip(("sorted_ids", "expert_ids", "padded"), triton_out, torch_out):
        assert torch.equal(got, want), name
    sorted_ids, expert_ids, padded = torch_out
    flat, pairs = ids.reshape(-1), ids.numel()
    held = (flat >= 0).nonzero().reshape(-1).tolist()
    counts = torch.bincount(flat[flat >= 0].long(), minlength=experts)
    assert int(padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted(sorted_ids[sorted_ids < pairs].tolist()) == held
    blocks = sorted_ids[: int(padded)].view(-1, block_m)
    for block, expert in zip(blocks, expert_ids):
        real = block[block < pairs]
        assert len(real) and all(int(flat[p]) == int(expert) for p in real)


def test_triton_moe_align_refuses_more_pairs_than_its_tile():
    with pytest.raises(ValueError, match="pairs exceed"):
        moe_align_triton(torch.zeros(129, 8, dtype=torch.int32), 192, 16)


CFG = MoeConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


def _weights(experts, hidden, inter, dtype=torch.float32):
    return (0.1 * torch.randn(experts, 2 * inter, hidden)).to(dtype), (
        0.1 * torch.randn(experts, hidden, inter)
    ).to(dtype)


def _expert_weights(experts, hidden, inter, fp8):
    """(w13, w2, (w13_scale, w2_scale)): bf16 weights, or e4m3 ones with per-channel scales."""
    w13, w2 = _weights(experts, hidden, inter)
    if not fp8:
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16), (None, None)
    scales = (w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448)
    return (w13 / scales[0][..., None]).to(FP8_DTYPE), (w2 / scales[1][..., None]).to(FP8_DTYPE), scales


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "case"),
    [
        (1, 8, 2, "T=1"),
        (13, 8, 2, "some experts idle"),
        (7, 4, 1, "all to one expert"),
        (5, 4, 4, "top-k = experts"),
    ],
)
def test_fused_moe_bf16_and_fp32(tokens, experts, top_k, case):
    x = torch.randn(tokens, 64)
    w13, w2 = _weights(experts, 64, 32)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    if case == "some experts idle":
        ids = ids % (experts // 2)
        ids[:, 1] = (ids[:, 0] + 1) % (experts // 2)
    if case == "all to one expert":
        ids.fill_(2)
    w = torch.rand(tokens, top_k)
    shared = torch.randn(tokens, 64)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        args = (x.to(dtype), w, ids, w13.to(dtype), w2.to(dtype), None, None, None, None, shared.to(dtype))
        out = fused_moe_triton(*args, config=CFG)
        torch.testing.assert_close(out.float(), hy3.fused_moe(*args).float(), atol=tol, rtol=tol)
        options_tried = (
            {"tma": True},
            {"swap_ab": True},
            {"swap_ab": True, "tma": True},
            {"pair_blocks": True},  # one pair per block: experts shared by pairs are read once per pair
            {"pair_blocks": True, "swap_ab": True},
            {"combine_block": 32},  # two combine programs per token (hidden 64)
        )
        for options in options_tried:
            other = fused_moe_triton(*args, config=dataclasses.replace(CFG, **options))
            torch.testing.assert_close(other.float(), hy3.fused_moe(*args).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fused_moe_fp8(static, per_channel):
    tokens, experts, top_k = 9, 8, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2 = _weights(experts, 64, 32)
    if per_channel:
        s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    else:
        s13, s2 = w13.abs().amax((1, 2))[:, None] / 448, w2.abs().amax((1, 2))[:, None] / 448
    q13, q2 = (w13 / s13[..., None]).to(FP8_DTYPE), (w2 / s2[..., None]).to(FP8_DTYPE)
    a13 = torch.tensor([x.float().abs().max() / 448]) if static else None
    a2 = torch.tensor([0.05 / 448 * 8]) if static else None
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, top_k), ids, q13, q2, s13, s2, a13, a2, None)
    out = fused_moe_triton(*args, config=CFG)
    ref = hy3.fused_moe(*args)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 2e-2
    on_load = fused_moe_triton(*args, config=dataclasses.replace(CFG, quant_on_load=True))
    torch.testing.assert_close(on_load, out, atol=0, rtol=0)  # the same FP8 rows, quantized in the GEMMs
    tma = fused_moe_triton(*args, config=dataclasses.replace(CFG, tma=True))  # weight tiles by TMA
    torch.testing.assert_close(tma, out, atol=0, rtol=0)
    wide = fused_moe_triton(*args, config=dataclasses.replace(CFG, block_m=64))  # mostly padding rows
    assert (wide.float() - ref.float()).norm() / ref.float().norm() < 2e-2
    for tma, on_load in itertools.product((False, True), (False, True)):  # weights as the MMA's rows
        cfg = dataclasses.replace(CFG, swap_ab=True, tma=tma, quant_on_load=on_load)
        torch.testing.assert_close(fused_moe_triton(*args, config=cfg), out, atol=0, rtol=0)


@pytest.mark.parametrize("fp8", ["bf16", "dynamic", "static"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_moe_tuned_configs_run_on_small_experts(tokens, fp8):
    """The H200 configs picked by token count (TMA tiles of 64–128 rows) on experts 32 / 64 wide: the
    TMA option is dropped where block_n does not divide the widths, and the output is the reference's
    (the launch on the CPU takes the defaults: the H200's table is asked for by name)."""
    experts, top_k = 8, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8 != "bf16")
    act = (None, None)
    if fp8 == "static":
        act = (torch.tensor([x.float().abs().max() / 448]), torch.tensor([0.05 / 448 * 8]))
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, top_k), ids, w13, w2, *scales, *act, None)
    kind = config_kind(fp8 != "bf16", fp8 == "static")
    config = fit_to_widths(select_config(tokens, kind, "NVIDIA H200"), w13)
    assert config.pair_blocks == (tokens == 1)  # the H200's one-token config (the defaults have none)
    out, ref = fused_moe_triton(*args, config=config).float(), hy3.fused_moe(*args).float()
    assert (out - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_pair_blocks_equal_the_aligned_blocks_for_one_token(fp8, swap_ab):
    """One token: each aligned block holds one pair in row 0, so a block per pair computes the same tiles."""
    experts, top_k = 8, 4
    x = torch.randn(1, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8)
    ids = torch.randperm(experts)[None, :top_k].int()
    args = (x, torch.rand(1, top_k), ids, w13, w2, *scales, None, None, torch.randn(1, 64).to(torch.bfloat16))
    strided = torch.stack([ids, ids], -1)[..., 0]  # the same ids with stride (2k, 2)
    strided_w = torch.stack([args[1], args[1]], -1)[..., 0]  # and the same weights
    assert not strided.is_contiguous() and not strided_w.is_contiguous()
    aligned = fused_moe_triton(*args, config=dataclasses.replace(CFG, swap_ab=swap_ab))
    cases = itertools.product(((ids.long(), args[1]), (strided, strided_w)), (False, True))
    for (other_ids, other_w), pair in cases:  # int64 and strided ids and weights, either blocking: the same
        cfg = dataclasses.replace(CFG, swap_ab=swap_ab, pair_blocks=pair)
        other = fused_moe_triton(args[0], other_w, other_ids, *args[3:], config=cfg)
        torch.testing.assert_close(other, aligned, atol=0, rtol=0)
    pair_blocks = fused_moe_triton(*args, config=dataclasses.replace(CFG, swap_ab=swap_ab, pair_blocks=True))
    torch.testing.assert_close(pair_blocks, aligned, atol=0, rtol=0)
    assert (aligned.float() - hy3.fused_moe(*args).float()).norm() / aligned.float().norm() < 2e-2


NO_EXPERT_CONFIGS = (
    {},
    {"swap_ab": True, "tma": True},
    {"pair_blocks": True},
    {"pair_blocks": True, "swap_ab": True},
    {"block_m": 4},  # blocks of 4: experts with exactly 4 and with 5 pairs (the test's ids)
)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8 dynamic", "fp8 static"])
def test_fused_moe_skips_pairs_without_an_expert(weights):
    """Ids of −1 (expert parallelism: experts of other ranks) with nonzero routing weights: every
    config (aligned blocks, block-size boundaries, pair blocks, weights as the MMA's rows, TMA tiles, the
    alignment's torch ops) gives the reference's output, which skips them — tokens whose every id is −1
    get only the shared expert's output."""
    tokens, experts, top_k = 12, 8, 2
    ids = _ids_with_no_expert(tokens, experts, top_k, 1)
    ids[1:5, 0], ids[5, 0] = 3, 6  # expert 3: 4 pairs (one full block of 4), then the ones below
    ids[6:11, 1] = torch.tensor([6, 6, 6, 6, 5], dtype=torch.int32)  # expert 6: 5 pairs (one past it)
    assert (ids == -1).all(-1).sum() >= 2 and (ids == -1).any(-1).sum() > (ids == -1).all(-1).sum()
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    x, shared = torch.randn(tokens, 64).to(dtype), torch.randn(tokens, 64).to(dtype)
    if weights.startswith("fp8"):
        w13, w2, scales = _expert_weights(experts, 64, 32, fp8=True)
    else:
        w13, w2 = (w.to(dtype) for w in _weights(experts, 64, 32))
        scales = (None, None)
    act = (None, None)
    if weights == "fp8 static":
        act = (torch.tensor([x.float().abs().max() / 448]), torch.tensor([0.05 / 448 * 8]))
    args = (x, torch.rand(tokens, top_k) + 0.5, ids, w13, w2, *scales, *act, shared)
    ref = hy3.fused_moe(*args).float()
    only_held = torch.where(ids >= 0, ids, 0), torch.where(ids >= 0, args[1], 0.0)  # −1 as weight 0
    torch.testing.assert_close(ref, hy3.fused_moe(x, only_held[1], only_held[0], *args[3:]).float())
    tol = {"fp32": 1e-5, "bf16": 2e-2}.get(weights)
    for options in NO_EXPERT_CONFIGS:
        out = fused_moe_triton(*args, config=dataclasses.replace(CFG, **options)).float()
        if tol is None:
            assert (out - ref).norm() / ref.norm() < 2e-2, options
        else:
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol, msg=str(options))
        torch.testing.assert_close(out[0], shared[0].float(), atol=0, rtol=0)  # no expert: the shared part


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("options", [{}, {"pair_blocks": True}])
def test_fused_moe_expert_parallel_parts_sum_to_the_whole_layer(fp8, options):
    """ep = 2 in one process: each rank's FusedMoE over its half of the experts (weights and scales cut
    along the expert dim), with the ids and weights `hy3.local_experts` gives that rank (the router's id
    − rank · 4, −1 and weight 0 for the other half), sums to the whole layer's routed output."""
    tokens, experts, top_k, ep = 9, 8, 2, 2
    local = experts // ep
    dtype = torch.bfloat16 if fp8 else torch.float32
    x = torch.randn(tokens, 64).to(dtype)
    if fp8:
        w13, w2, scales = _expert_weights(experts, 64, 32, fp8=True)
    else:
        w13, w2 = _weights(experts, 64, 32)
        scales = (None, None)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    ids[0] = torch.tensor([1, 2], dtype=torch.int32)  # token 0: both experts on rank 0, none on rank 1
    w = torch.rand(tokens, top_k)
    whole = hy3.fused_moe(x, w, ids, w13, w2, *scales, None, None, None).float()
    parts = []
    for rank in range(ep):
        rows = slice(rank * local, (rank + 1) * local)
        mine = (ids >= rank * local) & (ids < (rank + 1) * local)
        local_ids = (ids - rank * local).masked_fill(~mine, -1)
        local_w = w.masked_fill(~mine, 0)
        cut = [None if s is None else s[rows] for s in scales]
        cfg = dataclasses.replace(CFG, **options)
        part = fused_moe_triton(
            x, local_w, local_ids, w13[rows], w2[rows], *cut, None, None, None, config=cfg
        )
        parts.append(part.float())
    assert torch.equal(parts[1][0], torch.zeros(64))  # rank 1 holds neither of token 0's experts
    if fp8:
        assert ((parts[0] + parts[1]) - whole).norm() / whole.norm() < 2e-2
    else:
        torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_fused_moe_writes_no_row_of_a_pair_without_an_expert(monkeypatch):
    """The pairs of id −1 are neither computed nor written, and the combine does not read them: with
    every buffer allocated full of a marker value, their rows of the per-pair outputs still hold it
    (aligned blocks, the alignment's torch ops, pair blocks — whose −1 programs would otherwise read the
    weights before the first expert's) and the layer's output is the reference's."""
    from hy3c.kernels.moe import align, fused_moe

    marker, new_empty = 1000.0, torch.Tensor.new_empty

    def marked(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        return t.fill_(marker) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", marked)
    tokens, experts, top_k = 6, 8, 2
    ids = _ids_with_no_expert(tokens, experts, top_k, 2)
    x, w = torch.randn(tokens, 64).bfloat16(), torch.rand(tokens, top_k)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8=False)
    held = (ids >= 0).reshape(-1)
    ref = hy3.fused_moe(x, w, ids, w13, w2, *scales, None, None, None)
    for options, torch_align in (({}, False), ({}, True), ({"pair_blocks": True}, False)):
        monkeypatch.setattr(align, "MAX_ALIGN_PAIRS", 0 if torch_align else 1024)
        cfg = dataclasses.replace(CFG, **options)
        per_pair = fused_moe._routed_pairs_triton(
            x, None, None, ids, w13, w2, *scales, None, None, cfg, False
        )
        assert (per_pair[~held] == marker).all(), (options, torch_align)
        assert (per_pair[held].abs() < marker / 10).all(), (options, torch_align)
        out = fused_moe_triton(x, w, ids, w13, w2, *scales, None, None, None, config=cfg)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_fused_moe_quantizes_no_intermediate_row_of_a_pair_without_an_expert(monkeypatch):
    """FP8 with dynamic scales: the intermediate's per-pair quantization gives the row-wise kernel's
    bytes and scales for the held pairs and leaves the rows and scales of id −1 as allocated."""
    from hy3c.kernels.moe.blocks import quantize_intermediate
    from hy3c.kernels.rowwise.quant import quant_fp8_per_token

    marker, empty = 1000.0, torch.empty

    def marked(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(marker) if t.dtype == torch.float32 else t.view(torch.uint8).fill_(0x7E).view(t.dtype)

    ids = _ids_with_no_expert(5, 8, 2, 3).reshape(-1)
    held = ids >= 0
    h = torch.randn(ids.numel(), 96).bfloat16()
    h[~held] = float("nan")  # never written by the gate-up: whatever the allocation held
    want_q, want_scale = quant_fp8_per_token(h[held], pdl=False)
    monkeypatch.setattr(torch, "empty", marked)
    q, scale = quantize_intermediate(h, ids, on_load=False, pdl=False)
    assert torch.equal(q[held].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale[held], want_scale.reshape(-1))
    assert (scale[~held] == marker).all() and (q[~held].view(torch.uint8) == 0x7E).all()


def test_fused_moe_reads_column_strided_x_and_shared_rows():
    """x and the shared expert's output as transposed views (column stride ≠ 1): the same output."""
    tokens, experts, top_k = 5, 8, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    shared = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8=False)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    w = torch.rand(tokens, top_k)
    x_t, shared_t = x.t().contiguous().t(), shared.t().contiguous().t()
    assert x_t.stride(-1) != 1 and shared_t.stride(-1) != 1
    want = fused_moe_triton(x, w, ids, w13, w2, *scales, None, None, shared, config=CFG)
    got = fused_moe_triton(x_t, w, ids, w13, w2, *scales, None, None, shared_t, config=CFG)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.library.opcheck(  # the fake output is row-major too
        torch.ops.hy3_triton.fused_moe.default,
        (x_t, w, ids, w13, w2, *scales, None, None, shared_t),
        test_utils=("test_faketensor",),
    )


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_tma_zero_fills_k_blocks_past_the_last_column(fp8, swap_ab):
    """K blocks (64) past hidden = 96 and inter = 32: the copies' zero fill matches the masked loads."""
    tokens, experts, top_k = 5, 4, 2
    x = torch.randn(tokens, 96).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 96, 32, fp8)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, top_k), ids, w13, w2, *scales, None, None, None)
    cfg = dataclasses.replace(CFG, block_k=64, swap_ab=swap_ab)
    pointers = fused_moe_triton(*args, config=cfg)
    torch.testing.assert_close(fused_moe_triton(*args, config=dataclasses.replace(cfg, tma=True)), pointers)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_down_gemm_takes_its_own_tiles(fp8, tma):
    """The down GEMM's own tiles (`MoeConfig.down`): wider column blocks give the shared tiles' output
    bit for bit (the same K order); a K block past inter (64 of 32 columns) sums the same products in
    another order."""
    tokens, experts, top_k = 9, 4, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, top_k), ids, w13, w2, *scales, None, None, None)
    cfg = dataclasses.replace(CFG, tma=tma)
    shared_tiles = fused_moe_triton(*args, config=cfg)
    wide = dataclasses.replace(cfg, down_block_n=64, down_num_warps=8, down_num_stages=3)
    assert wide.down() == dataclasses.replace(cfg, block_n=64, num_warps=8, num_stages=3)
    torch.testing.assert_close(fused_moe_triton(*args, config=wide), shared_tiles, atol=0, rtol=0)
    deep = fused_moe_triton(*args, config=dataclasses.replace(cfg, down_block_k=64))
    assert (deep.float() - shared_tiles.float()).norm() / shared_tiles.float().norm() < 1e-2
    ref = hy3.fused_moe(*args)
    assert (deep.float() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_down_tiles_that_cannot_run_are_one_error():
    with pytest.raises(ValueError, match="down tiles must be positive or 0"):
        MoeConfig(16, 32, 32, down_block_n=-1)
    with pytest.raises(ValueError, match="not pair_blocks"):
        MoeConfig(16, 32, 32, pair_blocks=True, down_block_k=64)
    assert MoeConfig(16, 32, 32).down() == MoeConfig(16, 32, 32)  # none of its own: the gate-up's
    x, w = torch.randn(3, 64), torch.rand(3, 2)
    w13, w2 = _weights(4, 64, 32)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    misfit = dataclasses.replace(CFG, tma=True, down_block_n=128)  # 128 rows do not tile hidden = 64
    with pytest.raises(ValueError, match=r"block_n \(32, down 128\) to divide the expert widths"):
        fused_moe_triton(x, w, ids, w13, w2, None, None, None, None, None, config=misfit)
    assert fit_to_widths(misfit, w13) == dataclasses.replace(misfit, tma=False)  # a table's config
    assert fit_to_widths(dataclasses.replace(misfit, down_block_n=64), w13).tma


@pytest.mark.parametrize("fp8", [False, True])
def test_persistent_config_runs_its_triton_kernels_where_the_gluon_ones_cannot(fp8):
    """A `persistent` config off sm_90 (here: the interpreter) runs the same config's Triton kernels."""
    tokens, experts, top_k = 9, 4, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, top_k), ids, w13, w2, *scales, None, None, None)
    cfg = dataclasses.replace(CFG, block_m=128)
    persistent = fused_moe_triton(*args, config=dataclasses.replace(cfg, persistent=True))
    torch.testing.assert_close(persistent, fused_moe_triton(*args, config=cfg), atol=0, rtol=0)


def _emulated_grouped_gemm(
    a_sorted,
    w,
    out,
    sorted_ids,
    expert_ids,
    padded,
    a_scale,
    a_scale_mode,
    w_scale,
    h_static_scale,
    pairs,
    top_k,
    cfg,
    model_dtype,
    gate_up,
):
    """`fused_moe_persistent.grouped_gemm` in torch, tile rows as the kernel's epilogue takes them."""
    from hy3c.kernels.moe import fused_moe_persistent as persistent

    fp8 = w.dtype == FP8_DTYPE
    for block in range(int(padded) // persistent.BLOCK_M):
        rows = torch.arange(block * persistent.BLOCK_M, (block + 1) * persistent.BLOCK_M)
        pair = sorted_ids[rows].long()
        rows, pair = rows[pair < pairs], pair[pair < pairs]
        expert = int(expert_ids[block])
        acc = a_sorted[rows].float() @ w[expert].float().t()
        if fp8:
            if a_scale_mode == persistent.SCALE_STATIC.value:
                scale = a_scale.reshape(1)
            elif a_scale_mode == persistent.SCALE_PER_TOKEN.value:
                scale = a_scale[pair // top_k][:, None]
            else:
                scale = a_scale[rows][:, None]
            acc = acc * scale * w_scale[expert][None, :]
        if gate_up:
            gate, up = (t.to(model_dtype).float() for t in acc.chunk(2, dim=1))
            h = (F.silu(gate).to(model_dtype).float() * up).to(model_dtype)
            if h_static_scale is not None:
                h = (h.float() / h_static_scale.float()).clamp(-448, 448)
            out[rows] = h.to(out.dtype)
        else:
            out[pair] = acc.to(out.dtype)


@pytest.mark.parametrize("case", ["bf16", "fp8 dynamic", "fp8 static", "fp8 x_q", "fp8 expert parallel"])
def test_persistent_path_around_its_gemms_equals_the_reference(case, monkeypatch):
    """`_routed_pairs_persistent` with the Gluon GEMMs emulated in torch (they cannot run here): the
    alignment, the rows gathered in sorted order, the intermediate's quantization skipping pad rows, the
    combine — against the reference layer."""
    from hy3c.kernels.moe import fused_moe_persistent as persistent

    monkeypatch.setattr(persistent, "grouped_gemm", _emulated_grouped_gemm)
    monkeypatch.setattr(persistent, "unsupported_launch", lambda w13, w2: None)
    tokens, experts, top_k = 40, 4, 2
    fp8 = case.startswith("fp8")
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2, scales = _expert_weights(experts, 64, 32, fp8)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    if case == "fp8 expert parallel":
        ids = torch.where(ids < 2, ids, -1)
    statics, extra = (None, None), ()
    if case == "fp8 static":
        statics = (x.float().abs().amax().reshape(1) / 448, torch.tensor([4.0 / 448]))
    if case == "fp8 x_q":
        extra = hy3.quant_fp8_per_token(x)
    args = (
        x,
        torch.rand(tokens, top_k),
        ids,
        w13,
        w2,
        *scales,
        *statics,
        torch.randn(tokens, 64).bfloat16(),
        *extra,
    )
    cfg = MoeConfig(128, 32, 32, 1, 4, 2, persistent=True)
    out = fused_moe_triton(*args, config=cfg, gluon=True)
    ref = hy3.fused_moe(*args)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 2e-2
    triton_kernels = fused_moe_triton(*args, config=dataclasses.replace(cfg, persistent=False))
    assert (out.float() - triton_kernels.float()).norm() / triton_kernels.float().norm() < 1e-2


def test_persistent_gemms_take_aligned_token_rows_and_say_what_else_they_cannot():
    from hy3c.kernels.moe import fused_moe_persistent as persistent

    for options in ({"pair_blocks": True}, {"swap_ab": True}, {"quant_on_load": True}):
        with pytest.raises(ValueError, match="persistent: aligned M blocks of token rows"):
            MoeConfig(128, 128, 128, persistent=True, **options)
    cfg = MoeConfig(128, 128, 128, 8, 8, 4, persistent=True, down_block_n=128)

    def experts(dtype, inter=1536, hidden=4096):
        return (
            torch.empty(192, 2 * inter, hidden, dtype=dtype, device="meta"),
            torch.empty(192, hidden, inter, dtype=dtype, device="meta"),
        )

    assert persistent.unsupported(cfg, *experts(FP8_DTYPE), torch.bfloat16) is None
    assert persistent.unsupported(cfg, *experts(torch.bfloat16), torch.bfloat16) is None
    assert "block_m 64" in persistent.unsupported(
        dataclasses.replace(cfg, block_m=64), *experts(FP8_DTYPE), torch.bfloat16
    )
    assert "in a torch.float16 model" in persistent.unsupported(cfg, *experts(torch.bfloat16), torch.float16)
    assert "block_n 128 must be a power of two from 16 to 128 that divides 1472" in persistent.unsupported(
        cfg, *experts(FP8_DTYPE, inter=1472), torch.bfloat16
    )
    for down_block_n in (256, 96):  # 256 spills (ptxas); Gluon's blocks are powers of two
        wide_down = dataclasses.replace(cfg, down_block_n=down_block_n)
        assert f"down block_n {down_block_n}" in persistent.unsupported(
            wide_down, *experts(FP8_DTYPE), torch.bfloat16
        )
    assert persistent.unsupported_launch(*(torch.zeros(1, 2, 2) for _ in range(2))) == "not an sm_90 GPU"


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_are_gathered_in_the_alignments_order(fp8):
    from hy3c.kernels.moe import fused_moe_persistent as persistent

    tokens, top_k = 5, 2
    x = torch.randn(tokens, 64)
    a = x.to(FP8_DTYPE) if fp8 else x.to(torch.bfloat16)
    sorted_ids = torch.tensor([3, 0, 10, 10, 9, 1, 4, 10], dtype=torch.int32)  # 10 = T·k: pad rows
    rows = persistent.gather_rows(a, sorted_ids, top_k)
    assert rows.dtype == a.dtype and rows.shape == (8, 64)
    for row, pair in enumerate(sorted_ids.tolist()):
        if pair < tokens * top_k:  # pad rows are not written (computed by the GEMMs, never stored)
            assert torch.equal(rows[row].view(torch.uint8), a[pair // top_k].view(torch.uint8))
    assert torch.equal(
        persistent.pad_rows(sorted_ids, tokens * top_k), torch.tensor([0, 0, -1, -1, 0, 0, 0, -1])
    )


def test_fused_moe_takes_its_input_already_quantized_per_token():
    """FP8 experts, per-token scales: x handed over as the norm's e4m3 rows and scales gives the same
    output as x quantized inside (Triton and the reference), and the reference reads the given rows."""
    from hy3c.ops.quant import per_token_scale, quantize_fp8

    tokens, experts, top_k = 9, 8, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    q13, q2, (s13, s2) = _expert_weights(experts, 64, 32, fp8=True)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    args = (
        x,
        torch.rand(tokens, top_k),
        ids,
        q13,
        q2,
        s13,
        s2,
        None,
        None,
        torch.randn(tokens, 64).bfloat16(),
    )
    x_scale = per_token_scale(x)
    x_q = quantize_fp8(x, x_scale)
    for config in (CFG, dataclasses.replace(CFG, quant_on_load=True)):
        inside = fused_moe_triton(*args, config=config)
        handed = fused_moe_triton(*args, x_q, x_q_scale=x_scale, config=config)
        torch.testing.assert_close(handed, inside, atol=0, rtol=0)
    torch.testing.assert_close(hy3.fused_moe(*args, x_q, x_scale), hy3.fused_moe(*args), atol=0, rtol=0)
    negated = quantize_fp8(-x, x_scale)  # the given rows are the ones read, by both
    other = hy3.fused_moe(*args, negated, x_scale)
    assert (other.float() - hy3.fused_moe(*args).float()).abs().max() > 0.1
    other_triton = fused_moe_triton(*args, negated, x_scale, config=CFG)
    assert (other_triton.float() - other.float()).norm() / other.float().norm() < 2e-2
    # opcheck's schema test has no CPU FP8 arithmetic: the inputs are checked unmutated byte for byte
    tensors = [a for a in (*args, x_q, x_scale) if isinstance(a, torch.Tensor)]
    before = [a.view(torch.uint8).clone() for a in tensors]
    for op in (hy3.fused_moe.default, torch.ops.hy3_triton.fused_moe.default):
        op(*args, x_q, x_scale)
        assert all(torch.equal(b, a.view(torch.uint8)) for b, a in zip(before, tensors))
        torch.library.opcheck(
            op,
            (*args, x_q, x_scale),
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("half", "come together"),
        ("bf16 experts", "needs FP8 or W4A8 experts with per-token"),
        ("static scales", "needs FP8 or W4A8 experts with per-token"),
        ("shape", "must be e4m3"),
    ],
)
def test_fused_moe_refuses_a_mismatched_quantized_input(case, message):
    tokens, experts = 3, 4
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    w13, w2 = _weights(experts, 64, 32)
    s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    weights = ((w13 / s13[..., None]).to(FP8_DTYPE), (w2 / s2[..., None]).to(FP8_DTYPE), s13, s2)
    a13 = None
    x_q, x_scale = x.to(FP8_DTYPE), torch.ones(tokens, 1)
    if case == "half":
        x_scale = None
    if case == "bf16 experts":
        weights = (w13.bfloat16(), w2.bfloat16(), None, None)
    if case == "static scales":
        a13 = torch.tensor([0.01])
    if case == "shape":
        x_scale = torch.ones(tokens)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    args = (x, torch.rand(tokens, 2), ids, *weights, a13, None, None, x_q, x_scale)
    for op in (fused_moe_triton, hy3.fused_moe):
        with pytest.raises(ValueError, match=message):
            op(*args)


def test_fused_moe_tma_needs_blocks_that_tile_the_experts():
    x, w = torch.randn(3, 64), torch.rand(3, 2)
    w13, w2 = _weights(4, 64, 48)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="to divide the expert widths"):
        fused_moe_triton(
            x, w, ids, w13, w2, None, None, None, None, None, config=dataclasses.replace(CFG, tma=True)
        )


def test_opcheck_moe_l2_ops():
    x, ids = (
        torch.randn(6, 32),
        torch.tensor([[0, 1], [1, 2], [3, 0], [0, 2], [1, 3], [2, 3]], dtype=torch.int32),
    )
    w13, w2 = torch.randn(4, 16, 32), torch.randn(4, 32, 8)
    torch.library.opcheck(
        hy3.fused_moe.default, (x, torch.rand(6, 2), ids, w13, w2, None, None, None, None, torch.randn(6, 32))
    )
    torch.library.opcheck(hy3.topk_routing.default, (torch.randn(6, 8), torch.randn(8), 2, 2.5))
    torch.library.opcheck(
        hy3.router_gemm.default,
        (x, torch.randn(8, 32), torch.randn(8, 32).bfloat16(), torch.randn(8, 32).bfloat16()),
    )
    assert hy3c.kernels.HAVE_TRITON


def test_static_fp8_configs_fall_back_to_dynamic_buckets(tmp_path, monkeypatch):
    """fp8_static buckets the table lacks come from the fp8 table, not from its largest own bucket."""
    import json

    from hy3c.kernels.moe import config as moe_config

    small, large = MoeConfig(16, 32, 128, 1, 4, 4), MoeConfig(128, 128, 64, 8, 8, 3)
    table = {"fp8": {"16": large.__dict__, "8192": large.__dict__}, "fp8_static": {"16": small.__dict__}}
    (tmp_path / "fused_moe_h200.json").write_text(json.dumps(table))
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    moe_config._tuned.cache_clear()
    try:
        assert moe_config.select_config(1, "fp8_static", "NVIDIA H200") == small
        assert moe_config.select_config(4096, "fp8_static", "NVIDIA H200") == large
        assert moe_config.select_config(1, "fp8", "NVIDIA H200") == large
    finally:
        moe_config._tuned.cache_clear()


def test_config_tables_are_keyed_by_the_gpus_name_and_others_get_the_defaults(hy3c_log):
    """An H200 takes fused_moe_h200.json and an H100 fused_moe_h100_80gb_hbm3.json; an H20 or the CPU (no
    GPU) take the untuned defaults — never another GPU's tiles — and a GPU without a table is logged
    once; the compile report's text for a target says which it gets."""
    from hy3c.kernels.moe import config as moe_config

    assert moe_config.device_key("NVIDIA H200") == "h200" and moe_config.device_key("NVIDIA H20") == "h20"
    assert moe_config.device_key("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    tuned = moe_config.select_config(1, "bf16", "NVIDIA H200")
    assert tuned.pair_blocks and tuned == moe_config._tuned("h200")["bf16"][1]
    h100 = moe_config.select_config(8192, "fp8", "NVIDIA H100 80GB HBM3")
    assert h100 == moe_config._tuned("h100_80gb_hbm3")["fp8"][8192]
    assert h100 != moe_config.select_config(8192, "fp8", "NVIDIA H200")
    defaults = moe_config._DEFAULTS[16]
    moe_config._tuned.cache_clear()
    try:
        for gpu in ("NVIDIA H20", None, "NVIDIA H20"):
            assert moe_config.select_config(1, "bf16", gpu) == defaults
        untuned = [r.getMessage() for r in hy3c_log.records if "moe_configs_untuned" in r.getMessage()]
        assert len(untuned) == 1 and "missing=fused_moe_h20.json" in untuned[0]
    finally:
        moe_config._tuned.cache_clear()
    assert moe_config.table_for("h200") == "fused_moe_h200.json"
    assert (
        moe_config.table_for("h20") == "untuned defaults (no fused_moe_h20.json; tuned: h100_80gb_hbm3, h200)"
    )


def test_gluon_moe_slots_and_support():
    """The Gluon one-token kernels' shared memory at Hy3's widths: five gate-up slots (one program per SM),
    six down slots with two programs per SM for FP8; the inputs they take (what `lower` checks) and the
    launch they need (never on CPU tensors)."""
    from hy3c.kernels.moe import fused_moe_gluon as mod

    for dtype, slots in ((FP8_DTYPE, (5, 6)), (torch.bfloat16, (4, 5))):
        w13 = torch.empty(2, 3072, 4096, dtype=dtype, device="meta")
        w2 = torch.empty(2, 4096, 1536, dtype=dtype, device="meta")
        assert (mod.gate_up_slots(w13), mod.down_slots(w2)) == slots
        ring = mod.down_slots(w2) * mod.BLOCK_ROWS.value * mod.BOX_BYTES
        assert 2 * (ring + mod._row_bytes(1536, mod.BOX_BYTES // dtype.itemsize) + 1024) <= 228 * 1024
        assert mod.unsupported_inputs(w13, w2, torch.bfloat16) is None
        assert "in a torch.float32 model" in mod.unsupported_inputs(w13, w2, torch.float32)
    small = (torch.empty(2, 128, 64, dtype=FP8_DTYPE), torch.empty(2, 64, 64, dtype=FP8_DTYPE))
    assert "multiples of 128" in mod.unsupported_inputs(*small, torch.bfloat16)
    fp8 = (torch.empty(2, 256, 128, dtype=FP8_DTYPE), torch.empty(2, 128, 128, dtype=FP8_DTYPE))
    assert mod.unsupported_inputs(*fp8, torch.bfloat16) is None
    assert mod.unsupported_launch(*fp8) == "not an sm_90 GPU"


def test_fused_moe_rejects_weight_scales_of_other_widths():
    """Weight scales are per tensor ([E, 1]) or per output channel ([E, rows]); any other width would be
    read out of bounds by the kernels, so it is refused with the field's name."""
    experts, hidden, inter = 2, 64, 32
    w13 = torch.zeros(experts, 2 * inter, hidden).to(FP8_DTYPE)
    w2 = torch.zeros(experts, hidden, inter).to(FP8_DTYPE)
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    ids, weights = torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2)
    good13, good2 = torch.ones(experts, 2 * inter), torch.ones(experts, 1)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe_triton(x, weights, ids, w13, w2, torch.ones(experts, 2), good2, None, None, None)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe_triton(x, weights, ids, w13, w2, good13, torch.ones(experts, inter), None, None, None)
