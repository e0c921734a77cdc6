"""Triton paged attention (dynamic split-KV decode, chunked prefill) against the
torch reference, under TRITON_INTERPRET=1 on CPU; the schedule as a pure function."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import hy3c.ops  # noqa: F401
from hy3c.kernels.attention import plan as plan_mod
from hy3c.kernels.attention import prefill_gluon
from hy3c.kernels.attention.config import (
    DECODE_CONFIG,
    FP8_BATCH_DECODE_CONFIG,
    FP8_BATCH_MIN_REQUESTS,
    FP8_DECODE_CONFIG,
    GLUON_PREFILL_CONFIG,
    LaunchConfig,
    decode_config,
    prefill_config,
    triton_prefill_config,
)
from hy3c.kernels.attention.decode import decode_attention_dynamic
from hy3c.kernels.attention.prefill import prefill_attention
from hy3c.ops.quant import FP8_DTYPE
from tests.kernels.attention_checks import assert_attention_close

hy3 = torch.ops.hy3


def _case(
    lengths,
    new_tokens,
    page_size,
    heads,
    kv_heads,
    head_dim=32,
    cache_dtype=torch.bfloat16,
    q_dtype=torch.bfloat16,
    unused=0.0,
):
    """A random paged cache (pages shuffled) holding `lengths` tokens; the last new_tokens[r] are queries.
    Slots no token was written to hold `unused`."""
    pages_per = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages).tolist()
    table = torch.zeros(len(lengths), max([*pages_per, 1]), dtype=torch.int32)
    cache = torch.full((2, 2, num_pages, page_size, kv_heads, head_dim), unused, dtype=cache_dtype)
    scales = torch.tensor([[1.0, 1.0], [0.02, 0.03]])
    cursor = 0
    for r, n in enumerate(lengths):
        pages = order[cursor : cursor + pages_per[r]]
        cursor += pages_per[r]
        table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor(
            [pages[p // page_size] * page_size + p % page_size for p in range(n)], dtype=torch.int64
        )
        hy3.kv_store(
            torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim), cache, scales, 1, slots
        )
    qsl = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim).to(q_dtype)
    return q, cache, scales, table, torch.tensor(lengths, dtype=torch.int32), qsl


def _plan(seq_lens, qsl, group):
    return hy3.attention_plan(seq_lens, qsl, plan_mod.KV_TILE, plan_mod.prefill_q_block(group))


def _reference(q, cache, scales, table, seq_lens, qsl):
    return hy3.attention(q, cache, scales, 1, table, seq_lens, qsl, 0.2)


def _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl):
    assert_attention_close(out, q, cache, scales, 1, table, seq_lens, qsl, 0.2)


DECODE_CASES = [
    # lengths (ragged, not multiples of the page), page size, (q heads, kv heads)
    ([1, 17, 300, 5, 1100], 16, (8, 1)),
    ([600, 3, 257], 5, (8, 2)),
    ([40], 7, (4, 4)),
    ([513, 1, 1, 260, 70], 64, (8, 8)),
]


@pytest.mark.parametrize(("lengths", "page", "heads"), DECODE_CASES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_dynamic_decode_matches_reference(lengths, page, heads, cache_dtype):
    q, cache, scales, table, seq_lens, qsl = _case(
        lengths, [1] * len(lengths), page, *heads, cache_dtype=cache_dtype, unused=float("nan")
    )
    kv = (cache, scales, table, seq_lens, qsl)
    plan = _plan(seq_lens, qsl, heads[0] // heads[1])
    for num_ctas in (1, 3, 16):
        out = decode_attention_dynamic(q, cache, scales, 1, table, seq_lens, 0.2, plan, num_ctas=num_ctas)
        _assert_attention_close(out, q, *kv)


@pytest.mark.parametrize(("page", "block_n"), [(16, 16), (64, 32)])
def test_fp8_decode_by_tma_page_slices_matches_reference(page, block_n):
    """FP8 decode's 64-key TMA page slices (here smaller) of K and of the transposed V pages, whose unused
    slots hold NaN: tail keys must not reach the output."""
    lengths = [1, 17, 300, 5, 1100]
    q, cache, scales, table, seq_lens, qsl = _case(
        lengths, [1] * 5, page, 8, 2, cache_dtype=FP8_DTYPE, unused=float("nan")
    )
    config = dataclasses.replace(FP8_DECODE_CONFIG, block_n=block_n, num_stages=1)
    assert config.tma
    plan = _plan(seq_lens, qsl, 4)
    for num_ctas in (1, 7):
        out = decode_attention_dynamic(
            q, cache, scales, 1, table, seq_lens, 0.2, plan, num_ctas=num_ctas, config=config
        )
        _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


def test_fp8_bound_fails_a_kernel_that_ignores_the_transposed_v_layout():
    """The FP8 check can fail: V read as if its pages were not transposed is far outside the bound."""
    q, cache, scales, table, seq_lens, qsl = _case([300, 40], [1, 1], 16, 8, 2, cache_dtype=FP8_DTYPE)
    ok = decode_attention_dynamic(q, cache, scales, 1, table, seq_lens, 0.2, _plan(seq_lens, qsl, 4))
    _assert_attention_close(ok, q, cache, scales, table, seq_lens, qsl)
    pages, page, kv_heads, dim = cache.shape[2:]
    wrong = cache.clone()  # V pages rewritten [page, kv_heads, dim]: the old layout read through the new one
    wrong[:, 1] = cache[:, 1].view(2, pages, kv_heads, dim, page).permute(0, 1, 4, 2, 3)
    with pytest.raises(AssertionError, match="past the e4m3 P bound"):
        _assert_attention_close(ok, q, wrong, scales, table, seq_lens, qsl)


def _ramp_keys(cache, table, lengths, rate):
    """Scale layer 1's key at position t by 1 + rate·t, so that a row's running max keeps growing."""
    page = cache.shape[3]
    for r, n in enumerate(lengths):
        for t in range(n):
            slot = cache[1, 0, table[r, t // page], t % page]
            slot.copy_((slot.float() * (1 + rate * t)).to(cache.dtype))


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_lazy_rescaling_matches_reference(cache_dtype, tma):
    """lazy_rescale: the running max moves only when a row's block max outgrows it by more than 2^8 —
    causal prefill chunks over cached prefixes (unused slots hold NaN), with key norms ramped along the
    sequence so that the max moves again after it has been kept (acc nonzero)."""
    lengths, new = [1, 17, 300, 5, 1100], [1, 17, 40, 1, 9]
    q, cache, scales, table, seq_lens, qsl = _case(
        lengths, new, 16, 8, 2, cache_dtype=cache_dtype, unused=float("nan")
    )
    _ramp_keys(cache, table, lengths, 0.05)
    q = q * 4
    config = LaunchConfig(block_n=16, num_warps=4, num_stages=1, lazy_rescale=True, tma=tma)
    prefill = prefill_attention(
        q, *(cache, scales, 1, table, seq_lens, qsl, 0.2, _plan(seq_lens, qsl, 4)), config=config
    )
    _assert_attention_close(prefill, q, cache, scales, table, seq_lens, qsl)


def test_decode_refuses_lazy_rescaling():
    q, cache, scales, table, seq_lens, qsl = _case([40], [1], 64, 8, 2, cache_dtype=FP8_DTYPE)
    config = dataclasses.replace(DECODE_CONFIG, lazy_rescale=True)
    with pytest.raises(ValueError, match="prefill option"):
        decode_attention_dynamic(
            q, cache, scales, 1, table, seq_lens, 0.2, _plan(seq_lens, qsl, 4), config=config
        )


def test_decode_config_by_kv_dtype_batch_and_page_size():
    assert decode_config(torch.bfloat16, 64) == DECODE_CONFIG
    assert decode_config(FP8_DTYPE, FP8_BATCH_MIN_REQUESTS - 1) == FP8_DECODE_CONFIG
    assert decode_config(FP8_DTYPE, FP8_BATCH_MIN_REQUESTS) == FP8_BATCH_DECODE_CONFIG
    assert FP8_DECODE_CONFIG.tma and decode_config(FP8_DTYPE, 1, page_size=128).tma
    for page in (16, 96):  # 64-key blocks do not tile these pages: pointer loads
        assert decode_config(FP8_DTYPE, 1, page) == dataclasses.replace(FP8_DECODE_CONFIG, tma=False)


def test_range_per_cta_grows_to_the_minimum_at_most_to_the_share_over_min_ctas():
    """132 CTAs per KV head, ranges grow toward 16 tiles up to the share over 33 CTAs (FP8 decode, H200)."""
    assert plan_mod.tiles_per_cta(8, 132, 16, 33) == 1  # one short request: 8 CTAs of one tile
    assert plan_mod.tiles_per_cta(256, 132, 16, 33) == 8  # 32 × 2K: still 32 CTAs busy
    assert plan_mod.tiles_per_cta(512, 132, 16, 33) == 16  # one 128K request: 32 ranges of 16 tiles
    assert plan_mod.tiles_per_cta(7700, 132, 16, 33) == 59  # a large batch: every CTA, equal shares
    assert plan_mod.tiles_per_cta(34, 132, 16, 33) == 2  # rounded up: 17 CTAs busy, not 33


def test_dynamic_decode_with_a_minimum_range_per_cta_matches_reference():
    """FP8_BATCH_DECODE_CONFIG's shape of schedule: ranges of at least N tiles, the CTAs past the work idle."""
    lengths = [5 * plan_mod.KV_TILE + 3, 40, 2 * plan_mod.KV_TILE, 1]
    q, cache, scales, table, seq_lens, qsl = _case(lengths, [1] * 4, 64, 8, 2, cache_dtype=FP8_DTYPE)
    plan = _plan(seq_lens, qsl, 4)
    for min_tiles in (1, 3, 16):
        config = dataclasses.replace(
            FP8_BATCH_DECODE_CONFIG, min_tiles_per_cta=min_tiles, block_n=32, num_stages=1
        )
        out = decode_attention_dynamic(
            q, cache, scales, 1, table, seq_lens, 0.2, plan, num_ctas=8, config=config, min_ctas=1
        )
        _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


