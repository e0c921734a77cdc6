"""Two `hy3c serve` instances sharing one `mooncake_master` (started here on 127.0.0.1): the second
serves the prefix the first computed; the master killed in the middle of the second's store read: the
request still completes with the right text, the store shows degraded in /metrics, and once a master
is back reuse between the servers resumes. No GPU page or host block is left held."""

from __future__ import annotations

import dataclasses
import time

import httpx

from hy3c.serve.engine.kv_tiers import MooncakeStore
from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions

from ..engine.test_kv_tiers_mooncake import master  # noqa: F401 (the fixture)

PROMPTS = [
    f"Prefix number {n} is shared between two servers through the Mooncake Store. " * 6 for n in range(3)
]


def _complete(server: BackgroundServer, prompt: str) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _degraded(server: BackgroundServer) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    (line,) = [line for line in metrics.splitlines() if line.startswith("hy3c:kv_l3_degraded")]
    return float(line.split()[-1])


def _server(art, master_port: int) -> BackgroundServer:
    options = ServeOptions(
        art,
        port=0,
        kv_memory_gib=0.02,
        kv_host_gib=0.01,
        kv_store=f"mooncake:127.0.0.1:{master_port}",
        kv_store_gib=0.03,
        kv_store_timeout=1.0,
    )
    server = BackgroundServer(options)
    tiers = server.engine.tiers
    tiers.config = dataclasses.replace(tiers.config, failures_to_degrade=1, probe_seconds=0.5)
    return server


def _settled(server: BackgroundServer) -> None:
    tiers = server.engine.tiers
    tiers.flush()
    assert tiers.blocks_busy == 0, "host blocks left held"
    assert server.engine.pool.num_free == server.engine.pool.usable, "GPU pages leaked"


def test_two_servers_share_a_prefix_and_survive_the_master_dying_mid_read(tiny_artifact, master):  # noqa: F811
    first, second = _server(tiny_artifact, master.port), _server(tiny_artifact, master.port)
    try:
        expected = []
        for prompt in PROMPTS[:2]:
            text, cached = _complete(first, prompt)
            assert cached == 0
            expected.append(text)
        first.engine.tiers.flush()
        assert second.engine.tiers.zero_copy
        text, cached = _complete(second, PROMPTS[0])
        assert text == expected[0] and cached > 0  # computed by the first server

        store = second.engine.tiers.store
        assert isinstance(store, MooncakeStore)
        read = store.get_blocks

        def killed_mid_read(keys, blocks):
            master.stop()  # the read has started: its batch now meets a dead master
            return read(keys, blocks)

        store.get_blocks = killed_mid_read
        text, cached = _complete(second, PROMPTS[1])
        assert text == expected[1] and cached == 0  # recomputed, right
        assert second.engine.tiers.degraded and _degraded(second) == 1.0
        store.get_blocks = read
        for prompt, want in zip(PROMPTS[:2], expected):  # served while degraded: L1 / L2 or recomputed
            assert _complete(second, prompt)[0] == want

        master.start()
        deadline = time.monotonic() + 30
        while (second.engine.tiers.degraded or first.engine.tiers.degraded) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _degraded(second) == 0.0 and _degraded(first) == 0.0
        # a new prefix the first server writes after the restart reaches the second
        stored = first.engine.tiers.stats.l3_stored
        text, cached = _complete(first, PROMPTS[2])
        first.engine.tiers.flush()
        assert first.engine.tiers.stats.l3_stored > stored
        again, cached = _complete(second, PROMPTS[2])
        assert again == text and cached > 0
        _settled(first)
        _settled(second)
    finally:
        first.stop()
        second.stop()
        first.engine.tiers.close()
        second.engine.tiers.close()
