"""`hy3c serve ART`: load a compiled artifact, size the KV cache, start the engine and the HTTP server.

The KV cache gets `--kv-memory` GiB (default: the recipe's `serving.kv_memory_fraction` of the free GPU
memory on CUDA, 0.25 GiB on CPU); `--max-model-len` defaults to what that cache and the model allow. On
CUDA, decode steps of up to `--max-num-seqs` requests are captured as CUDA graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hy3c.artifact import load
from hy3c.logs import log_event
from hy3c.serve.api import ServerConfig, build_app
from hy3c.serve.engine import Engine, EngineConfig
from hy3c.serve.kernel_builds import watch_kernel_builds
from hy3c.tokenizer import Hy3Tokenizer

log = logging.getLogger("hy3c.serve")


@dataclass
class ServeOptions:
    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_memory_gib: float | None = None
    page_size: int | None = None
    device: str | None = None
    compile: bool = False
    cuda_graphs: bool = True
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024


def page_bytes(runner, page_size: int) -> int:
    c = runner.config
    return (
        c.num_kv_layers
        * 2
        * page_size
        * c.num_key_value_heads
        * c.head_dim
        * torch.empty((), dtype=runner.kv_dtype).element_size()
    )


def build_engine(options: ServeOptions) -> tuple[Engine, Hy3Tokenizer, ServerConfig]:
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # off by default: Inductor adds nothing measurable over the fused kernels (BENCHMARKS.md) and
    # specializes on each step's token count, recompiling on live traffic
    compile_ = options.compile
    runner = load(options.artifact, device=device, compile=compile_)
    tokenizer = Hy3Tokenizer.from_dir(options.artifact)
    serving = runner.recipe.serving
    page_size = options.page_size or serving.page_size
    if options.kv_memory_gib is not None:
        budget = int(options.kv_memory_gib * 2**30)
    elif runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
        budget = int(free * serving.kv_memory_fraction)
    else:
        budget = 1 << 28
    num_pages = budget // page_bytes(runner, page_size)
    if num_pages < 2:
        raise ValueError(
            f"--kv-memory: {budget} bytes hold fewer than 2 KV pages of {page_bytes(runner, page_size)} bytes"
        )
    capacity = (num_pages - 1) * page_size
    max_model_len = min(
        options.max_model_len or runner.config.max_position_embeddings, runner.config.max_position_embeddings
    )
    if max_model_len > capacity:
        if options.max_model_len is not None:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the KV cache's {capacity} tokens (raise --kv-memory)"
            )
        max_model_len = capacity
    config = EngineConfig(
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=options.max_num_seqs or serving.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens or serving.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    engine = Engine(runner, tokenizer, config)
    if options.cuda_graphs and runner.device.type == "cuda":
        sizes = [b for b in runner.recipe.cuda_graphs.decode_batch_sizes if b <= config.max_num_seqs]
        runner.capture_decode_graphs(
            engine.kv_cache, max_pages=-(-max_model_len // page_size), batch_sizes=sizes
        )
    if runner.device.type == "cuda":
        started = time.monotonic()
        engine.warm_up()
        log_event(log, "engine_warmed_up", seconds=round(time.monotonic() - started, 2))
    watch_kernel_builds(engine.metrics.kernel_builds)
    name = options.served_model_name or Path(options.artifact).resolve().name
    server = ServerConfig(
        model_name=name,
        api_key=options.api_key,
        max_request_bytes=options.max_request_bytes,
        max_waiting=options.max_waiting,
    )
    log_event(
        log,
        "engine_ready",
        model=name,
        device=str(runner.device),
        pages=num_pages,
        page_size=page_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
    )
    return engine, tokenizer, server


def serve(options: ServeOptions) -> None:
    import uvicorn

    engine, tokenizer, server = build_engine(options)
    engine.start()
    log_event(log, "serving", url=f"http://{options.host}:{options.port}/v1", model=server.model_name)
    try:
        uvicorn.run(
            build_app(engine, tokenizer, server), host=options.host, port=options.port, log_level="warning"
        )
    finally:
        engine.stop()
