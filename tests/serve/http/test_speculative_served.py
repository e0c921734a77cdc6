"""MTP speculative decoding and overlapped scheduling through `hy3c serve` (issue 27): greedy streamed
completions equal with MTP K = 0 / 1 / 2 and overlap on and off, on the random and the trained tiny
model, with a page pool so small that requests are preempted, while another client disconnects
mid-stream; afterwards nothing runs and no page is held."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from hy3c.compiler.driver import compile_artifact
from hy3c.recipe import load_recipe
from hy3c.serve.http.demo import BackgroundServer, free_port
from hy3c.serve.http.server import ServeOptions

# one 16-token page of KV (fp32) of each tiny model: the random one has 3 layers + the MTP layer, the
# trained one 2 + 1
PAGE_BYTES = {"random": 32 * 1024, "trained": 24 * 1024}
POOL_PAGES = 9  # page 0 is scratch: 8 usable, 128 tokens; the six prompts end at 17 pages together
PROMPTS = [
    "def parse(",
    "import os\nimport sys\n\n",
    "class Tokenizer:\n    def __init__(self",
    "for i in range(",
    "return self._cache[key]",
    "# Copyright 2026\n",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def artifacts(tiny_ckpt, trained_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-served")
    return {
        name: compile_artifact(load_recipe("cpu-reference"), root / name, checkpoint=ckpt).out
        for name, ckpt in (("random", tiny_ckpt), ("trained", trained_ckpt))
    }


def _serve(artifacts, model: str, k: int, overlap: bool) -> dict[str, str]:
    """Every prompt's streamed greedy completion, concurrently, beside a request whose client leaves
    after two chunks; checks the server is idle with every page free at the end, and that the pool
    (`POOL_PAGES`) made it preempt."""
    config = None if k == 0 else f'{{"method": "mtp", "num_speculative_tokens": {k}}}'
    options = ServeOptions(
        artifacts[model],
        port=free_port(),
        kv_memory_gib=POOL_PAGES * PAGE_BYTES[model] / 2**30,
        max_num_seqs=8,
        async_scheduling=overlap,
        speculative_config=config,
    )
    server = BackgroundServer(options)
    try:
        assert server.engine.pool.num_pages == POOL_PAGES, (
            "PAGE_BYTES no longer matches the tiny model's page"
        )

        async def one(client: httpx.AsyncClient, prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                assert response.status_code == 200
                text = []
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
                return "".join(text)

        async def leaver(client: httpx.AsyncClient) -> None:
            body = {"prompt": "a long one", "max_tokens": 64, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.aiter_lines()
                for _ in range(2):
                    await lines.__anext__()

        async def main() -> list[str]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                results = await asyncio.gather(leaver(client), *(one(client, p) for p in PROMPTS))
                return results[1:]

        texts = asyncio.run(main())
        engine = server.engine
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            running, waiting = engine.num_requests()
            if running == waiting == 0 and engine.pool.num_free == engine.pool.usable:
                break
            time.sleep(0.02)
        assert engine.num_requests() == (0, 0) and engine.pool.num_free == engine.pool.usable, "pages leaked"
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemptions"
        assert engine.metrics.sample("hy3c:request_aborted_total") == 1
        if k:
            assert engine.metrics.spec_draft_tokens._value.get() > 0
        return dict(zip(PROMPTS, texts))
    finally:
        server.stop()


@pytest.mark.parametrize("model", ["random", "trained"])
def test_greedy_output_is_the_same_with_mtp_and_overlap_through_the_server(artifacts, model):
    expected = _serve(artifacts, model, 0, overlap=False)
    assert all(expected.values())
    settings = (
        [(1, True), (2, True)]
        if model == "trained"
        else [(0, True), (1, False), (1, True), (2, False), (2, True)]
    )
    for k, overlap in settings:
        assert _serve(artifacts, model, k, overlap) == expected, f"K = {k}, overlap {overlap}"
