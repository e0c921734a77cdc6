"""A compiled artifact on the GPU: Triton/cublas providers, torch.compile, CUDA-graph decode."""

from __future__ import annotations

import pytest
import torch

import hy3c.runtime.artifact as artifact
from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.model import SeqChunk, build_step_batch
from hy3c.recipe import load_recipe
from tests.greedy import greedy

pytestmark = pytest.mark.gpu


def test_h200_artifact_with_cuda_graphs_matches_eager(tiny_ckpt, tmp_path):
    recipe = load_recipe("h200-bf16")
    summary = compile_artifact(recipe, tmp_path / "art", checkpoint=tiny_ckpt)
    providers = next(r for r in summary.results if r.name == "lower").summary["providers"]
    assert providers["hy3.paged_attention"] == {"triton": 3} and providers["hy3.fused_moe"] == {"triton": 2}
    runner = artifact.load(summary.out, device="cuda")
    model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda", progress=False)
    # teacher-forced logits of every position (free-running generations diverge after one bf16 flip)
    ids = torch.randint(0, 512, (4, 48))
    chunks = [SeqChunk(row.tolist(), 0, list(range(b * 3, b * 3 + 3)), "all") for b, row in enumerate(ids)]
    batch = build_step_batch(chunks, 16, "cuda")
    ours = runner(*batch.model_args(runner.allocate_kv_cache(16, 16)))[0].float()
    ref = model(*batch.model_args(model.allocate_kv_cache(16, 16)))[0].float()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ours - ref).norm() / ref.norm() < 0.05
    tok = Hy3Tokenizer.from_dir(summary.out)
    assert len(greedy(runner, tok, [[5, 9, 100, 7]], 8)[0].token_ids) == 8  # the engine drives it

    kv = runner.allocate_kv_cache(64, 16)
    assert runner.capture_decode_graphs(kv, max_pages=8, batch_sizes=[1, 2, 4]) is None
    chunks = [
        SeqChunk([7], 5, [1], "last"),
        SeqChunk([9], 20, [2, 3], "last"),
        SeqChunk([11], 0, [4], "last"),
    ]
    batch = build_step_batch(chunks, 16, "cuda")
    replayed = runner.step(batch, kv)
    direct = runner(*batch.model_args(kv))
    torch.testing.assert_close(replayed[0], direct[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(replayed[1], direct[1], atol=1e-2, rtol=1e-2)

    # a full batch, then a smaller one in the same graph: the rows the first used become padding again
    # (a stale row would store its K/V into page 6 once more)
    runner.step(build_step_batch([*chunks, SeqChunk([13], 3, [6], "last")], 16, "cuda"), kv)
    kv[:, :, 6].zero_()
    smaller = build_step_batch(chunks, 16, "cuda")
    replayed = runner.step(smaller, kv)
    assert not kv[:, :, 6].any()
    torch.testing.assert_close(replayed[0], runner(*smaller.model_args(kv))[0], atol=1e-2, rtol=1e-2)


def test_fp8_conversion_calibrates_on_the_gpu_and_compiles_with_the_static_recipe(tiny_ckpt, tmp_path):
    """`hy3c init-checkpoint --fp8 static --device cuda` → `hy3c compile --recipe h20-w8a8c8` (the path
    bench/serve_bench.sh takes at real shapes)."""
    from hy3c.checkpoint.fp8_convert import convert_to_fp8

    # calibrated as init-checkpoint --fp8 does it (the GPU image has no ModelOpt), layer by layer on the GPU
    fp8 = convert_to_fp8(tiny_ckpt, tmp_path / "fp8", "static", calibrator="absmax", device="cuda")
    summary = compile_artifact(load_recipe("h20-w8a8c8"), tmp_path / "art", checkpoint=fp8)
    quantize = next(r for r in summary.results if r.name == "quantize")
    assert quantize.status == "skipped"  # the checkpoint is already FP8 with static scales
    runner = artifact.load(summary.out, device="cuda")
    assert len(greedy(runner, Hy3Tokenizer.from_dir(summary.out), [[5, 9, 100, 7]], 4)[0].token_ids) == 4
