"""The file store's writer process (`SpawnedFileStore`): pages sent through the pipe land as the same
files `FileStore` writes and reads, a page the store holds is not written again, a failed write is
raised by the next `put`, a dead child is started again by `probe`, and the child imports no torch."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hy3c.serve.engine.kv_file_store import FileStore, SharedBlocks, SpawnedFileStore

PAGE = 4096


def _store(tmp_path, max_bytes: int = 1 << 30) -> SpawnedFileStore:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    return SpawnedFileStore(root, b"ns", max_bytes)


def _page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


def test_pages_sent_to_the_writer_process_are_read_back_here_and_after_a_restart(tmp_path):
    store = _store(tmp_path)
    try:
        for i in range(20):
            store.put(bytes([i]) * 16, memoryview(_page(i)))
        assert store.drain(timeout=30)
        assert all(bytes(store.get(bytes([i]) * 16, PAGE)) == _page(i) for i in range(20))
        assert store.get(bytes([99]) * 16, PAGE) is None
        assert not store.reader._index  # the reader keeps no index: only the child's bounds the store
        reopened = FileStore(tmp_path / "store", b"ns", 1 << 30)  # another instance, as after a restart
        assert bytes(reopened.get(bytes([7]) * 16, PAGE)) == _page(7)
        assert reopened.get(bytes([7]) * 16, PAGE + 1) is None  # a page of another size is not ours
        path = store.reader._path(bytes([8]) * 16)
        path.unlink()  # deleted here (as a corrupt page is): the child writes it again when sent again
        store.put(bytes([8]) * 16, _page(8))
        assert store.drain(timeout=30) and bytes(store.get(bytes([8]) * 16, PAGE)) == _page(8)
        orphan = path.with_name("0" * 40 + ".tmp999999999.1")  # of a writer that no longer runs
        orphan.write_bytes(b"half a page")
    finally:
        store.close()
    assert store.child.returncode == 0
    restarted = SpawnedFileStore(tmp_path / "store", b"ns", 1 << 30)
    restarted.close()
    assert not orphan.exists() and path.exists()


def test_the_writer_process_skips_pages_the_store_holds_and_evicts_the_least_recently_used(tmp_path):
    """Pages the store holds are not written again; over its bound the child evicts the page least
    recently written or read (reads here reach it as touches), one page at a time so the order is known
    (the child's writes run in parallel)."""
    store = _store(tmp_path, max_bytes=5 * (PAGE + 64))

    def on_disk() -> list[int]:
        return [i for i in range(1, 13) if store.reader._path(bytes([i]) * 16).is_file()]

    stored: list[int] = []
    store.on_stored = stored.append
    try:
        key = bytes([1]) * 16
        store.put(key, _page(1))
        assert store.drain(timeout=30)
        path = store.reader._path(key)
        before = path.stat().st_mtime_ns
        store.put(key, _page(2))  # held already: the child answers without writing
        assert store.drain(timeout=30)
        assert path.stat().st_mtime_ns == before and bytes(store.reader.get(key, PAGE)) == _page(1)
        for i in range(2, 12):
            store.put(bytes([i]) * 16, _page(i))
            assert store.drain(timeout=30)
        assert on_disk() == list(range(7, 12))  # the bound's five pages, the latest written
        assert store.get(bytes([7]) * 16, PAGE) is not None  # read here: now the child's most recent
        store.put(bytes([12]) * 16, _page(12))
        assert store.drain(timeout=30)
        assert on_disk() == [7, 9, 10, 11, 12]  # the least recently used (8) went, not 7
        assert len(stored) == 12  # every page written once; the one the store held is not counted
    finally:
        store.close()


def test_a_failed_write_is_raised_by_the_next_put_and_a_dead_child_restarts_on_probe(tmp_path):
    store = _store(tmp_path)
    try:
        key = bytes([3]) * 16
        blocker = store.reader._path(key).parent
        blocker.write_bytes(b"")  # a file where the page's directory goes: the child's mkdir fails
        store.put(key, _page(3))
        assert store.drain(timeout=30)
        with pytest.raises(OSError, match="lost 1 page"):
            store.put(bytes([4]) * 16, _page(4))
        blocker.unlink()
        store.put(bytes([4]) * 16, _page(4))  # a failure is raised once, not by every put after it
        assert store.drain(timeout=30)
        assert bytes(store.get(bytes([4]) * 16, PAGE)) == _page(4)
        store.child.kill()
        store.child.wait()
        with pytest.raises(OSError):  # the pipe is broken until a probe starts the child again
            store.put(bytes([5]) * 16, _page(5))
        store.probe()
        store.put(bytes([5]) * 16, _page(5))
        assert store.drain(timeout=30)
        assert bytes(store.get(bytes([5]) * 16, PAGE)) == _page(5)
    finally:
        store.close()


def _shared_blocks(count: int) -> tuple[SharedBlocks, mmap.mmap]:
    """`count` blocks of PAGE bytes in a memfd, block i filled with _page(i)."""
    fd = os.memfd_create("test-blocks", os.MFD_CLOEXEC)
    os.ftruncate(fd, count * PAGE)
    mapping = mmap.mmap(fd, count * PAGE)
    for i in range(count):
        mapping[i * PAGE : (i + 1) * PAGE] = _page(i)
    return SharedBlocks(fd, PAGE, count), mapping


@pytest.fixture
def block_store(tmp_path):
    """A writer process sharing 8 blocks (block i holds _page(i)), and the blocks it has given back."""
    blocks, mapping = _shared_blocks(8)
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    store = SpawnedFileStore(root, b"ns", 1 << 30, blocks)
    done: list[int] = []
    lock = threading.Lock()

    def block_done(block: int) -> None:
        with lock:
            done.append(block)

    store.on_block_done = block_done
    yield store, done
    store.close()
    os.close(blocks.fd)
    mapping.close()


def test_blocks_handed_over_by_number_are_read_from_shared_memory_and_each_given_back_once(block_store):
    """`hand_blocks` sends a key and a block number: the child reads the page from the shared blocks,
    each block is given back (`on_block_done`) exactly once after its write, and the files equal
    the blocks; a block outside the shared ones is refused here."""
    store, done = block_store
    store.hand_blocks([bytes([i]) * 16 for i in range(6)], list(range(6)), timeout=10)
    store.hand_blocks([bytes([6]) * 16, bytes([7]) * 16], [6, 7], timeout=10)
    store.hand_blocks([bytes([3]) * 16], [3], timeout=10)  # held already: given back all the same
    assert store.drain(timeout=30)
    assert sorted(done) == [0, 1, 2, 3, 3, 4, 5, 6, 7]
    assert all(bytes(store.get(bytes([i]) * 16, PAGE)) == _page(i) for i in range(8))
    with pytest.raises(ValueError, match="block 8"):
        store.hand_blocks([bytes([7]) * 16, bytes([8]) * 16], [7, 8], timeout=10)
    assert store.drain(timeout=30) and len(done) == 9  # refused whole: block 7 not handed again


def test_a_block_answered_before_its_hand_over_returns_is_given_back_once(block_store, monkeypatch):
    """The child may answer a block before `hand_blocks` has returned (its write done, the pipe read at
    once): the block is given back once, also at close, never again for the same hand-over."""
    from hy3c.serve.engine import kv_file_store

    store, done = block_store
    write_all = kv_file_store._write_all

    def slow_after_write(fd, data) -> None:  # the child answers while the sender is still here
        write_all(fd, data)
        time.sleep(0.3)

    monkeypatch.setattr(kv_file_store, "_write_all", slow_after_write)
    store.hand_blocks([bytes([i]) * 16 for i in range(4)], list(range(4)), timeout=10)
    assert store.drain(timeout=30) and sorted(done) == [0, 1, 2, 3] and not store._held
    store.close()
    store._reader.join(timeout=30)  # the answers' end after close: nothing given back twice
    assert sorted(done) == [0, 1, 2, 3]


def test_blocks_a_dead_writer_held_are_given_back_and_its_loss_raised_once(block_store):
    """Blocks handed to a child that dies before answering (stopped, then killed): every one is given
    back once (no L2 block stays held), the loss is raised by the next `hand_blocks` once, and after a
    probe pages are written again."""
    store, done = block_store
    store.child.send_signal(signal.SIGSTOP)  # reads nothing, answers nothing
    store.hand_blocks([bytes([i]) * 16 for i in range(4)], list(range(4)), timeout=10)
    store.child.kill()
    store.child.wait()
    store._reader.join(timeout=30)  # the answers' end: what the child held is given back
    assert sorted(done) == [0, 1, 2, 3] and not store._held
    with pytest.raises(OSError, match="lost 4 page"):
        store.hand_blocks([bytes([1]) * 16], [1], timeout=10)
    with pytest.raises(OSError):  # raised once; now the dead child's pipe refuses the block
        store.hand_blocks([bytes([1]) * 16], [1], timeout=10)
    store.probe()  # a new child
    store.hand_blocks([bytes([2]) * 16], [2], timeout=10)
    assert store.drain(timeout=30) and sorted(done) == [0, 1, 2, 2, 3]
    assert bytes(store.get(bytes([2]) * 16, PAGE)) == _page(2)


def test_a_directory_that_is_not_ours_is_refused_before_any_child_starts(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ValueError, match="must be ours"):
        SpawnedFileStore(root, b"ns", 1 << 20)


def test_the_writer_process_imports_no_torch():
    code = "import sys, hy3c.serve.engine.kv_file_store; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_a_writer_process_that_cannot_open_its_store_says_why_on_stdout(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    child = subprocess.run(
        [sys.executable, "-m", "hy3c.serve.engine.kv_file_store", str(root), b"ns".hex(), "4096"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 2
    assert child.stdout.startswith(b"F") and b"must be ours" in child.stdout


def test_the_writer_loop_answers_a_block_it_does_not_have_and_ends_when_its_input_fails(tmp_path):
    """In the child's loop (run here): a block frame naming no shared block is answered `!` with that
    block; input that fails mid-stream ends the loop with every answer sent (the answer sender joined)."""
    import io
    import struct

    from hy3c.serve.engine.kv_file_store import BLOCK_FRAME, MappedBlocks, serve_writes

    blocks, mapping = _shared_blocks(2)
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    frame = struct.Struct("<16sQ")

    class Failing(io.BytesIO):
        def read(self, size=-1):
            data = super().read(size)
            if not data:
                raise OSError("the pipe broke")
            return data

    frames = Failing(frame.pack(b"a" * 16, BLOCK_FRAME | 1) + frame.pack(b"b" * 16, BLOCK_FRAME | 5))
    answers = io.BytesIO()
    try:
        with pytest.raises(OSError, match="the pipe broke"):
            serve_writes(FileStore(root, b"ns", 1 << 30), frames, answers, MappedBlocks(blocks.fd, PAGE, 2))
        got = sorted(struct.iter_unpack("<cQ", answers.getvalue()))
        assert got == [(b"!", 5), (b"+", 1)]
        assert not any(t.name == "hy3c-kv-file-answer-sender" for t in threading.enumerate())
    finally:
        os.close(blocks.fd)
        mapping.close()


def test_a_writer_that_stops_answering_is_restarted_by_the_probe_and_its_blocks_given_back(
    block_store, monkeypatch
):
    """A child alive but stuck (stopped) with blocks handed over: once they have gone unanswered for
    `_HUNG_SECONDS`, `probe` ends it, every block comes back once, and a new child writes."""
    from hy3c.serve.engine import kv_file_store

    store, done = block_store
    store.child.send_signal(signal.SIGSTOP)
    store.hand_blocks([bytes([i]) * 16 for i in range(3)], [0, 1, 2], timeout=10)
    store.probe()  # not unanswered for long yet: left alone
    assert store.child.poll() is None and done == []
    monkeypatch.setattr(kv_file_store, "_HUNG_SECONDS", 0.0)
    store.probe()
    assert sorted(done) == [0, 1, 2] and not store._held  # the loss is forgotten by the restart
    store.hand_blocks([bytes([3]) * 16], [3], timeout=10)
    assert store.drain(timeout=30) and sorted(done) == [0, 1, 2, 3]
    assert bytes(store.get(bytes([3]) * 16, PAGE)) == _page(3)


def test_answers_give_back_only_blocks_still_held_once_each(block_store):
    """A burst of answers naming a block twice, or a block never handed over (a garbled stream), gives
    back each block held once and ignores the rest: no L2 block is released while still handed over."""
    import struct
    from collections import Counter
    from types import SimpleNamespace

    store, done = block_store
    read_end, write_end = os.pipe()
    os.write(write_end, b"".join(struct.pack("<cQ", b"+", block) for block in (3, 3, 9, 5)))
    os.close(write_end)
    with store._answers:
        store._held = Counter({3: 1, 5: 2})
        store._sent += 4
    with os.fdopen(read_end, "rb") as stdout:
        store._read_answers(SimpleNamespace(stdout=stdout))  # to the end of the stream, here
    assert sorted(done) == [3, 5, 5]  # 3 once, 9 never; 5's second hand-over given back at the end
    assert not store._held
