"""Sampler benchmark on one GPU: hy3c's Triton fused sampler vs the torch reference and the eager chain
of the peer baseline (vLLM-style torch ops), vocabulary 120832, per batch size.

    python bench/sampler_bench.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from hy3c.kernels.sampler import fused_sample
from hy3c.serve.sampler import History, SamplingParams, sample_reference

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


def measure(rows: int) -> str:
    logits = torch.randn(rows, V, device="cuda")
    t = torch.full((rows,), 0.8, device="cuda")
    k = torch.full((rows,), 50, device="cuda", dtype=torch.int32)
    p = torch.full((rows,), 0.9, device="cuda")
    mp = torch.zeros(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda", dtype=torch.int32)
    peer = do_bench(lambda: peer_chain(logits, t, k, p), warmup=10, rep=50, return_mode="median")
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows
    gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(rows)]
    history = [History([], [])] * rows
    ref = do_bench(
        lambda: sample_reference(logits, params, history, gens), warmup=2, rep=10, return_mode="median"
    )
    ours = do_bench(lambda: fused_sample(logits, t, k, p, mp, seeds), warmup=10, rep=50, return_mode="median")
    floor = rows * V * 4 / 4.25e9
    return f"| {rows} | {peer:.3f} | {ref:.3f} | {ours:.3f} | {peer / ours:.2f}× | {floor:.4f} |"


def main() -> None:
    print("| batch | peer eager chain ms | torch reference ms | hy3c Triton ms | vs peer | read floor ms |")
    print("|---|---|---|---|---|---|")
    for rows in (1, 16, 64, 256):
        print(measure(rows))


if __name__ == "__main__":
    main()
