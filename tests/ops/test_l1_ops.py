"""Every L1 hy3 op: torch.library.opcheck plus equality with an independent reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.hy_v3 import modeling_hy_v3 as hf

import hy3c.ops  # noqa: F401
from hy3c.ops import L1_OPS
from hy3c.ops.attention import gather_request_kv
from hy3c.ops.quant import FP8_DTYPE

hy3 = torch.ops.hy3


def _paged_case(
    lengths, new_tokens, page_size, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, layers=2
):
    """A random paged cache holding `lengths` tokens per request; the last `new_tokens[r]` are queries."""
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + 1
    perm = torch.randperm(num_pages).tolist()  # scatter pages to catch page-table bugs
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32)
    cache = torch.zeros(layers, 2, num_pages, page_size, kv_heads, head_dim, dtype=dtype)
    contiguous = []
    cursor = 0
    for r, n in enumerate(lengths):
        pages = perm[cursor : cursor + pages_per[r]]
        cursor += pages_per[r]
        table[r, : len(pages)] = torch.tensor(pages)
        k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        scales = torch.tensor([[0.01, 0.02]] * layers)
        hy3.kv_store(k, v, cache, scales, 1, slots)
        contiguous.append((k, v))
    q_start = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(q_start[-1]), heads, head_dim)
    meta = (table, torch.tensor(lengths, dtype=torch.int32), q_start)
    return q, cache, contiguous, meta


def _sdpa_reference(q, contiguous, lengths, new_tokens, scale):
    outs = []
    start = 0
    for (k, v), n, m in zip(contiguous, lengths, new_tokens):
        qr = q[start : start + m]
        start += m
        group = qr.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        o = F.scaled_dot_product_attention(qr.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("page_size", [4, 5, 16])
def test_paged_attention_matches_sdpa(page_size):
    lengths, new = [1, 7, 33, 16], [1, 3, 33, 2]
    q, cache, contiguous, (table, seq_lens, q_start) = _paged_case(lengths, new, page_size)
    scales = torch.ones(2, 2)
    out = hy3.attention(q, cache, scales, 1, table, seq_lens, q_start, 0.25)
    ref = _sdpa_reference(q, contiguous, lengths, new, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fp8_kv_store_and_attention_dequantize_with_scales():
    lengths, new = [9, 20], [9, 1]
    q, cache, contiguous, (table, seq_lens, q_start) = _paged_case(lengths, new, 8, dtype=FP8_DTYPE)
    scales = torch.tensor([[0.01, 0.02]] * 2)
    out = hy3.attention(q, cache, scales, 1, table, seq_lens, q_start, 0.25)
    quantized = [
        ((k / 0.01).to(FP8_DTYPE).float() * 0.01, (v / 0.02).to(FP8_DTYPE).float() * 0.02)
        for k, v in contiguous
    ]
    torch.testing.assert_close(out, _sdpa_reference(q, quantized, lengths, new, 0.25), atol=1e-5, rtol=1e-5)
    unquantized = _sdpa_reference(q, contiguous, lengths, new, 0.25)
    assert (out - unquantized).abs().max() > 1e-4  # the FP8 path really quantized


def test_hadamard_rotation_keeps_scores_and_helps_fp8_only_near_its_subnormals():
    """The fused op's optional rotation: orthonormal and q·k unchanged. Under a per-tensor FP8 scale it
    pays when one massive key entry (an attention-sink token) sets the scale so high that the other keys
    fall toward e4m3's subnormals: the rotation cuts that peak by up to sqrt(head_dim). A moderate
    outlier channel gains nothing — e4m3's error is relative — hence off by default."""
    from hy3c.ops.rope import hadamard_matrix, hadamard_reference

    h = hadamard_matrix(128)
    torch.testing.assert_close(h @ h.T, torch.eye(128), atol=1e-5, rtol=0)
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(64, 128, generator=gen), torch.randn(256, 128, generator=gen)
    torch.testing.assert_close(
        hadamard_reference(q) @ hadamard_reference(keys).T, q @ keys.T, atol=1e-4, rtol=1e-4
    )

    def error_on_other_keys(k: torch.Tensor, rotate: bool) -> float:
        qq, kk = (hadamard_reference(q), hadamard_reference(k)) if rotate else (q, k)
        scale = kk.abs().max() / 448.0  # a per-tensor static scale
        scores = qq @ ((kk / scale).to(FP8_DTYPE).float() * scale).T
        return (scores - q @ k.T)[:, 1:].abs().mean().item()

    sink = keys.clone()
    sink[0, 5] = 3e4
    assert error_on_other_keys(sink, rotate=True) < 0.75 * error_on_other_keys(sink, rotate=False)
    moderate = keys.clone()
    moderate[:, 5] *= 60.0
    assert error_on_other_keys(moderate, rotate=True) > 0.9 * error_on_other_keys(moderate, rotate=False)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(96)


