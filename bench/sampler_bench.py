"""Sampler benchmark on one GPU: hy3c's Triton fused sampler vs the torch reference and the eager chain
of the peer baseline (vLLM-style torch ops), vocabulary 120832, per batch size; also the sampler
without filters and on its fallback path, and a token-for-token check against the reference with
injected noise (top-k 50 + top-p 0.9, and top-p 0.9 alone).

    python bench/sampler_bench.py [--sweep]
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from hy3c.kernels.sampler.fused_sampler import fused_sample
from hy3c.serve.engine.sampler import History, SamplingParams, sample_reference

V = 120832


def peer_chain(logits, temp, topk, topp):
    logits = logits / temp[:, None]
    kth = logits.topk(int(topk.max()), dim=-1).values[:, -1:]
    logits = logits.masked_fill(logits < kth, -float("inf"))
    sl, si = logits.sort(dim=-1, descending=False)
    cum = sl.softmax(-1).cumsum(-1)
    mask = cum <= 1 - topp[:, None]
    mask[:, -1] = False
    logits = torch.empty_like(logits).scatter_(1, si, sl.masked_fill(mask, -float("inf")))
    probs = logits.softmax(-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def columns(rows: int, temperature: float, top_k: int, top_p: float):
    def col(value, dtype=torch.float32):
        return torch.full((rows,), value, device="cuda", dtype=dtype)

    seeds = torch.arange(rows, device="cuda", dtype=torch.int32)
    return col(temperature), col(top_k, torch.int32), col(top_p), col(0.0), seeds


def check(logits: torch.Tensor, params: SamplingParams) -> int:
    """Rows where the kernel's token differs from the reference's under the same injected noise."""
    rows = logits.shape[0]
    noise = torch.rand_like(logits)
    ref = sample_reference(logits, [params] * rows, [History([], [])] * rows, [None] * rows, noise=noise)
    cols = columns(rows, params.temperature, params.top_k, params.top_p)
    tokens, _ = fused_sample(logits, *cols, noise=noise)
    return sum(a != b for a, b in zip(tokens.tolist(), ref.tokens))


def measure(rows: int) -> str:
    logits = torch.randn(rows, V, device="cuda")
    t, k, p, mp, seeds = columns(rows, 0.8, 50, 0.9)
    peer = do_bench(lambda: peer_chain(logits, t, k, p), warmup=10, rep=50, return_mode="median")
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows
    gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(rows)]
    history = [History([], [])] * rows
    ref = do_bench(
        lambda: sample_reference(logits, params, history, gens), warmup=2, rep=10, return_mode="median"
    )
    ours = do_bench(lambda: fused_sample(logits, t, k, p, mp, seeds), warmup=10, rep=50, return_mode="median")
    captured = do_bench(
        captured_sampler(logits, (t, k, p, mp, seeds)), warmup=10, rep=50, return_mode="median"
    )
    # the same kernels when the candidates cannot decide: no top-k, top-p 0.9 of flat logits (fallback)
    flat = columns(rows, 1.0, 0, 0.9)
    fallback = do_bench(lambda: fused_sample(logits, *flat), warmup=5, rep=20, return_mode="median")
    plain = columns(rows, 1.0, 0, 1.0)  # temperature only: drawn in the chunk kernel
    no_filter = do_bench(lambda: fused_sample(logits, *plain), warmup=10, rep=50, return_mode="median")
    wrong = check(logits, params[0]) + check(logits, SamplingParams(temperature=1.0, top_p=0.9))
    floor = rows * V * 4 / 4.25e9
    return (
        f"| {rows} | {peer:.3f} | {ref:.3f} | {ours:.3f} | {peer / ours:.2f}× | {captured:.3f} | "
        f"{peer / captured:.2f}× | {floor:.4f} | "
        f"{no_filter:.3f} | {fallback:.3f} | {wrong} |"
    )


def captured_sampler(logits: torch.Tensor, cols: tuple[torch.Tensor, ...]):
    """A replay of the fused sampler captured in a CUDA graph, as the decode graphs run it (no host
    launch cost per kernel)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_sample(logits, *cols)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_sample(logits, *cols)
    return graph.replay


def sweep() -> None:
    """The chunking tunables at top-k 50 + top-p 0.9: (chunk, candidates per chunk, merged candidates)."""
    configs = [(4096, 32, 256), (4096, 64, 256), (4096, 16, 128), (4096, 32, 128), (2048, 16, 256)]
    configs += [(2048, 32, 512), (8192, 32, 256), (8192, 64, 512), (16384, 64, 256)]
    print("| chunk | candidates | merged | batch 1 ms | batch 16 ms | batch 64 ms | batch 256 ms |")
    print("|---|---|---|---|---|---|---|")
    for chunk, candidates, merged in configs:
        times = []
        for rows in (1, 16, 64, 256):
            logits = torch.randn(rows, V, device="cuda")
            cols = columns(rows, 0.8, 50, 0.9)
            fallback = torch.empty(rows, dtype=torch.int32, device="cuda")

            tunables = (chunk, candidates, merged, fallback)

            def run(logits=logits, cols=cols, tunables=tunables):
                fused_sample(logits, *cols, None, *tunables)

            times.append(do_bench(run, warmup=10, rep=50, return_mode="median"))
            times[-1] = f"{times[-1]:.3f}" + (" (fallback)" if int(fallback.sum()) else "")
        print(f"| {chunk} | {candidates} | {merged} | " + " | ".join(times) + " |", flush=True)


def main() -> None:
    if "--sweep" in sys.argv:
        sweep()
    print(
        "| batch | peer eager chain ms | torch reference ms | hy3c Triton ms | vs peer "
        "| hy3c Triton in a CUDA graph ms | vs peer | read floor ms "
        "| hy3c, temperature only | hy3c, top-p over flat logits (fallback) | rows ≠ reference |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in (1, 16, 64, 256):
        print(measure(rows), flush=True)


if __name__ == "__main__":
    main()
