"""`hy3c serve --kv-host-gib --kv-store file:DIR`: a prompt served before a restart is found in the file
store by the restarted server (usage's cached tokens count every tier, same greedy text), the tier
gauges show in /metrics, and bad tier flags are one clear error at start-up."""

from __future__ import annotations

import httpx
import pytest

from hy3c.serve.http.demo import BackgroundServer
from hy3c.serve.http.server import ServeOptions, build_engine

PROMPT = "The tiered prefix cache keeps pages in host memory and in files. " * 6


def _complete(server) -> tuple[str, int]:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def _options(art, store) -> ServeOptions:
    return ServeOptions(art, port=0, kv_memory_gib=0.02, kv_host_gib=0.01, kv_store=f"file:{store}")


def test_a_restarted_server_serves_the_prefix_from_the_file_store(tiny_artifact, tmp_path, hy3c_log):
    with BackgroundServer(_options(tiny_artifact, tmp_path)) as server:
        text, cached = _complete(server)
        assert cached == 0
        server.engine.tiers.flush()
        # the ready line says what the tiers hold
        assert f"l2_pages={server.engine.tiers.num_blocks} l3=file:{tmp_path}" in hy3c_log.text
    assert list(tmp_path.glob("*/*.kv"))
    with BackgroundServer(_options(tiny_artifact, tmp_path)) as server:
        again, cached = _complete(server)
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert again == text and cached > 0
    l3_hits = [
        line
        for line in metrics.splitlines()
        if line.startswith("hy3c:kv_tier_pages{") and 'event="hits"' in line
    ]
    assert any('tier="l3"' in line and float(line.split()[-1]) > 0 for line in l3_hits), l3_hits
    assert "hy3c:kv_l3_degraded" in metrics


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"kv_store": "s3:bucket", "kv_host_gib": 0.01},
            "--kv-store 's3:bucket': expected file:DIR or mooncake:HOST:PORT",
        ),
        ({"kv_store": "file:/tmp/x"}, "--kv-store: needs --kv-host-gib"),
        ({"kv_host_gib": 1e-9}, "--kv-host-gib 1e-09: smaller than one KV page"),
    ],
)
def test_bad_tier_flags_are_one_error_naming_the_flag(tiny_artifact, overrides, message):
    options = ServeOptions(tiny_artifact, port=0, kv_memory_gib=0.02, **overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("?", r"\?")):
        build_engine(options)
