"""Running a sharded artifact on its N ranks (docs/ARCHITECTURE.md §7): the process groups the program's
collectives use, the loop the ranks other than 0 run, and rank 0's view of all ranks as one runner.

    runner = start_ranks("art/", device="cpu")   # rank 0: starts ranks 1 … N−1 (or joins torchrun's)
    engine = Engine(runner, tokenizer, config)    # every step is handed to every rank
    runner.shutdown()                             # the stop message: the workers exit

**Processes.** Rank 0 runs the engine: scheduler, sampling, HTTP. Every other rank runs `run_worker`:
join the default process group, bind the layout's groups (`bind_process_groups`), load its own
weights (`hy3c.runtime.artifact.load(rank=r)`: only its files), then loop: receive a message from
rank 0, do it with its runner on its own KV cache, until the stop message. On one host, `hy3c serve
ART` and `hy3c generate --artifact ART` start the workers themselves (`python -m hy3c worker …`, one
process per rank, each in its own session; they meet on a TCP store rank 0 opens on 127.0.0.1 at a
free port). Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) every process
runs the same command; rank 0 serves, the others become workers. The ranks use gloo on the CPU and
NCCL on CUDA (rank r on cuda:{LOCAL_RANK}); NVLink multicast is kept off in every process
(`MULTICAST_OFF`).

**Protocol.** Every message is a `torch.distributed.broadcast` from rank 0 over the default group: a
header of HEADER_LEN int64s (the op and its sizes), then the op's tensors.

    STEP       T, B, P, S       the step's int64 tensor (token ids | positions | slots, each row of
                                even length, then the S logits rows) and int32 tensor (the B × P page
                                table | sequence lengths | query starts, each segment 16-byte aligned,
                                as `build_step_batch` lays them out)
    ALLOCATE   pages, page size every rank allocates the same KV pages (its own KV heads)
    CAPTURE    max pages, n     then the n decode batch sizes: every rank captures the same CUDA graphs
    HEARTBEAT                   nothing: an idle rank 0 sends one every HEARTBEAT_S seconds, so a
                                worker's wait for the next message stays under its timeout
    STOP                        the worker leaves its loop and exits
    DP_STEP    T, S, L          an attention-DP step, each rank its own batch: scattered from rank 0,
                                each rank's sizes (T, B, P, S), its int64 tensor (the same length on
                                every rank) and its int32 tensor (zero-padded to L); after the step the
                                S logits rows of every rank are gathered to rank 0

Every rank computes the full logits (lm_head's are all-gathered); only rank 0's are sampled. All
ranks run the same program on the same inputs, so they make the same choices (a captured graph or
not) without telling each other.

**Attention data parallelism** (parallel.dp_attention = D > 1, tp = 1: one DP rank per rank). The
engine keeps a page pool per rank and schedules each rank's own requests (`DataParallelScheduler`);
`ShardedRunner.step_data_parallel` takes the D batches. The MoE all-gathers every rank's tokens, so
every rank's step has the same token count T = the largest batch's (`pad_step`: padding tokens are id
0 at position 0 writing slot −1, in no sequence; a rank with no work gets one dummy sequence of length
1 over the scratch page 0, as padded CUDA-graph rows do — a batch of zero sequences would launch
empty kernel grids on the GPU) and the same S logits rows (extra rows read token 0). DP steps run
uncaptured on every rank: a decode graph is chosen per batch, and the ranks' batches differ.

**Failure.** The rendezvous, the init, every collective and every wait for a message have a timeout
(`timeout`, `--collective-timeout`, 300 s by default). On rank 0 a thread watches the workers it
started. A worker that exits, or a step, capture or message that raises or times out, marks the
runner failed: `failure` says which rank (one `rank_failed` log line), the workers rank 0 started are
stopped, every later call raises `RankFailure`, and the engine reports itself dead (`/health` answers
503; requests fail with that message). A worker exits when rank 0 goes away: its wait for a message
fails (gloo: at once, the connection closes; NCCL: at the timeout), or its parent process is gone
(checked every _PARENT_POLL_S seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from hy3c.logs import log_event
from hy3c.model.batch import StepBatch
from hy3c.ops.collectives import bind_groups, unbind_groups
from hy3c.program.artifact import Artifact, ArtifactError, open_artifact
from hy3c.recipe import ParallelSpec
from hy3c.runtime.artifact import check_weight_files, load
from hy3c.runtime.runner import Runner

log = logging.getLogger("hy3c.runtime.distributed")

COLLECTIVE_TIMEOUT = timedelta(seconds=300)  # a rank that stops answering fails its peers' steps
HEARTBEAT_S = 5.0  # an idle rank 0 tells the workers it is there this often (at most timeout / 4)
HEADER_LEN = 8  # int64s of a message's header: the op and up to seven sizes
# never NVLink multicast (it can take a host's shared GPUs out of service): in every rank's process
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
JOINED_KEY = "hy3c/joined/"  # + rank: a started worker's mark on rank 0's store
_STOP_GRACE_S = 5.0  # for workers to exit after the stop message, before they are killed
_NAME_GRACE_S = 2.0  # after a failed collective: how long to wait for a dead worker's exit, to name it
_WATCH_S = 0.1  # how often rank 0 looks at the workers it started
_PARENT_POLL_S = 0.5  # how often a worker checks that its parent is still there

T = TypeVar("T")


class Op(IntEnum):
    """The messages rank 0 sends its workers (see the module docstring)."""

    STOP = 0
    STEP = 1
    ALLOCATE = 2
    CAPTURE = 3
    HEARTBEAT = 4
    DP_STEP = 5


class RankFailure(RuntimeError):
    """The ranks cannot run together any more: one died, or a collective failed or timed out."""


@dataclass(frozen=True)
class RankPlace:
    """Where a process runs among the ranks: its rank, how many there are, its rank on its host (its
    GPU) and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def bind_process_groups(
    parallel: ParallelSpec, rank: int, timeout: timedelta = COLLECTIVE_TIMEOUT
) -> dict[int, dist.ProcessGroup]:
    """Create the layout's process groups on this rank (the default group must be initialized, with the
    layout's world size) and bind the ones holding `rank`; returns group id → process group.

    Every rank creates every group of the layout (torch.distributed needs each `new_group` call on all
    ranks, in the same order) and binds, under the group's id, the rank set it belongs to
    (`hy3c.ops.collectives.bind_groups`); the program's `hy3.all_reduce(x, group, size)` and the others
    then run over it. Groups of one rank are left unbound: their collectives do nothing."""
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise RuntimeError(
            f"torch.distributed runs {world} ranks, the artifact's parallel layout needs {parallel.world_size}"
        )
    mine: dict[int, dist.ProcessGroup] = {}
    for group, rank_sets in parallel.groups().items():
        for ranks in rank_sets:
            if len(ranks) == 1:
                continue
            pg = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[group] = pg
    bind_groups(mine)
    return mine


