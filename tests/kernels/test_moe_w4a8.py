"""W4A8 experts (int4 weights in groups, FP8 activations): the packing helpers, the reference, and the
Triton FusedMoE GEMMs against it under TRITON_INTERPRET=1 at small shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from hy3c.kernels.moe.config import MoeConfig, select_config
from hy3c.kernels.moe.fused_moe import fused_moe_triton
from hy3c.kernels.moe.fused_moe_w4a8 import _interleave_bytes, _sign_magnitude_bytes, w4a8_block_k
from hy3c.ops.quant import (
    dequantize_int4_groups,
    pack_int4,
    per_token_scale,
    quantize_fp8,
    quantize_int4_groups,
    unpack_int4,
)

hy3 = torch.ops.hy3
CFG = MoeConfig(16, 32, 32, 1, 4, 1)
GROUP = 32


def _experts(experts: int, hidden: int, inter: int, group: int = GROUP):
    w13 = 0.1 * torch.randn(experts, 2 * inter, hidden)
    w2 = 0.1 * torch.randn(experts, hidden, inter)
    return (*quantize_int4_groups(w13, group), *quantize_int4_groups(w2, group))


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def test_int4_packing_round_trips_and_puts_the_even_column_low():
    values = torch.tensor([[-8, 7, 0, -1, 3, -5]], dtype=torch.int8)
    packed = pack_int4(values)
    assert packed.tolist() == [[0x78, 0xF0, 0xB3]]  # (7 << 4) | 8, (-1 << 4) | 0, (-5 << 4) | 3
    assert torch.equal(unpack_int4(packed), values)
    every = torch.arange(-8, 8, dtype=torch.int8).repeat(4)
    assert torch.equal(unpack_int4(pack_int4(every)), every)


def test_group_quantization_error_is_bounded_by_half_a_step():
    w = torch.randn(3, 16, 128)
    packed, scale = quantize_int4_groups(w, 32)
    assert packed.shape == (3, 16, 64) and packed.dtype == torch.uint8 and scale.shape == (3, 16, 4)
    error = (dequantize_int4_groups(packed, scale) - w).abs().unflatten(-1, (4, 32))
    assert (error <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    with pytest.raises(
        ValueError,
        match="group size 48 must be a power of two of at least 16 and divide the 128 input columns",
    ):
        quantize_int4_groups(w, 48)


@pytest.mark.parametrize("shape", [(5, 16, 128), (24, 64)])
def test_a_large_weight_is_quantized_in_slices_with_the_same_result(monkeypatch, shape):
    import hy3c.ops.quant as quant

    w = torch.randn(shape)
    whole = quantize_int4_groups(w, 32)
    monkeypatch.setattr(quant, "_INT4_CHUNK_VALUES", 2 * w[0].numel())  # slices of 2 along dim 0, 1 left
    sliced = quantize_int4_groups(w, 32)
    assert torch.equal(sliced[0], whole[0]) and torch.equal(sliced[1], whole[1])


def test_reference_is_fp8_rows_times_the_dequantized_int4_weights():
    """The op's definition, written out for one expert: per-token FP8 rows, exact int4 · group scale."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(1, 64, 32)
    ids, weights = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    out = hy3.fused_moe(x, weights, ids, q13, q2, s13, s2, None, None, None)
    scale = per_token_scale(x)
    gate_up = (
        (quantize_fp8(x, scale).float() @ dequantize_int4_groups(q13[0], s13[0]).t()) * scale
    ).bfloat16()
    h = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    h_scale = per_token_scale(h)
    hq = quantize_fp8(h, h_scale).float()
    expected = ((hq @ dequantize_int4_groups(q2[0], s2[0]).t()) * h_scale).bfloat16()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "options",
    [{}, {"swap_ab": True}, {"pair_blocks": True}, {"pair_blocks": True, "swap_ab": True}, {"block_m": 32}],
)
@pytest.mark.parametrize("activations", ["dynamic", "static", "pre-quantized"])
@pytest.mark.parametrize("subnormal", [False, True], ids=["fp16-widening", "subnormal-widening"])
def test_w4a8_fused_moe_equals_its_reference(options, activations, subnormal):
    tokens, experts, top_k = 9 if not options.get("pair_blocks") else 1, 8, 2
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(experts, 64, 32)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
    weights, shared = torch.rand(tokens, top_k), torch.randn(tokens, 64).to(torch.bfloat16)
    a13 = torch.tensor([x.float().abs().max() / 448]) if activations == "static" else None
    a2 = torch.tensor([0.02]) if activations == "static" else None
    args = (x, weights, ids, q13, q2, s13, s2, a13, a2, shared)
    if activations == "pre-quantized":
        scale = per_token_scale(x)
        args = (*args, quantize_fp8(x, scale), scale)
    ref = hy3.fused_moe(*args)
    config = dataclasses.replace(CFG, **options, int4_subnormal=subnormal)
    out = fused_moe_triton(*args, config=config, pdl=False)
    assert _relative_error(out, ref) < 1e-2


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_w4a8_down_gemm_takes_its_own_tiles(activations):
    """The down GEMM's own tiles (`MoeConfig.down`): wider column blocks and a K block of two groups
    give the shared tiles' output bit for bit (a K block steps a group at a time, in the same order)."""
    tokens, experts = 9, 8
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(experts, 64, 64)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)]).int()
    a13 = torch.tensor([x.float().abs().max() / 448]) if activations == "static" else None
    a2 = torch.tensor([0.02]) if activations == "static" else None
    args = (x, torch.rand(tokens, 2), ids, q13, q2, s13, s2, a13, a2, None)
    shared_tiles = fused_moe_triton(*args, config=CFG, pdl=False)
    own = dataclasses.replace(CFG, down_block_n=64, down_block_k=64, down_num_stages=2)
    assert torch.equal(fused_moe_triton(*args, config=own, pdl=False), shared_tiles)
    assert _relative_error(shared_tiles, hy3.fused_moe(*args)) < 1e-2


