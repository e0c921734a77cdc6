"""Attention data parallelism on its ranks (`parallel.dp_attention=2, ep=2` of the tiny checkpoint): each
DP rank runs its own requests. `hy3c generate --artifact` prints the single-rank artifact's greedy
tokens and both ranks ran real tokens; in an engine over the ranks (rank 0 in this process), a request
alone leaves the other rank idle (steps of padding only) and its pages go back to its rank's pool;
several requests spread over both ranks' pools; the scheduler places requests on the least-loaded
rank and keeps them there; a step is padded to the ranks' common size as the MoE needs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.compiler.driver import compile_artifact
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.recipe import load_recipe
from hy3c.runtime.artifact import load
from hy3c.runtime.distributed import pad_step, start_ranks
from hy3c.serve.engine.core import Engine, GenerationRequest
from hy3c.serve.engine.kv_pages import PagePool
from hy3c.serve.engine.offline import Generation, generate, offline_config
from hy3c.serve.engine.sampler import SamplingParams
from hy3c.serve.engine.scheduler import DataParallelScheduler, Sequence

# different lengths: the ranks' batches differ in size every prefill step
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time", "Hi", "A B C D E F"]
MAX_TOKENS = 6
TIMEOUT_S = 90  # per command: a hang fails the test instead of the suite
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint compiled for one rank and for attention-DP 2 + EP 2."""
    root = tmp_path_factory.mktemp("dp")
    layouts = {"tp1": [], "dp2-ep2": ["parallel.dp_attention=2", "parallel.ep=2"]}
    return {
        name: compile_artifact(load_recipe("cpu-reference", sets), root / name, checkpoint=tiny_ckpt).out
        for name, sets in layouts.items()
    }


def _requests(tokenizer: Hy3Tokenizer, prompts: list[str], tag: str = "") -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"{tag}prompt-{i}", tokenizer.encode(p), SamplingParams(temperature=0.0), MAX_TOKENS
        )
        for i, p in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def single_rank(artifacts) -> list[Generation]:
    """The one-rank artifact's greedy generations of PROMPTS (in this process: it needs no ranks)."""
    runner = load(artifacts["tp1"], "cpu", compile=False)
    tokenizer = Hy3Tokenizer.from_dir(artifacts["tp1"])
    results = generate(runner, tokenizer, _requests(tokenizer, PROMPTS), runner.recipe.serving)
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    assert len({tuple(r.token_ids) for r in results}) == len(PROMPTS)  # the prompts differ: a real check
    return results


def test_generate_spreads_requests_over_the_dp_ranks_with_the_single_rank_greedy_tokens(
    artifacts, single_rank
):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    done = subprocess.run(
        [sys.executable, "-m", "hy3c", "generate", "--artifact", str(artifacts["dp2-ep2"]), *prompts,
         "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--show-ids", "--collective-timeout", "60"],
        capture_output=True, timeout=TIMEOUT_S, env=env,
    )  # fmt: skip
    # bytes, decoded here: text=True would turn a generated "\r" into "\n" (universal newlines)
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    assert stdout == "".join(f"{r.text}\n{' '.join(map(str, r.token_ids))}\n" for r in single_rank)
    tokens = re.search(r"event=ranks_stopped world_size=2 dp_tokens=(\d+),(\d+) failure=none", stderr)
    assert tokens, stderr
    # two requests each: every rank ran its prompts and their decodes, not the other's
    assert all(int(n) >= 2 * MAX_TOKENS for n in tokens.groups())
    assert "event=rank_stopped rank=1 steps=" in stderr


def _drive(engine: Engine) -> list[list[int]]:
    """Run the engine to the end one iteration at a time; each step's pages in use, per rank."""
    used = []
    while engine._iterate():
        used.append([pool.num_used for pool in engine.pools])
    return used


