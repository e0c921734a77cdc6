"""Running an artifact on its ranks (`hy3c.runtime.distributed`): `hy3c generate --artifact` of the
tiny checkpoint prints the greedy tokens of the single-rank artifact, compiled for tp 2 (the worker
started by hy3c) and for tp 2 + ep 2 (under torchrun); a torchrun world size that is not the
artifact's and a missing or truncated rank file are one error line each, before any rank starts; a
step's inputs cross to the workers intact; torchrun's environment is read strictly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.cli import main
from hy3c.compiler.driver import compile_artifact
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.recipe import load_recipe
from hy3c.runtime.artifact import load
from hy3c.runtime.distributed import pack_batch, torchrun_place, unpack_batch
from hy3c.serve.engine.core import GenerationRequest
from hy3c.serve.engine.offline import generate
from hy3c.serve.engine.sampler import SamplingParams
from tests.dist import free_port

PROMPTS = ["The quick brown fox jumps", "Once upon a time"]
TIMEOUT_S = 120  # per command: a hang fails the test instead of the suite
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint compiled for one rank, for tp 2 and for tp 2 + ep 2."""
    root = tmp_path_factory.mktemp("ranks")
    layouts = {"tp1": [], "tp2": ["parallel.tp=2"], "tp2-ep2": ["parallel.tp=2", "parallel.ep=2"]}
    return {
        name: compile_artifact(load_recipe("cpu-reference", sets), root / name, checkpoint=tiny_ckpt).out
        for name, sets in layouts.items()
    }


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN}
    return {**env, **extra}


def _generate(
    artifact: Path, *launcher: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    command = [*(launcher or (sys.executable, "-m")), "hy3c", "generate", "--artifact", str(artifact)]
    return subprocess.run(
        [*command, *prompts, "--max-tokens", "12", "--temperature", "0", "--show-ids",
         "--collective-timeout", "60"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env or _env(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def single_rank_output(artifacts) -> str:
    """What `hy3c generate --show-ids` prints for the one-rank artifact: its greedy tokens through the
    offline engine (in this process: it needs no ranks)."""
    runner = load(artifacts["tp1"], "cpu", compile=False)
    tokenizer = Hy3Tokenizer.from_dir(artifacts["tp1"])
    requests = [
        GenerationRequest(f"prompt-{i}", tokenizer.encode(p), SamplingParams(temperature=0.0), 12)
        for i, p in enumerate(PROMPTS)
    ]
    results = generate(runner, tokenizer, requests, runner.recipe.serving)
    assert all(len(r.token_ids) == 12 for r in results)
    assert len({tuple(r.token_ids) for r in results}) == len(PROMPTS)  # the prompts differ: a real check
    return "".join(f"{r.text}\n{' '.join(map(str, r.token_ids))}\n" for r in results)


def test_generate_on_two_ranks_it_starts_prints_the_single_rank_greedy_tokens(artifacts, single_rank_output):
    done = _generate(artifacts["tp2"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == single_rank_output
    log = done.stderr
    assert "event=ranks_started world_size=2" in log and "event=rank_ready rank=1" in log
    assert "event=rank_stopped rank=1 steps=12" in log  # the worker ran every step, then stopped
    assert "failure=none" in log


def test_generate_under_torchrun_prints_the_single_rank_greedy_tokens(artifacts, single_rank_output):
    """tp 2 + ep 2 under torchrun: every process runs the command; rank 1 becomes the worker."""
    launcher = (sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m")  # fmt: skip
    done = _generate(artifacts["tp2-ep2"], *launcher)
    assert done.returncode == 0, done.stderr
    assert done.stdout == single_rank_output  # only rank 0 prints
    assert "event=ranks_started" not in done.stderr  # torchrun started the ranks, not hy3c
    assert "event=rank_stopped rank=1 steps=12" in done.stderr


def _generate_here(artifact: Path, capsys) -> tuple[int, str, str]:
    """`hy3c generate` in this process (for what fails before any rank starts): status, stdout, stderr."""
    code = main(["generate", "--artifact", str(artifact), "--prompt", "hi", "--temperature", "0"])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("rank", ["0", "1"])  # rank 0 would generate, rank 1 would become a worker
def test_a_torchrun_world_size_other_than_the_artifacts_is_one_error_line(
    artifacts, monkeypatch, capsys, rank
):
    env = {
        "RANK": rank,
        "WORLD_SIZE": "3",
        "LOCAL_RANK": rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = _generate_here(artifacts["tp2"], capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"error: torchrun runs 3 ranks (WORLD_SIZE), but {artifacts['tp2']} was compiled for 2 "
        "(parallel.tp=2, ep=1, dp_attention=1): start 2 processes in all (--nnodes × --nproc-per-node)"
    ]  # nothing joined, started or loaded: nothing else logged


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_rank_file_is_one_error_line_before_any_rank_starts(
    artifacts, tmp_path, capsys, damage
):
    broken = tmp_path / "broken"
    shutil.copytree(artifacts["tp2"], broken)
    (rank1,) = (broken / "weights").glob("rank1*.safetensors")
    if damage == "missing":
        rank1.unlink()
        message = f"error: {broken / 'weights' / rank1.name}: missing"
    else:
        size = rank1.stat().st_size
        os.truncate(rank1, size - 8)
        message = f"error: {broken / 'weights' / rank1.name}: {size - 8} bytes, manifest.json says {size} (truncated?)"
    code, out, err = _generate_here(broken, capsys)
    assert (code, out) == (2, "")
    assert err.splitlines() == [message]  # no rank started, no weight loaded: nothing else logged


def test_a_steps_inputs_cross_to_the_workers_intact():
    chunks = [SeqChunk([5, 6, 7], 0, [1]), SeqChunk([9], 20, [2, 3], "all"), SeqChunk([4, 4], 3, [4], "none")]
    batch = build_step_batch(chunks, 16)
    sizes, wide, narrow = pack_batch(batch)
    got = unpack_batch(sizes, wide.clone(), narrow.clone())  # what a worker receives
    for name in ("input_ids", "positions", "page_table", "seq_lens", "query_start_loc", "slot_mapping",
                 "logits_indices"):  # fmt: skip
        want, have = getattr(batch, name), getattr(got, name)
        assert have.dtype == want.dtype and torch.equal(have, want), name
    assert torch.equal(got.token_rows, batch.token_rows)
    for tensor in (got.input_ids, got.positions, got.slot_mapping, got.seq_lens, got.query_start_loc):
        assert tensor.data_ptr() % 16 == 0  # every segment 16-byte aligned, as build_step_batch's


def test_torchrun_environment_is_read_strictly():
    assert torchrun_place({}) is None
    full = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
    place = torchrun_place(full)
    assert (place.rank, place.world_size, place.local_rank, place.master_addr, place.master_port) == (
        3, 8, 3, "h0", 29500
    )  # fmt: skip
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        torchrun_place({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK=8 is not a rank of WORLD_SIZE=8"):
        torchrun_place({**full, "RANK": "8"})
    with pytest.raises(ValueError, match="MASTER_PORT='x' is not an integer"):
        torchrun_place({**full, "MASTER_PORT": "x"})