def test_combine_merges_more_partials_than_one_trip_loads():
    """A request cut into more partial results than the combine kernel loads per trip (18 > 16)."""
    q, cache, scales, table, seq_lens, qsl = _case([18 * plan_mod.KV_TILE - 5], [1], 64, 8, 2)
    ref = _reference(q, cache, scales, table, seq_lens, qsl).float()
    plan = _plan(seq_lens, qsl, 4)
    out = decode_attention_dynamic(q, cache, scales, 1, table, seq_lens, 0.2, plan, num_ctas=24)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("lengths", "new", "page", "heads"),
    [
        ([9, 40, 3], [9, 13, 1], 16, (8, 1)),  # full prefill, chunk over a cached prefix, a decode
        ([130], [130], 5, (4, 2)),
        ([70, 20], [1, 20], 64, (8, 8)),
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_prefill_matches_reference(lengths, new, page, heads, cache_dtype):
    q, cache, scales, table, seq_lens, qsl = _case(
        lengths, new, page, *heads, cache_dtype=cache_dtype, unused=float("nan")
    )
    out = prefill_attention(
        q, cache, scales, 1, table, seq_lens, qsl, 0.2, _plan(seq_lens, qsl, heads[0] // heads[1])
    )
    _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


@pytest.mark.parametrize(
    ("lengths", "new", "page", "heads", "block_n"),
    [
        ([9, 40, 3], [9, 13, 1], 16, (8, 1), 16),
        ([70, 20], [1, 20], 64, (8, 8), 32),
        ([130], [130], 64, (4, 2), 64),
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_prefill_by_tma_copies_matches_reference(lengths, new, page, heads, block_n, cache_dtype):
    """Key blocks as TMA bulk copies of page slices whose unused slots hold NaN: a tail block's rows past
    the sequence must not reach the output."""
    q, cache, scales, table, seq_lens, qsl = _case(
        lengths, new, page, *heads, cache_dtype=cache_dtype, unused=float("nan")
    )
    config = LaunchConfig(block_n=block_n, num_warps=4, num_stages=2, tma=True)
    plan = _plan(seq_lens, qsl, heads[0] // heads[1])
    out = prefill_attention(q, cache, scales, 1, table, seq_lens, qsl, 0.2, plan, config=config)
    _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


def test_launch_config_caps_registers_only_when_asked():
    """max_registers becomes Triton's maxnreg launch option (more CTAs per SM for 8-warp prefill); a
    capped prefill computes the same output (the interpreter ignores the cap; sm90_compile builds it)."""
    assert LaunchConfig().launch_options() == {"num_warps": 4, "num_stages": 3}
    capped = LaunchConfig(num_warps=8, num_stages=2, max_registers=128, tma=True)
    assert capped.launch_options() == {"num_warps": 8, "num_stages": 2, "maxnreg": 128}
    q, cache, scales, table, seq_lens, qsl = _case([70, 20], [1, 20], 64, 8, 8, cache_dtype=torch.bfloat16)
    plan = _plan(seq_lens, qsl, 1)
    out = prefill_attention(q, cache, scales, 1, table, seq_lens, qsl, 0.2, plan, config=capped)
    _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


def test_prefill_takes_tma_copies_where_the_page_size_allows():
    for dtype in (torch.bfloat16, FP8_DTYPE):
        assert prefill_config(dtype, 64).tma and prefill_config(dtype, 128).tma
        assert not prefill_config(dtype, 16).tma and not prefill_config(dtype, 96).tma


def test_prefill_takes_the_gluon_kernel_for_bf16_pages_of_64_keys():
    """bf16 KV in pages of a multiple of 64 keys: the warp-specialized Gluon config where the program
    chose the Gluon kernel; FP8 KV, other pages and `gluon=False`: the Triton kernel's."""
    assert prefill_config(torch.bfloat16, 64) == prefill_config(torch.bfloat16, 128) == GLUON_PREFILL_CONFIG
    assert prefill_config(torch.bfloat16, 64, gluon=False) == triton_prefill_config(torch.bfloat16, 64)
    assert not prefill_config(torch.bfloat16, 16).warp_specialized
    assert not any(prefill_config(FP8_DTYPE, page).warp_specialized for page in (16, 64, 128))
    assert prefill_config(FP8_DTYPE, 64) == triton_prefill_config(FP8_DTYPE, 64)


def test_gluon_prefill_inputs_and_launch_conditions_name_what_they_refuse():
    """What `lower` checks on a node (dtypes, head_dim, rows per block) and what only a launch knows
    (an sm_90 GPU, the page size, strides): each refusal names its reason."""
    bf16 = torch.bfloat16
    assert prefill_gluon.unsupported_inputs(bf16, bf16, 128, 128) is None
    assert "float8_e4m3fn KV cache" in prefill_gluon.unsupported_inputs(bf16, FP8_DTYPE, 128, 128)
    assert "head_dim 64" in prefill_gluon.unsupported_inputs(bf16, bf16, 64, 128)
    assert "64 query rows" in prefill_gluon.unsupported_inputs(bf16, bf16, 128, 64)
    q, cache, *_ = _case([70], [1], 64, 8, 1, head_dim=128)
    assert prefill_gluon.unsupported_launch(q, cache) == "not an sm_90 GPU"


@pytest.mark.parametrize("gluon", [False, True])
def test_gluon_prefill_runs_only_on_hopper_with_bf16_and_falls_back_elsewhere(gluon):
    """On the CPU the Gluon kernel cannot launch: prefill_attention runs the Triton kernel, whether the
    program chose Gluon or not, and the output matches the reference."""
    q, cache, scales, table, seq_lens, qsl = _case([70, 20], [1, 20], 64, 8, 1, head_dim=128)
    plan = _plan(seq_lens, qsl, 8)
    out = prefill_attention(q, cache, scales, 1, table, seq_lens, qsl, 0.2, plan, gluon=gluon)
    _assert_attention_close(out, q, cache, scales, table, seq_lens, qsl)


def test_gluon_prefill_checks_its_config_and_keeps_batch_sizes_out_of_its_compile_key():
    """Key blocks of 64 or 128 keys and a ring that fits shared memory, else a ValueError naming the
    field; the registers at launch are the partitions' shared budget (two consumer warpgroups at 240,
    the producer's at 24). The request count and search depth are runtime values, so a batch of 1 or of
    16 requests compiles no variant of its own during live traffic."""
    options = prefill_gluon.launch_options(GLUON_PREFILL_CONFIG)
    assert options == {"num_warps": 4, "maxnreg": 168}
    assert prefill_gluon.launch_options(dataclasses.replace(GLUON_PREFILL_CONFIG, block_n=64, num_stages=4))
    for field, value in (("block_n", 96), ("block_n", 256), ("num_stages", 3), ("num_stages", 0)):
        with pytest.raises(ValueError, match=field):
            prefill_gluon.launch_options(dataclasses.replace(GLUON_PREFILL_CONFIG, **{field: value}))
    kernel = prefill_gluon._prefill_kernel
    assert {p.name for p in kernel.params if p.do_not_specialize} == {"num_requests", "search_iters"}


def test_gluon_prefill_refuses_lazy_rescaling():
    q, cache, scales, table, seq_lens, qsl = _case([20], [20], 64, 8, 1)
    lazy = dataclasses.replace(GLUON_PREFILL_CONFIG, lazy_rescale=True)
    with pytest.raises(ValueError, match="lazy_rescale"):
        prefill_attention(
            q, cache, scales, 1, table, seq_lens, qsl, 0.2, _plan(seq_lens, qsl, 8), config=lazy
        )


def test_prefill_rescales_eagerly_by_default():
    assert not any(
        prefill_config(dtype, page).lazy_rescale for page in (16, 64) for dtype in (torch.bfloat16, FP8_DTYPE)
    )


def test_prefill_by_tma_copies_needs_blocks_inside_a_page():
    q, cache, scales, table, seq_lens, qsl = _case([130], [130], 5, 4, 2)
    with pytest.raises(ValueError, match="to divide the page size"):
        prefill_attention(
            q,
            cache,
            scales,
            1,
            table,
            seq_lens,
            qsl,
            0.2,
            _plan(seq_lens, qsl, 2),
            config=LaunchConfig(tma=True),
        )


def test_fp32_paths_are_exact_enough():
    q, cache, scales, table, seq_lens, qsl = _case(
        [33, 7], [1, 1], 8, 8, 2, cache_dtype=torch.float32, q_dtype=torch.float32
    )
    ref = _reference(q, cache, scales, table, seq_lens, qsl)
    out = decode_attention_dynamic(
        q, cache, scales, 1, table, seq_lens, 0.2, _plan(seq_lens, qsl, 4), num_ctas=2
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("min_tiles", "min_ctas"), [(1, 1), (5, 1), (40, 3)])
@pytest.mark.parametrize("num_ctas", [1, 2, 7, 64, 300])
def test_schedule_assigns_every_tile_once_with_balanced_load(num_ctas, min_tiles, min_ctas):
    gen = torch.Generator().manual_seed(num_ctas)
    lengths = [int(x) for x in torch.randint(0, 5000, (23,), generator=gen)] + [0, 1, 256, 257]
    starts = plan_mod.tile_starts(lengths)
    segments = plan_mod.decode_segments(lengths, num_ctas, min_tiles=min_tiles, min_ctas=min_ctas)
    covered = sorted(t for s in segments for t in range(s.first_tile, s.last_tile))
    assert covered == list(range(starts[-1]))  # every tile exactly once
    load = [0] * num_ctas
    for s in segments:
        load[s.cta] += s.last_tile - s.first_tile
        assert starts[s.request] <= s.first_tile < s.last_tile <= starts[s.request + 1]
    quota = plan_mod.tiles_per_cta(starts[-1], num_ctas, min_tiles, min_ctas)
    assert max(load) <= quota
    assert sum(1 for n in load if n) == -(-starts[-1] // quota)  # CTAs past the work stay idle
    assert len({s.slot for s in segments}) == len(segments)  # partial slots never collide
    for r in range(len(lengths)):  # the combine reads exactly the slots written for its request
        slots = plan_mod.combine_slots(lengths, r, num_ctas, min_tiles=min_tiles, min_ctas=min_ctas)
        assert slots == [s.slot for s in segments if s.request == r]


def test_combine_weights_merge_split_softmax_exactly():
    """A request split across CTAs: merging per-segment (o, lse) reproduces one softmax over all keys."""
    scores, values = torch.randn(8, 700, dtype=torch.float64), torch.randn(700, 16, dtype=torch.float64)
    full = torch.softmax(scores, -1) @ values
    cuts = [0, 256, 512, 700]
    parts = []
    for lo, hi in itertools.pairwise(cuts):
        s = scores[:, lo:hi]
        parts.append((torch.softmax(s, -1) @ values[lo:hi], torch.logsumexp(s, -1)))
    lse = torch.stack([p[1] for p in parts])
    weights = torch.softmax(lse, 0)
    merged = sum(w[:, None] * p[0] for w, p in zip(weights, parts))
    torch.testing.assert_close(merged, full)


def test_plan_op_matches_python_schedule():
    lengths = [5, 0, 600, 256]
    qsl = torch.tensor([0, 1, 2, 40, 41], dtype=torch.int32)
    plan = hy3.attention_plan(torch.tensor(lengths, dtype=torch.int32), qsl, 256, 16)
    assert plan[0].tolist() == plan_mod.tile_starts(lengths)
    assert plan[1].tolist() == [0, 1, 2, 5, 6]


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize(("heads", "kv_heads", "tokens"), [(8, 2, 11), (16, 4, 5), (4, 4, 9), (6, 3, 7)])
def test_qknorm_rope_kvstore_kernel_matches_reference(cache_dtype, heads, kv_heads, tokens, hadamard):
    """Both program shapes (one head group per program; every group of a token block in one program,
    sharing the rotary angles), with and without the Hadamard rotation, against the reference: q, the K/V
    pages, padding slots left untouched."""
    from hy3c.kernels.attention.qknorm_rope_kvstore import launch as kvstore
    from hy3c.kernels.attention.qknorm_rope_kvstore import q_group

    dim, page = 32, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    pos = torch.randint(0, 150000, (tokens,))
    qw, kw = (1 + 0.1 * torch.randn(dim)).to(torch.bfloat16), (1 + 0.1 * torch.randn(dim)).to(torch.bfloat16)
    scales = torch.tensor([[1.0, 1.0], [0.05, 0.04]])
    slots = torch.randperm(tokens + 2 * page)[:tokens]
    slots[::3] = -1
    args = (pos, qw, kw, 1e-5, 11158840.0)
    ref_cache = torch.full((2, 2, tokens // page + 3, page, kv_heads, dim), 0.5).to(cache_dtype)
    q_ref = hy3.qknorm_rope_quant_kvstore(qkv, *args, ref_cache, scales, 1, slots, heads, kv_heads, hadamard)
    groups = heads // q_group(heads) + (
        1 if cache_dtype == FP8_DTYPE else 2
    )  # FP8: V has programs of its own
    for per_program in (1, 2, groups):  # one group, two, all of them
        cache = torch.full_like(ref_cache, 0.5)
        q = kvstore(
            qkv,
            *args,
            cache,
            scales,
            1,
            slots,
            heads,
            kv_heads,
            hadamard,
            block_t=4,
            groups_per_program=per_program,
        )
        torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1e-2)
        # e4m3 has 3 mantissa bits: a different FMA contraction may move a value across a rounding tie
        torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0.07, rtol=0.13)
        assert torch.equal(cache[0].float(), torch.full_like(cache[0].float(), 0.5))  # other layer untouched


@pytest.mark.parametrize("page", [32, 24])
@pytest.mark.parametrize(("decodes", "chunk_offset"), [(5, 19), (16, 0)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_qknorm_rope_kvstore_kernel_stores_prefill_runs_like_the_reference(
    cache_dtype, decodes, chunk_offset, page
):
    """A mixed batch as the scheduler builds it — decode tokens at scattered slots (one padding), then a
    prefill chunk at consecutive slots from `chunk_offset` in a page across the next pages: FP8's V
    programs store the chunk's aligned windows of slots whole (the programs' tokens starting at page
    offsets that are multiples of 16 in the second case, at others in the first), the rest token by
    token; V programs of 16 and of 32 tokens. Pages of 32 slots hold whole aligned windows; pages of 24
    also have aligned windows that run into the next page (stored token by token)."""
    from hy3c.kernels.attention.qknorm_rope_kvstore import launch as kvstore

    heads, kv_heads, dim, tokens = 8, 2, 32, 150
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    pos = torch.arange(tokens)
    norm = torch.ones(dim, dtype=torch.bfloat16)
    # decode slots on pages the chunk does not touch (0-2 and 10): two tokens storing into one slot is
    # a write race on the GPU and unspecified for the reference's index_put (it made this test flaky)
    scattered = [2 * page + 7, -1, 0, 10 * page + page - 1, 2 * page + 1]
    decode_slots = torch.tensor(scattered + [10 * page + i for i in range(decodes - 5)])
    slots = torch.cat([decode_slots, 3 * page + chunk_offset + torch.arange(tokens - decodes)])
    stored = slots[slots >= 0]
    assert stored.unique().numel() == stored.numel(), "every token needs a slot of its own"
    scales = torch.tensor([[0.05, 0.04]])
    args = (pos, norm, norm, 1e-5, 1e6)
    ref_cache = torch.zeros(1, 2, 11, page, kv_heads, dim).to(cache_dtype)
    hy3.qknorm_rope_quant_kvstore(qkv, *args, ref_cache, scales, 0, slots, heads, kv_heads)
    # head groups per program (1 or all); V programs of 16 or 32 tokens, of 1 or 2 KV heads
    for per_program, v_tokens, v_heads in ((1, 16, 2), (None, 16, 2), (None, 32, 2), (None, 16, 1)):
        cache = torch.zeros_like(ref_cache)
        kvstore(
            qkv, *args, cache, scales, 0, slots, heads, kv_heads, groups_per_program=per_program,
            v_tokens=v_tokens, v_heads=v_heads,
        )  # fmt: skip
        assert torch.equal(cache[0, 1].float(), ref_cache[0, 1].float())  # V: quantized the same way
        torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0.07, rtol=0.13)


@pytest.mark.parametrize(
    ("tunables", "message"),
    [
        ({"v_heads": 3}, "v_heads 3 must divide"),
        ({"v_heads": 0}, "v_heads 0"),
        ({"v_tokens": 24}, "power of two"),
    ],
)
def test_qknorm_rope_kvstore_refuses_v_program_shapes_it_cannot_run(tunables, message):
    from hy3c.kernels.attention.qknorm_rope_kvstore import launch as kvstore

    qkv, norm = torch.randn(3, 12 * 32).to(torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 2, 16, 2, 32).to(FP8_DTYPE)
    args = (torch.arange(3), norm, norm, 1e-5, 1e6, cache, torch.ones(1, 2), 0, torch.arange(3), 8, 2)
    with pytest.raises(ValueError, match=message):
        kvstore(qkv, *args, **tunables)


def test_layer_offset_beyond_int32_reads_and_writes_that_layer():
    """A Hy3-sized cache: layer 2 starts 2^31 elements in (8192 pages of 64 tokens × 8 heads × 128).

    The cache is allocated lazily (only the touched pages become memory). Every kernel must address
    layer 2 itself — an int32 layer offset would wrap and read or write another layer.
    """
    check_far_layer("cpu")


def check_far_layer(device: str) -> None:
    """Decode, prefill and the KV store at a layer whose offset exceeds int32 (also run on the GPU)."""
    with torch.device(device):
        _check_far_layer()


def _check_far_layer() -> None:
    from hy3c.kernels.attention.qknorm_rope_kvstore import launch as kvstore

    layers, pages, page, kv_heads, dim, heads, layer = 3, 8192, 64, 8, 128, 64, 2
    cache = torch.empty((layers, 2, pages, page, kv_heads, dim), dtype=torch.bfloat16)
    assert layer * cache.stride(0) >= 2**31
    used = [3, 7]
    for lay in range(layers):
        cache[lay, :, used] = torch.randn(2, len(used), page, kv_heads, dim).to(torch.bfloat16)
    scales = torch.ones(layers, 2)
    table, seq_lens = torch.tensor([used], dtype=torch.int32), torch.tensor([100], dtype=torch.int32)
    for new in (1, 20):
        qsl = torch.tensor([0, new], dtype=torch.int32)
        q = torch.randn(new, heads, dim).to(torch.bfloat16)
        plan = _plan(seq_lens, qsl, heads // kv_heads)
        ref = hy3.attention(q, cache, scales, layer, table, seq_lens, qsl, 0.088).float()
        if new == 1:
            out = decode_attention_dynamic(q, cache, scales, layer, table, seq_lens, 0.088, plan, num_ctas=4)
        else:
            out = prefill_attention(q, cache, scales, layer, table, seq_lens, qsl, 0.088, plan)
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    before = cache[:, :, used[0], :3].clone()
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim).to(torch.bfloat16)
    norm = torch.ones(dim, dtype=torch.bfloat16)
    slots = torch.arange(3) + used[0] * page
    kvstore(qkv, torch.arange(3), norm, norm, 1e-5, 1e6, cache, scales, layer, slots, heads, kv_heads)
    after = cache[:, :, used[0], :3]
    assert torch.equal(after[:layer], before[:layer]) and not torch.equal(after[layer], before[layer])