@pytest.mark.parametrize("activations", ["dynamic", "pre-quantized, static intermediate"])
def test_subnormal_widening_gives_the_fp16_widenings_result_bit_for_bit(activations):
    """Both widenings give the MMA q exactly (q · 2⁻⁹ and the 2⁹ after it are powers of two), so with K
    blocks of half a group (32 of 64 columns) and any activations the layer's output is the same."""
    tokens, experts = 5, 4
    x = torch.randn(tokens, 128).to(torch.bfloat16)
    x[:, :4] *= 20
    q13, s13, q2, s2 = _experts(experts, 128, 64, group=64)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)]).int()
    scale = per_token_scale(x)
    extra, a2 = (
        ((), None) if activations == "dynamic" else ((quantize_fp8(x, scale), scale), torch.tensor([0.05]))
    )
    args = (x, torch.rand(tokens, 2), ids, q13, q2, s13, s2, None, a2, None, *extra)
    outs = [
        fused_moe_triton(*args, config=dataclasses.replace(CFG, block_k=32, int4_subnormal=sub), pdl=False)
        for sub in (False, True)
    ]
    assert torch.equal(outs[0], outs[1])
    assert _relative_error(outs[1], hy3.fused_moe(*args)) < 1e-2


@pytest.mark.parametrize("swap_ab", [False, True], ids=["tokens-as-rows", "weights-as-rows"])
def test_k_blocks_of_several_groups_step_a_group_at_a_time(swap_ab):
    """A K block of 2 or 4 groups (more bytes a loop iteration) multiplies each group by its own scale
    and sums in the same order as blocks of one group: the same output bit for bit. A block that does
    not divide both GEMMs' K is halved until it does."""
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=128), 32, 128, 64) == (64, 32)
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=256), 128, 4096, 1536) == (256, 128)
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=512), 128, 4096, 1536) == (512, 128)
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=512), 128, 4096, 640) == (128, 128)
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=64), 128, 4096, 1536) == (64, 64)
    assert w4a8_block_k(dataclasses.replace(CFG, block_k=192), 32, 128, 64) == (64, 32)  # a power of two
    tokens, experts = 5, 4
    x = torch.randn(tokens, 128).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(experts, 128, 128, group=32)
    s13[..., 1::2] *= 3  # groups of very different scales: a block scaled as one group would show
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)]).int()
    args = (x, torch.rand(tokens, 2), ids, q13, q2, s13, s2, None, None, None)
    one, two, four = (
        fused_moe_triton(
            *args,
            config=dataclasses.replace(CFG, block_k=bk, swap_ab=swap_ab, int4_subnormal=True),
            pdl=False,
        )
        for bk in (32, 64, 128)
    )
    assert torch.equal(one, two) and torch.equal(one, four)
    assert _relative_error(four, hy3.fused_moe(*args)) < 1e-2


@triton.jit
def _sign_magnitude_kernel(in_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _sign_magnitude_bytes(tl.load(in_ptr + offs)))


