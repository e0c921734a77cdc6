"""KV tiers on the GPU (`gpu`): the side stream's saves and loads, their events, and a load that
overlaps other requests' steps, over the engine `hy3c serve --kv-host-gib` builds (bf16 and FP8 KV).

The CPU tests (test_kv_tiers.py) run the same logic with synchronous copies and stand-in events; here
the copies are real: the bytes a prefix's pages hold after coming back from L2 — alone, and while
another request steps — equal those its first computation wrote, and the greedy tokens of an L2 hit
equal those of an L1 hit of the same prompt. (Whether a step could read the pages before their copy
ended is the scheduler's part, checked on the CPU with stand-in events: the bytes read afterwards
would not show it.)"""

from __future__ import annotations

import pytest
import torch

from hy3c.serve.engine.core import GenerationRequest, StepOutput
from hy3c.serve.engine.sampler import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_artifact(tiny_ckpt, tmp_path_factory):
    from hy3c.compiler.driver import compile_artifact
    from hy3c.recipe import load_recipe

    recipe = load_recipe("h20-w8a8c8", ["quant.activations=dynamic"])
    return compile_artifact(recipe, tmp_path_factory.mktemp("art") / "fp8", checkpoint=tiny_ckpt).out


def _engine(artifact, kv_pages: int | None = None, page_bytes: int = 0):
    from hy3c.serve.http.server import ServeOptions, build_engine

    memory = 1.0 if kv_pages is None else (kv_pages + 1.5) * page_bytes / 2**30
    options = ServeOptions(artifact=artifact, max_num_seqs=8, kv_memory_gib=memory, kv_host_gib=0.25)
    return build_engine(options)[0]


def _run(
    engine, prompts: dict[str, list[int]], tokens: int = 8, first: str | None = None
) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, submitted together (`first` one step ahead of the others)."""
    outputs: dict[str, list[StepOutput]] = {name: [] for name in prompts}
    for name, prompt in prompts.items():
        request = GenerationRequest(name, prompt, SamplingParams(temperature=0.0), tokens, ignore_eos=True)
        engine.submit(request, outputs[name].append)
        if name == first:
            engine._iterate()
    engine.run_until_done()
    return {name: [t for o in outs for t in o.token_ids] for name, outs in outputs.items()}


def _prefix_bytes(engine, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """(pages, bytes) of the prompt's pages L1 holds now (every layer's K and V)."""
    pages = engine.pool.match_prefix(prompt)
    try:
        return len(pages), engine.kv_cache.view(torch.uint8)[:, :, pages].clone()
    finally:
        engine.pool.release(pages)


def _no_leaks(engine) -> None:
    engine.tiers.flush()
    assert engine.pool.num_free == engine.pool.usable and engine.tiers.blocks_busy == 0


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_on_cuda_a_prefix_comes_back_from_host_memory_exactly_alone_and_beside_a_running_request(
    cuda_artifact, fp8_artifact, kv
):
    from .conftest import free_cuda_memory

    artifact = cuda_artifact if kv == "bf16" else fp8_artifact
    probe = _engine(artifact)
    page, page_bytes = probe.pool.page_size, probe.tiers.page_bytes
    vocab = probe.runner.config.vocab_size
    del probe
    free_cuda_memory()
    engine = _engine(artifact, kv_pages=24, page_bytes=page_bytes)  # L1: 24 pages, L2: many more
    assert engine.kv_cache.dtype == (torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn)
    generator = torch.Generator().manual_seed(0)

    def prompt(pages: int) -> list[int]:
        return torch.randint(3, vocab, (pages * page + 3,), generator=generator).tolist()

    target = prompt(6)
    fillers = {f"filler-{i}": prompt(6) for i in range(4)}
    _run(engine, {"first": target})
    full, written = _prefix_bytes(engine, target)
    assert full == 6
    l1_hit = _run(engine, {"l1": target})["l1"]

    def evict() -> None:
        _run(engine, fillers)  # 4 × 7 pages through a 24-page pool: the target's pages are handed out
        engine.tiers.flush()
        assert _prefix_bytes(engine, target)[0] == 0

    evict()
    hits = engine.tiers.stats.l2_hits
    l2_hit = _run(engine, {"l2": target})["l2"]
    assert engine.tiers.stats.l2_hits - hits == 6 and l2_hit == l1_hit  # same KV, same tokens
    assert torch.equal(_prefix_bytes(engine, target)[1], written)

    evict()
    other = prompt(2)
    _run(engine, {"other": other, "l2-beside": target}, tokens=24, first="other")
    assert torch.equal(_prefix_bytes(engine, target)[1], written)
    _no_leaks(engine)
