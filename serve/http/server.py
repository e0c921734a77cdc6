"""`hy3c serve ART`: bind the port, load a compiled artifact, size the KV cache, start the engine and the
HTTP server (`lifecycle`: client limits, shutdown on SIGTERM).

The port is bound, then the artifact's manifest read, before anything heavy is imported or loaded, so a
busy port or a missing artifact fails in a fraction of a second; this module imports torch, the
artifact loader and the server only inside functions. The KV cache gets `--kv-memory` GiB (default: the
recipe's `serving.kv_memory_fraction` of the free GPU memory on CUDA, 0.25 GiB on CPU);
`--max-model-len` defaults to what that cache and the model allow, and may not exceed the model's
`max_position_embeddings`. On CUDA, decode steps of up to `--max-num-seqs` requests are captured as
CUDA graphs. An artifact compiled for several ranks starts them (`hy3c.runtime.distributed.start_ranks`:
worker processes on this host, or torchrun's) before rank 0 loads; this process is rank 0 and serves,
and they stop with it.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hy3c.logs import log_event

if TYPE_CHECKING:
    from hy3c.checkpoint.tokenizer import Hy3Tokenizer
    from hy3c.runtime.distributed import RankPlace
    from hy3c.serve.engine.core import Engine
    from hy3c.serve.http.api import ServerConfig
    from hy3c.serve.http.engine_process import EngineClient
    from hy3c.serve.http.http_gate import HttpLimits

log = logging.getLogger("hy3c.serve")


@dataclass
class ServeOptions:
    """`hy3c serve`'s settings, one per flag (the README lists the limits and their defaults)."""

    artifact: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None  # a prompt chunk's tokens per step at most
    max_num_partial_prefills: int | None = None  # requests prefilling in one step at most
    max_model_len: int | None = None
    kv_memory_gib: float | None = None
    kv_host_gib: float | None = None  # L2 (pinned host memory) below the GPU pages
    kv_store: str | None = None  # L3 below L2: file:DIR
    kv_store_gib: float = 64.0
    kv_store_timeout: float = 2.0
    page_size: int | None = None
    device: str | None = None
    compile: bool = False
    cuda_graphs: bool = True
    async_scheduling: bool = True  # plan and launch step N+1 while the device runs step N
    speculative_config: str | None = None  # --speculative-config's JSON (MTP speculative decoding)
    max_request_bytes: int = 1 << 20
    max_waiting: int = 1024
    shutdown_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 2048
    max_header_bytes: int = 64 * 1024
    collective_timeout: float = 300.0  # an artifact for several ranks: seconds any collective may take
    torchrun: RankPlace | None = None  # rank 0's place when torchrun started the ranks (else: spawned here)
    random_weights: int | None = None  # a config preset's artifact: seeded random weights (benchmarks)
    # the engine in a child process (`engine_process`; `hy3c serve`'s default), else on a thread here
    engine_process: bool = False

    def limits(self) -> HttpLimits:
        """The limits on clients that the HTTP layer enforces."""
        from hy3c.serve.http.http_gate import HttpLimits

        return HttpLimits(
            self.header_timeout,
            self.body_timeout,
            self.timeout_keep_alive,
            self.max_connections,
            self.max_header_bytes,
        )


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (connections made while the model loads wait in the
    backlog). A busy port or a bad host is an OSError naming the flag."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise OSError(f"--host {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may find old TIME_WAIT pairs
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"--port {port}: {host}:{port} is already in use (pick another --port)") from None
        raise OSError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None
    return sock


def page_bytes(runner, page_size: int) -> int:
    import torch

    c = runner.config
    return (
        c.num_kv_layers
        * 2
        * page_size
        * runner.kv_heads
        * c.head_dim
        * torch.empty((), dtype=runner.kv_dtype).element_size()
    )


def check_before_loading(options: ServeOptions) -> int:
    """The artifact's manifest and `--max-model-len` against the model's `max_position_embeddings`
    (which it returns), checked before torch is imported: a missing artifact is one error line at
    once, not after seconds of imports."""
    from hy3c.program.artifact import open_artifact

    limit = open_artifact(options.artifact).config.max_position_embeddings
    if options.max_model_len is not None and options.max_model_len > limit:
        raise ValueError(
            f"--max-model-len {options.max_model_len} exceeds the model's max_position_embeddings ({limit})"
        )
    return limit


