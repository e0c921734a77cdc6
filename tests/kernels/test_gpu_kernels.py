"""The Triton and cublas kernels at real Hy3 shapes on a CUDA GPU (skipped on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hy3c.kernels
import hy3c.ops  # noqa: F401
from hy3c.kernels import overrides
from hy3c.kernels.attention import plan as plan_mod
from hy3c.kernels.attention import prefill_gluon, qknorm_rope_kvstore
from hy3c.kernels.attention.config import (
    GLUON_PREFILL_CONFIG,
    LaunchConfig,
    prefill_config,
    triton_prefill_config,
)
from hy3c.kernels.attention.decode import decode_attention_dynamic
from hy3c.kernels.attention.prefill import prefill_attention
from hy3c.kernels.moe import fused_moe_gluon, router
from hy3c.ops.quant import FP8_DTYPE
from tests.kernels.attention_checks import assert_attention_close, fp8_reference_and_bound

pytestmark = pytest.mark.gpu


def _config(tokens: int, kind: str):
    """The FusedMoE config this GPU's table has for a token count (`hy3c.kernels.moe.config`)."""
    from hy3c.kernels.moe.config import select_config

    return select_config(tokens, kind, torch.cuda.get_device_name())


hy3 = torch.ops.hy3
HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 128, 64