def test_kv_store_skips_padding_slots_and_writes_only_its_layer():
    cache = torch.zeros(2, 2, 2, 4, 1, 8)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    hy3.kv_store(k, v, cache, torch.ones(2, 2), 0, torch.tensor([5, -1, 0]))
    flat = cache[0].view(2, 8, 1, 8)
    torch.testing.assert_close(flat[0, 5], k[0])
    torch.testing.assert_close(flat[1, 0], v[2])
    assert flat[0].abs().sum(dim=(-1, -2)).nonzero().flatten().tolist() == [0, 5]
    assert cache[1].abs().sum() == 0


def test_fp8_kv_store_writes_v_pages_transposed():
    """FP8 caches store each V page as [kv_heads, head_dim, page] (K pages, bf16 V pages as the shape
    says): the key at slot s sits at byte column s % page of its page's (head, dim) rows."""
    pages, page, kv_heads, dim = 3, 4, 2, 16
    k, v = torch.randn(5, kv_heads, dim), torch.randn(5, kv_heads, dim)
    slots = torch.tensor([9, 2, -1, 4, 11])
    scales = torch.tensor([[0.5, 0.25]])
    for dtype in (torch.bfloat16, FP8_DTYPE):
        cache = torch.zeros(1, 2, pages, page, kv_heads, dim, dtype=dtype)
        hy3.kv_store(k, v, cache, scales, 0, slots)
        s = scales if dtype == FP8_DTYPE else torch.ones(1, 2)
        raw_v = cache[0, 1].view(pages, kv_heads, dim, page) if dtype == FP8_DTYPE else None
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            p, off = divmod(slot, page)
            torch.testing.assert_close(cache[0, 0, p, off].float() * s[0, 0], k[t], atol=0.2, rtol=0.07)
            stored_v = raw_v[p, :, :, off] if raw_v is not None else cache[0, 1, p, off]
            torch.testing.assert_close(stored_v.float() * s[0, 1], v[t], atol=0.1, rtol=0.07)
        k_back, v_back = gather_request_kv(cache, s, 0, torch.tensor([2, 0]), 7)  # slots 8..11, 0..2
        order = [slots.tolist().index(x) if x in slots.tolist() else None for x in (8, 9, 10, 11, 0, 1, 2)]
        for row, t in enumerate(order):
            if t is not None:
                torch.testing.assert_close(v_back[row], v[t], atol=0.1, rtol=0.07)
                torch.testing.assert_close(k_back[row], k[t], atol=0.2, rtol=0.07)
            else:
                assert v_back[row].abs().sum() == 0 and k_back[row].abs().sum() == 0


def test_rms_norm_and_qk_norm_match_hf():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 32, dtype=dtype)
        norm = hf.HYV3RMSNorm(32, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(32))
            torch.testing.assert_close(hy3.qk_norm(x, norm.weight, 1e-5), norm(x), atol=0, rtol=0)
            torch.testing.assert_close(
                hy3.rms_norm(x[:, 0], norm.weight, 1e-5), norm(x[:, 0]), atol=0, rtol=0
            )