def build_engine(options: ServeOptions) -> tuple[Engine, Hy3Tokenizer, ServerConfig]:
    """The engine, tokenizer and API settings of `options` (`check_before_loading` first)."""
    limit = check_before_loading(options)
    from datetime import timedelta

    from hy3c.runtime.distributed import start_ranks

    # off by default: Inductor adds nothing measurable over the fused kernels (BENCHMARKS.md) and
    # specializes on each step's token count, recompiling on live traffic
    from hy3c.runtime.random_weights import artifact_tokenizer

    tokenizer = artifact_tokenizer(options.artifact, options.random_weights)  # before any rank starts
    timeout = timedelta(seconds=options.collective_timeout)
    runner = start_ranks(
        options.artifact, options.device, options.compile, timeout, options.torchrun, options.random_weights
    )
    try:
        return _engine_over(runner, tokenizer, options, limit)
    except BaseException:
        shutdown = getattr(runner, "shutdown", None)  # a sharded artifact's workers stop with it
        if shutdown is not None:
            shutdown()
        raise


def _engine_over(
    runner, tokenizer: Hy3Tokenizer, options: ServeOptions, limit: int
) -> tuple[Engine, Hy3Tokenizer, ServerConfig]:
    """`build_engine` once the runner (all its ranks) is up: the tokenizer, the KV cache sized, the
    engine, its CUDA graphs and warm-up."""
    import torch

    from hy3c.serve.agent.structured import IN_TURN_AT_MOST
    from hy3c.serve.engine.core import Engine, EngineConfig
    from hy3c.serve.engine.kernel_builds import watch_kernel_builds
    from hy3c.serve.engine.metrics import EngineMetrics
    from hy3c.serve.engine.spec_decode import parse_speculative_config

    serving = runner.recipe.serving
    page_size = serving.page_size if options.page_size is None else options.page_size
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
    max_model_len = limit if options.max_model_len is None else options.max_model_len
    if max_model_len > capacity:
        if options.max_model_len is not None:
            raise ValueError(
                f"--max-model-len {max_model_len} exceeds the KV cache's {capacity} tokens (raise --kv-memory)"
            )
        max_model_len = capacity
    speculative = None
    if options.speculative_config is not None:
        layers = getattr(runner, "num_draft_layers", 0)
        speculative = parse_speculative_config(options.speculative_config, layers)
    tiers = None
    if options.kv_store is not None and not options.kv_host_gib:
        raise ValueError("--kv-store: needs --kv-host-gib (L3 pages pass through L2)")
    if options.kv_host_gib:
        from hy3c.serve.engine.kv_tiers import TierConfig

        # KV of one artifact (model, quantization), page layout and KV dtype is never read by another
        kv_shape = (page_size, page_bytes(runner, page_size), str(runner.kv_dtype))
        # (a weightless artifact's random weights come from --random-weights' seed: part of the key too)
        namespace = f"{runner.manifest['cache_key']['key']}|{kv_shape}|{options.random_weights}".encode()
        tiers = TierConfig(
            host_gib=options.kv_host_gib,
            store=options.kv_store,
            store_gib=options.kv_store_gib,
            store_timeout=options.kv_store_timeout,
            namespace=namespace,
        )
    config = EngineConfig(
        kv_tiers=tiers,
        num_pages=num_pages,
        page_size=page_size,
        max_num_seqs=serving.max_num_seqs if options.max_num_seqs is None else options.max_num_seqs,
        max_num_batched_tokens=(
            serving.max_num_batched_tokens
            if options.max_num_batched_tokens is None
            else options.max_num_batched_tokens
        ),
        max_model_len=max_model_len,
        async_scheduling=options.async_scheduling,
        speculative=speculative,
        long_prefill_token_threshold=options.long_prefill_token_threshold or 0,
        max_num_partial_prefills=options.max_num_partial_prefills or 0,
        # an engine on a thread of the HTTP server retakes the GIL from its loop after every mask
        masks_in_turn_at_most=None if options.engine_process else IN_TURN_AT_MOST,
    )
    metrics = EngineMetrics(max_model_len)
    metrics.describe_cache(page_size, num_pages, str(runner.kv_dtype).removeprefix("torch."))
    engine = Engine(runner, tokenizer, config, metrics)
    if options.cuda_graphs and runner.device.type == "cuda":
        sizes = [b for b in runner.recipe.cuda_graphs.decode_batch_sizes if b <= config.max_num_seqs]
        max_pages = -(-max_model_len // page_size)
        if speculative is None:
            runner.capture_decode_graphs(engine.kv_cache, max_pages=max_pages, batch_sizes=sizes)
        else:  # verify steps and the MTP's first pass feed K + 1 tokens per request, its recursion one
            k = speculative.num_speculative_tokens
            runner.capture_decode_graphs(engine.kv_cache, max_pages, sizes, (1, k + 1), sample=False)
            runner.capture_draft_graphs(engine.kv_cache, max_pages, sizes, (k + 1, 1) if k > 1 else (k + 1,))
            # steady decodes replay the whole step (verify, accept, draft) as one graph: greedy batches
            # one, batches with sampled requests another (the rejection rule's draft distributions kept
            # by slot in a tensor the graphs hold: a row per request)
            speculator = engine.speculator
            assert speculator is not None
            runner.capture_spec_steps(
                engine.kv_cache, max_pages, sizes, k, page_size, speculator.captured_rule()
            )
            if speculator.forced is None:
                speculator.probs.reserve(config.max_num_seqs, runner.config.vocab_size, runner.device)
                sampled_sizes = [b for b in sizes if b <= SAMPLED_SPEC_STEP_SIZES]
                runner.capture_spec_steps(
                    engine.kv_cache, max_pages, sampled_sizes, k, page_size, speculator.captured_rule(True),
                    sampled=True,
                )  # fmt: skip
    if runner.device.type == "cuda":
        started = time.monotonic()
        engine.warm_up()
        log_event(log, "engine_warmed_up", seconds=round(time.monotonic() - started, 2))
    watch_kernel_builds(engine.metrics.kernel_builds)
    server = server_config(options)
    log_event(
        log,
        "engine_ready",
        model=server.model_name,
        device=str(runner.device),
        ranks=runner.world_size,
        pages=num_pages,
        page_size=page_size,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        l2_pages=engine.tiers.num_blocks if engine.tiers is not None else 0,
        l3=options.kv_store or "none",
    )
    return engine, tokenizer, server


# the largest batch a captured sampled speculative step takes (larger ones run uncaptured: their host
# work weighs less against the step, and the graph's temporaries — several [b·(K+1), V] fp32 rows — and
# its capture time grow with b)
SAMPLED_SPEC_STEP_SIZES = 64


def server_config(options: ServeOptions) -> ServerConfig:
    from hy3c.serve.http.api import ServerConfig

    return ServerConfig(
        model_name=options.served_model_name or Path(options.artifact).resolve().name,
        api_key=options.api_key,
        max_request_bytes=options.max_request_bytes,
        max_waiting=options.max_waiting,
    )


def start_engine(options: ServeOptions) -> tuple[Engine | EngineClient, Hy3Tokenizer, ServerConfig]:
    """`build_engine`, or with `options.engine_process` the engine built and run in a child process
    (`engine_process`) and the tokenizer loaded here too. Either way the engine's loop is to be
    started with `start`, and stopped with `stop_engine`."""
    if not options.engine_process:
        return build_engine(options)
    check_before_loading(options)  # a missing or bad artifact: its error at once, from this process
    from hy3c.runtime.random_weights import artifact_tokenizer
    from hy3c.serve.http.engine_process import EngineClient

    tokenizer = artifact_tokenizer(options.artifact, options.random_weights)
    return EngineClient(options), tokenizer, server_config(options)


def stop_engine(engine: Engine | EngineClient) -> None:
    """Stop the engine's loop, and the workers of a sharded artifact's other ranks."""
    engine.stop()
    runner = getattr(engine, "runner", None)  # (an EngineClient's child stops its own)
    shutdown = getattr(runner, "shutdown", None)
    if shutdown is not None:
        shutdown()


def serve(options: ServeOptions) -> None:
    """Serve until SIGTERM or Ctrl-C (`lifecycle`): the port first, then the artifact's manifest, then
    the model (and torch and the API)."""
    sock = bind_socket(options.host, options.port)
    engine = None
    try:
        engine, tokenizer, server = start_engine(options)
        from hy3c.serve.http.api import build_app
        from hy3c.serve.http.lifecycle import HttpServer

        limits = options.limits()
        gate = build_app(engine, tokenizer, server, limits)
        engine.start()
        HttpServer(gate, engine, sock, limits, options.shutdown_timeout, server.model_name).run()
    finally:
        if engine is not None:
            stop_engine(engine)
        sock.close()