def test_sign_magnitude_bytes_are_the_e4m3_values_of_the_nibbles():
    """Every two's-complement nibble (0–15, q = nibble − 16 from 8 up) in every byte of a word becomes the
    e4m3 byte of q · 2⁻⁹, exactly, whatever its neighbours hold (no carry or borrow between bytes)."""
    nibbles = torch.tensor(
        [[(word + 5 * byte) % 16 for byte in range(4)] for word in range(16)], dtype=torch.uint8
    )
    words = nibbles.view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    _sign_magnitude_kernel[(1,)](words, out, N=16)
    values = out.view(torch.float8_e4m3fn).reshape(16, 4).float()
    q = torch.where(nibbles >= 8, nibbles.int() - 16, nibbles.int()).float()
    assert torch.equal(values, q * 2.0**-9)


@triton.jit
def _interleave_kernel(even_ptr, odd_ptr, out_ptr, N: tl.constexpr, PRMT: tl.constexpr):
    offs = tl.arange(0, N)
    first, second = _interleave_bytes(tl.load(even_ptr + offs), tl.load(odd_ptr + offs), PRMT)
    tl.store(out_ptr + 2 * offs, first)
    tl.store(out_ptr + 2 * offs + 1, second)


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32 d, a, b, c` (default mode): byte i of d is byte (nibble i of c) & 7 of b:a."""
    both = (b & 0xFFFFFFFF) << 32 | (a & 0xFFFFFFFF)
    picked = [(both >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF for i in range(4)]
    return int.from_bytes(bytes(picked), "little", signed=True)


@pytest.mark.parametrize("prmt", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["masks", "prmt"])
def test_byte_interleave_matches_ptx_prmt(prmt):
    """The subnormal widening's byte interleave, (e0 o0 e1 o1) and (e2 o2 e3 o3) from (e0 e1 e2 e3) and
    (o0 o1 o2 o3): PTX `prmt` with selectors 0x5140 and 0x7362 on the GPU, shifts and masks elsewhere,
    against a model of `prmt` itself."""
    device = "cuda" if prmt else "cpu"
    even, odd = (torch.randint(-(2**31), 2**31, (64,), dtype=torch.int32, device=device) for _ in range(2))
    out = torch.empty(128, dtype=torch.int32, device=device)
    _interleave_kernel[(1,)](even, odd, out, N=64, PRMT=prmt)
    expected = []
    for e, o in zip(even.tolist(), odd.tolist()):
        expected += [_prmt(e, o, 0x5140), _prmt(e, o, 0x7362)]
    assert out.tolist() == expected


def test_w4a8_fused_moe_at_a_group_of_128_with_default_configs():
    """Hy3's group size (128) with the built-in W4A8 configs, for one token and for many."""
    q13, s13, q2, s2 = _experts(4, 256, 128, group=128)
    for tokens in (1, 20):
        x = torch.randn(tokens, 256).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)]).int()
        args = (x, torch.rand(tokens, 2), ids, q13, q2, s13, s2, None, None, None)
        # K blocks of one group at 1 token, of two above (halved to one here: inter is a single group)
        assert w4a8_block_k(select_config(tokens, "w4a8", None), 128, 256, 128) == (128, 128)
        assert _relative_error(fused_moe_triton(*args, pdl=False), hy3.fused_moe(*args)) < 1e-2


def test_w4a8_pairs_without_an_expert_add_nothing():
    """Expert parallelism: ids of −1 are skipped, and the two halves of the experts sum to the layer."""
    tokens, experts = 6, 8
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(experts, 64, 32)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, 2)
    whole = fused_moe_triton(x, weights, ids, q13, q2, s13, s2, None, None, None, config=CFG, pdl=False)
    parts = []
    for first in (0, 4):
        local = torch.where((ids >= first) & (ids < first + 4), ids - first, -1).int()
        held = slice(first, first + 4)
        parts.append(
            fused_moe_triton(
                x,
                weights,
                local,
                q13[held],
                q2[held],
                s13[held],
                s2[held],
                None,
                None,
                None,
                config=CFG,
                pdl=False,
            ).float()
        )
    assert _relative_error(parts[0] + parts[1], whole) < 1e-2


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("w2 unpacked", r"W4A8 w2 must be uint8 \[4, 64, 16\]"),
        ("scale of another group", r"W4A8 w13 and w2 have different group sizes"),
        ("scale missing", r"W4A8 w13_scale must be fp32 \[4, 64, 64 / group\], got None"),
        ("x of another width", r"x has 128 columns, the W4A8 experts 64"),
        ("groups of 16", r"the W4A8 GEMMs need groups of at least 32 columns"),
        ("groups of 24", r"group size 24 must be a power of two"),
        ("w13 off a word boundary", r"W4A8 w13 must start on a 4-byte boundary"),
    ],
)
def test_w4a8_fused_moe_refuses_misshaped_weights(case, message):
    x = torch.randn(2, 64).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(4, 64, 32)
    if case == "w2 unpacked":
        q2 = torch.zeros(4, 64, 32, dtype=torch.uint8)
    elif case == "scale of another group":
        s2 = torch.ones(4, 64, 2)
    elif case == "x of another width":
        x = torch.randn(2, 128).to(torch.bfloat16)
    elif case == "groups of 16":
        q13, s13, q2, s2 = _experts(4, 64, 32, group=16)
    elif case == "groups of 24":  # hidden 96 in 4 groups: of 24 columns each
        x = torch.randn(2, 96).to(torch.bfloat16)
        q13, q2 = torch.zeros(4, 64, 48, dtype=torch.uint8), torch.zeros(4, 96, 16, dtype=torch.uint8)
        s13, s2 = torch.ones(4, 64, 4), torch.ones(4, 96, 1)
    elif case == "w13 off a word boundary":  # contiguous, one byte into its storage
        q13 = torch.cat([torch.zeros(1, dtype=torch.uint8), q13.flatten()])[1:].view(q13.shape)
    else:
        s13 = None
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        fused_moe_triton(x, torch.rand(2, 2), ids, q13, q2, s13, s2, None, None, None, config=CFG, pdl=False)


def test_opcheck_fused_moe_with_w4a8_experts():
    x = torch.randn(6, 64)
    q13, s13, q2, s2 = _experts(4, 64, 32)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [0, 2], [1, 3], [2, 3]], dtype=torch.int32)
    torch.library.opcheck(
        hy3.fused_moe.default, (x, torch.rand(6, 2), ids, q13, q2, s13, s2, None, None, None)
    )
    torch.library.opcheck(hy3.moe_experts.default, (x, torch.rand(6, 2), ids, q13, q2, s13, s2, None, None))


def _real_shape_layer(tokens: int) -> tuple:
    """fused_moe's arguments for Hy3's experts (192 × [3072, 4096] and [4096, 1536], top-8, int4 groups
    of 128) on the GPU, with a shared expert's output."""
    experts, hidden, inter = 192, 4096, 1536
    q13, s13 = quantize_int4_groups(0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda"), 128)
    q2, s2 = quantize_int4_groups(0.02 * torch.randn(experts, hidden, inter, device="cuda"), 128)
    # rows with a mean and a few large columns, as MoE inputs have (an offset-binary widening's MMA
    # summed a · (q + 8) and lost 2% to taking 8 · Σa back out: bench/LOG.md, session 32)
    x = torch.randn(tokens, hidden, device="cuda") + 0.5
    x[:, :8] *= 20
    x = x.to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:8] for _ in range(tokens)]).int()
    weights, shared = torch.rand(tokens, 8, device="cuda"), torch.randn_like(x)
    return (x, weights, ids, q13, q2, s13, s2, None, None, shared)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_w4a8_k_blocks_of_several_groups_at_real_shapes(tokens):
    """K blocks of 2 and 4 groups of 128 (the sweep's deeper configs) give the one-group blocks' output
    at Hy3's shapes, and match the reference."""
    args = _real_shape_layer(tokens)
    one_group = dataclasses.replace(
        select_config(tokens, "w4a8", torch.cuda.get_device_name()), block_k=128, int4_subnormal=True
    )
    outs = [
        fused_moe_triton(*args, config=dataclasses.replace(one_group, block_k=block_k, num_stages=stages))
        for block_k, stages in ((128, 4), (256, 3), (512, 2))
    ]
    assert _relative_error(outs[0], hy3.fused_moe(*args)) < 1e-2
    assert _relative_error(outs[1], outs[0]) < 1e-6 and _relative_error(outs[2], outs[0]) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4])
def test_w4a8_one_token_gate_up_split_over_k_at_real_shapes(split_k):
    """The one-token gate-up with its K cut in 2 and 4 parts (fp32 atomics, arrival counters) at Hy3's
    shapes on the GPU: the unsplit output up to the order of the part sums, twice in a row."""
    args = _real_shape_layer(1)
    shipped = dataclasses.replace(select_config(1, "w4a8", torch.cuda.get_device_name()), split_k=1)
    whole = fused_moe_triton(*args, config=shipped)
    split = dataclasses.replace(shipped, split_k=split_k)
    first, second = (fused_moe_triton(*args, config=split) for _ in range(2))
    assert _relative_error(first, whole) < 2e-3 and _relative_error(second, whole) < 2e-3
    assert _relative_error(first, hy3.fused_moe(*args)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 128, 2048])
@pytest.mark.parametrize("subnormal", [False, True], ids=["fp16-widening", "subnormal-widening"])
def test_w4a8_fused_moe_real_shapes(tokens, subnormal):
    """Hy3's experts (192 × [3072, 4096] and [4096, 1536], top-8, groups of 128) on the GPU, with the
    shipped configs (and their subnormal widening: e4m3 subnormals through the FP8 MMA, the byte
    permutes in inline PTX): against the reference, with x as given or as the norm's FP8 rows."""
    args = _real_shape_layer(tokens)
    x = args[0]
    ref = hy3.fused_moe(*args)
    shipped = select_config(tokens, "w4a8", torch.cuda.get_device_name())
    config = dataclasses.replace(shipped, int4_subnormal=subnormal)
    baseline = dataclasses.replace(shipped, int4_subnormal=False)
    scale = per_token_scale(x)
    for extra in ((), (quantize_fp8(x, scale), scale)):  # x as given, or as the norm's FP8 rows
        error = _relative_error(fused_moe_triton(*args, *extra, config=config), ref)
        assert error < 1e-2
        # no worse than the fp16 widening's (its e4m3 weights are exact too) by more than a margin far
        # below FP8's own rounding of the activations (~3e-2 of bf16)
        assert error <= 1.5 * _relative_error(fused_moe_triton(*args, *extra, config=baseline), ref) + 1e-3


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("activations", ["dynamic", "pre-quantized, static intermediate"])
def test_a_one_token_gate_up_split_over_k_sums_its_parts(split_k, activations):
    """Pair blocks with the gate-up's K cut in 2 or 4 parts (fp32 atomics, the last part's program
    finishing the tile): the unsplit output up to the order of a few fp32 sums, the reference's within
    its tolerance, and the scratch counters leave no trace in a second call."""
    experts, top_k, hidden = 8, 4, 256
    x = torch.randn(1, hidden).to(torch.bfloat16)
    q13, s13, q2, s2 = _experts(experts, hidden, 64)
    ids = torch.randperm(experts)[:top_k].int()[None]
    scale = per_token_scale(x)
    extra, a2 = (
        ((), None) if activations == "dynamic" else ((quantize_fp8(x, scale), scale), torch.tensor([0.05]))
    )
    args = (x, torch.rand(1, top_k), ids, q13, q2, s13, s2, None, a2, torch.randn_like(x), *extra)
    one = dataclasses.replace(CFG, pair_blocks=True, swap_ab=True, int4_subnormal=True)
    whole = fused_moe_triton(*args, config=one, pdl=False)
    split = dataclasses.replace(one, split_k=split_k)
    first, second = (fused_moe_triton(*args, config=split, pdl=False) for _ in range(2))
    assert torch.equal(first, second)
    assert _relative_error(first, whole) < 1e-2  # bf16 rounding of sums that differ in the last fp32 bits
    assert _relative_error(first, hy3.fused_moe(*args)) < 1e-2


@pytest.mark.parametrize(
    "config, message",
    [
        (dataclasses.replace(CFG, split_k=2), "split_k 2 needs pair_blocks"),
        (dataclasses.replace(CFG, pair_blocks=True, split_k=16), "split_k 16 does not cut hidden 256"),
    ],
)
def test_a_gate_up_split_that_cannot_run_is_one_error(config, message):
    x, ids = torch.randn(1, 256).to(torch.bfloat16), torch.tensor([[0, 1]], dtype=torch.int32)

    def layer(*experts):  # (w13, w2, w13_scale, w2_scale), no static scales, no shared expert
        return (x, torch.rand(1, 2), ids, *experts, None, None, None)

    q13, s13, q2, s2 = _experts(4, 256, 64)
    with pytest.raises(ValueError, match=message):
        fused_moe_triton(*layer(q13, q2, s13, s2), config=config, pdl=False)
    with pytest.raises(ValueError, match="persistent GEMMs are for bf16 / FP8 experts"):
        fused_moe_triton(*layer(q13, q2, s13, s2), config=MoeConfig(128, 32, 32, persistent=True), pdl=False)
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        MoeConfig(16, 32, 32, split_k=0)
    bf16 = layer(torch.randn(4, 128, 256).bfloat16(), torch.randn(4, 256, 64).bfloat16(), None, None)
    with pytest.raises(ValueError, match="split_k 2 is for W4A8 experts only"):
        fused_moe_triton(*bf16, config=dataclasses.replace(CFG, pair_blocks=True, split_k=2), pdl=False)