def test_rope_matches_hf_neox_rotation():
    cfg = hf.HYV3Config(head_dim=32, num_attention_heads=2, num_key_value_heads=1, hidden_size=64)
    rotary = hf.HYV3RotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 2, 37, 4095, 200000])
    q = torch.randn(6, 2, 32)
    cos, sin = rotary(q, positions[None])
    ref, _ = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    out = hy3.rope(q, positions, cfg.rope_parameters["rope_theta"])
    torch.testing.assert_close(out, ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_router_matches_hf_top_k_router():
    cfg = hf.HYV3Config(num_experts=16, num_experts_per_tok=4, hidden_size=64)
    router = hf.HYV3TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.1)
    bias = 0.05 * torch.randn(16)
    x = torch.randn(9, 64)
    _, ref_w, ref_ids = router(x, bias)
    w, ids = hy3.router(x, router.weight, bias, 4, cfg.router_scaling_factor)
    assert ids.dtype == torch.int32
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values.long(), ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices))
    # the bias only selects: the weights are the renormalised unbiased scores
    scores = torch.sigmoid(x @ router.weight.t()).gather(1, ids.long())
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * 2.826)


def test_moe_experts_match_hf_experts():
    cfg = hf.HYV3Config(num_experts=6, num_experts_per_tok=2, hidden_size=32, moe_intermediate_size=16)
    experts = hf.HYV3Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(11, 32)
    ids = torch.stack([torch.randperm(5)[:2] for _ in range(11)])  # expert 5 gets no token
    w = torch.rand(11, 2)
    ref = experts(x, ids, w)
    out = hy3.moe_experts(x, w, ids.int(), experts.gate_up_proj, experts.down_proj, None, None, None, None)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("static", [True, False])
def test_fp8_moe_experts_equal_dequantized_math(static):
    e, h, i, t = 4, 32, 16, 7
    w13, w2 = 0.2 * torch.randn(e, 2 * i, h), 0.2 * torch.randn(e, h, i)
    s13, s2 = w13.abs().amax(-1) / 448, w2.abs().amax(-1) / 448
    q13, q2 = (w13 / s13[..., None]).to(FP8_DTYPE), (w2 / s2[..., None]).to(FP8_DTYPE)
    x = torch.randn(t, h)
    ids = torch.randint(0, e, (t, 2)).int()
    ids[:, 1] = (ids[:, 0] + 1) % e
    w = torch.rand(t, 2)
    a13 = torch.tensor([x.abs().max() / 448]) if static else None
    a2 = torch.tensor([0.02]) if static else None
    out = hy3.moe_experts(x, w, ids, q13, q2, s13, s2, a13, a2)

    def qdq(v, scale):
        scale = v.abs().amax(-1, keepdim=True) / 448 if scale is None else scale
        return (v / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale

    ref = torch.zeros(t, h)
    for tok in range(t):
        for j in range(2):
            ex = int(ids[tok, j])
            gu = qdq(x[tok : tok + 1], a13) @ (q13[ex].float() * s13[ex][:, None]).t()
            mid = F.silu(gu[:, :i]) * gu[:, i:]
            ref[tok] += w[tok, j] * (qdq(mid, a2) @ (q2[ex].float() * s2[ex][:, None]).t())[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_quant_ops_round_trip_and_saturate():
    x = torch.randn(6, 64) * 3
    q, s = hy3.quant_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1)
    back = hy3.dequant_fp8(q, s, torch.float32)
    assert ((back - x).abs() <= x.abs().amax(-1, keepdim=True) * 2**-4).all()  # e4m3: 3 mantissa bits
    assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0))
    static = hy3.quant_fp8(torch.tensor([[1000.0, -1000.0, 1.0]]), torch.tensor([1.0]))
    assert static.float().tolist() == [[448.0, -448.0, 1.0]]


