"""Run a function on several local processes joined by a gloo process group (the distributed tests).

    results = run_ranks(fn, 2, a, b)    # [fn(0, 2, a, b), fn(1, 2, a, b)], each in its own process

`fn` must be importable by name (a module-level function of a test module or of hy3c), its arguments
picklable; results come back as `torch.save` bytes, so they may be tensors or lists, tuples and dicts
of them and of plain values. Each rank calls `init_process_group("gloo", tcp://127.0.0.1:<free port>,
rank, world_size, timeout=...)` first and `destroy_process_group()` after. A rank's exception fails
the call with that rank's traceback; a rank that hangs (in a collective some rank never joins) or dies
fails it after `timeout` seconds, or soon after its death, with a message naming the ranks; every
child is killed on the way out.
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_REPORT_GRACE_S = 2.0  # how long a rank's report may still be in the pipe after it exited


class RankError(RuntimeError):
    """A rank raised, hung or died; the message holds its traceback or what is known."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, timeout: float, args: tuple, out: Any
) -> None:
    """One rank: join the group, run fn, report (rank, ok, result bytes or traceback text)."""
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            result = _to_bytes(fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # everything goes back to the parent, which raises it
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, timeout, args, out), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, bytes] = {}
    exited: dict[int, float] = {}  # rank → when it was first seen exited without a report
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = out.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                waiting = [r for r in range(world_size) if r not in results]
                for r in waiting:
                    if procs[r].exitcode is not None:
                        exited.setdefault(r, now)
                dead = [r for r in waiting if now - exited.get(r, now) > _REPORT_GRACE_S]
                if dead:
                    codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in dead)
                    raise RankError(f"{fn.__name__}: died without a result ({codes})") from None
                if now > deadline:
                    raise RankError(
                        f"{fn.__name__}: ranks {waiting} of {world_size} did not finish within "
                        f"{timeout} s (a hung collective?); all ranks killed"
                    ) from None
                continue
            if not ok:
                raise RankError(f"{fn.__name__}: rank {rank} of {world_size} raised:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
    return [torch.load(io.BytesIO(results[r]), weights_only=True) for r in range(world_size)]


def step_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The step the sharded-program tests run on the tiny model: two prefills (4 and 3 tokens) over
    16-token pages — ids (`seed` picks them), positions, page table, lengths, starts, slots, logits rows."""
    ids = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(seed))
    return (
        ids,
        torch.tensor([0, 1, 2, 3, 0, 1, 2]),
        torch.tensor([[0], [1]], dtype=torch.int32),
        torch.tensor([4, 3], dtype=torch.int32),
        torch.tensor([0, 4, 7], dtype=torch.int32),
        torch.tensor([0, 1, 2, 3, 16, 17, 18]),
        torch.tensor([3, 6]),
    )


def run_step(runner, seed: int = 0) -> torch.Tensor:
    """The logits of `step_inputs(seed)` through a runner, over a fresh 4-page KV cache."""
    ids, positions, pages, lens, starts, slots, rows = step_inputs(seed)
    logits, _ = runner(ids, positions, runner.allocate_kv_cache(4, 16), pages, lens, starts, slots, rows)
    return logits
