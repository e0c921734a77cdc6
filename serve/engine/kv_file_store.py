"""The embedded L3 of the KV tiers (`--kv-store file:DIR`): page files (`FileStore`), and their writer in a
process of its own (`SpawnedFileStore`).

Writing every page a server computes is steady file-system work: at Hy3's slice shape on an H100,
thousands of 0.62 MiB pages a second. Done by threads of the engine's process, their Python between
system calls held the engine's GIL often enough to cost 30.7% of the throughput at 0% prefix hit
(bench/LOG.md, session 32). `SpawnedFileStore` hands the pages to a child process instead, which
checksums, writes and bounds the store. The KV tiers keep L2 in shared memory (`SharedBlocks`, a
memfd the child maps read-only), so a page is handed over as its key and L2 block number — 24 bytes
through a pipe, the child reading the block itself — and its block stays held until the child
answers (`on_block_done`); `put` sends a page's bytes through the pipe instead (a store without
shared blocks). Reads stay in the engine's process: a `FileStore` over the same directory finds the
files the child wrote.

The child runs `python -m hy3c.serve.engine.kv_file_store ROOT NAMESPACE_HEX MAX_BYTES [FD BLOCK_BYTES
BLOCKS]`; it imports neither torch nor the engine. It reads frames from stdin — a key, then a word:
a payload's length and the payload, or `BLOCK_FRAME | block`, or 0 (a page read here: a touch, for
the store's LRU, not answered) — and answers each page on stdout with a code, `+` stored, `=` the store
held it already, `!` the write failed, and the page's block (`NO_BLOCK` for a payload).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import select
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hy3c.logs import log_event

log = logging.getLogger("hy3c.serve.engine.kv_file_store")

Buffer = bytes | bytearray | memoryview  # a page's bytes: a view of an L2 block, or bytes read
MAGIC = b"HY3CKV02"
_HEADER = struct.Struct("<8s16sQI")  # magic, namespace digest, payload bytes, payload CRC-32
# a page handed to the writer process: its key, then a word (module docstring)
_FRAME = struct.Struct("<16sQ")
_ANSWER = struct.Struct("<cQ")  # the writer's answer for a page: its code, then its block (or NO_BLOCK)
BLOCK_FRAME = 1 << 63  # a frame's word with this bit set names an L2 block, not a payload's length
NO_BLOCK = (1 << 64) - 1  # the block of a page sent with its payload
_PIPE_BYTES = 4 << 20  # the pipe to the writer: a few pages in flight (Linux's default is 64 KiB)
_CHILD_THREADS = 4  # the child's page writes in parallel (a new file's block allocation scales with cores)
_CHILD_PAGES = 16  # pages the child holds at most (read, not yet written): the pipe's back-pressure
_BLOCKS_IN_FLIGHT = 64  # L2 blocks handed over and not yet answered, at most (`hand_blocks` waits)
_ANSWER_PAUSE = 0.002  # seconds the child waits after sending answers, so the next ones come in a burst
_HUNG_SECONDS = 30.0  # a child with pages unanswered this long is stopped by `probe` (and started again)
_STARTUP_SECONDS = 60.0  # the child's start: its import and the store's index scan


class FileStore:
    """The embedded L3: one file per page, `root/<xx>/<hex>.kv`, a header (magic, namespace digest,
    payload length, CRC-32) then the payload; written to a temporary file and renamed (a
    reader never sees half a page), bounded to `max_bytes` by evicting the least recently used files
    (an index rebuilt by scanning the directory at start, so pages survive a restart; a page another
    process wrote since is found on disk). The directory must be ours (owner, no group or other write):
    whoever can write it can plant KV. Files are opened without following links, only regular files of
    the expected size are read. `indexed=False`: a reader beside the process that writes and bounds the
    store (`SpawnedFileStore`), with no scan and no index of its own (it would only go stale)."""

    local_lookup = True  # `contains` is one stat of a local file: the tiers ask it on the engine's thread

    def __init__(self, root: Path, namespace: bytes, max_bytes: int, indexed: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = self.root.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise ValueError(
                f"--kv-store file:{self.root}: the directory must be ours and not group/other-writable"
            )
        self.namespace = hashlib.blake2b(namespace, digest_size=16).digest()
        self.max_bytes = max_bytes
        self.indexed = indexed
        self._lock = threading.Lock()
        self._index: OrderedDict[Path, int] = OrderedDict()  # path → size, least recently used first
        self.bytes = 0
        found = []
        for path in self.root.glob("*/*.kv") if indexed else ():
            try:  # another process may evict files meanwhile
                info = path.stat()
            except FileNotFoundError:
                continue
            found.append((info.st_mtime, path, info.st_size))
        for _, path, size in sorted(found):
            self._index[path] = size
            self.bytes += size

    def _path(self, key: bytes) -> Path:
        name = hashlib.blake2b(self.namespace + key, digest_size=20).hexdigest()
        return self.root / name[:2] / f"{name}.kv"

    def contains(self, key: bytes) -> bool:
        """Whether the page's file is there (one deleted by a reader as corrupt, or evicted by another
        process, leaves the index too)."""
        path = self._path(key)
        if path.is_file():
            return True
        self._forget(path)
        return False

    def get(self, key: bytes, length: int) -> memoryview | None:
        """The payload (a view of the file's bytes read), or None when absent, not a regular file of the page's size, truncated, foreign
        or corrupt (a bad file is deleted)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # absent (maybe evicted by another process), or a link
            self._forget(path)
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size != _HEADER.size + length:
                data = b""
            else:
                data = f.read(_HEADER.size + length + 1)
        payload = unseal(data, self.namespace, length)
        if payload is None:
            log_event(
                log, "kv_store_page_rejected", level=logging.WARNING, path=str(path), bytes=info.st_size
            )
            self._forget(path, unlink=True)
            return None
        if self.indexed:
            with self._lock:
                if path not in self._index:
                    self.bytes += len(data)
                self._index[path] = len(data)
                self._index.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)
        return payload

    def touch(self, key: bytes) -> None:
        """The page was read (by another instance over this directory): the most recently used."""
        path = self._path(key)
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)

    def put(self, key: bytes, payload: Buffer) -> None:
        """Write a page (`payload` may be a view of an L2 block: it is read, not copied, and not kept)."""
        path = self._path(key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(_header(payload, self.namespace))
            f.write(payload)
        os.replace(tmp, path)
        size = _HEADER.size + len(payload)
        with self._lock:
            self.bytes += size - self._index.pop(path, 0)
            self._index[path] = size
            victims = []
            while self.bytes > self.max_bytes and len(self._index) > 1:
                victim, victim_size = self._index.popitem(last=False)
                self.bytes -= victim_size
                victims.append(victim)
        for victim in victims:
            victim.unlink(missing_ok=True)

    def probe(self) -> None:
        """Raise unless the store can be written and read (the degraded state's health check)."""
        path = self.root / ".probe"
        path.write_bytes(MAGIC)
        if path.read_bytes() != MAGIC:
            raise OSError(f"{self.root}: a probe read back wrong")

    def close(self) -> None:
        """Nothing to let go of: every write is complete when `put` returns."""

    def _forget(self, path: Path, unlink: bool = False) -> None:
        with self._lock:
            self.bytes -= self._index.pop(path, 0)
        if unlink:
            path.unlink(missing_ok=True)


def _checksum(payload: Buffer) -> int:
    """CRC-32: catches torn and flipped pages at 4.6× the rate of blake2b (bench/LOG.md); a checksum
    is no defence against a writer of the store, which is ours alone (FileStore) or trusted (Mooncake)."""
    return zlib.crc32(payload)


def _header(payload: Buffer, namespace: bytes) -> bytes:
    """A stored page's header: magic, namespace digest, payload length, checksum."""
    return _HEADER.pack(MAGIC, namespace, memoryview(payload).nbytes, _checksum(payload))


def seal(payload: Buffer, namespace: bytes) -> bytes:
    """A stored page in one object: the header, then the payload."""
    return b"".join((_header(payload, namespace), payload))


def unseal(data: bytes, namespace: bytes, length: int) -> memoryview | None:
    """The payload of a stored page (a view of `data`), or None when it is truncated, foreign or corrupt."""
    if len(data) != _HEADER.size + length:
        return None
    magic, stored_namespace, size, checksum = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    if (magic, stored_namespace, size) != (MAGIC, namespace, length) or checksum != _checksum(payload):
        return None
    return payload


@dataclasses.dataclass(frozen=True)
class SharedBlocks:
    """L2 in shared memory, as the writer process maps it: a file descriptor (a memfd), the bytes of one
    block, and how many blocks."""

    fd: int
    block_bytes: int
    count: int


class SpawnedFileStore:
    """A `FileStore` whose writes run in a child process (`serve_writes`): `put` sends the page through
    a pipe and returns once the pipe holds it (blocking while the child is behind: back-pressure);
    with `blocks` (L2 in shared memory) `hand_blocks` sends only the page's key and block, and the child
    reads the block itself; `get` and `contains` read the directory here. Writes the child reports
    failed, and pages a dead child took with it, are raised by the next `put` or `hand_blocks` (once: the
    tiers count it like any store failure); a dead child is started again by `probe`. `drain` waits
    until the child has answered every page sent."""

    # told of each page the child wrote (its '+' answers; a page it already held is not one), on the
    # thread that reads the answers: the tiers' count of pages stored
    on_stored: Callable[[int], None] | None = None
    # told of each block `hand_blocks` handed over once the child is done reading it (answered, or died
    # holding it), on the thread that reads the answers: exactly once per `hand_blocks` that returned
    on_block_done: Callable[[int], None] | None = None
    local_lookup = True  # `contains` and `get` read the directory here (`FileStore.local_lookup`)

    def __init__(
        self, root: Path, namespace: bytes, max_bytes: int, blocks: SharedBlocks | None = None
    ) -> None:
        # checks the directory before any child starts; reads only (the child indexes and bounds)
        self.reader = FileStore(root, namespace, max_bytes, indexed=False)
        self.root, self.raw_namespace, self.max_bytes = Path(root), namespace, max_bytes
        self.blocks = blocks
        self._send = threading.Lock()  # one frame at a time into the pipe; held while the child restarts
        self._answers = threading.Condition()
        self._sent = self._answered = self._lost = 0
        self._held: Counter[int] = Counter()  # blocks handed over, not yet answered
        self._progress = time.monotonic()  # the child's last answer, or the send that gave it work
        self._reader: threading.Thread | None = None
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Start the child (under `_send`, or before any other thread has the store) and wait for it to
        report ready, `_STARTUP_SECONDS` at most."""
        store = [str(self.root), self.raw_namespace.hex(), str(self.max_bytes)]
        if self.blocks is not None:
            store += [str(self.blocks.fd), str(self.blocks.block_bytes), str(self.blocks.count)]
        self.child = subprocess.Popen(
            # -P: nothing from the working directory on the child's import path
            [sys.executable, "-P", "-m", "hy3c.serve.engine.kv_file_store", *store],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # never read: the store's own start-up error comes on stdout
            bufsize=0,
            start_new_session=True,  # a Ctrl-C at the server's terminal reaches the server, which closes it
            pass_fds=() if self.blocks is None else (self.blocks.fd,),
        )
        with contextlib.suppress(OSError):  # a larger pipe, as large as the system lets this user have
            fcntl.fcntl(self.child.stdin.fileno(), fcntl.F_SETPIPE_SZ, min(_PIPE_BYTES, _max_pipe_bytes()))
        poller = select.poll()
        poller.register(self.child.stdout.fileno(), select.POLLIN)
        ready = _read_exact(self.child.stdout, 1) if poller.poll(_STARTUP_SECONDS * 1000) else b""
        if ready != b"R":
            reason = self.child.stdout.read().decode(errors="replace").strip() if ready == b"F" else ""
            self.child.kill()
            self.child.wait()
            raise OSError(f"the file store's writer process did not start: {reason or 'no reason given'}")
        with self._answers:
            self._sent = self._answered = 0
            self._held.clear()
            self._progress = time.monotonic()
        self._reader = threading.Thread(
            target=self._read_answers, args=(self.child,), name="hy3c-kv-file-answers", daemon=True
        )
        self._reader.start()

    def _read_answers(self, child: subprocess.Popen) -> None:
        """The child's answers, one a page, read as many at a time as have come (the child sends them
        in bursts: each wake-up here takes the engine's GIL), until its stdout closes; then the blocks
        it still held are done with (a new child starts only after this ends: `probe`). A block is given
        back only while it is held (an answer for another is ignored), and before the answers are
        counted, so `drain` returns after the callbacks."""
        fd, pending = child.stdout.fileno(), b""
        try:
            while data := os.read(fd, 256 * _ANSWER.size):
                pending += data
                whole = len(pending) - len(pending) % _ANSWER.size
                answers = [_ANSWER.unpack_from(pending, at) for at in range(0, whole, _ANSWER.size)]
                pending = pending[whole:]
                blocks = []
                with self._answers:
                    for _, block in answers:  # one give-back per hand-over still held, never more
                        if block != NO_BLOCK and self._held[block] > 0:
                            self._held[block] -= 1
                            blocks.append(block)
                    self._held = +self._held  # drop the blocks no longer held
                self._tell(sum(code == b"+" for code, _ in answers), blocks)
                with self._answers:
                    self._answered += len(answers)
                    self._lost += sum(code == b"!" for code, _ in answers)
                    self._progress = time.monotonic()
                    self._answers.notify_all()
        except OSError:  # the pipe failed: as if the child had ended
            pass
        finally:  # the child is gone: what it had not answered is lost (a frame being sent: under `_send`)
            with self._send:
                with self._answers:
                    held, self._held = self._held, Counter()
                self._tell(0, list(held.elements()))
                with self._answers:
                    self._lost += self._sent - self._answered
                    self._answered = self._sent
                    self._answers.notify_all()

    def _tell(self, stored: int, blocks: list[int]) -> None:
        """The callbacks of pages stored and blocks given back (a callback's error is logged: the answers
        go on being read)."""
        try:
            if stored and self.on_stored is not None:
                self.on_stored(stored)
            for block in blocks if self.on_block_done is not None else ():
                self.on_block_done(block)
        except Exception as exc:
            log_event(log, "kv_file_store_callback_failed", level=logging.ERROR, error=repr(exc))

    def put(self, key: bytes, payload: Buffer) -> None:
        """Hand the page to the writer process (`payload` is copied into the pipe, not kept)."""
        view = memoryview(payload).cast("B")
        if len(key) != 16 or not view.nbytes:
            raise ValueError("a page is a 16-byte key and a payload of at least one byte")
        self._raise_lost()
        with self._send:
            if self._closed:
                raise OSError("the file store is closed")
            fd = self.child.stdin.fileno()
            with self._sending([]):  # BrokenPipeError (an OSError) if the child died
                _write_all(fd, _FRAME.pack(key, view.nbytes))
                _write_all(fd, view)

    def hand_blocks(self, keys: list[bytes], blocks: list[int], timeout: float) -> None:
        """Hand the pages in L2 blocks `blocks` (of the shared `blocks`) to the writer process, which
        reads them there: a block must not change until `on_block_done(block)`. One write of their
        frames (atomic: all are handed over, or — when this raises — none). Waits while
        `_BLOCKS_IN_FLIGHT` pages are handed over and unanswered, `timeout` seconds at most (then a
        TimeoutError)."""
        if not keys and not blocks:
            return
        if len(keys) != len(blocks) or len(keys) * _FRAME.size > select.PIPE_BUF:
            raise ValueError(f"hand_blocks: {len(keys)} keys and {len(blocks)} blocks in one write")
        for key, block in zip(keys, blocks):
            if self.blocks is None or not 0 <= block < self.blocks.count or len(key) != 16:
                raise ValueError(f"hand_blocks: block {block} of a store sharing {self.blocks}")
        self._raise_lost()
        with self._answers:
            if not self._answers.wait_for(lambda: self._sent - self._answered < _BLOCKS_IN_FLIGHT, timeout):
                raise TimeoutError(
                    f"the file store's writer process left {_BLOCKS_IN_FLIGHT} pages unanswered for {timeout} s"
                )
        frames = b"".join(_FRAME.pack(key, BLOCK_FRAME | block) for key, block in zip(keys, blocks))
        with self._send:
            if self._closed:
                raise OSError("the file store is closed")
            with self._sending(blocks):
                _write_all(self.child.stdin.fileno(), frames)

    @contextlib.contextmanager
    def _sending(self, blocks: list[int]):
        """Count a page (`blocks` empty: one sent with its payload) or these blocks as sent before the
        write — the child may answer before the write returns — and uncount them if it fails (under
        `_send`, so a dead child's last accounting comes after)."""
        count = len(blocks) or 1
        with self._answers:
            if self._sent == self._answered:  # the child was idle: its time to answer starts now
                self._progress = time.monotonic()
            self._sent += count
            self._held.update(blocks)
        try:
            yield
        except BaseException:
            with self._answers:
                self._sent -= count
                self._held.subtract(blocks)
                self._held = +self._held
            raise

    def _raise_lost(self) -> None:
        with self._answers:
            lost, self._lost = self._lost, 0
        if lost:
            raise OSError(f"the file store's writer process lost {lost} page(s) (failed or ended)")

    def get(self, key: bytes, length: int) -> memoryview | None:
        """The page read here; a hit is sent to the child as a touch (a frame without payload), whose
        index then evicts the least recently used page, not the one written first."""
        payload = self.reader.get(key, length)
        if payload is not None:
            self._touch(key)
        return payload

    def _touch(self, key: bytes) -> None:
        """Tell the child of a read, unless that would wait: a page being sent, or a pipe without room
        (a read never waits behind the writes; a touch missed only ages the page in the child's LRU)."""
        if not self._send.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            fd = self.child.stdin.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if poller.poll(0):  # room for PIPE_BUF bytes: a frame's write will not block
                _write_all(fd, _FRAME.pack(key, 0))
        except OSError:  # the child is gone: the next put reports it
            pass
        finally:
            self._send.release()

    def contains(self, key: bytes) -> bool:
        return self.reader.contains(key)

    def probe(self) -> None:
        """Raise unless the directory can be written and read and the writer process runs (started
        again if it died, or stopped first if it has left pages unanswered for `_HUNG_SECONDS`; the
        pages the old one lost are forgotten, counted once already)."""
        self.reader.probe()
        with self._answers:
            hung = self._sent > self._answered and time.monotonic() - self._progress > _HUNG_SECONDS
        if hung and self.child.poll() is None:
            log_event(
                log, "kv_file_writer_hung", level=logging.WARNING, unanswered=self._sent - self._answered
            )
            self.child.kill()
            self.child.wait()
        if self.child.poll() is not None and self._reader is not None:
            self._reader.join()  # its end releases what the dead child held (it takes `_send`)
        with self._send:
            ended = self._reader is None or not self._reader.is_alive()
            if self.child.poll() is not None and not self._closed and ended:
                with self._answers:
                    self._lost = 0
                self._start()

    def drain(self, timeout: float) -> bool:
        """Wait until the child has answered every page sent, or `timeout` seconds; whether it has."""
        with self._answers:
            return self._answers.wait_for(lambda: self._answered >= self._sent, timeout)

    def close(self) -> None:
        """Let the child write what it holds and end (a few seconds at most): after a `put` still
        sending, which no later one follows."""
        if not self._send.acquire(timeout=5.0):  # a put blocked on a hung child: end it
            self.child.kill()
            self._send.acquire()
        try:
            self._closed = True
            with contextlib.suppress(OSError):
                self.child.stdin.close()
        finally:
            self._send.release()
        try:
            self.child.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def _max_pipe_bytes() -> int:
    """The largest pipe an unprivileged process may ask for (Linux's pipe-max-size; 1 MiB by default)."""
    try:
        return int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        return 1 << 20


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(stream, count: int) -> bytes:
    """`count` bytes from a binary stream, fewer only at its end."""
    parts, left = [], count
    while left:
        part = stream.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


class MappedBlocks:
    """The shared L2 blocks in the writer process, mapped read-only: a block's view on demand."""

    def __init__(self, fd: int, block_bytes: int, count: int) -> None:
        self.block_bytes, self.count = block_bytes, count
        self.view = memoryview(mmap.mmap(fd, block_bytes * count, prot=mmap.PROT_READ))

    def get(self, block: int) -> memoryview | None:
        """Block `block`, or None when there is no such block."""
        if not 0 <= block < self.count:
            return None
        return self.view[block * self.block_bytes : (block + 1) * self.block_bytes]


def serve_writes(store: FileStore, frames, answers, blocks: MappedBlocks | None = None) -> None:
    """The writer process's loop: each frame's page stored (unless the store holds it) by a small pool
    of threads, answered in the order the writes end, until the frames end or fail. `blocks`: the
    shared L2 blocks that block frames name (read, never written here)."""
    room = threading.BoundedSemaphore(_CHILD_PAGES)
    queued: queue.SimpleQueue = queue.SimpleQueue()  # answers, sent in bursts by `send_answers`

    def send_answers() -> None:
        """Every answer queued, in one write, then a pause (`_ANSWER_PAUSE`): the engine's process
        wakes for a burst, not for each page; None ends it."""
        while (first := queued.get()) is not None:
            burst, end = [first], False
            while not queued.empty():
                item = queued.get()
                if item is None:
                    end = True
                    break
                burst.append(item)
            answers.write(b"".join(_ANSWER.pack(*answer) for answer in burst))
            answers.flush()
            if end:
                return
            time.sleep(_ANSWER_PAUSE)

    sender = threading.Thread(target=send_answers, name="hy3c-kv-file-answer-sender")
    sender.start()

    def write(key: bytes, payload: Buffer | None, block: int) -> None:
        try:
            answer = b"="
            if payload is None:  # a block frame naming no block of ours
                answer = b"!"
            elif not store.contains(key):
                store.put(key, payload)
                answer = b"+"
        except Exception:  # whatever the write raised: that page is not stored, the loop goes on
            answer = b"!"
        finally:
            room.release()
        queued.put((answer, block))

    try:
        with ThreadPoolExecutor(_CHILD_THREADS, thread_name_prefix="hy3c-kv-file-write") as pool:
            while head := _read_exact(frames, _FRAME.size):
                if len(head) < _FRAME.size:
                    break
                key, word = _FRAME.unpack(head)
                if word == 0:  # a page read by the engine's process: a touch, not answered
                    store.touch(key)
                    continue
                if word & BLOCK_FRAME:
                    block = word & ~BLOCK_FRAME
                    payload = blocks.get(block) if blocks is not None else None
                else:
                    block, payload = NO_BLOCK, _read_exact(frames, word)
                    if len(payload) < word:
                        break
                room.acquire()
                pool.submit(write, key, payload, block)
    finally:  # after every write (the pool is shut down): the last answers, then the end
        queued.put(None)
        sender.join()


def main(argv: list[str]) -> int:
    root, namespace, max_bytes = Path(argv[0]), bytes.fromhex(argv[1]), int(argv[2])
    answers = sys.stdout.buffer
    try:
        store = FileStore(root, namespace, max_bytes)
        blocks = MappedBlocks(*map(int, argv[3:6])) if len(argv) >= 6 else None
    except (OSError, ValueError) as exc:
        answers.write(b"F" + str(exc).encode())
        answers.flush()
        return 2
    _remove_orphaned_temporaries(root)
    answers.write(b"R")
    answers.flush()
    serve_writes(store, sys.stdin.buffer, answers, blocks)
    return 0


def _remove_orphaned_temporaries(root: Path) -> None:
    """Temporary page files (`*.kv.tmpPID.TID` or `*.tmpPID.TID`) of writers no longer running: a killed
    writer leaves them, the store's index never counts them."""
    for path in root.glob("*/*.tmp*"):
        pid = path.name.rpartition(".tmp")[2].partition(".")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except OSError:  # alive, another user's: not ours to touch
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
