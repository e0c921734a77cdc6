"""The Mooncake Store as L3 (`--kv-store mooncake:HOST:PORT`), against a `mooncake_master` this test
starts on 127.0.0.1: a second engine serves the prefix a first one computed (cached tokens, same greedy
output); with the master killed every request still completes correctly and the store shows degraded,
and reuse resumes once a master is back. Needs `mooncake-transfer-engine(-non-cuda)` and the
`mooncake_master` binary (`.ci/run` installs them)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from hy3c.serve.engine.kv_tiers import TierConfig

from .test_kv_tiers import PROMPT, _engine, _evict, _generate, _no_leaks

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed")
MASTER = shutil.which("mooncake_master")
pytestmark = pytest.mark.skipif(MASTER is None, reason="mooncake_master is not on PATH")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A `mooncake_master` on loopback only (RPC and metrics listeners)."""

    def __init__(self) -> None:
        self.port, self.metrics_port = _free_port(), _free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        assert MASTER is not None
        self.process = subprocess.Popen(
            [
                MASTER,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("mooncake_master did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def master():
    server = Master()
    server.start()
    yield server
    server.stop()


def _config(master: Master, **overrides) -> TierConfig:
    return TierConfig(
        host_gib=0.001,
        store=f"mooncake:127.0.0.1:{master.port}",
        store_gib=0.03,
        store_timeout=1.0,
        namespace=b"test-artifact",
        **overrides,
    )


def test_a_second_engine_serves_the_prefix_the_first_computed(model, tokenizer, master):
    first = _engine(model, tokenizer, _config(master))
    expected, _ = _generate(first, PROMPT, "a")
    first.tiers.flush()
    assert first.tiers.stats.l3_stored >= 10
    second = _engine(model, tokenizer, _config(master))
    tokens, cached = _generate(second, PROMPT, "a")
    assert tokens == expected and cached == 40 and second.tiers.stats.l3_hits == 10
    assert second.tiers.zero_copy  # pages moved straight between the registered L2 blocks and the pool
    _no_leaks(first)
    _no_leaks(second)
    first.tiers.close()
    second.tiers.close()


def test_a_dead_master_degrades_to_host_memory_and_reuse_resumes(model, tokenizer, master):
    expected, _ = _generate(_engine(model, tokenizer, None), PROMPT, "ref")
    engine = _engine(model, tokenizer, _config(master, failures_to_degrade=2, probe_seconds=0.5))
    master.stop()
    tokens, _ = _generate(engine, PROMPT, "a")  # its pages' writes fail or time out
    engine.tiers.flush()
    assert tokens == expected
    assert engine.tiers.degraded and engine.tiers.stats.l3_failures >= 2
    _evict(engine)
    tokens, cached = _generate(engine, PROMPT, "b")  # L2 still serves it
    assert tokens == expected and cached == 40
    master.start()
    deadline = time.monotonic() + 30
    while engine.tiers.degraded and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.tiers.degraded
    stored = engine.tiers.stats.l3_stored
    other = [(5 * i + 2) % 90 + 3 for i in range(41)]
    _generate(engine, other, "c")
    engine.tiers.flush()
    assert engine.tiers.stats.l3_stored > stored  # writes reach the new master again
    _no_leaks(engine)
    engine.tiers.close()