def _paged(lengths, new, cache_dtype, device="cuda", key_ramp=0.0, page=PAGE):
    """A paged cache of random K/V (key at position t scaled by 1 + key_ramp·t) and the queries."""
    pages_per = [-(-n // page) for n in lengths]
    total = sum(pages_per)
    order = torch.randperm(total, device=device)
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32, device=device)
    # slots no token is written to hold NaN: a kernel that lets a tail row past the sequence reach the
    # output (TMA copies read whole page slices) fails the comparison
    cache = torch.full(
        (1, 2, total, page, KV_HEADS, HEAD_DIM), float("nan"), dtype=cache_dtype, device=device
    )
    scales = torch.tensor([[0.05, 0.04]], device=device)
    cursor = 0
    for r, n in enumerate(lengths):
        pages = order[cursor : cursor + pages_per[r]]
        cursor += pages_per[r]
        table[r, : len(pages)] = pages.int()
        pos = torch.arange(n, device=device)
        slots = pages[pos // page].long() * page + pos % page
        hy3.kv_store(
            torch.randn(n, KV_HEADS, HEAD_DIM, device=device) * (1 + key_ramp * pos)[:, None, None],
            torch.randn(n, KV_HEADS, HEAD_DIM, device=device),
            cache,
            scales,
            0,
            slots,
        )
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(int(qsl[-1]), HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, cache, scales, table, seq_lens, qsl


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_decode_attention_real_shapes(cache_dtype):
    lengths = [1, 63, 64, 65, 1000, 4097, 20000, 333]
    q, cache, scales, table, seq_lens, _ = _paged(lengths, [1] * len(lengths), cache_dtype)
    for rows in (slice(0, None), slice(4, None)):  # a batch; fewer requests (their own launch config)
        n = len(lengths[rows])
        few_qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        kv = (cache, scales, 0, table[rows], seq_lens[rows], few_qsl, HEAD_DIM**-0.5)
        plan = hy3.attention_plan(seq_lens[rows], few_qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
        dyn = decode_attention_dynamic(q[rows], *kv[:5], kv[6], plan)
        assert_attention_close(dyn, q[rows], *kv)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_prefill_attention_real_shapes(cache_dtype):
    lengths, new = [2048, 700, 5], [2048, 300, 1]
    q, cache, scales, table, seq_lens, qsl = _paged(lengths, new, cache_dtype)
    kv = (cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    out = prefill_attention(q, *kv, plan)
    assert_attention_close(out, q, *kv)
    for stages in (2, 3):  # key blocks by TMA bulk copies (one per 64-key page), and per-row pointers
        for tma in (True, False):
            cfg = LaunchConfig(block_n=PAGE, num_warps=8, num_stages=stages, tma=tma)
            assert_attention_close(prefill_attention(q, *kv, plan, config=cfg), q, *kv)
    default = triton_prefill_config(cache_dtype, PAGE)  # eager rescaling: the lazy choice agrees
    other = dataclasses.replace(default, lazy_rescale=not default.lazy_rescale)
    assert_attention_close(prefill_attention(q, *kv, plan, config=other), q, *kv)


@pytest.mark.parametrize(
    ("lengths", "new"),
    [
        ([2048, 700, 5], [2048, 300, 1]),  # a full prefill, a chunk over a cached prefix, one token
        ([8192], [8192]),
        ([130, 64, 65, 1], [130, 1, 65, 1]),  # lengths around the 64-key page and the 128-key block
        ([5000, 33], [77, 33]),  # a chunk whose length is no multiple of the 16-token query block
        ([129], [2]),  # the last key block holds one key of its 128
    ],
)
@pytest.mark.parametrize("page", [64, 128, 192])  # a 128-key block: two pages, one page, across two
def test_gluon_prefill_matches_reference(lengths, new, page):
    """The warp-specialized Gluon kernel (bf16 KV, the shipped config; unused slots hold NaN) against the
    reference, and the default config runs it on this GPU."""
    q, cache, scales, table, seq_lens, qsl = _paged(lengths, new, torch.bfloat16, page=page)
    kv = (cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5)
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    assert prefill_config(torch.bfloat16, page) == GLUON_PREFILL_CONFIG
    assert prefill_gluon.unsupported_inputs(q.dtype, cache.dtype, HEAD_DIM, 128) is None
    assert prefill_gluon.unsupported_launch(q, cache) is None
    out = prefill_attention(q, *kv, plan)
    assert_attention_close(out, q, *kv)
    triton_out = prefill_attention(q, *kv, plan, config=triton_prefill_config(torch.bfloat16, page))
    assert not torch.equal(out, triton_out)  # 128-key blocks round differently: the Gluon kernel ran


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_prefill_lazy_rescaling_with_growing_scores_real_shapes(cache_dtype):
    """Key norms ramped ×5 over 2K positions and q ×4: a row's max keeps outgrowing the kept one by more
    than 2^8 after the first key block (over a thousand times per 256 rows in a CPU simulation), so the
    lazy path's rescale of a nonzero accumulator runs on the GPU."""
    q, cache, scales, table, seq_lens, qsl = _paged([2048, 700], [2048, 300], cache_dtype, key_ramp=0.002)
    q = q * 4
    plan = hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(8))
    kv = (cache, scales, 0, table, seq_lens, qsl, HEAD_DIM**-0.5)
    config = dataclasses.replace(triton_prefill_config(cache_dtype, PAGE), lazy_rescale=True)
    out = prefill_attention(q, *kv, plan, config=config)
    if cache_dtype != FP8_DTYPE:
        assert_attention_close(out, q, *kv)
        return
    # FP8: at scores this sharp the e4m3 QK product (its MMA accumulates with fewer bits than fp32)
    # moves a few probabilities past P's rounding bound (23 of 19M elements, max 0.034, in the eager and
    # the lazy kernel alike — measured on the H200 with P in f16), so elementwise the lazy kernel is held
    # to the eager one within twice the bound, and to the reference in norm
    ref, bound = fp8_reference_and_bound(q, *kv)
    eager = dataclasses.replace(config, lazy_rescale=False)
    out_eager = prefill_attention(q, *kv, plan, config=eager).float()
    assert ((out.float() - out_eager).abs() <= 2 * bound + 2e-2).all()
    assert (out.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("slot_layout", ["random", "prefill", "prefill after decodes"])
def test_qknorm_rope_kvstore_real_shapes(cache_dtype, hadamard, slot_layout):
    """Every token at a random slot (a tenth padding); a prefill's slots (consecutive per page: FP8's
    V programs store aligned windows of them as vectors, each program's tokens starting at page offsets
    that are multiples of 16); the same after 5 decode tokens (windows straddling two programs)."""
    tokens = 4096
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 200000, (tokens,), device="cuda")
    qw = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kw = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    caches = [
        torch.zeros(2, 2, tokens // PAGE + 1, PAGE, KV_HEADS, HEAD_DIM, dtype=cache_dtype, device="cuda")
        for _ in range(2)
    ]
    scales = torch.tensor([[0.1, 0.1], [0.05, 0.04]], device="cuda")
    if slot_layout == "random":
        slots = torch.randperm(tokens + PAGE, device="cuda")[:tokens]
        slots[::7] = -1
    else:
        decodes = 5 if slot_layout == "prefill after decodes" else 0
        pages = torch.randperm(tokens // PAGE, device="cuda")
        chunk = torch.arange(tokens - decodes, device="cuda")
        decode_slots = tokens // PAGE * PAGE + torch.arange(decodes, device="cuda")  # the last page
        slots = torch.cat([decode_slots, pages[chunk // PAGE] * PAGE + chunk % PAGE])
    args = (pos, qw, kw, 1e-5, 11158840.0)
    q_ref = hy3.qknorm_rope_quant_kvstore(qkv, *args, caches[1], scales, 1, slots, HEADS, KV_HEADS, hadamard)
    v_programs = ((16, 2), (32, 2), (16, 1)) if cache_dtype == FP8_DTYPE else ((16, 2),)  # FP8 only
    for v_tokens, v_heads in v_programs:  # tokens and KV heads per V program
        caches[0].zero_()
        q_tri = qknorm_rope_kvstore.launch(
            qkv,
            *args,
            caches[0],
            scales,
            1,
            slots,
            HEADS,
            KV_HEADS,
            hadamard,
            v_tokens=v_tokens,
            v_heads=v_heads,
        )
        torch.testing.assert_close(q_tri.float(), q_ref.float(), atol=2e-2, rtol=1e-2)
        # e4m3 has 3 mantissa bits: FMA contraction may move a value across a rounding tie, one ulp (12.5%)
        torch.testing.assert_close(caches[0].float(), caches[1].float(), atol=0.07, rtol=0.13)


def test_grouped_moe_real_shapes():
    tokens, experts, top_k, hidden, inter = 128, 192, 8, 4096, 1536
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = 0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).int()
    w = torch.rand(tokens, top_k, device="cuda")
    ref = hy3.moe_experts(x, w, ids, w13, w2, None, None, None, None).float()
    out = torch.ops.hy3_cublas.moe_experts(x, w, ids, w13, w2, None, None, None, None).float()
    assert (out - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("tokens", [1, 128, 1024])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_real_shapes(tokens, fp8, monkeypatch):
    """The Triton kernels (the one-token Gluon ones have tests of their own below) and their configs."""
    from hy3c.kernels.moe.fused_moe import fused_moe_triton

    monkeypatch.setenv(overrides.GLUON, "0")  # the override: the Triton kernels whatever a call says

    experts, top_k, hidden, inter = 192, 8, 4096, 1536
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = 0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    scales = (None, None)
    if fp8:
        scales = (w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448)
        w13 = (w13.float() / scales[0][..., None]).to(FP8_DTYPE)
        w2 = (w2.float() / scales[1][..., None]).to(FP8_DTYPE)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).int()
    w = torch.rand(tokens, top_k, device="cuda")
    shared = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    args = (x, w, ids, w13, w2, *scales, None, None, shared)
    out = fused_moe_triton(*args).float()
    ref = hy3.fused_moe(*args).float()
    assert (out - ref).norm() / ref.norm() < 1e-2
    tma = dataclasses.replace(_config(tokens, "fp8" if fp8 else "bf16"), tma=True)  # weight tiles by TMA
    assert (fused_moe_triton(*args, config=tma).float() - out).norm() / out.norm() < 1e-3
    kind = "fp8" if fp8 else "bf16"
    if not _config(tokens, kind).pair_blocks:  # the down GEMM's own tiles, by pointer loads and by TMA
        for tma in (False, True):
            own = dataclasses.replace(
                _config(tokens, kind),
                tma=tma,
                down_block_n=256,
                down_block_k=128 if fp8 else 64,
                down_num_warps=8,
                down_num_stages=3,
            )
            assert (fused_moe_triton(*args, config=own).float() - out).norm() / out.norm() < 1e-3
    if _config(tokens, kind).block_m <= 32:  # decode sizes: the one-token config's options here too
        cfg_pair = dataclasses.replace(_config(1, kind), swap_ab=True, pair_blocks=True)
        cfg_swap = dataclasses.replace(cfg_pair, pair_blocks=False)  # weights as the MMA's rows, aligned
        cfg_plain = dataclasses.replace(cfg_swap, swap_ab=False)  # the token rows as the MMA's rows
        out_swap = fused_moe_triton(*args, config=cfg_swap).float()
        out_pair = fused_moe_triton(*args, config=cfg_pair).float()
        out_plain = fused_moe_triton(*args, config=cfg_plain).float()
        for other in (out_swap, out_plain):
            assert (other - ref).norm() / ref.norm() < 1e-2
        if tokens == 1:  # each aligned block holds one pair: the same tiles
            assert torch.equal(out_pair, out_swap)
        else:
            assert (out_pair - ref).norm() / ref.norm() < 1e-2
    if fp8 and _config(tokens, "fp8").block_m <= 32:  # activations quantized inside the GEMMs
        for on_load in (False, True):
            cfg = dataclasses.replace(_config(tokens, "fp8"), quant_on_load=on_load)
            other = fused_moe_triton(*args, config=cfg).float()
            assert (other - out).norm() / out.norm() < 1e-3
    if fp8:  # x handed over as the norm's FP8 rows (the Triton norm's quantization): the same output
        normed, _, x_q, x_scale = torch.ops.hy3_triton.add_rms_norm_quant(
            x, torch.zeros_like(x), torch.ones(hidden, device="cuda", dtype=x.dtype), 1e-5, None
        )
        mine = (normed, *args[1:])
        for cfg in (
            _config(tokens, "fp8"),
            dataclasses.replace(_config(1, "fp8"), quant_on_load=True),
        ):
            inside = fused_moe_triton(*mine, config=cfg)
            assert torch.equal(fused_moe_triton(*mine, x_q, x_scale, config=cfg), inside)
    if fp8:  # static activation scales: the gate-up epilogue writes the intermediate as e4m3
        static = (x.float().abs().max().reshape(1) / 448, torch.tensor([0.03], device="cuda"))
        args = (x, w, ids, w13, w2, *scales, *static, shared)
        out = fused_moe_triton(*args).float()
        ref = hy3.fused_moe(*args).float()
        assert (out - ref).norm() / ref.norm() < 1e-2


def _moe_weights(fp8: bool, per_tensor: bool = False):
    """Hy3's experts (192 × [3072, 4096] and [4096, 1536]), bf16 or e4m3 with per-channel (or per-tensor)
    scales."""
    experts, hidden, inter = 192, 4096, 1536
    w13 = 0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        return w13, w2, None, None
    s13, s2 = (w.float().abs().amax(-1, keepdim=per_tensor) / 448 for w in (w13, w2))
    if per_tensor:
        s13, s2 = s13.amax(-2), s2.amax(-2)
    return (w13.float() / s13[..., None]).to(FP8_DTYPE), (w2.float() / s2[..., None]).to(FP8_DTYPE), s13, s2


def _quantize_rows(v: torch.Tensor, scale: torch.Tensor | None = None):
    """e4m3 rows as the kernels quantize them (per-row absmax / 448 unless a static scale) and the scale."""
    v = v.float()
    if scale is None:
        scale = (v.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (v / scale).clamp(-448, 448).to(FP8_DTYPE), scale


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return w.double() if scale is None else w.double() * scale.double()[..., None]


def _assert_roundings_apart(actual: torch.Tensor, expected: torch.Tensor, step: float) -> None:
    """actual within one rounding step (relative `step`: 2⁻⁸ bf16, 2⁻³ e4m3) of expected, give or take
    the sums' own rounding (2⁻⁶ of the values' RMS: values near zero come from sums of large terms), for
    all but 1% of the values (a sum landing on the other side of a rounding boundary), within two steps
    for all but 0.05% (FP8 products summed with the MMA's reduced precision; one run saw 1 of 24576).
    A stale or misplaced K block puts a whole program's 128 values off by a tenth of the RMS or more."""
    floor = 2**-6 * expected.pow(2).mean().sqrt()
    error = (actual - expected).abs()
    beyond_two = int((error > 2 * step * expected.abs() + floor).sum())
    assert beyond_two <= 5e-4 * expected.numel(), f"{beyond_two} values off by more than two steps"
    assert (error > step * expected.abs() + floor).float().mean().item() < 0.01


@pytest.mark.parametrize("variant", ["bf16", "fp8 x_q", "fp8 dynamic", "fp8 static", "fp8 per-tensor"])
def test_gluon_moe_gemms_match_emulation(variant):
    """Each Gluon GEMM against its arithmetic done in fp64 on the same inputs: the gate-up from the e4m3
    (or bf16) rows and weights, rounded as its epilogue rounds; the down GEMM from the gate-up's own
    intermediate, quantized as it quantizes it. Two tokens whose pairs share experts."""
    fp8 = variant != "bf16"
    w13, w2, s13, s2 = _moe_weights(fp8, per_tensor=variant == "fp8 per-tensor")
    top_k, hidden, inter = 8, 4096, 1536
    x = torch.randn(2, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(192, device="cuda")[:top_k] for _ in range(2)]).int()
    ids[1, :3] = ids[0, :3]
    flat = ids.view(-1)
    weights = torch.rand(2, top_k, device="cuda")
    h_static = torch.tensor([0.02], device="cuda") if variant == "fp8 static" else None
    modes = fused_moe_gluon.ROW_AS_IS, fused_moe_gluon.ROW_DYNAMIC, fused_moe_gluon.ROW_STATIC
    if variant == "fp8 static":
        x_static = x.float().abs().max().reshape(1) / 448
        a, a_scale, mode = x, x_static, modes[2]
        a_q, a_s = _quantize_rows(x, x_static)
    elif variant == "fp8 dynamic":
        a, a_scale, mode = x, x.new_empty(1, dtype=torch.float32), modes[1]
        a_q, a_s = _quantize_rows(x)
    elif fp8:
        a_q, a_s = _quantize_rows(x)
        a, a_scale, mode = a_q, a_s.view(-1), modes[0]
    else:
        a, a_scale, mode = x, x.new_empty(1), modes[0]
        a_q, a_s = x, torch.ones(2, 1, device="cuda")
    assert fused_moe_gluon.unsupported_inputs(w13, w2, x.dtype) is None
    assert fused_moe_gluon.unsupported_launch(w13, w2) is None
    h = fused_moe_gluon.gate_up_rows(a, a_scale, mode.value, w13, s13, h_static, flat, top_k, x.dtype, True)

    token = torch.arange(flat.numel(), device="cuda") // top_k
    acc = torch.einsum(
        "pk,pnk->pn", a_q.double()[token], w13.double()[flat.long()]
    )  # unscaled, as the MMA sums
    scale13 = (
        s13[flat.long()].double() if fp8 else torch.ones(1, 2 * inter, device="cuda", dtype=torch.float64)
    )
    scale13 = scale13.expand(-1, 2 * inter) if scale13.shape[-1] == 1 else scale13
    pair_scale = a_s.double().reshape(-1, 1).expand(2, 1)[token]  # per token, or the static scale
    gate, up = (acc * pair_scale * scale13).float().to(torch.bfloat16).float().chunk(2, -1)
    expected_h = ((gate * torch.sigmoid(gate)).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
    if h_static is not None:
        expected_h = (expected_h / h_static).clamp(-448, 448).to(FP8_DTYPE).float()
    _assert_roundings_apart(h.float(), expected_h, 2**-3 if h_static is not None else 2**-8)

    per_pair = fused_moe_gluon.down_rows(h, w2, s2, h_static, flat, weights, True)
    if h_static is not None:
        h_q, h_s = h, h_static.reshape(1, 1)
    elif fp8:
        h_q, h_s = _quantize_rows(h)
    else:
        h_q, h_s = h, torch.ones(1, 1, device="cuda")
    acc = torch.einsum("pk,pnk->pn", h_q.double(), w2.double()[flat.long()])
    scale2 = s2[flat.long()].double() if fp8 else torch.ones(1, 1, device="cuda", dtype=torch.float64)
    expected = acc * h_s.double() * scale2 * weights.view(-1, 1).double()
    assert ((per_pair.double() - expected).norm() / expected.norm()).item() < 2e-3
    # per (pair, 128-column block): a stale or misplaced K block would be off by far more
    block_error = (per_pair.double() - expected).abs().view(-1, 128).amax(-1)
    assert (block_error <= 1e-2 * expected.abs().view(-1, 128).amax(-1) + 1e-6).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_moe_layer_matches_triton(fp8):
    """The one-token layer on the Gluon kernels (what an sm_90 target compiles): bf16 bit-equal to the
    Triton pair-block kernels, FP8 as close to the reference as they are."""
    from hy3c.kernels.moe.fused_moe import fused_moe_triton
    from hy3c.kernels.rowwise.quant import quant_fp8_per_token

    w13, w2, s13, s2 = _moe_weights(fp8)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert fused_moe_gluon.unsupported_inputs(w13, w2, x.dtype) is None
    assert (
        fused_moe_gluon.unsupported_launch(w13, w2) is None
        and _config(1, "fp8" if fp8 else "bf16").pair_blocks
    )
    ids = torch.randperm(192, device="cuda")[:8].int()[None]
    weights = torch.rand(1, 8, device="cuda")
    shared = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    args = (x, weights, ids, w13, w2, s13, s2, None, None, shared)
    if fp8:
        args = (*args, *quant_fp8_per_token(x))  # x from the norm, as the FP8 model runs the layer
    out = fused_moe_triton(*args, gluon=True)
    triton_out = fused_moe_triton(*args, gluon=False)
    if fp8:
        ref = hy3.fused_moe(*args[:10]).float()
        error, triton_error = ((o.float() - ref).norm() / ref.norm() for o in (out, triton_out))
        assert error < 1.5 * triton_error
    else:
        assert torch.equal(out, triton_out)


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_moe_layer_in_a_graph_sees_each_replays_inputs(fp8, pdl):
    """Routing (the Triton top-k kernel), the norm's FP8 rows and the layer captured in one CUDA graph,
    replayed 10 times on new router logits and x: each replay equals the same step run eagerly on those
    inputs — the down kernel reads the top-k ids and starts its weight copies before waiting for the
    gate-up, so a read before its writer finished would show the previous replay's values."""
    from hy3c.kernels.moe.fused_moe import fused_moe_triton
    from hy3c.kernels.rowwise.quant import quant_fp8_per_token

    w13, w2, s13, s2 = _moe_weights(fp8)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, 192, device="cuda")
    bias = 0.1 * torch.randn(192, device="cuda")

    def step() -> torch.Tensor:
        weights, ids = torch.ops.hy3_triton.topk_routing(logits, bias, 8, 2.826, pdl=pdl)
        rows = quant_fp8_per_token(x, pdl=pdl) if fp8 else ()
        return fused_moe_triton(
            x, weights, ids, w13, w2, s13, s2, None, None, None, *rows, gluon=True, pdl=pdl
        )

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    for _ in range(10):
        logits.copy_(torch.randn_like(logits))
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(replayed, step())


@pytest.mark.parametrize("rows", [1, 2, 16, 208, 4096])
def test_router_gemm_real_shapes(rows):
    from hy3c.ops.quant import split_router_weight

    w = 0.02 * torch.randn(192, 4096, device="cuda")
    x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
    hi, lo = split_router_weight(w)
    out = torch.ops.hy3_triton.router_gemm(x, w, hi, lo)
    assert (out.double() - x.double() @ w.double().t()).abs().max() <= 2e-3
    for _ in range(200):  # the last split to arrive adds the partials in split order: bit-equal every time
        assert torch.equal(out, torch.ops.hy3_triton.router_gemm(x, w, hi, lo))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = torch.ops.hy3_triton.router_gemm(x, w, hi, lo)
    for _ in range(200):
        graph.replay()
        assert torch.equal(replayed, out)
    for buffers in router._COUNTERS.values():  # every arrival counter back at zero
        assert all(int(buffer.abs().sum()) == 0 for buffer in buffers)
    logits_w, ids = torch.ops.hy3_triton.topk_routing(out, 0.01 * torch.randn(192, device="cuda"), 8, 2.826)
    assert ids.shape == (rows, 8) and torch.all(logits_w.sum(-1) - 2.826 < 1e-4)


@pytest.mark.parametrize("tokens", [1, 32, 64, 128])
def test_moe_align_real_shapes(tokens):
    """The one-program Triton alignment equals the torch ops at Hy3's 192 experts, top-8."""
    from hy3c.kernels.moe.align import moe_align_torch, moe_align_triton

    ids = torch.stack([torch.randperm(192, device="cuda")[:8] for _ in range(tokens)]).int()
    for block_m in (16, 64):
        got, want = moe_align_triton(ids, 192, block_m), moe_align_torch(ids, 192, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_layer_offset_beyond_int32_on_the_gpu():
    from tests.kernels.test_paged_attention import check_far_layer

    check_far_layer("cuda")


@pytest.mark.parametrize("tokens", [1, 33, 8192])
def test_rms_norm_kernels_real_shapes(tokens):
    x = 3 * torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    out, total = torch.ops.hy3_triton.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_total = hy3.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=8e-3)  # at most a bf16 ulp (rsqrt, sum order)
    torch.testing.assert_close(
        torch.ops.hy3_triton.rms_norm(x, weight, 1e-5), hy3.rms_norm(x, weight, 1e-5), atol=2e-2, rtol=8e-3
    )


def test_silu_and_mul_and_attention_plan_real_shapes():
    x = 4 * torch.randn(33, 2 * 1536, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        torch.ops.hy3_triton.silu_and_mul(x), hy3.silu_and_mul(x), atol=1e-2, rtol=8e-3
    )
    seq_lens = torch.randint(1, 131072, (256,), device="cuda", dtype=torch.int32)
    qsl = torch.arange(257, device="cuda", dtype=torch.int32)
    plan = torch.ops.hy3_triton.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, 16)
    assert torch.equal(plan, hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, 16))


@pytest.mark.parametrize("static", [False, True])
def test_add_rms_norm_quant_real_shapes(static):
    x = 3 * torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    scale = torch.tensor([0.02], device="cuda") if static else None
    out, total, q, q_scale = torch.ops.hy3_triton.add_rms_norm_quant(x, residual, weight, 1e-5, scale)
    ref = hy3.add_rms_norm_quant(x, residual, weight, 1e-5, scale)
    assert torch.equal(total, ref[1])
    torch.testing.assert_close(out, ref[0], atol=2e-2, rtol=8e-3)
    torch.testing.assert_close(q.float() * q_scale, ref[2].float() * ref[3], atol=0.1, rtol=0.07)


@pytest.mark.parametrize("static", [False, True])
def test_silu_and_mul_quant_real_shapes(static):
    x = 4 * torch.randn(64, 2 * 1536, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.03], device="cuda") if static else None
    q, q_scale = torch.ops.hy3_triton.silu_and_mul_quant(x, scale)
    ref_q, ref_scale = hy3.silu_and_mul_quant(x, scale)
    torch.testing.assert_close(q.float() * q_scale, ref_q.float() * ref_scale, atol=0.05, rtol=0.07)


@pytest.mark.parametrize("tokens", [1024, 8192])
@pytest.mark.parametrize("case", ["fp8 dynamic", "fp8 x_q", "fp8 static", "fp8 expert parallel", "bf16"])
@pytest.mark.parametrize("block_n", [128, 64])
def test_persistent_moe_gemms_real_shapes(tokens, case, block_n):
    """The persistent Gluon GEMMs (`fused_moe_persistent`) against the same config's Triton kernels and
    the reference: FP8 with dynamic per-token scales, the norm's e4m3 rows, static scales (an e4m3
    intermediate), a rank holding half the experts (ids −1 elsewhere), and bf16."""
    from hy3c.kernels.moe.config import MoeConfig
    from hy3c.kernels.moe.fused_moe import fused_moe_triton

    experts, top_k, hidden, inter = 192, 8, 4096, 1536
    fp8 = case.startswith("fp8")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = 0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = 0.02 * torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    scales, statics, extra = (None, None), (None, None), ()
    if fp8:
        scales = (w13.float().abs().amax(-1) / 448, w2.float().abs().amax(-1) / 448)
        w13 = (w13.float() / scales[0][..., None]).to(FP8_DTYPE)
        w2 = (w2.float() / scales[1][..., None]).to(FP8_DTYPE)
    if case == "fp8 static":  # the intermediate's scale clips it at ±8 (|silu(g) · u| is mostly below 4)
        statics = (x.float().abs().amax().reshape(1) / 448, torch.tensor([8.0 / 448], device="cuda"))
    if case == "fp8 x_q":
        extra = torch.ops.hy3_triton.quant_fp8_per_token(x)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).int()
    if case == "fp8 expert parallel":
        ids = torch.where(ids < experts // 2, ids, -1)
    args = (x, torch.rand(tokens, top_k, device="cuda"), ids, w13, w2, *scales, *statics, None, *extra)
    cfg = MoeConfig(128, block_n, 128 if fp8 else 64, 8, 8, 4, persistent=True, down_block_n=128)
    gluon = fused_moe_triton(*args, config=cfg).float()
    triton_kernels = fused_moe_triton(*args, config=dataclasses.replace(cfg, persistent=False)).float()
    ref = hy3.fused_moe(*args).float()
    assert torch.isfinite(gluon).all()
    assert (gluon - triton_kernels).norm() / triton_kernels.norm() < 1e-3
    assert (gluon - ref).norm() / ref.norm() < 2e-2