# ---- where a process runs ---------------------------------------------------------------------------


def torchrun_place(environ: Mapping[str, str] = os.environ) -> RankPlace | None:
    """This process's place when torchrun started it (RANK or WORLD_SIZE set), else None. A ValueError
    naming the variable when torchrun's environment is incomplete or malformed."""
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return None
    missing = [name for name in TORCHRUN_VARS if name not in environ]
    if missing:
        raise ValueError(
            f"torchrun environment: {', '.join(missing)} not set (run under torchrun, or unset RANK and WORLD_SIZE)"
        )
    numbers: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            numbers[name] = int(environ[name])
        except ValueError:
            raise ValueError(f"torchrun environment: {name}={environ[name]!r} is not an integer") from None
    if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise ValueError(
            f"torchrun environment: RANK={numbers['RANK']} is not a rank of WORLD_SIZE={numbers['WORLD_SIZE']}"
        )
    return RankPlace(
        numbers["RANK"],
        numbers["WORLD_SIZE"],
        numbers["LOCAL_RANK"],
        environ["MASTER_ADDR"],
        numbers["MASTER_PORT"],
    )


def check_ranks(
    path: str | Path, place: RankPlace | None = None, random_weights: int | None = None
) -> Artifact:
    """The artifact at `path`, checked for a run on its ranks before any rank starts or loads a weight:
    it has weights (or, with `random_weights`, has none: a config preset's), torchrun's world size
    (`place`, if any) is the artifact's, and every rank's weight files are there with their recorded
    sizes (on every host: each needs the whole artifact). One ValueError (an ArtifactError for the
    artifact's files) otherwise."""
    art = open_artifact(path)
    if random_weights is not None and art.has_weights:
        raise ArtifactError(
            f"{art.path}: has weights; random weights are for an artifact compiled from a config preset "
            "(drop --random-weights)"
        )
    if random_weights is None and not art.has_weights:
        raise ArtifactError(
            f"{art.path}: compiled from a config preset without weights; it can be inspected, not run "
            "(or run with random weights: --random-weights SEED)"
        )
    if place is not None and place.world_size != art.world_size:
        p = art.recipe.parallel
        runs = f"{place.world_size} rank" + ("s" if place.world_size != 1 else "")
        start = f"{art.world_size} process" + ("es" if art.world_size != 1 else "")
        raise ValueError(
            f"torchrun runs {runs} (WORLD_SIZE), but {art.path} was compiled for "
            f"{art.world_size} (parallel.tp={p.tp}, ep={p.ep}, dp_attention={p.dp_attention}): start "
            f"{start} in all (--nnodes × --nproc-per-node)"
        )
    if random_weights is None:
        check_weight_files(art)
    return art