def test_an_engine_over_the_dp_ranks_runs_each_ranks_requests_and_frees_their_pages(artifacts, single_rank):
    tokenizer = Hy3Tokenizer.from_dir(artifacts["dp2-ep2"])
    threads = torch.get_num_threads()  # start_ranks gives rank 0 its share of the cores
    runner = start_ranks(artifacts["dp2-ep2"], "cpu", timeout=timedelta(seconds=60))
    try:
        assert runner.data_parallel == 2
        alone = _requests(tokenizer, PROMPTS[:1], "alone-")
        spread = _requests(tokenizer, PROMPTS, "spread-")
        engine = Engine(runner, tokenizer, offline_config(alone + spread, runner.recipe.serving))
        assert [pool.num_pages for pool in engine.pools] == [engine.config.num_pages] * 2

        # one request: rank 1 has no work in any step (a step of padding only)
        result = Generation(alone[0].request_id)
        engine.submit(alone[0], result.add)
        used = _drive(engine)
        assert result.token_ids == single_rank[0].token_ids
        assert max(u[0] for u in used) > 0 and max(u[1] for u in used) == 0
        assert runner.dp_tokens[1] == 0 and runner.dp_tokens[0] > 0
        assert [pool.num_used for pool in engine.pools] == [0, 0]  # its pages went back to rank 0's pool

        # several: two per rank, both pools hold pages, every page comes back
        results = [Generation(r.request_id) for r in spread]
        for request, out in zip(spread, results):
            engine.submit(request, out.add)
        engine._drain_inbox()
        placed = {seq.request_id: seq.dp_rank for seq in engine.scheduler.waiting}
        assert sorted(placed.values()) == [0, 0, 1, 1]
        used = _drive(engine)
        assert [r.token_ids for r in results] == [r.token_ids for r in single_rank]
        assert min(u[0] for u in used[:2]) > 0 and min(u[1] for u in used[:2]) > 0
        assert [pool.num_used for pool in engine.pools] == [0, 0]
        assert runner.dp_tokens[1] > 0
    finally:
        runner.shutdown()
        torch.set_num_threads(threads)
    assert runner.failure is None


def test_requests_go_to_the_least_loaded_rank_and_stay_there():
    scheduler = DataParallelScheduler([PagePool(8, 4), PagePool(8, 4)], 8, 64)
    seqs = [Sequence(f"r{i}", [1] * n, n) for i, n in enumerate([9, 2, 3])]
    for seq in seqs:
        scheduler.add(seq)
    assert [s.dp_rank for s in seqs] == [0, 1, 1]  # r2: one request each, rank 1 has fewer tokens
    work = scheduler.schedule()
    assert [(w.seq.request_id, w.seq.dp_rank) for w in work] == [("r0", 0), ("r1", 1), ("r2", 1)]
    assert len(seqs[0].pages) == 3 and scheduler.pools[0].num_used == 3 and scheduler.pools[1].num_used == 2
    scheduler.advance(work)
    scheduler.finish(seqs[1])
    late = Sequence("r3", [2] * 5, 5)
    scheduler.add(late)
    assert late.dp_rank == 1  # one request on each rank: rank 1's has fewer tokens
    assert scheduler.pools[1].num_used == 1  # r1's page went back to rank 1's pool


def test_a_dp_step_is_padded_to_the_ranks_common_size():
    busy = build_step_batch([SeqChunk([5, 6, 7], 0, [1]), SeqChunk([9], 4, [2])], 16)
    padded = pad_step(busy, 6, 3)
    assert padded.input_ids.tolist() == [5, 6, 7, 9, 0, 0]
    assert padded.positions.tolist() == [0, 1, 2, 4, 0, 0]
    assert padded.slot_mapping.tolist() == [16, 17, 18, 36, -1, -1]  # padding writes no KV
    assert padded.query_start_loc.tolist() == [0, 3, 4]  # padding is in no sequence
    assert padded.logits_indices.tolist() == [2, 3, 0]
    idle = pad_step(build_step_batch([], 16), 6, 3)  # a rank with no work
    assert idle.input_ids.tolist() == [0] * 6 and idle.slot_mapping.tolist() == [-1] * 6
    assert idle.seq_lens.tolist() == [1] and idle.query_start_loc.tolist() == [0, 1]
    assert idle.page_table.tolist() == [[0]]  # the scratch page
