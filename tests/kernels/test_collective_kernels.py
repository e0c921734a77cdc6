"""The collectives' CUDA providers (hy3c.kernels.collectives) on the CPU.

The fused all-reduce + residual add + RMSNorm kernel runs under the interpreter over ordinary tensors
standing for each rank's symmetric buffer and signal pad (`symmetric.local_peers`): one phase at a time
for every rank (the arithmetic: which rows each rank stages, reduces and gathers), and whole, barriers
and all, in one forked process per rank over shared memory (the signal-pad protocol, across calls that
switch between one-shot and two-shot). Each is checked against `hy3.all_reduce_add_rms_norm`'s
reference. Then the providers' registration, their fallbacks off CUDA (alone and on gloo ranks), and
the `lower` pass picking them for a CUDA target with tp = 2 (+ sp). The sm_90 compile is in
tests/kernels/sm90_compile.py; the run over real peers on several GPUs (and the thresholds) belongs to
the multi-GPU issue.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import fx

import hy3c.kernels  # noqa: F401
from hy3c.kernels.collectives import all_reduce, config, symmetric
from hy3c.kernels.collectives.symmetric import local_peers
from hy3c.kernels.registry import PDL, providers_for
from hy3c.ops.collectives import (
    all_reduce_add_rms_norm_reference,
    allgather_gemm_reference,
    bind_groups,
    gemm_reduce_scatter_reference,
    unbind_groups,
)
from hy3c.program import allowlist
from hy3c.program.artifact import open_artifact, read_program_file
from tests.dist import run_ranks

hy3, triton_ops, cublas = torch.ops.hy3, torch.ops.hy3_triton, torch.ops.hy3_cublas
EPS = 1e-5
PAD_SLOTS = 2304  # torch's default signal pad: 9216 bytes


def _ranks(world: int, capacity: int, hidden: int, dtype: torch.dtype, shared: bool = False):
    """Each rank's buffer and (zero) signal pad, in shared memory for forked ranks."""
    bufs = [torch.full((capacity, hidden), float("nan"), dtype=dtype) for _ in range(world)]
    pads = [torch.zeros(PAD_SLOTS, dtype=torch.int32) for _ in range(world)]
    if shared:
        for t in (*bufs, *pads):
            t.share_memory_()
    return bufs, pads


def _reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor):
    """The op's reference over the ranks' sum (fp32, rounded once: what the kernel reduces to)."""
    reduced = torch.stack(xs).float().sum(0).to(xs[0].dtype)
    return all_reduce_add_rms_norm_reference(reduced, residual, weight, EPS, 0, 1)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}


