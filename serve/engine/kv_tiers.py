"""KV tiers below the GPU page pool: L2 in pinned host memory, L3 in a store (`file:DIR`, `mooncake:HOST:PORT`).

    tiers = KVTiers(kv_cache, TierConfig(host_gib=8, store="file:/var/cache/hy3c", namespace=key))
    pool.on_publish, pool.on_allocate = tiers.published, tiers.reusing
    tiers.commit_saves()                                 # once per step: the pages published go to L2
    while tiers.fetching(pool, request_id, tokens): ...   # the store's pages read into L2 (the engine steps on)
    pages = pool.match_prefix(tokens)                    # L1 hit
    pages += tiers.extend_prefix(pool, tokens, pages)    # then L2 hits, loaded into new L1 pages

Every tier keys a page by the chained page hash the L1 pool publishes it under (`kv_pages`), so a
prefix is found page by page in L1, then L2, then L3, stopping at the first miss.

* **Write-through.** When the pool publishes a full page, it is given an L2 block; once per step
  (`commit_saves`) the pages published in it have their KV (every layer, the MTP layer's too: one
  [layers, 2, page_size, heads, head_dim] slab each) gathered into a staging buffer and copied to their
  blocks, one copy per run of consecutive blocks, on a side CUDA stream that first waits for the work
  queued so far (the KV it copies is computed by then), so the copy is off the step's critical path;
  the L1 page is not handed out again before that copy is done (`reusing` makes the stream wait on its
  event — no host wait). Pages L2 already holds are only touched (LRU).
* **L2 → L3.** A page new to L2 is *unwritten* until a writer thread has stored it: the writer's
  bounded queue is topped up from the unwritten blocks, oldest first, once per step and after each
  batch it writes, so a burst faster than the store is written back while L2 still holds it (the
  store's rate, not the queue, bounds what reaches L3); an unwritten block L2 evicts is a dropped
  write, counted. The writer waits for a page's copy event, then has the block stored without
  copying it: L2 lives in shared memory (a memfd, registered with CUDA as pinned memory), which the
  file store's writer process (`kv_file_store.SpawnedFileStore`) maps, so it is handed a page's key
  and block number and reads the block itself; a zero-copy store (Mooncake: the L2 blocks
  registered with it) moves the block itself, and reads land straight in reserved blocks — a read
  that outlives its timeout keeps them until it ends. A block being written is pinned until its
  write ends, so L2 eviction never hands it out mid-write.
* **Store reads** (`fetching`, before admission): when a waiting request's prefix continues past what
  L1 and L2 hold, one read of those pages runs on a worker while the engine keeps stepping the running
  requests; the request is admitted when the read ends or its timeout passes, the pages read landing
  in L2 blocks (the host writes a block only after its last device copy is done).
* **Load-back** (`extend_prefix`, at admission): the pages after the L1 hit that L2 holds go into newly
  allocated L1 pages on the side stream — after the work queued so far, since a freshly freed L1 page
  may still be written by a step in flight: each run of consecutive blocks in one H2D copy into a
  staging buffer, then one scatter into the pages per round. Nothing waits for it there: the pages
  are `loading` until the copies' event has passed. A request holding such pages joins the next step
  at once, the compute stream waiting on the event (`wait_loads`), when the load is no larger than a
  step's token budget or the step has nothing else to run; else it is held back while other requests
  step (the copy overlaps their work). A loading page handed out again is waited for likewise
  (`reusing`). The loaded pages are published in L1 at once, so concurrent
  requests with that prefix share them (and their wait).
* **L3 never blocks serving for long.** Each store call runs on a worker with a timeout; after
  `failures_to_degrade` consecutive failures or timeouts the store is *degraded*: lookups miss and
  writes drop while a background probe retries it every `probe_seconds`, resuming when it answers. A
  page that fails its checksum or is truncated is deleted and reads as a miss: the prefix is
  recomputed from there, never served wrong.

Off CUDA (tests, the CPU runner) the copies are plain synchronous copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy
import torch
from torch import Tensor

from hy3c.logs import log_event
from hy3c.serve.engine.kv_file_store import MAGIC, Buffer, SharedBlocks, SpawnedFileStore, seal, unseal
from hy3c.serve.engine.kv_pages import OutOfPages, PagePool, extend_page_keys

log = logging.getLogger("hy3c.serve.engine.kv_tiers")

_MOONCAKE_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND: a miss, unlike every other negative code
_WRITE_BATCH = 32  # pages per L3 store call of the writer
# threads a batch's page writes are spread over: a new file's writing is the file system's block
# allocation, which scales with cores (1 → 2 threads: 0.38 → 0.70 GB/s on the 2-core CPU machine)
WRITE_THREADS = 4
# idle L2 blocks still waiting for L3 that eviction passes over, looking for one L3 holds already,
# before it drops the oldest of them (a bound: the scan is per block taken)
_VICTIM_SCAN = 64
_STAGING_BYTES = 256 * 2**20  # the device staging buffer of one round of L2 → L1 loads


@dataclass(frozen=True)
class TierConfig:
    """`--kv-host-gib` (L2 size; 0: no L2, and then no L3), `--kv-store` (None or `file:DIR`),
    `--kv-store-gib` (the file store's size bound), `--kv-store-timeout` (seconds per store call), and
    the cache key KV is stored under: the artifact's model, quantization and page layout, so KV from one
    artifact is never read by another."""

    host_gib: float = 0.0
    store: str | None = None
    store_gib: float = 64.0
    store_timeout: float = 2.0
    namespace: bytes = b""
    failures_to_degrade: int = 3
    probe_seconds: float = 5.0
    write_queue: int = 256  # pages handed to the writer at a time (the rest wait in L2, unwritten)


class PageStore(Protocol):
    """An L3 backend: page payloads by key (bytes of a fixed length), atomic, checksummed. Optionally
    `local_lookup = True`: `contains` is a local lookup (a file's stat), cheap enough for the engine's
    thread, so a request whose next page the store lacks is not held a step for a read."""

    def get(self, key: bytes, length: int) -> Buffer | None: ...

    def put(self, key: bytes, payload: Buffer) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def probe(self) -> None: ...

    def close(self) -> None: ...


def _consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, first block) of each run blocks[start:end] of consecutive block numbers: one
    contiguous host copy each."""
    runs, start = [], 0
    for end in range(1, len(blocks) + 1):
        if end == len(blocks) or blocks[end] != blocks[end - 1] + 1:
            runs.append((start, end, blocks[start]))
            start = end
    return runs


def _words(t: Tensor) -> Tensor:
    """t's bytes as the widest integers that tile its last dimension: the gather and scatter kernels
    then move 8 bytes an element, not 1 (an FP8 cache's byte view made `index_copy_` 7× slower on the
    CPU; torch has no `index_copy_` for FP8 at all)."""
    row_bytes = t.shape[-1] * t.element_size()
    width = next(
        dtype
        for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if row_bytes % dtype.itemsize == 0
    )
    return t.view(torch.uint8).view(width)


class SharedHost:
    """L2's blocks in shared memory: a memfd mapped here, whose descriptor a writer process maps too
    (`SharedBlocks`), registered with CUDA as pinned memory when the cache is on a GPU (its copies
    then run asynchronously at the link's rate, as from `pin_memory` buffers). Unpinned by `release`,
    or when it is collected — before the mapping can go, which the tensor over it keeps alive: memory
    unmapped while registered would stay pinned, and a later mapping at its address would not pin."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        nbytes = int(numpy.prod(shape)) * dtype.itemsize
        self.fd = os.memfd_create("hy3c-kv-l2", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self._mapping = mmap.mmap(self.fd, nbytes)
        except OSError:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8).view(dtype).view(shape)
        pointer = None
        if device.type == "cuda":
            code = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(code) != 0:
                os.close(self.fd)
                raise OSError(
                    f"--kv-host-gib: pinning {nbytes / 2**30:.1f} GiB of host memory failed ({code})"
                )
            pointer = self.tensor.data_ptr()
        self.release = weakref.finalize(self, _unpin, pointer, self.fd, device)

    def blocks(self) -> SharedBlocks:
        return SharedBlocks(
            self.fd, self.tensor[0].numel() * self.tensor.element_size(), self.tensor.shape[0]
        )


def _unpin(pointer: int | None, fd: int, device: torch.device) -> None:
    """`SharedHost`'s release: unregistered from CUDA once no copy into or out of it runs (on the
    cache's device: a collector's thread may have another current)."""
    if pointer is not None:
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(pointer)
    os.close(fd)


def _all_of(parts: list[Future]) -> Future:
    """A future done once every one of `parts` is: the sum of their results, or the first error."""
    combined: Future = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [part.exception() for part in parts if part.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result(sum(part.result() for part in parts))

    for part in parts:
        part.add_done_callback(one_done)
    return combined


class MooncakeStore:
    """L3 in a Mooncake Store (`--kv-store mooncake:HOST:PORT`, the master's RPC address; the
    `mooncake-transfer-engine` package): pages shared by every instance on that master, as objects
    `hy3c/<namespace>/<key>` holding the same sealed page as a file. The client joins over TCP with the
    P2P handshake (no metadata server to start) and mounts a segment of `segment_bytes` into the pool.
    Mooncake's calls return codes and never raise: a negative code is an OSError here (the tiers'
    failure count) except OBJECT_NOT_FOUND, which is a miss, as is an empty `get`."""

    def __init__(
        self, master: str, namespace: bytes, segment_bytes: int, local_host: str = "127.0.0.1"
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(
                "--kv-store mooncake: needs the mooncake-transfer-engine package"
                " (mooncake-transfer-engine-non-cuda on a machine without CUDA)"
            ) from exc
        self.namespace = hashlib.blake2b(namespace, digest_size=16).digest()
        self.prefix = f"hy3c/{self.namespace.hex()}/"
        self._make = MooncakeDistributedStore
        self._host: Tensor | None = None
        self._block_bytes = 0
        self._setup = (
            local_host,
            "P2PHANDSHAKE",
            segment_bytes,
            min(segment_bytes, 256 << 20),
            "tcp",
            "",
            master,
        )
        try:
            self.client = self._join()
        except OSError as exc:
            raise ValueError(f"--kv-store mooncake:{master}: {exc}") from None

    def _join(self):
        """A client joined to the master, its segment mounted in the pool."""
        client = self._make()
        code = client.setup(*self._setup)
        if code != 0:
            client.close()
            raise OSError(f"the Mooncake client could not join the master (code {code})")
        return client

    def attach(self, host: Tensor) -> None:
        """Register the L2 blocks (`host`, a page per row) for zero-copy transfers: pages then move
        between L2 and the pool with `put_blocks` / `get_blocks`, no bytes in between."""
        self._host = host
        self._block_bytes = host[0].numel() * host.element_size()
        self._register(self.client)

    def _register(self, client) -> None:
        if self._host is not None:
            code = client.register_buffer(
                self._host.data_ptr(), self._host.numel() * self._host.element_size()
            )
            if code != 0:
                raise OSError(f"mooncake register_buffer returned {code}")

    def _pointers(self, blocks: list[int]) -> list[int]:
        assert self._host is not None
        return [self._host.data_ptr() + block * self._block_bytes for block in blocks]

    def put_blocks(self, keys: list[bytes], blocks: list[int]) -> None:
        """Store L2 blocks as the pages `keys` in one batch, straight from the registered buffer."""
        names = [self.prefix + key.hex() for key in keys]
        codes = self.client.batch_put_from(names, self._pointers(blocks), [self._block_bytes] * len(keys))
        failed = [code for code in codes if code < 0]
        if failed:
            raise OSError(
                f"mooncake batch_put_from returned {failed[0]} for {len(failed)} of {len(keys)} pages"
            )

    def get_blocks(self, keys: list[bytes], blocks: list[int]) -> int:
        """Read the pages `keys` into L2 blocks in one batch; how many leading ones arrived whole."""
        names = [self.prefix + key.hex() for key in keys]
        sizes = self.client.batch_get_into(names, self._pointers(blocks), [self._block_bytes] * len(keys))
        whole = 0
        for size in sizes:
            if size == self._block_bytes:
                whole += 1
                continue
            if size < 0 and size != _MOONCAKE_NOT_FOUND:  # e.g. -900, the master unreachable: a failure
                raise OSError(f"mooncake batch_get_into returned {size}")
            break
        return whole

    def get(self, key: bytes, length: int) -> memoryview | None:
        data = self.client.get(self.prefix + key.hex())
        return unseal(bytes(data), self.namespace, length) if data else None

    def put(self, key: bytes, payload: Buffer) -> None:
        code = self.client.put(self.prefix + key.hex(), seal(payload, self.namespace))
        if code != 0:
            raise OSError(f"mooncake put returned {code}")

    def contains(self, key: bytes) -> bool:
        code = self.client.is_exist(self.prefix + key.hex())
        if code < 0:
            raise OSError(f"mooncake is_exist returned {code}")
        return code == 1

    def probe(self) -> None:
        """Join the master again (a restarted master has lost every segment and object) and round-trip
        a probe object; raise while that fails."""
        client = self._join()
        self._register(client)
        name = self.prefix + "probe"
        if client.upsert(name, MAGIC) != 0 or bytes(client.get(name)) != MAGIC:
            client.close()
            raise OSError("a Mooncake probe object did not round-trip")
        self.client = client  # the old one is left open: a hung call may still be inside it

    def close(self) -> None:
        self.client.close()


def open_store(spec: str, namespace: bytes, max_bytes: int, blocks: SharedBlocks | None = None) -> PageStore:
    """The store `--kv-store` names: `file:DIR` (bounded to `max_bytes`; its writer process reads the
    L2 `blocks`) or `mooncake:HOST:PORT` (a segment of `max_bytes` mounted into the pool)."""
    kind, _, where = spec.partition(":")
    if kind == "mooncake" and where.rpartition(":")[2].isdigit():
        return MooncakeStore(where, namespace, max_bytes)
    if kind != "file" or not where:
        raise ValueError(f"--kv-store {spec!r}: expected file:DIR or mooncake:HOST:PORT")
    try:
        return SpawnedFileStore(Path(where), namespace, max_bytes, blocks)
    except OSError as exc:
        raise ValueError(f"--kv-store {spec!r}: {exc.strerror or exc}") from None


@dataclass
class TierStats:
    """Per-tier counters (pages unless named bytes), read by the metrics."""

    l2_queries: int = 0
    l2_hits: int = 0
    l2_stored: int = 0
    l2_evicted: int = 0
    l3_queries: int = 0
    l3_hits: int = 0
    l3_stored: int = 0
    l3_dropped: int = 0  # writes dropped: evicted from L2 before the writer got to them, or store degraded
    l3_failures: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_seconds: float = 0.0
    l3_read_seconds: float = 0.0
    l3_write_seconds: float = 0.0


@dataclass
class _Fetch:
    keys: list[bytes]
    future: Future
    started: float
    blocks: list[int] = field(default_factory=list)  # a zero-copy read's target blocks


class KVTiers:
    """L2 (pinned host blocks, LRU by page key) and the optional L3 store over one KV cache."""

    def __init__(self, kv_cache: Tensor, config: TierConfig) -> None:
        self.kv_cache = kv_cache
        self.config = config
        page = kv_cache[:, :, 0]
        self.page_bytes = page.numel() * page.element_size()
        self.num_blocks = int(config.host_gib * 2**30) // self.page_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"--kv-host-gib {config.host_gib}: smaller than one KV page ({self.page_bytes / 2**20:.1f} MiB)"
            )
        self.cuda = kv_cache.is_cuda
        self.shared = SharedHost((self.num_blocks, *page.shape), kv_cache.dtype, kv_cache.device)
        self.host = self.shared.tensor
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self.stats = TierStats()
        self._lock = threading.Lock()  # blocks: the engine thread and the L3 writer
        self._block_of: OrderedDict[bytes, int] = OrderedDict()  # key → block, least recently used first
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._busy: dict[int, int] = {}  # block → pending L3 writes of it (not evictable meanwhile)
        self._pending: list[tuple[int, bytes, int]] = []  # (L1 page, key, block) published, not yet copied
        # blocks copied to L2 and not yet handed to the L3 writer, oldest first: block → key
        self._unwritten: OrderedDict[int, bytes] = OrderedDict()
        self._saving: dict[int, torch.cuda.Event] = {}  # L1 page → its D2H copy's event
        self._loading: dict[int, torch.cuda.Event] = {}  # L1 page → its H2D load's event (until done)
        self._block_events: dict[int, torch.cuda.Event] = {}  # block → its last device copy's event
        self._fetches: dict[str, _Fetch] = {}  # request → its store read in flight
        self._fetched: set[str] = set()  # requests whose store read is done (until admitted)
        self._orphans: list[_Fetch] = []  # timed-out zero-copy reads still holding their blocks
        self.store: PageStore | None = None
        self.zero_copy = False
        self.degraded = False
        self._failures = 0
        self._health = threading.Lock()
        self._workers: ThreadPoolExecutor | None = None
        self._page_writers: ThreadPoolExecutor | None = None  # a batch's page writes, in parallel
        self._writes: queue.Queue = queue.Queue(config.write_queue)
        self._closed = threading.Event()
        if config.store:
            self.store = open_store(
                config.store, config.namespace, int(config.store_gib * 2**30), self.shared.blocks()
            )
            if hasattr(self.store, "on_stored"):  # a store whose writes end after its `put` returns
                self.store.on_stored = self._stored
            if self.by_block:  # told when it is done with each block it was handed
                self.store.on_block_done = self._block_written  # type: ignore[attr-defined]
            # a store that can move pages straight from and into the L2 blocks (Mooncake) does
            self.zero_copy = hasattr(self.store, "attach")
            if self.zero_copy:
                self.store.attach(self.host)  # type: ignore[attr-defined]
            self._workers = ThreadPoolExecutor(2, thread_name_prefix="hy3c-kv-store")
            self._page_writers = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="hy3c-kv-put")
            threading.Thread(target=self._write_loop, name="hy3c-kv-writer", daemon=True).start()

    @property
    def by_block(self) -> bool:
        """Whether the store reads the pages it writes from the shared L2 blocks (`hand_blocks`)."""
        return hasattr(self.store, "hand_blocks")

    # ---- blocks -------------------------------------------------------------------------------------
    @property
    def blocks_used(self) -> int:
        with self._lock:
            return len(self._block_of)

    @property
    def blocks_busy(self) -> int:
        with self._lock:
            return len(self._busy)

    def _take_block(self) -> int | None:
        """A free block, else the least recently used one not waiting to be written to L3 (written, or
        never to be: no L3, or published while it was degraded), else — none among the first
        `_VICTIM_SCAN` idle blocks — the least recently used one waiting (its page dropped: in no tier
        any more). Blocks being copied or written are skipped."""
        if self._free:
            return self._free.pop()
        victim, looked = None, 0
        for key, block in self._block_of.items():
            if block in self._busy:
                continue
            if block not in self._unwritten:
                victim = (key, block)
                break
            victim = victim or (key, block)
            looked += 1
            if looked == _VICTIM_SCAN:
                break
        if victim is None:
            return None
        key, block = victim
        del self._block_of[key]
        self.stats.l2_evicted += 1
        if self._unwritten.pop(block, None) is not None:
            self.stats.l3_dropped += 1
        return block

    # ---- write-through ------------------------------------------------------------------------------
    def published(self, page: int, key: bytes) -> None:
        """The pool published L1 `page` under `key`: unless L2 holds the key, take it a block, to be
        copied by the next `commit_saves` (the block is held until then, so nobody else takes it)."""
        with self._lock:
            if key in self._block_of:
                self._block_of.move_to_end(key)
                return
            block = self._take_block()
            if block is None:
                return
            self._block_of[key] = block
            self._busy[block] = self._busy.get(block, 0) + 1
        self._pending.append((page, key, block))

    def commit_saves(self) -> None:
        """Copy the pages published since the last call to their L2 blocks on the side stream, after
        the work queued so far (which computes their KV), and queue the L3 writes. The engine calls it
        once per step; a page handed out again, a load and a flush call it first.

        As `_load`, in rounds of at most `_STAGING_BYTES`: one gather of the round's pages into a
        contiguous staging buffer, then one device → host copy per run of consecutive blocks (not two
        launches and a temporary per page)."""
        pending, self._pending = self._pending, []
        per_round = max(1, _STAGING_BYTES // self.page_bytes)
        for at in range(0, len(pending), per_round):
            round_ = pending[at : at + per_round]
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            event = None
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                index = torch.tensor([page for page, _, _ in round_], dtype=torch.long, pin_memory=self.cuda)
                index = index.to(self.kv_cache.device, non_blocking=True)
                staging = _words(self.kv_cache).movedim(2, 0)[index]  # [pages, layers, 2, …]
                host = _words(self.host)
                for start, end, first in _consecutive_runs([block for _, _, block in round_]):
                    host[first : first + end - start].copy_(staging[start:end], non_blocking=True)
                if self.stream is not None:
                    event = torch.cuda.Event()
                    event.record()
            to_store = self.store is not None and not self.degraded
            for page, key, block in round_:
                self._note_copy(block, event)
                if event is not None:
                    self._saving[page] = event
                if to_store:
                    with self._lock:
                        self._unwritten[block] = key
                self._release_busy(block)
        self.stats.l2_stored += len(pending)
        self.stats.stored_bytes += len(pending) * self.page_bytes
        self._hand_to_writer()

    def _hand_to_writer(self) -> None:
        """Top the writer's queue up with the oldest unwritten blocks (each held until written)."""
        if self.store is None or self.degraded:
            return
        with self._lock:
            while self._unwritten and not self._writes.full():
                block, key = self._unwritten.popitem(last=False)
                self._busy[block] = self._busy.get(block, 0) + 1  # the writer releases it once written
                self._writes.put_nowait((key, block, self._block_events.get(block)))

    def reusing(self, pages: Sequence[int]) -> None:
        """The pool hands these L1 pages out again: their saves are issued first (`commit_saves`) and
        the compute stream waits for their copies to L2, and for loads into them still running (no
        host wait)."""
        if self._pending:
            self.commit_saves()
        for page in pages:
            for copies in (self._saving, self._loading):
                event = copies.pop(page, None)
                if event is not None:
                    self._device_wait(event)

    def loading(self, pages: Sequence[int]) -> int:
        """How many of these L1 pages a load from L2 is still filling on the side stream (0: none; the
        scheduler decides whether a request holding them joins a step now: `extend_prefix`)."""
        running, done = 0, {}  # event → whether it has passed (asked once: a load's pages share one)
        for page in pages if self._loading else ():
            event = self._loading.get(page)
            if event is None:
                continue
            if id(event) not in done:
                done[id(event)] = event.query()
            if done[id(event)]:
                del self._loading[page]
            else:
                running += 1
        return running

    def wait_loads(self, pages: Sequence[int]) -> None:
        """The compute stream waits for the loads into these pages (a step that admits their request
        while they load: a device wait, not a host poll)."""
        events = {id(event): event for event in (self._loading.pop(page, None) for page in pages) if event}
        for event in events.values():
            self._device_wait(event)

    def _device_wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.kv_cache.device).wait_event(event)

    # ---- load-back ----------------------------------------------------------------------------------
    def extend_prefix(
        self,
        pool: PagePool,
        tokens: Sequence[int],
        pages: list[int],
        request_id: str = "",
        keys: list[bytes] | None = None,
    ) -> list[int]:
        """L1 pages holding the pages after `pages` (an L1 hit on `tokens`) that L2 has (those a
        `fetching` read brought from the store included), loaded, published in L1 and referenced;
        stops at the first miss (leaving at least one token to compute, as `match_prefix` does) or when
        L1 has no page to give. `keys`: the request's page keys so far, extended in place (as
        `match_prefix`'s).

        The load runs on the side stream and nothing waits for it here: a step that reads the pages
        must come after it — the scheduler makes the step wait on the device (`wait_loads`) when the
        load is small (moving a token's KV costs a small fraction of computing it, so a load of up to a
        step's token budget delays the step less than waiting a step delays the request), and holds
        back a request with a larger load while other requests step (the copy overlaps their work)."""
        self._fetched.discard(request_id)
        if self._pending:  # a block about to be read may be one still to be copied into
            self.commit_saves()
        full = (len(tokens) - 1) // pool.page_size
        if full <= len(pages):
            return []
        keys = extend_page_keys([] if keys is None else keys, tokens, pool.page_size, pool.namespace, full)
        started = time.perf_counter()
        blocks: list[int] = []
        with self._lock:
            for key in keys[len(pages) : full]:
                self.stats.l2_queries += 1
                block = self._block_of.get(key)
                if block is None:
                    break
                self._block_of.move_to_end(key)
                self._busy[block] = self._busy.get(block, 0) + 1  # held while it is copied from
                blocks.append(block)
            self.stats.l2_hits += len(blocks)
        if not blocks:
            return []
        try:
            try:  # as many pages as L1 can give (a shorter hit; the rest is computed)
                loaded = pool.allocate(min(len(blocks), pool.num_free))
            except OutOfPages:
                loaded = []
            event = self._load(loaded, blocks[: len(loaded)])
            if event is not None:
                self._loading.update(dict.fromkeys(loaded, event))
        finally:
            for block in blocks:
                self._release_busy(block)
        if loaded:
            computed = (len(pages) + len(loaded)) * pool.page_size
            pool.publish(tokens, [*pages, *loaded], computed, keys, since=len(pages))
            self.stats.loaded_bytes += len(loaded) * self.page_bytes
            self.stats.load_seconds += time.perf_counter() - started
        return loaded

    def _load(self, pages: list[int], blocks: list[int]) -> torch.cuda.Event | None:
        """Copy L2 `blocks` into L1 `pages` on the side stream; the last copy's event (None off CUDA).

        A page is strided in the cache (one run per layer and K / V), so copying page by page would
        cost two launches and a temporary per page. Instead, in rounds of at most `_STAGING_BYTES`:
        each run of consecutive blocks goes host → device in one contiguous copy into a staging
        buffer, then one `index_copy_` scatters the round into its pages (on `_words` views)."""
        per_round = max(1, _STAGING_BYTES // self.page_bytes)
        event = None
        for at in range(0, len(pages), per_round):
            round_pages, round_blocks = pages[at : at + per_round], blocks[at : at + per_round]
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                staging = torch.empty_like(self.host[: len(round_blocks)], device=self.kv_cache.device)
                for start, end, first in _consecutive_runs(round_blocks):
                    staging[start:end].copy_(self.host[first : first + end - start], non_blocking=True)
                index = torch.tensor(round_pages, dtype=torch.long, pin_memory=self.cuda)
                index = index.to(self.kv_cache.device, non_blocking=True)
                _words(self.kv_cache).index_copy_(2, index, _words(staging).movedim(0, 2))
                if self.stream is not None:
                    event = torch.cuda.Event()
                    event.record()
            for block in round_blocks:
                self._note_copy(block, event)
        return event

    def fetching(
        self, pool: PagePool, request_id: str, tokens: Sequence[int], keys: list[bytes] | None = None
    ) -> bool:
        """Whether the request's admission waits for the store: the first call starts one read, on a
        worker, of the pages after its L1 and L2 hit (one call, so one timeout), and this is True until
        the read ends or the timeout passes; the pages read land in L2, where `extend_prefix` finds
        them. Running requests keep stepping meanwhile; a failed or late read is a miss (recompute). A
        local store (`local_lookup`) is asked first, here, whether it holds the first of those pages:
        when it does not, there is no read and the request goes on at once."""
        if self.store is None:
            return False
        fetch = self._fetches.get(request_id)
        if fetch is None:
            if request_id in self._fetched or self.degraded:
                return False
            self._fetched.add(request_id)
            keys = self._beyond_l2(pool, tokens, [] if keys is None else keys)
            if not keys:
                return False
            self.stats.l3_queries += 1
            if getattr(self.store, "local_lookup", False) and not self._holds(keys[0]):
                return False  # its first page is not there: a miss now, no read and no step waited for one
            if self.zero_copy:
                blocks = self._reserve_blocks(len(keys))
                keys = keys[: len(blocks)]
                future = self._workers.submit(self.store.get_blocks, keys, blocks)  # type: ignore[union-attr]
                self._fetches[request_id] = _Fetch(keys, future, time.perf_counter(), blocks)
            else:
                self._fetches[request_id] = _Fetch(keys, self._read_run(keys), time.perf_counter())
            return True
        waited = time.perf_counter() - fetch.started
        if not fetch.future.done() and waited < self.config.store_timeout:
            return True
        del self._fetches[request_id]
        self.stats.l3_read_seconds += waited
        try:
            if not fetch.future.done():
                if fetch.blocks:  # the read may still write them: they wait for it (`_reap`)
                    self._orphans.append(fetch)
                raise FutureTimeout()
            result = fetch.future.result()
        except Exception as exc:  # whatever the read raised: a miss, and the store's failure
            if fetch.future.done():
                self._return_blocks(fetch.blocks)
            self._failed(exc)
            return False
        self._failures = 0
        found = result if fetch.blocks else len(result)
        self.stats.l3_queries += found - (found == len(fetch.keys))
        if fetch.blocks:
            self._adopt(fetch.keys[:found], fetch.blocks[:found])
            self._return_blocks(fetch.blocks[found:])
        else:
            self._into_l2(fetch.keys, result)
        return False

    def _holds(self, key: bytes) -> bool:
        """A local store's answer, here and now, whether it holds `key` (a failing lookup says yes: the
        read then meets the failure, with its timeout, and counts it)."""
        try:
            return self.store.contains(key)  # type: ignore[union-attr]
        except OSError:
            return True

    def _reserve_blocks(self, count: int) -> list[int]:
        """Up to `count` L2 blocks for a zero-copy read, out of the LRU and held busy (no device copy of
        their old content still running)."""
        self._reap()
        blocks = []
        with self._lock:
            for _ in range(count):
                block = self._take_block()
                if block is None:
                    break
                self._busy[block] = self._busy.get(block, 0) + 1
                blocks.append(block)
        for block in blocks:
            self._settled(block)
        return blocks

    def _adopt(self, keys: list[bytes], blocks: list[int]) -> None:
        """Blocks a zero-copy read filled become the L2 copies of `keys` (a key another read brought in
        meanwhile keeps its block; this one goes back)."""
        spare = []
        with self._lock:
            for key, block in zip(keys, blocks):
                if key in self._block_of:
                    spare.append(block)
                else:
                    self._block_of[key] = block
        for block in blocks:
            self._release_busy(block)
        self._return_blocks(spare)
        self.stats.l3_hits += len(blocks) - len(spare)

    def _return_blocks(self, blocks: list[int]) -> None:
        with self._lock:
            for block in blocks:
                self._busy.pop(block, None)
                self._free.append(block)

    def _reap(self) -> None:
        """Blocks of timed-out zero-copy reads go back once those reads have ended."""
        for fetch in [f for f in self._orphans if f.future.done()]:
            self._orphans.remove(fetch)
            self._return_blocks(fetch.blocks)

    @property
    def waiting_on_store(self) -> bool:
        """Whether an admission waits for a store read (the engine loop then naps instead of spinning)."""
        return bool(self._fetches)

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted): its fetch bookkeeping goes (a read in flight ends unused)."""
        self._fetches.pop(request_id, None)
        self._fetched.discard(request_id)

    def _beyond_l2(self, pool: PagePool, tokens: Sequence[int], keys: list[bytes]) -> list[bytes]:
        """The keys of the request's full pages after the run L1 and then L2 hold (`keys`: its page keys
        so far, extended in place)."""
        full = (len(tokens) - 1) // pool.page_size
        keys = extend_page_keys(keys, tokens, pool.page_size, pool.namespace, full)[:full]
        at = 0
        while at < len(keys) and keys[at] in pool.page_of:
            at += 1
        with self._lock:
            hits = 0
            while at < len(keys) and keys[at] in self._block_of:
                self._block_of.move_to_end(keys[at])  # most recent: the read must not evict them
                at, hits = at + 1, hits + 1
            room = self.num_blocks - hits - len(self._busy)  # what L2 can take without evicting them
        return keys[at : at + max(0, room)]

    def _read_run(self, keys: list[bytes]) -> Future:
        """A worker's read of the leading pages of `keys` the store has (stops at the first miss)."""
        assert self._workers is not None and self.store is not None
        store, length = self.store, self.page_bytes

        def read() -> list[memoryview]:
            payloads = []
            for key in keys:
                payload = store.get(key, length)
                if payload is None:
                    break
                payloads.append(payload)
            return payloads

        return self._workers.submit(read)

    def _into_l2(self, keys: list[bytes], payloads: list[memoryview]) -> None:
        """Pages read from the store into L2 blocks (least recently used ones evicted for them)."""
        for key, payload in zip(keys, payloads):
            with self._lock:
                if key in self._block_of:
                    continue
                block = self._take_block()
                if block is None:
                    return
                self._block_of[key] = block
            self._settled(block)  # no device copy of the block's old content may still be running
            self.host[block].view(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(payload, numpy.uint8)
            self.stats.l3_hits += 1

    def _note_copy(self, block: int, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._block_events[block] = event

    def _settled(self, block: int) -> None:
        """Wait for the last device copy into or out of the block (before the host writes it)."""
        event = self._block_events.pop(block, None)
        if event is not None:
            event.synchronize()

    def _release_busy(self, block: int) -> None:
        with self._lock:
            left = self._busy.get(block, 0) - 1
            if left > 0:
                self._busy[block] = left
            else:
                self._busy.pop(block, None)

    # ---- the store's health -------------------------------------------------------------------------
    def _call(self, fn, *args) -> tuple[bool, object]:
        """A store call with the timeout: (True, its result), or (False, None) with a failure counted
        when it raises or times out."""
        assert self._workers is not None
        return self._await(self._workers.submit(fn, *args))

    def _await(self, future: Future) -> tuple[bool, object]:
        """`_call`'s wait for a submitted store call."""
        try:
            result = future.result(timeout=self.config.store_timeout)
        except Exception as exc:  # whatever a backend raises is its failure, never the engine's
            self._failed(exc)
            return False, None
        self._failures = 0
        return True, result

    def _failed(self, exc: BaseException) -> None:
        with self._health:  # the engine and writer threads both report; one probe thread at most
            self.stats.l3_failures += 1
            self._failures += 1
            if self._failures < self.config.failures_to_degrade or self.degraded:
                return
            self.degraded = True
        log_event(log, "kv_store_degraded", level=logging.WARNING, reason=repr(exc))
        threading.Thread(target=self._probe_loop, name="hy3c-kv-probe", daemon=True).start()

    def _probe_loop(self) -> None:
        """Probe the degraded store every `probe_seconds` on this thread (not behind calls still hung
        on the workers) until it answers, then resume."""
        assert self.store is not None
        while not self._closed.wait(self.config.probe_seconds):
            try:
                self.store.probe()
            except Exception:  # still down (whatever it raised): probe again later
                continue
            with self._health:
                self._failures = 0
                self.degraded = False
            log_event(log, "kv_store_resumed")
            self._hand_to_writer()  # what waited in L2 meanwhile, also while no step runs
            return

    def _write_loop(self) -> None:
        """The L3 writer: takes the queued pages in batches (up to `_WRITE_BATCH`), waits for their L2
        copies, and stores each batch with one store call (fewer thread hand-offs per page). The store
        reads the pages from their L2 blocks (no copy: 640 KiB pages copied into new `bytes` held the
        writer to ~0.3 GB/s on the CPU machine, bench/LOG.md); the blocks stay held until the store
        call ends, also when it outlives its timeout, so no block is reused under a running write."""
        assert self.store is not None
        while not self._closed.is_set():
            try:
                batch = [self._writes.get(timeout=0.5)]
            except queue.Empty:
                continue
            with contextlib.suppress(queue.Empty):
                while len(batch) < _WRITE_BATCH:
                    batch.append(self._writes.get_nowait())
            still_writing = False
            try:
                if self.degraded:
                    with self._lock:
                        self.stats.l3_dropped += len(batch)
                    continue
                # each copy's event once (a step's saves share one), waited only while it runs: every
                # wait lets go of the GIL, and taking it back can keep the engine's thread waiting
                for event in {id(event): event for _, _, event in batch if event is not None}.values():
                    if not event.query():
                        event.synchronize()
                started = time.perf_counter()
                keys, blocks = [key for key, _, _ in batch], [block for _, block, _ in batch]
                if (
                    self.zero_copy
                ):  # the transfer reads the blocks themselves: on this thread, which holds them
                    self.store.put_blocks(keys, blocks)  # type: ignore[attr-defined]
                    with self._health:
                        self._failures = 0
                    stored = len(batch)
                elif self.by_block:  # handed over by block number; each released as the store answers
                    self.store.hand_blocks(keys, blocks, self.config.store_timeout)  # type: ignore[attr-defined]
                    still_writing = True  # handed over: no longer this loop's to release
                    with self._health:
                        self._failures = 0
                    stored = 0  # counted as the writer answers (`on_stored`)
                else:
                    views = [
                        memoryview(self.host[block].view(-1).view(torch.uint8).numpy()) for block in blocks
                    ]
                    assert self._page_writers is not None
                    parts = min(WRITE_THREADS, len(keys))
                    future = _all_of(
                        [
                            self._page_writers.submit(self._put_new, keys[part::parts], views[part::parts])
                            for part in range(parts)
                        ]
                    )
                    ok, stored = self._await(future)
                    stored = stored if ok else 0
                    if not future.done():  # timed out, still reading the blocks: they wait for it
                        still_writing = True
                        future.add_done_callback(lambda _, batch=batch: self._written(batch))
                with self._lock:
                    self.stats.l3_stored += stored
                self.stats.l3_write_seconds += time.perf_counter() - started
            except Exception as exc:  # the writer lives on: the pages are not stored, the store failed
                self._failed(exc)
            finally:
                if not still_writing:
                    self._written(batch)
                self._hand_to_writer()

    def _stored(self, pages: int) -> None:
        with self._lock:
            self.stats.l3_stored += pages

    def _written(self, batch: list[tuple[bytes, int, torch.cuda.Event | None]]) -> None:
        """The writer is done with these queued pages: their L2 blocks are free to reuse."""
        for _, block, _ in batch:
            self._release_busy(block)
            self._writes.task_done()

    def _block_written(self, block: int) -> None:
        """The store is done reading a block `hand_blocks` handed it: free to reuse."""
        self._release_busy(block)
        self._writes.task_done()

    def _put_new(self, keys: list[bytes], payloads: list[memoryview]) -> int:
        """Store the pages the store does not hold yet (another instance may have); how many."""
        assert self.store is not None
        stored = 0
        for key, payload in zip(keys, payloads):
            if not self.store.contains(key):
                self.store.put(key, payload)
                stored += 1
        return stored

    def flush(self, timeout: float = 30.0) -> None:
        """Issue the saves published so far, then wait until every queued store write is done, or
        `timeout` seconds (tests, shutdown)."""
        self.commit_saves()
        if self.store is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (
            self._writes.unfinished_tasks or (self._unwritten and not self.degraded)
        ):
            self._hand_to_writer()
            time.sleep(0.005)
        drain = getattr(self.store, "drain", None)  # a store whose writes end after its `put` returns
        if drain is not None:
            drain(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._closed.is_set():
            return
        self.flush(timeout=5.0)  # what L2 still holds unwritten, for a few seconds at most
        self._closed.set()
        for pool in (self._workers, self._page_writers):
            if pool is not None:
                pool.shutdown(wait=False)
        if self.store is not None:
            self.store.close()
        self.shared.release()