def rank_device(device: str | None, art: Artifact, local_rank: int, ranks_here: int) -> str:
    """The device of the rank with `local_rank` on its host, where `ranks_here` ranks run: `device`
    (default: cuda if there is one, else cpu); on CUDA, cuda:{local_rank}. A ValueError when it is not
    the artifact's device type or the host has too few GPUs."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(name)
    if kind.type != art.recipe.device_type:
        raise ArtifactError(
            f"{art.path}: compiled for target '{art.recipe.target}' ({art.recipe.device_type}); cannot run on {name}"
        )
    if kind.type != "cuda":
        return name
    if kind.index is not None:
        raise ValueError(
            f"--device {name}: the ranks of a sharded artifact run on cuda:<local rank>; pass --device cuda"
        )
    if torch.cuda.device_count() < ranks_here:
        raise ValueError(
            f"{ranks_here} ranks on this host need {ranks_here} GPUs, {torch.cuda.device_count()} are visible"
            " (run across hosts with torchrun)"
        )
    return f"cuda:{local_rank}"


def disable_multicast(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn NVLink multicast off for NCCL, symmetric memory and NVSHMEM (read when they initialize)."""
    environ.update(MULTICAST_OFF)


def _share_cpu(device: str, ranks_here: int) -> None:
    """CPU ranks on one host: each gets its share of the cores (not all of them each)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


def init_group(device: str, rank: int, world_size: int, timeout: timedelta, store: dist.Store | None) -> None:
    """Join the default process group: gloo for a CPU device, NCCL for CUDA (bound to its GPU), over
    `store` or, without one, torchrun's environment (env://); `timeout` bounds the init and every
    collective of the group."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    extra: dict = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        extra["device_id"] = torch.device(device)
    if store is None:
        extra["init_method"] = "env://"
    else:
        extra["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **extra)


def leave_group() -> None:
    """Unbind the program's groups and destroy the process groups (a no-op when none exists)."""
    unbind_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def _short(exc: BaseException) -> str:
    """An exception as one short line (gloo's messages run long)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---- a step's inputs as two tensors ----------------------------------------------------------------


def _layout(t: int, b: int, p: int, s: int) -> tuple[int, int, int, int, int]:
    """Where a step's inputs lie in its two tensors: (token row length, int64 length, sequence lengths'
    offset, query starts' offset, int32 length)."""
    row = t + t % 2  # rows of even length: each starts 16-byte aligned
    lens_at = -(-(b * p) // 4) * 4
    starts_at = lens_at + -(-b // 4) * 4
    return row, 3 * row + s, lens_at, starts_at, starts_at + b + 1


def pack_batch(batch: StepBatch) -> tuple[list[int], Tensor, Tensor]:
    """A step's inputs as (sizes T, B, P, S; the int64 tensor; the int32 tensor), on the batch's device."""
    t, b, p = batch.input_ids.shape[0], *batch.page_table.shape
    s = batch.logits_indices.shape[0]
    row, wide_len, lens_at, starts_at, narrow_len = _layout(t, b, p, s)
    device = batch.input_ids.device
    wide = torch.zeros(wide_len, dtype=torch.int64, device=device)
    rows = wide[: 3 * row].view(3, row)[:, :t]
    if batch.token_rows is not None:
        rows.copy_(batch.token_rows)
    else:
        for i, values in enumerate((batch.input_ids, batch.positions, batch.slot_mapping)):
            rows[i].copy_(values)
    wide[3 * row :].copy_(batch.logits_indices)
    narrow = torch.zeros(narrow_len, dtype=torch.int32, device=device)
    narrow[: b * p].copy_(batch.page_table.reshape(-1))
    narrow[lens_at : lens_at + b].copy_(batch.seq_lens)
    narrow[starts_at:].copy_(batch.query_start_loc)
    return [t, b, p, s], wide, narrow


def unpack_batch(sizes: list[int], wide: Tensor, narrow: Tensor) -> StepBatch:
    """The StepBatch of `pack_batch`'s tensors (views of them; no logits owners: workers sample nothing)."""
    t, b, p, s = sizes
    row, _, lens_at, starts_at, _ = _layout(t, b, p, s)
    rows = wide[: 3 * row].view(3, row)[:, :t]
    return StepBatch(
        input_ids=rows[0],
        positions=rows[1],
        page_table=narrow[: b * p].view(b, p),
        seq_lens=narrow[lens_at : lens_at + b],
        query_start_loc=narrow[starts_at:],
        slot_mapping=rows[2],
        logits_indices=wide[3 * row :],
        token_rows=rows,
    )


def pad_step(batch: StepBatch, tokens: int, rows: int) -> StepBatch:
    """`batch` grown to `tokens` tokens and `rows` logits rows (an attention-DP step: every rank feeds
    the MoE the same token count). Padding tokens are id 0 at position 0 writing slot −1, past the last
    sequence (never attended); padding rows read token 0. A batch without sequences gets one dummy
    sequence of length 1 owning token 0, over the scratch page 0 (`tokens` must be at least 1)."""
    extra = tokens - batch.input_ids.shape[0]
    extra_rows = rows - batch.logits_indices.shape[0]
    if extra < 0 or extra_rows < 0:
        raise ValueError(f"cannot pad a step of {batch.input_ids.shape[0]} tokens to {tokens}")

    def padded(values: Tensor, count: int, fill: int) -> Tensor:
        return torch.cat([values, values.new_full((count,), fill)])

    page_table, seq_lens, starts = batch.page_table, batch.seq_lens, batch.query_start_loc
    if seq_lens.shape[0] == 0:
        if tokens < 1:
            raise ValueError("a step without sequences needs at least one (padding) token")
        page_table = page_table.new_zeros((1, 1))
        seq_lens = seq_lens.new_ones(1)
        starts = starts.new_tensor([0, 1])
    return StepBatch(
        input_ids=padded(batch.input_ids, extra, 0),
        positions=padded(batch.positions, extra, 0),
        page_table=page_table,
        seq_lens=seq_lens,
        query_start_loc=starts,
        slot_mapping=padded(batch.slot_mapping, extra, -1),
        logits_indices=padded(batch.logits_indices, extra_rows, 0),
    )


def _empty_tensors(sizes: list[int], device: str | torch.device) -> tuple[Tensor, Tensor]:
    _, wide_len, _, _, narrow_len = _layout(*sizes)
    return (
        torch.empty(wide_len, dtype=torch.int64, device=device),
        torch.empty(narrow_len, dtype=torch.int32, device=device),
    )


# ---- rank 0 ----------------------------------------------------------------------------------------


class LocalWorkers:
    """The worker processes rank 0 started on this host (rank → process) and the thread watching them."""

    def __init__(self, procs: dict[int, subprocess.Popen]) -> None:
        self.procs = procs
        self._stopping = threading.Event()

    @classmethod
    def spawn(
        cls,
        path: Path,
        world_size: int,
        port: int,
        device: str,
        compile: bool,
        timeout: timedelta,
        random_weights: int | None = None,
    ) -> LocalWorkers:
        """Start ranks 1 … world_size − 1 as `python -m hy3c worker` (on CUDA, rank r on cuda:r), each
        in its own session (a Ctrl-C meant for rank 0 does not reach them; rank 0 stops them), stdout
        discarded, stderr shared with rank 0 (their log lines end in `rank=r`)."""
        level = logging.getLevelName(logging.getLogger("hy3c").getEffectiveLevel())
        env = {**os.environ, **MULTICAST_OFF}
        procs: dict[int, subprocess.Popen] = {}
        workers = cls(procs)
        try:
            for rank in range(1, world_size):
                rank_dev = f"cuda:{rank}" if torch.device(device).type == "cuda" else device
                command = [
                    sys.executable, "-m", "hy3c", "--log-level", str(level), "worker", str(path),
                    "--rank", str(rank), "--world-size", str(world_size),
                    "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "--device", rank_dev, "--collective-timeout", str(timeout.total_seconds()),
                ]  # fmt: skip
                if compile:
                    command.append("--compile")
                if random_weights is not None:
                    command += ["--random-weights", str(random_weights)]
                procs[rank] = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except BaseException:
            workers.stop(0)
            raise
        log_event(
            log, "ranks_started", world_size=world_size, pids=",".join(str(p.pid) for p in procs.values())
        )
        return workers

    def exited(self) -> tuple[int, int, int] | None:
        """(rank, pid, exit code) of a worker that has exited, None while all run."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return rank, proc.pid, code
        return None

    def wait_exited(self, seconds: float) -> tuple[int, int, int] | None:
        """`exited()`, waiting up to `seconds` for one to exit."""
        deadline = time.monotonic() + seconds
        while True:
            found = self.exited()
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.02)

    def wait_joined(self, store: dist.Store, timeout: timedelta) -> None:
        """Wait until every worker has marked `store` (it started and reached rank 0), failing at once
        when one exits first and after `timeout` when one never comes."""
        keys = [f"{JOINED_KEY}{rank}" for rank in self.procs]
        deadline = time.monotonic() + timeout.total_seconds()
        while not store.check(keys):
            dead = self.exited()
            if dead is not None:
                rank, pid, code = dead
                raise RankFailure(f"rank {rank} (pid {pid}) exited before joining ({_exit_status(code)})")
            if time.monotonic() > deadline:
                late = [r for r, key in zip(self.procs, keys) if not store.check([key])]
                raise RankFailure(f"ranks {late} did not join within {timeout.total_seconds():g} s")
            time.sleep(0.02)

    def watch(self, on_exit: Callable[[int, int, int], None]) -> None:
        """Call on_exit(rank, pid, exit code) from a thread when a worker exits before `stop` (once)."""

        def run() -> None:
            while not self._stopping.wait(_WATCH_S):
                found = self.exited()
                if found is not None and not self._stopping.is_set():
                    on_exit(*found)
                    return

        threading.Thread(target=run, name="hy3c-rank-watch", daemon=True).start()

    def expect_exit(self) -> None:
        """From now on workers exiting is expected (the stop message is on its way): not reported."""
        self._stopping.set()

    def stop(self, grace: float) -> None:
        """Let the workers exit within `grace` seconds, then SIGTERM, then SIGKILL what still runs."""
        self._stopping.set()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class ShardedRunner:
    """Rank 0's runner over all ranks: the Runner interface the engine uses (`step`,
    `allocate_kv_cache`, `capture_decode_graphs`, `config`, `device`, …), each call sent to the workers
    before rank 0 runs it on its own runner; `idle` (the engine calls it when it has nothing to do:
    a heartbeat now and then), `failure` (why the ranks cannot run any more, None while they can) and
    `shutdown`. Calls come from one thread at a time (the engine's); `failure` may be set from the
    thread watching the workers."""

    def __init__(self, runner: Runner, workers: LocalWorkers | None, timeout: timedelta) -> None:
        self.runner = runner
        self.config, self.recipe, self.device = runner.config, runner.recipe, runner.device
        self.dtype, self.kv_dtype, self.kv_heads = runner.dtype, runner.kv_dtype, runner.kv_heads
        self.path, self.manifest = runner.path, runner.manifest
        self.rank, self.world_size = runner.rank, runner.world_size
        self.workers = workers
        self.data_parallel = self.recipe.parallel.dp_attention  # > 1: the engine calls step_data_parallel
        self.dp_tokens = [0] * self.data_parallel  # real (unpadded) tokens each DP rank has run
        self.failure: str | None = None
        self.heartbeat_s = min(HEARTBEAT_S, timeout.total_seconds() / 4)
        self._lock = threading.Lock()  # one message, and the work it announces, at a time
        self._fail_lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = False
        if workers is not None:
            workers.watch(self._worker_exited)

    @property
    def decode_graphs(self):
        return self.runner.decode_graphs

    @property
    def num_draft_layers(self) -> int:
        """0: sharded artifacts hold no draft program yet (manifest.json `programs.mtp_absent`)."""
        return 0

    def capture_draft_graphs(
        self,
        kv_cache: Tensor,
        max_pages: int,
        batch_sizes: list[int] | None,
        query_lens: tuple[int, ...],
    ) -> str | None:
        """Refused with the reason: a sharded artifact has no draft program."""
        return "sharded artifacts hold no draft program"

    def draft(
        self, batch: StepBatch, hidden_prev: Tensor, kv_cache: Tensor, query_len: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Refused: a sharded artifact has no draft program (`num_draft_layers` is 0)."""
        raise RuntimeError(
            f"{self.path}: sharded artifacts hold no draft program (num_draft_layers is 0; "
            "speculative decoding needs a single-rank artifact)"
        )

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> Tensor:
        """Every rank allocates `num_pages` pages of `page_size` tokens (of its own KV heads); rank 0's."""
        with self._lock:
            self._send(Op.ALLOCATE, num_pages, page_size)
            return self.runner.allocate_kv_cache(num_pages, page_size)

    def capture_decode_graphs(
        self,
        kv_cache: Tensor,
        max_pages: int,
        batch_sizes: list[int] | None = None,
        query_lens: tuple[int, ...] = (1,),
    ) -> str | None:
        """Every rank captures decode graphs of the same sizes (the recipe's by default); rank 0's result.
        One token per request only (`query_lens` other than (1,) is refused with the reason: the ranks'
        capture message carries no query length, and a sharded artifact drafts nothing to verify)."""
        if tuple(query_lens) != (1,):
            return "sharded runners capture graphs at one token per request only"
        sizes = list(self.recipe.cuda_graphs.decode_batch_sizes if batch_sizes is None else batch_sizes)
        with self._lock:
            extra = [torch.tensor(sizes, dtype=torch.int64, device=self.device)] if sizes else []
            self._send(Op.CAPTURE, max_pages, len(sizes), tensors=extra)
            # no sampler in the graphs: the engine samples a sharded step's logits after it
            return self._collective(
                lambda: self.runner.capture_decode_graphs(kv_cache, max_pages, sizes, sample=False)
            )

    def step(self, batch: StepBatch, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """Send the step's inputs to every rank, then run it here; rank 0's (full) logits and hidden."""
        sizes, wide, narrow = pack_batch(batch)
        with self._lock:
            self._send(Op.STEP, *sizes, tensors=[wide, narrow])
            return self._collective(lambda: self.runner.step(batch, kv_cache))

    def step_data_parallel(self, batches: list[StepBatch], kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """An attention-DP step: `batches[r]` runs on rank r (see the module docstring: each padded to
        the same tokens and logits rows, scattered, run uncaptured); returns every rank's logits rows
        in rank order, padding rows dropped, and rank 0's hidden states."""
        if len(batches) != self.world_size or self.data_parallel != self.world_size:
            raise ValueError(f"{len(batches)} batches for {self.data_parallel} attention-DP ranks")
        counts = [b.logits_indices.shape[0] for b in batches]
        tokens, rows = max(1, *(b.input_ids.shape[0] for b in batches)), max(counts)
        padded = [pad_step(b, tokens, rows) for b in batches]
        packed = [pack_batch(b) for b in padded]
        narrow_len = max(narrow.shape[0] for _, _, narrow in packed)
        sizes = [torch.tensor(size, dtype=torch.int64, device=self.device) for size, _, _ in packed]
        wides = [wide for _, wide, _ in packed]
        narrows = [torch.nn.functional.pad(n, (0, narrow_len - n.shape[0])) for _, _, n in packed]
        for r, batch in enumerate(batches):
            self.dp_tokens[r] += batch.input_ids.shape[0]

        def run() -> tuple[Tensor, Tensor]:
            for mine, parts in ((sizes[0], sizes), (wides[0], wides), (narrows[0], narrows)):
                dist.scatter(torch.empty_like(mine), parts, src=0)
            logits, hidden = self.runner(*padded[0].model_args(kv_cache))
            if rows:
                parts = [torch.empty_like(logits) for _ in batches]
                dist.gather(logits.contiguous(), parts, dst=0)
                logits = torch.cat([part[:n] for part, n in zip(parts, counts)])
            return logits, hidden[: batches[0].input_ids.shape[0]]

        with self._lock:
            self._send(Op.DP_STEP, tokens, rows, narrow_len)
            return self._collective(run)

    def idle(self) -> None:
        """The engine has nothing to do: a heartbeat when nothing was sent for `heartbeat_s` seconds (a
        failure it meets is recorded in `failure`, not raised)."""
        if self.failure is None and time.monotonic() - self._last_sent >= self.heartbeat_s:
            with self._lock, contextlib.suppress(RankFailure):
                self._send(Op.HEARTBEAT)

    def shutdown(self) -> None:
        """Stop the ranks: the stop message (if they still run together and no step is stuck), the
        workers rank 0 started given _STOP_GRACE_S seconds to exit (then killed), the process group
        left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.workers is not None:
            self.workers.expect_exit()
        free = self._lock.acquire(timeout=_STOP_GRACE_S)  # the engine thread may be stuck in a step
        try:
            if free and self.failure is None:
                with contextlib.suppress(RankFailure):
                    self._send(Op.STOP)
        finally:
            if self.workers is not None:
                self.workers.stop(_STOP_GRACE_S)
            if free:
                if self.failure is None:
                    leave_group()
                else:  # peers are gone: destroying the group could wait on them
                    unbind_groups()
                self._lock.release()
        extra = {"dp_tokens": ",".join(map(str, self.dp_tokens))} if self.data_parallel > 1 else {}
        log_event(log, "ranks_stopped", world_size=self.world_size, **extra, failure=self.failure or "none")

    # ---- internals ------------------------------------------------------------------------------------
    def _send(self, op: Op, *sizes: int, tensors: list[Tensor] | tuple = ()) -> None:
        """Broadcast one message (the caller holds the lock)."""
        values = [int(op), *sizes]
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        header = header.to(self.device)

        def broadcast() -> None:
            for tensor in (header, *tensors):
                dist.broadcast(tensor, 0)

        self._collective(broadcast)
        self._last_sent = time.monotonic()

    def _collective(self, fn: Callable[[], T]) -> T:
        """Run work that communicates with the other ranks; any exception fails the ranks (they would
        wait in collectives rank 0 never joins) and is raised as RankFailure."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            return fn()
        except Exception as exc:
            self._lost(exc)
            raise RankFailure(self.failure) from exc

    def _lost(self, exc: Exception) -> None:
        """A collective raised: name the worker that died if one did (it may take a moment to be seen)."""
        dead = self.workers.wait_exited(_NAME_GRACE_S) if self.workers is not None else None
        if dead is not None:
            rank, pid, code = dead
            self._fail(f"rank {rank} (pid {pid}) died: {_exit_status(code)}", rank)
        elif self.workers is not None:
            self._fail(f"a step failed on rank 0: {_short(exc)}", 0)
        else:  # torchrun: the other ranks are out of sight
            self._fail(f"the ranks lost each other ({_short(exc)}); see every rank's log", None)

    def _worker_exited(self, rank: int, pid: int, code: int) -> None:
        if not self._closed:
            self._fail(f"rank {rank} (pid {pid}) died: {_exit_status(code)}", rank)

    def _fail(self, reason: str, rank: int | None) -> None:
        """Record the first failure (one log line) and stop the workers rank 0 started, which could only
        wait for collectives that will not come."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = reason
        log_event(
            log, "rank_failed", level=logging.ERROR, rank="unknown" if rank is None else rank, reason=reason
        )
        if self.workers is not None:
            self.workers.stop(0)


def start_ranks(
    path: str | Path,
    device: str | None = None,
    compile: bool = False,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
    place: RankPlace | None = None,
    random_weights: int | None = None,
) -> Runner | ShardedRunner:
    """Rank 0's start of an artifact: its `Runner` for one rank; for more, check the artifact
    (`check_ranks`: before any rank starts), start the workers on this host (or, under torchrun,
    `place`, join the ones torchrun started), join the process group, bind the groups, load rank 0's
    weights (or, `random_weights`, each rank its seeded random ones) and return the `ShardedRunner`
    over all ranks. Whatever fails on the way stops the workers."""
    art = check_ranks(path, place, random_weights)
    if art.world_size == 1:
        return load(art.path, device, compile, random_weights=random_weights)
    ranks_here = art.world_size if place is None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = 0 if place is None else place.local_rank
    rank0_device = rank_device(device, art, local_rank, art.world_size if place is None else local_rank + 1)
    disable_multicast()
    # NCCL's watchdog: on a timeout abort the communicators and raise (so rank 0 can answer 503),
    # rather than its default of ending the process
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    _share_cpu(rank0_device, ranks_here)
    workers: LocalWorkers | None = None
    try:
        if place is None:
            store = dist.TCPStore(
                "127.0.0.1", 0, art.world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
            base = "cuda" if rank0_device.startswith("cuda") else rank0_device
            workers = LocalWorkers.spawn(
                art.path, art.world_size, store.port, base, compile, timeout, random_weights
            )
            workers.wait_joined(store, timeout)
            init_group(rank0_device, 0, art.world_size, timeout, store)
        else:
            init_group(rank0_device, 0, art.world_size, timeout, None)
        bind_process_groups(art.recipe.parallel, 0, timeout)
        runner = load(art.path, rank0_device, compile, rank=0, random_weights=random_weights)
    except BaseException:
        if workers is not None:
            workers.stop(0)
        leave_group()
        raise
    log_event(log, "rank_ready", rank=0, world_size=art.world_size, device=rank0_device)
    return ShardedRunner(runner, workers, timeout)


# ---- the other ranks -------------------------------------------------------------------------------


class _RankTag(logging.Filter):
    """Ends a worker's log lines with its rank (its stderr is rank 0's)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.suffix = f" rank={rank}"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if " rank=" not in message:
            record.msg, record.args = "%s", (message + self.suffix,)
        return True


def _exit_with_parent() -> None:
    """A thread that ends this process when its parent (rank 0, or torchrun's agent) has gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent:
                log_event(log, "worker_orphaned", level=logging.ERROR, parent_pid=parent)
                sys.stderr.flush()
                os._exit(1)

    threading.Thread(target=watch, name="hy3c-parent-watch", daemon=True).start()


def run_worker(
    path: str | Path,
    place: RankPlace,
    device: str | None = None,
    compile: bool = False,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
    spawned: bool = True,
    random_weights: int | None = None,
) -> None:
    """Rank `place.rank` as a worker (see the module docstring): join rank 0 (`spawned`: on rank 0's
    store at master_addr:master_port, marking it; else torchrun's env://), bind the groups, load this
    rank's weights, then do what rank 0 sends until STOP. Returns after STOP; a RankFailure when rank 0
    is gone or a step fails here. `random_weights`: this rank's seeded random weights (a preset's
    artifact), as rank 0's."""
    art = check_ranks(path, None if spawned else place, random_weights)  # before anything changes here
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 takes Ctrl-C and stops the workers
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a stop that cannot wait for a collective
    for handler in logging.getLogger("hy3c").handlers:
        handler.addFilter(_RankTag(place.rank))
    disable_multicast()
    _exit_with_parent()
    if spawned:  # rank 0 chose the device (cuda:{rank} or the CPU)
        ranks_here, name = place.world_size, device or "cpu"
    else:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        name = rank_device(device, art, place.local_rank, place.local_rank + 1)
    _share_cpu(name, ranks_here)
    store = None
    if spawned:
        store = dist.TCPStore(
            place.master_addr, place.master_port, place.world_size, is_master=False, timeout=timeout
        )
        store.set(f"{JOINED_KEY}{place.rank}", "1")
    init_group(name, place.rank, place.world_size, timeout, store)
    try:
        bind_process_groups(art.recipe.parallel, place.rank, timeout)
        runner = load(art.path, name, compile, rank=place.rank, random_weights=random_weights)
        log_event(log, "rank_ready", rank=place.rank, world_size=place.world_size, device=name)
        steps = _follow_rank0(runner, place.rank)
        log_event(log, "rank_stopped", rank=place.rank, steps=steps)
    finally:
        leave_group()


def _follow_rank0(runner: Runner, rank: int) -> int:
    """The worker loop: receive rank 0's messages and do them, until STOP; returns the steps run."""
    device = runner.device
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    kv_cache: Tensor | None = None
    steps = 0
    while True:
        try:
            dist.broadcast(header, 0)
            op, *args = header.tolist()
        except Exception as exc:
            raise RankFailure(f"rank {rank}: lost rank 0 ({_short(exc)})") from None
        try:
            if op == Op.STOP:
                return steps
            if op == Op.HEARTBEAT:
                continue
            if op == Op.ALLOCATE:
                kv_cache = None  # the old cache's memory goes back before the new one is taken
                kv_cache = runner.allocate_kv_cache(args[0], args[1])
            elif op == Op.CAPTURE:
                sizes = torch.empty(args[1], dtype=torch.int64, device=device)
                if args[1]:
                    dist.broadcast(sizes, 0)
                if kv_cache is None:
                    raise RankFailure("a capture before any KV cache was allocated")
                runner.capture_decode_graphs(kv_cache, args[0], sizes.tolist(), sample=False)
            elif op == Op.STEP:
                wide, narrow = _empty_tensors(args[:4], device)
                dist.broadcast(wide, 0)
                dist.broadcast(narrow, 0)
                if kv_cache is None:
                    raise RankFailure("a step before any KV cache was allocated")
                runner.step(unpack_batch(args[:4], wide, narrow), kv_cache)
                steps += 1
            elif op == Op.DP_STEP:
                if kv_cache is None:
                    raise RankFailure("a step before any KV cache was allocated")
                _data_parallel_step(runner, kv_cache, *args[:3])
                steps += 1
            else:
                raise RankFailure(f"unknown message {op} from rank 0")
        except Exception as exc:
            what = Op(op).name.lower() if op in {o.value for o in Op} else "message"
            raise RankFailure(f"rank {rank}: {what} failed: {_short(exc)}") from exc


def _data_parallel_step(runner: Runner, kv_cache: Tensor, tokens: int, rows: int, narrow_len: int) -> None:
    """A worker's part of an attention-DP step: receive its own inputs (scattered by rank 0), run them
    uncaptured, send its `rows` logits rows to rank 0."""
    device = runner.device
    sizes = torch.empty(4, dtype=torch.int64, device=device)
    wide = torch.empty(_layout(tokens, 0, 0, rows)[1], dtype=torch.int64, device=device)
    narrow = torch.empty(narrow_len, dtype=torch.int32, device=device)
    for tensor in (sizes, wide, narrow):
        dist.scatter(tensor, None, src=0)
    mine = sizes.tolist()
    batch = unpack_batch(mine, wide, narrow[: _layout(*mine)[4]])
    logits, _ = runner(*batch.model_args(kv_cache))
    if rows:
        dist.gather(logits.contiguous(), None, dst=0)
