"""The KV tiers' data paths, without serving: L2 → GPU loads and GPU → L2 saves against a plain pinned
host-to-device copy of the same bytes (the peer, same run), and the file store's write / read rate.

A KV cache of the artifact's real shape (`--artifact`: its layers, KV heads, head size, KV dtype;
`--page-size`) is allocated on the device with `--pages` pages, and `KVTiers` over it with room for
them all. Timed, each the median of `--rounds`:

* save: `--pages` published pages copied to L2 (`KVTiers.published`, then `commit_saves`: side
  stream, one gather into a staging buffer, one copy per run of consecutive blocks), until the last
  copy's event; again with the blocks handed out shuffled (about one copy per page);
* load: those pages back into fresh GPU pages (`KVTiers.extend_prefix` with the page keys hashed
  before, as the engine hashes a prompt once at admission: runs of consecutive blocks
  copied whole into a staging buffer, one scatter per round), until the compute stream has waited for
  them; again with the pages' L2 blocks shuffled (few runs: about one copy per page, as after churn);
* peer: one pinned host → device `copy_` of all those bytes (contiguous), and device → host;
* file store: `FileStore.put` / `get` of every page (page cache warm: the rate of the code, not the disk),
  the puts spread over threads, through the writer process's pipe, and handed to it by L2 block
  number (as the tiers do: it reads the shared blocks).

Prints GB/s and the load's share of the peer's bandwidth (the issue's goal: ≥ 80%) and of the H2D
limit of the link, and how much of a load is the host's `extend_prefix` call (on the H100 a 26K-token
hit's copy ran at the link's rate while the call around it took longer: BENCHMARKS run S). On a machine without CUDA it runs on the CPU (plain copies) as a dry run.

    python3 bench/kv_tiers_bench.py --artifact ART [--pages 256] [--page-size 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hy3c.program.artifact import open_artifact
from hy3c.serve.engine.kv_file_store import FileStore, SpawnedFileStore
from hy3c.serve.engine.kv_pages import PagePool, page_keys
from hy3c.serve.engine.kv_tiers import WRITE_THREADS, KVTiers, TierConfig


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, rounds: int) -> float:
    """Median seconds of `fn()` (device work included)."""
    fn()
    sync(device)
    seconds = []
    for _ in range(rounds):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = open_artifact(args.artifact).config
    manifest = open_artifact(args.artifact).manifest
    dtype = getattr(torch, manifest["kv_cache"]["dtype"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, size = args.pages, args.page_size
    shape = (config.num_kv_layers, 2, 2 * n + 1, size, config.num_key_value_heads, config.head_dim)
    kv = torch.randn(shape, device=device).to(dtype)
    page_bytes = kv[:, :, 0].numel() * kv.element_size()
    tiers = KVTiers(kv, TierConfig(host_gib=(n + 1) * page_bytes / 2**30))
    pool = PagePool(2 * n + 1, size)
    tokens = list(range(n * size + 1))
    keys = page_keys(tokens, size, pool.namespace, n)
    total = n * page_bytes

    def save(shuffled: bool = False) -> None:
        tiers._block_of.clear()
        tiers._free = list(range(tiers.num_blocks - 1, -1, -1))
        if shuffled:  # blocks handed out in no order: one D2H copy per page
            order = torch.randperm(len(tiers._free), generator=torch.Generator().manual_seed(1))
            tiers._free = [tiers._free[i] for i in order.tolist()]
        for page, key in zip(range(1, n + 1), keys):
            tiers.published(page, key)
        tiers.commit_saves()
        for event in list(tiers._saving.values()):
            event.synchronize()
        tiers._saving.clear()

    for shuffled in (False, True):  # correctness first: every saved block holds its page
        save(shuffled)
        for page, key in zip(range(1, n + 1), keys):
            block = tiers._block_of[key]
            assert torch.equal(
                tiers.host[block].view(torch.uint8).cpu(), kv[:, :, page].view(torch.uint8).cpu()
            )
    save()

    host_seconds: list[float] = []  # of each load's `extend_prefix` call, until it returns (copies queued)

    def load() -> None:
        pool.reset_prefix_cache()
        started = time.perf_counter()
        pages = tiers.extend_prefix(pool, tokens, [], keys=list(keys))  # hashed at admission, as the engine's
        host_seconds.append(time.perf_counter() - started)
        assert len(pages) == n, f"loaded {len(pages)} of {n} pages"
        pool.release(pages)
        pool.reset_prefix_cache()

    def load_scattered() -> None:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        blocks = [tiers._block_of[k] for k in keys]
        for key, at in zip(keys, order):
            tiers._block_of[key] = blocks[at]
        load()
        for key, block in zip(keys, blocks):
            tiers._block_of[key] = block

    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    results = {
        "save (GPU → L2, consecutive blocks)": timed(save, device, args.rounds),
        "save (GPU → L2, shuffled blocks)": timed(lambda: save(True), device, args.rounds),
    }
    save()  # the pages back in consecutive blocks (the shuffled save left them in no order)
    results["load (L2 → GPU, consecutive blocks)"] = timed(load, device, args.rounds)
    load_host = statistics.median(host_seconds)
    results |= {
        "load (L2 → GPU, shuffled blocks)": timed(load_scattered, device, args.rounds),
        "peer: pinned H2D copy_, contiguous": timed(
            lambda: flat.copy_(pinned, non_blocking=True), device, args.rounds
        ),
        "peer: D2H copy_ to pinned, contiguous": timed(
            lambda: pinned.copy_(flat, non_blocking=True), device, args.rounds
        ),
    }
    with tempfile.TemporaryDirectory() as directory:
        store = FileStore(Path(directory), b"bench", max_bytes=4 * total)
        payload = bytes(page_bytes)
        results["file store put"] = timed(lambda: [store.put(k, payload) for k in keys], device, args.rounds)
        with ThreadPoolExecutor(WRITE_THREADS) as writers:  # as the L3 writer spreads a batch
            results[f"file store put, {WRITE_THREADS} threads"] = timed(
                lambda: list(writers.map(lambda k: store.put(k, payload), keys)), device, args.rounds
            )
        results["file store get"] = timed(
            lambda: [store.get(k, page_bytes) for k in keys], device, args.rounds
        )
        # the serving path: pages through the pipe to the writer process, until it has written them
        # (new keys each round: the writer skips pages the store holds)
        spawned = SpawnedFileStore(Path(directory) / "spawned", b"bench", max_bytes=4 * total)
        rounds = iter(range(1 << 30))

        def spawned_puts() -> None:
            prefix = next(rounds).to_bytes(4, "little")
            for key in keys:
                spawned.put(prefix + key[4:], payload)
            spawned.drain(timeout=600)

        results["file store put, writer process"] = timed(spawned_puts, device, args.rounds)
        spawned.close()
        # as the tiers hand pages over: by L2 block number, the child reading the shared blocks
        by_block = SpawnedFileStore(
            Path(directory) / "by-block", b"bench", max_bytes=4 * total, blocks=tiers.shared.blocks()
        )

        def block_puts() -> None:
            prefix = next(rounds).to_bytes(4, "little")
            for at in range(0, len(keys), 32):  # in the tiers' batches
                batch = keys[at : at + 32]
                by_block.hand_blocks(
                    [prefix + k[4:] for k in batch], [tiers._block_of[k] for k in batch], 600
                )
            by_block.drain(timeout=600)

        results["file store put, writer process, by block"] = timed(block_puts, device, args.rounds)
        by_block.close()
    print(
        f"KV tiers: {device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}, torch {torch.__version__},"
        f" {n} pages of {page_bytes / 2**20:.2f} MiB ({total / 2**30:.2f} GiB), KV {dtype}"
    )
    print("| path | ms | GB/s |")
    print("|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {total / seconds / 1e9:.2f} |")
    peer = results["peer: pinned H2D copy_, contiguous"]
    for name in ("load (L2 → GPU, consecutive blocks)", "load (L2 → GPU, shuffled blocks)"):
        print(f"{name} vs peer H2D: {peer / results[name]:.2f}× of its bandwidth")
    print(
        f"load (consecutive): {load_host * 1e3:.2f} ms of it is the host's `extend_prefix` call (lookup,"
        f" allocation, copies queued, publish: {load_host / n * 1e6:.1f} µs a page)"
    )
    peer = results["peer: D2H copy_ to pinned, contiguous"]
    for name in ("save (GPU → L2, consecutive blocks)", "save (GPU → L2, shuffled blocks)"):
        print(f"{name} vs peer D2H: {peer / results[name]:.2f}× of its bandwidth")
    # where the load's host call spends its time: the host ops of one load, by their own time (a call
    # that waits for its copies, as the host time of run X suggested, shows as one op taking it all)
    # (with CUDA activity the runtime calls show too: a cudaMemcpyAsync or a synchronize that blocks)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        load()
        sync(device)
    print("load's host ops and runtime calls (one call, self CPU time):")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    tiers.close()


if __name__ == "__main__":
    main()
