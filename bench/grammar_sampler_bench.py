"""Structured outputs' token masks in the fused sampler, on one GPU: the sampler's device time with a
packed grammar mask read by its kernels against the same sampler without one, and against applying the
mask with torch first (unpack the bits, masked_fill the logits: what hy3c did before the kernels read
it); the engine's host side beside it — llguidance filling the rows' masks in parallel, and the mask's
copy to the device — at batch 1 / 32 / 128, vocabulary 120832.

The masks are real: llguidance's, for a JSON schema, at the states of a walk through a document (each
row a different state) over a byte-level vocabulary of 120832 tokens (`grammar_mask_bench`'s synthetic
tokenizer). A correctness pass first: the kernel's token for every row equals `hy3.sample`'s reference
under the same mask and injected noise, and lies inside the mask.

    python3 bench/grammar_sampler_bench.py [--vocab 120832] [--graph]

`--graph` times each sampler call replayed from a CUDA graph (`do_bench_cudagraph`): the device's
time without the eager launch's host cost, which bounds the batch-1 rows otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from grammar_mask_bench import SCHEMA, synthetic_tokenizer
from triton.testing import do_bench, do_bench_cudagraph

import hy3c.kernels  # noqa: F401  (registers hy3.sample)
from hy3c.kernels.sampler.fused_sampler import fused_sample
from hy3c.ops.sample import unpack_allowed

BATCHES = (1, 32, 128)


def walk_states(tok, eos: int, rows: int):
    """`rows` matchers of SCHEMA, each at a different point of walks through documents (the lowest
    allowed non-eos token, then the highest, in turn: the walks differ), and their masks packed."""
    import llguidance
    import llguidance.torch as lt

    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    start = llguidance.LLMatcher(lltok, grammar)
    states, matcher, turn = [], start.deep_copy(), 0
    mask = lt.allocate_token_bitmask(1, tok.get_vocab_size())
    while len(states) < rows:
        lt.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: tok.get_vocab_size()]
        allowed = [int(t) for t in np.flatnonzero(bits) if t != eos]
        if not allowed or matcher.is_stopped():
            matcher, turn = start.deep_copy(), turn + 1
            continue
        states.append(matcher.deep_copy())
        matcher.consume_token(allowed[0] if (len(states) + turn) % 2 else allowed[-1])
    masks = lt.allocate_token_bitmask(rows, tok.get_vocab_size())
    fill_parallel(states, masks)
    return states, masks


def fill_parallel(states, masks) -> None:
    import llguidance
    import llguidance.torch as lt

    executor = getattr(fill_parallel, "executor", None) or llguidance.LLExecutor()
    fill_parallel.executor = executor
    if len(states) == 1:
        lt.fill_next_token_bitmask(states[0], masks, 0)
    else:
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(states)], masks)


def columns(rows: int, temperature: float, top_k: int, top_p: float):
    def col(value, dtype=torch.float32):
        return torch.full((rows,), value, device="cuda", dtype=dtype)

    return (
        col(temperature),
        col(top_k, torch.int32),
        col(top_p),
        col(0.0),
        torch.arange(rows, device="cuda", dtype=torch.int32),
    )


def torch_masked(logits, allowed, cols):
    masked = logits.masked_fill(~unpack_allowed(allowed, logits.shape[1]), float("-inf"))
    return fused_sample(masked, *cols)


def host_ms(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=120832)
    parser.add_argument("--graph", action="store_true", help="time replays of a CUDA graph of each call")
    args = parser.parse_args()
    device_ms.graph = args.graph
    vocab = args.vocab
    tok = synthetic_tokenizer(vocab)
    states, host_masks = walk_states(tok, vocab - 1, max(BATCHES))
    density = unpack_allowed(host_masks, vocab).float().mean(1)
    print(
        f"grammar masks: {len(states)} states of a JSON walk, allowed share per row median "
        f"{density.median():.3f} (min {density.min():.4f}, max {density.max():.3f})"
    )
    timer = "CUDA-graph replays" if args.graph else "eager calls, L2 flushed"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, vocabulary {vocab}, timer: {timer}")
    torch.manual_seed(0)
    settings = {"greedy": (0.0, 0, 1.0), "T 0.8 top-k 50 top-p 0.9": (0.8, 50, 0.9)}
    for rows in BATCHES:  # correctness first
        logits = torch.randn(rows, vocab, device="cuda") * 3
        allowed = host_masks[:rows].cuda()
        noise = torch.rand(rows, vocab, device="cuda")
        for name, (t, k, p) in settings.items():
            cols = columns(rows, t, k, p)
            ours, _ = fused_sample(logits, *cols, noise, allowed=allowed)
            ref = torch.ops.hy3.sample(logits, *cols, noise, 0, allowed)[0]
            inside = unpack_allowed(allowed, vocab)[torch.arange(rows, device="cuda"), ours].all()
            print(
                f"check batch {rows} {name}: rows ≠ reference {int((ours != ref).sum())}, inside mask {bool(inside)}"
            )
    print()
    print(
        "| batch | sampling | no mask ms | mask in kernel ms | ratio | torch masked_fill + kernel ms |"
        " mask copy H2D ms | llguidance fill (host) ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rows in BATCHES:
        for line in time_batch(rows, states[:rows], host_masks[:rows], vocab, settings):
            print(line)


def device_ms(fn) -> float:
    if getattr(device_ms, "graph", False):
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def time_batch(rows: int, states, host_masks, vocab: int, settings: dict) -> list[str]:
    """The table's lines of one batch size: each sampling setting without and with the mask."""
    logits = torch.randn(rows, vocab, device="cuda") * 3
    pinned = host_masks.pin_memory()
    allowed = pinned.cuda()
    copy = device_ms(lambda: allowed.copy_(pinned, non_blocking=True))
    fill = host_ms(lambda: fill_parallel(states, host_masks))
    lines = []
    for name, (t, k, p) in settings.items():
        plain, fused, peer = sampler_times(logits, columns(rows, t, k, p), allowed)
        lines.append(
            f"| {rows} | {name} | {plain:.3f} | {fused:.3f} | {fused / plain:.2f}× | {peer:.3f} |"
            f" {copy:.3f} | {fill:.3f} |"
        )
    return lines


def sampler_times(logits, cols, allowed) -> tuple[float, float, float]:
    """(no mask, the mask read by the kernels, torch's masked_fill then the kernels) in device ms."""
    return (
        device_ms(lambda: fused_sample(logits, *cols)),
        device_ms(lambda: fused_sample(logits, *cols, allowed=allowed)),
        device_ms(lambda: torch_masked(logits, allowed, cols)),
    )


if __name__ == "__main__":
    main()