def _inputs(world: int, rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    return xs, residual, weight


# ---- the kernel's arithmetic, one phase at a time ----------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_phases_match_the_reference(world, rows, two_shot, dtype):
    """Every rank stages, then every rank reduces, then (two-shot) every rank gathers; each rank ends
    with the reference's (normed, total), all ranks with the same bits. 1 row over 4 ranks leaves
    empty chunks; 48 columns leave masked lanes in a 64-wide block."""
    hidden = 48
    xs, residual, weight = _inputs(world, rows, hidden, dtype)
    bufs, pads = _ranks(world, 40, hidden, dtype)
    outs = [(torch.empty(rows, hidden, dtype=dtype), torch.empty(rows, hidden, dtype=dtype)) for _ in xs]
    phases = (all_reduce.STAGE, all_reduce.REDUCE, all_reduce.GATHER)
    for phase in phases if two_shot else phases[:2]:
        for rank in range(world):
            peers = local_peers(bufs, pads, rank)
            all_reduce.launch(xs[rank], residual, weight, EPS, peers, two_shot, phase=phase, out=outs[rank])
    normed, total = _reference(xs, residual, weight)
    for rank, (out_normed, out_total) in enumerate(outs):
        torch.testing.assert_close(out_total, total, **_tolerance(dtype))
        torch.testing.assert_close(out_normed, normed, **_tolerance(dtype))
        assert torch.equal(out_normed, outs[0][0]) and torch.equal(out_total, outs[0][1]), rank
    assert all(not p.any() for p in pads)  # no barrier ran


def test_programs_split_rows_like_every_rank():
    """More rows than programs: each program loops over its rows (a pad with slots for 2 programs)."""
    world, rows, hidden = 2, 11, 32
    xs, residual, weight = _inputs(world, rows, hidden, torch.float32, seed=1)
    bufs = [torch.zeros(16, hidden) for _ in range(world)]
    pads = [
        torch.zeros(symmetric.RESERVED_CHANNELS * world + symmetric.CHANNELS * world * 2, dtype=torch.int32)
    ]
    pads.append(pads[0].clone())
    assert local_peers(bufs, pads, 0).programs == 2
    for two_shot in (False, True):
        outs = [(torch.empty(rows, hidden), torch.empty(rows, hidden)) for _ in xs]
        for phase in (0, 1, 2) if two_shot else (0, 1):
            for rank in range(world):
                all_reduce.launch(
                    xs[rank],
                    residual,
                    weight,
                    EPS,
                    local_peers(bufs, pads, rank),
                    two_shot,
                    phase=phase,
                    out=outs[rank],
                )
        normed, total = _reference(xs, residual, weight)
        for out_normed, out_total in outs:
            torch.testing.assert_close(out_total, total)
            torch.testing.assert_close(out_normed, normed)


# ---- the whole kernel with its barriers: one process per rank --------------------------------------


class _Group:
    """Stands for a rank's process group in a forked rank (the op reads only what `group_peers` gets)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def _run_rank(rank: int, world: int, cases, bufs, pads, outs, threshold: int) -> None:
    """A forked rank: the provider op end to end (its group and buffers stubbed in this process only),
    one call per case; exits 1 with the traceback printed on any error."""
    try:
        all_reduce.process_group = lambda op, group, size: _Group(rank)
        all_reduce.group_peers = lambda pg, hidden, dtype, device: local_peers(bufs, pads, pg.rank)
        all_reduce.config = types.SimpleNamespace(
            gpu_key=config.gpu_key, one_shot_max_tokens=lambda key, world_size: threshold
        )
        for (xs, residual, weight), (out_normed, out_total) in zip(cases, outs, strict=True):
            normed, total = triton_ops.all_reduce_add_rms_norm(xs[rank], residual, weight, EPS, 0, world)
            out_normed[rank].copy_(normed)
            out_total[rank].copy_(total)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


@pytest.mark.parametrize("world", [2, 4])
def test_barriers_with_one_process_per_rank(world):
    """The op on `world` concurrent ranks, barriers on: calls of 3, 9, 1, 12 rows with a threshold of 4
    alternate one-shot and two-shot over the same buffers and pads; each result is the reference's on
    every rank, and the pads are all zero again after the last."""
    hidden, dtype, threshold = 40, torch.float32, 4
    cases = [_inputs(world, rows, hidden, dtype, seed=rows) for rows in (3, 9, 1, 12)]
    bufs, pads = _ranks(world, 16, hidden, dtype, shared=True)
    outs = []
    for xs, _, _ in cases:
        pair = tuple(
            torch.full((world, *xs[0].shape), float("nan"), dtype=dtype).share_memory_() for _ in "ab"
        )
        outs.append(pair)
    context = mp.get_context("fork")
    procs = [
        context.Process(target=_run_rank, args=(rank, world, cases, bufs, pads, outs, threshold))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} never left a barrier"
    assert [p.exitcode for p in procs] == [0] * world
    for (xs, residual, weight), (out_normed, out_total) in zip(cases, outs, strict=True):
        normed, total = _reference(xs, residual, weight)
        for rank in range(world):
            torch.testing.assert_close(out_total[rank], total)
            torch.testing.assert_close(out_normed[rank], normed)
    assert all(not p.any() for p in pads)


# ---- launch checks and fallbacks --------------------------------------------------------------------


def test_launch_refuses_rows_the_buffers_cannot_hold():
    xs, residual, weight = _inputs(2, 9, 32, torch.float32)
    bufs, pads = _ranks(2, 8, 32, torch.float32)
    with pytest.raises(ValueError, match="9 rows exceed the buffers' 8"):
        all_reduce.launch(xs[0], residual, weight, EPS, local_peers(bufs, pads, 0), False)
    with pytest.raises(ValueError, match="do not fit buffers of 32"):
        all_reduce.launch(xs[0].to(torch.bfloat16), residual, weight, EPS, local_peers(bufs, pads, 0), False)


def test_too_many_rows_fall_back_to_the_reference(monkeypatch):
    bufs, pads = _ranks(2, 8, 32, torch.float32)
    monkeypatch.setattr(
        all_reduce, "group_peers", lambda pg, hidden, dtype, device: local_peers(bufs, pads, 0)
    )
    x = torch.randn(9, 32)
    reason = all_reduce._peers_or_reason(x, x, _Group(0))
    assert isinstance(reason, str) and "more rows than the symmetric buffers hold (8" in reason
    assert isinstance(all_reduce._peers_or_reason(x[:8], x[:8], _Group(0)), symmetric.Peers)
    assert "kernel" in all_reduce._peers_or_reason(x.double(), x.double(), _Group(0))


def test_group_size_1_runs_the_references():
    x, residual, weight = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    for got, want in zip(
        triton_ops.all_reduce_add_rms_norm(x, residual, weight, EPS, 0, 1),
        hy3.all_reduce_add_rms_norm(x, residual, weight, EPS, 0, 1),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    w = torch.randn(24, 32)
    torch.testing.assert_close(cublas.gemm_reduce_scatter(x, w, 0, 1), hy3.gemm_reduce_scatter(x, w, 0, 1))
    for got, want in zip(cublas.allgather_gemm(x, w, 0, 1), hy3.allgather_gemm(x, w, 0, 1), strict=True):
        torch.testing.assert_close(got, want)


def test_opcheck_at_group_size_1():
    x, residual, weight, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(16, 32)
    torch.library.opcheck(triton_ops.all_reduce_add_rms_norm.default, (x, residual, weight, EPS, 0, 1))
    torch.library.opcheck(cublas.gemm_reduce_scatter.default, (x, w, 0, 1))
    torch.library.opcheck(cublas.allgather_gemm.default, (x, w, 0, 1))


def _providers_on_gloo(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The provider ops on CPU tensors over a real group: no symmetric memory, so the references run."""
    bind_groups({0: dist.group.WORLD})
    try:
        g = torch.Generator().manual_seed(rank)
        x, residual = torch.randn(4, 32, generator=g), torch.randn(4, 32)
        weight, w = torch.ones(32), torch.randn(8, 32, generator=torch.Generator().manual_seed(7))
        out = {}
        out["normed"], out["total"] = triton_ops.all_reduce_add_rms_norm(
            x, residual, weight, EPS, 0, world_size
        )
        want = all_reduce_add_rms_norm_reference(x, residual, weight, EPS, 0, world_size)
        out["scatter"] = cublas.gemm_reduce_scatter(x, w, 0, world_size)
        out["gathered"], out["gemm"] = cublas.allgather_gemm(x, w, 0, world_size)
        out["want"] = (*want, gemm_reduce_scatter_reference(x, w, 0, world_size))
        out["want"] += allgather_gemm_reference(x, w, 0, world_size)
        return out
    finally:
        unbind_groups()


def test_providers_fall_back_on_gloo_ranks():
    for result in run_ranks(_providers_on_gloo, 2, timeout=120):
        got = (result["normed"], result["total"], result["scatter"], result["gathered"], result["gemm"])
        for a, b in zip(got, result["want"], strict=True):
            torch.testing.assert_close(a, b)


# ---- symmetric memory: refusals and the older-torch path -------------------------------------------


def test_multicast_must_be_off(monkeypatch):
    monkeypatch.setenv(symmetric.MULTICAST_VAR, "0")
    reason = symmetric.multicast_refusal(torch.device("cuda", 0))
    assert reason is not None and "multicast off" in reason
    monkeypatch.setenv(symmetric.MULTICAST_VAR, "1")
    pg = types.SimpleNamespace(group_name="0")
    assert (
        symmetric.group_peers(pg, 32, torch.bfloat16, torch.device("cpu"))
        == "cpu tensors have no symmetric memory"
    )


def test_local_peers_check_their_tensors():
    bufs, pads = _ranks(2, 8, 32, torch.float32)
    peers = local_peers(bufs, pads, 1)
    assert (peers.rank, peers.world_size, peers.capacity, peers.hidden) == (1, 2, 8, 32)
    assert peers.buffers.tolist() == [b.data_ptr() for b in bufs]
    assert peers.programs == symmetric.MAX_PROGRAMS
    with pytest.raises(ValueError, match="one buffer and one pad per rank"):
        local_peers(bufs, pads[:1], 0)
    with pytest.raises(ValueError, match="int32"):
        local_peers(bufs, [p.float() for p in pads], 0)
    with pytest.raises(ValueError, match="contiguous"):
        local_peers([b.t() for b in bufs], pads, 0)
    with pytest.raises(ValueError, match="16-byte aligned"):
        local_peers([b.view(-1)[1 : 1 + 8 * 31].view(8, 31) for b in bufs], pads, 0)
    assert symmetric.pad_programs(PAD_SLOTS, 8) == 64 and symmetric.pad_programs(64, 8) == 0


def test_symmetric_memory_enabled_only_where_torch_needs_it():
    calls = []

    def enable(name):
        calls.append(name)

    module = types.SimpleNamespace(
        enable_symm_mem_for_group=enable, is_symm_mem_enabled_for_group=lambda n: False
    )
    symmetric.enable_on_older_torch(module, "tp")
    enable.__deprecated__ = "no need to call this function anymore"
    symmetric.enable_on_older_torch(module, "ep")
    symmetric.enable_on_older_torch(types.SimpleNamespace(), "dp")  # a torch without it
    assert calls == ["tp"]


# ---- registration and lowering ----------------------------------------------------------------------


def _node(target, *vals, extra=()):
    """A call of `target` on placeholders whose traced values are `vals` (meta tensors), then `extra`."""
    graph = fx.Graph()
    args = []
    for i, val in enumerate(vals):
        arg = graph.placeholder(f"a{i}")
        arg.meta["val"] = val
        args.append(arg)
    return graph.call_function(target, (*args, *extra))


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_providers_are_registered_for_cuda():
    (fused,) = [p for p in providers_for("all_reduce_add_rms_norm") if p.name == "triton"]
    assert fused.target is triton_ops.all_reduce_add_rms_norm.default
    assert fused.devices == {"cuda"} and fused.variants == (PDL,) and fused.cuda_graph_safe
    assert "untuned defaults" in fused.config_table("h200")
    node = _node(
        hy3.all_reduce_add_rms_norm.default, _meta(7, 4096), _meta(7, 4096), _meta(4096), extra=(EPS, 0, 2)
    )
    assert fused.supports(node) is None
    node = _node(
        hy3.all_reduce_add_rms_norm.default, _meta(7, 4096), _meta(7, 4096, dtype=torch.float32), _meta(4096)
    )
    assert fused.supports(node) == "x and residual differ in shape or dtype"
    long = _meta(7, 32768)
    assert "rows longer" in fused.supports(
        _node(hy3.all_reduce_add_rms_norm.default, long, long, _meta(32768))
    )
    for op, target in (
        ("gemm_reduce_scatter", cublas.gemm_reduce_scatter),
        ("allgather_gemm", cublas.allgather_gemm),
    ):
        (provider,) = [p for p in providers_for(op) if p.name == "cublas"]
        assert provider.target is target.default and provider.devices == {"cuda"}
        hy3_op = getattr(hy3, op).default
        for dtype in (torch.bfloat16, torch.float16):
            assert (
                provider.supports(_node(hy3_op, _meta(8, 64, dtype=dtype), _meta(32, 64, dtype=dtype)))
                is None
            )
        fp8 = _meta(32, 64, dtype=torch.float8_e4m3fn)
        assert "FP8 GEMMs keep the reference" in provider.supports(_node(hy3_op, _meta(8, 64), fp8))
    assert set(allowlist.SHARDED_KERNELS) == {
        "hy3_triton.all_reduce_add_rms_norm.default",
        "hy3_cublas.gemm_reduce_scatter.default",
        "hy3_cublas.allgather_gemm.default",
    }
    assert all(allowlist.resolve_op(name) is not None for name in allowlist.SHARDED_KERNELS)


def test_the_threshold_table():
    assert config.one_shot_max_tokens("h200", 2) == config.ONE_SHOT_MAX_TOKENS["h200"][2]
    assert config.one_shot_max_tokens("h20", 8) == config.DEFAULT[8]
    assert config.one_shot_max_tokens(None, 16) == min(config.DEFAULT.values())
    assert config.gpu_key("NVIDIA H200") == "h200" and config.gpu_key(None) is None
    assert config.UNTUNED and "untuned defaults" in config.table_for("h20")


def _lowered(tiny_ckpt, out, overrides):
    """Compile the tiny checkpoint for h200-bf16 with `overrides`: (call targets counted, lower's summary,
    the model config); the program passes the artifact's checks (read_program_file: node by node, shapes)."""
    from hy3c.compiler.driver import compile_artifact  # here: the gloo ranks import this module, not it
    from hy3c.recipe import load_recipe

    summary = compile_artifact(load_recipe("h200-bf16", overrides), out, tiny_ckpt, progress=False)
    art = open_artifact(out)
    program = read_program_file(art)
    targets = Counter(allowlist.op_name(n.target) for n in program.graph.nodes if n.op == "call_function")
    (lower,) = [r for r in summary.results if r.name == "lower"]
    return targets, lower.summary, art.config


def test_lower_picks_the_providers_for_a_cuda_target(tiny_ckpt, tmp_path):
    """tp 2: both norms of every layer take the fused kernel (2L sites); tp 2 + sp: o_proj everywhere and
    the dense layers' down_proj take the fused GEMM + reduce-scatter (L + dense), q|k|v and gate|up the
    all-gather + GEMM (2L)."""
    targets, summary, cfg = _lowered(tiny_ckpt, tmp_path / "tp2", ["parallel.tp=2"])
    layers, dense = cfg.num_hidden_layers, cfg.layer_types.count("dense")
    assert targets["hy3_triton.all_reduce_add_rms_norm.default"] == 2 * layers
    assert targets["hy3.all_reduce_add_rms_norm.default"] == 0
    assert summary["providers"]["hy3.all_reduce_add_rms_norm"] == {"triton": 2 * layers}
    assert summary["variants"]["pdl"]["on"]["hy3.all_reduce_add_rms_norm"] == 2 * layers
    assert "untuned defaults" in summary["config_tables"]["hy3.all_reduce_add_rms_norm"]
    targets, summary, _ = _lowered(tiny_ckpt, tmp_path / "tp2sp", ["parallel.tp=2", "parallel.sp=true"])
    for op, sites in (("gemm_reduce_scatter", layers + dense), ("allgather_gemm", 2 * layers)):
        assert targets[f"hy3_cublas.{op}.default"] == sites and targets[f"hy3.{op}.default"] == 0
        assert summary["providers"][f"hy3.{op}"] == {"cublas": sites}