def test_scaled_mm_matches_torch_scaled_mm():
    a, b = torch.randn(8, 64), torch.randn(24, 64)
    qa, sa = hy3.quant_fp8_per_token(a)
    sb = b.abs().amax(-1) / 448
    qb = hy3.quant_fp8(b, sb[:, None])
    out = hy3.scaled_mm(qa, qb, sa, sb, torch.float32)
    ref = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb[None, :], out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert (out - a @ b.t()).norm() / (a @ b.t()).norm() < 0.05  # close to the unquantized product


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(hy3.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])


def _opcheck_cases():
    lengths, new = [5, 12], [2, 12]
    q, cache, _, (table, seq_lens, q_start) = _paged_case(lengths, new, 4)
    scales = torch.ones(2, 2)
    x = torch.randn(6, 32)
    w13, w2 = torch.randn(4, 16, 32), torch.randn(4, 32, 8)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [0, 2], [1, 3], [2, 3]], dtype=torch.int32)
    xq, xs = hy3.quant_fp8_per_token(x)
    return {
        "rms_norm": (torch.randn(4, 32), torch.randn(32), 1e-5),
        "qk_norm": (torch.randn(4, 3, 16), torch.randn(16), 1e-5),
        "rope": (torch.randn(4, 3, 16), torch.arange(4), 10000.0),
        "kv_store": (
            torch.randn(3, 2, 16),
            torch.randn(3, 2, 16),
            cache.clone(),
            scales,
            0,
            torch.tensor([0, 3, -1]),
        ),
        "attention": (q, cache, scales, 1, table, seq_lens, q_start, 0.25),
        "router": (x, torch.randn(4, 32), torch.randn(4), 2, 2.5),
        "moe_experts": (x, torch.rand(6, 2), ids, w13, w2, None, None, None, None),
        "silu_and_mul": (torch.randn(4, 16),),
        "quant_fp8": (x, torch.tensor([0.01])),
        "quant_fp8_per_token": (x,),
        "dequant_fp8": (xq, xs, torch.bfloat16),
        "scaled_mm": (
            xq,
            hy3.quant_fp8(torch.randn(8, 32), torch.tensor([0.01])),
            xs,
            torch.rand(8),
            torch.float32,
        ),
    }


# opcheck's schema test compares inputs with arithmetic that has no FP8 kernel on CPU; for ops taking FP8
# inputs it is replaced by a byte-exact check that the inputs were not mutated.
_FP8_INPUT_OPS = {"dequant_fp8", "scaled_mm"}
_NON_SCHEMA_TESTS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", L1_OPS)
def test_opcheck(name):
    args = _opcheck_cases()[name]
    op = getattr(hy3, name).default
    if name not in _FP8_INPUT_OPS:
        torch.library.opcheck(op, args)
        return
    before = [a.view(torch.uint8).clone() for a in args if isinstance(a, torch.Tensor)]
    op(*args)
    after = [a.view(torch.uint8) for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    torch.library.opcheck(op, args, test_utils=_NON_SCHEMA_TESTS)


def test_moe_experts_fake_output_strides_equal_the_reference():
    """A transposed (non-contiguous) input: the reference returns a contiguous tensor, so must the fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    experts, hidden, inter, tokens = 4, 8, 6, 5
    args = (
        torch.randn(hidden, tokens).t(),
        torch.rand(tokens, 2),
        torch.randint(0, experts, (tokens, 2), dtype=torch.int32),
        torch.randn(experts, 2 * inter, hidden),
        torch.randn(experts, hidden, inter),
        None,
        None,
        None,
        None,
    )
    real = torch.ops.hy3.moe_experts(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.hy3.moe_experts(*fake_args)
    assert fake.stride() == real.stride() == (hidden, 1)
