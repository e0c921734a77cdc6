"""End-to-end step times of a real-shape Hy3 slice on one GPU, against peers in the same run.

    python bench/e2e.py --layers 4 --part main       # hy3c h200-bf16 (+ compiled), transformers, torch.compile
    python bench/e2e.py --layers 4 --part fp8        # hy3c h20-w8a8c8 (dynamic activations) + pass ablation
    python bench/e2e.py --layers 4 --part gluon-ab --decode 1,32   # decode with / without the Gluon kernels
    python bench/e2e.py --layers 4 --part w4a8 --decode 1,32 --prefill 8192   # W4A8 experts vs FP8
    python bench/e2e.py --device cpu --layers 2 --preset tiny --part main --quick   # logic check on CPU

Weights are random at the true Hy3 widths (`real-shapes:N`: first N layers), built on the GPU. Every
hy3c number is a step of the compiled program (`compile_model`: same trace, passes and weight
derivation as `hy3c compile`), decode steps replaying the runner's CUDA graphs.
* prefill latency for one request of 2K / 8K / 32K tokens;
* decode step time at batch 1 / 8 / 32 / 128 with 2K tokens of context per request (the KV cache is
  filled with random values: attention cost does not depend on them), tokens/s, and the bytes floor
  (weights of the active experts + the rest, plus KV, at 4.25 TB/s) with the % of it achieved;
* peers: transformers HYV3ForCausalLM (bf16, sdpa, grouped_mm experts; generate-based timing) and our
  model under plain torch.compile (no hy3c passes, torch reference ops);
* `--part fp8`: one pass off at a time (decode at batch 1 and 32, 8K prefill) and a profile of one
  decode step (kernel time by name; the CUDA-graph replay's busy/idle split and largest gaps), and
  decode steps captured with and without programmatic dependent launch, alternating in one process.
* `--part gluon-ab`: decode steps of the bf16 and the FP8 slice captured with and without the Gluon
  kernels (`HY3C_GLUON`), alternating in one process.
* `--part w4a8`: the FP8 slice (h20-w8a8c8, dynamic) and the W4A8 one (h20-w4a8c8: the experts
  quantized to int4 at compile time), decode and prefill, the bytes floor with the experts' half byte.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

import hy3c.kernels  # noqa: F401
from hy3c.checkpoint.random_checkpoint import random_model
from hy3c.compiler.driver import compile_model
from hy3c.config import preset_config
from hy3c.kernels import overrides
from hy3c.model.batch import SeqChunk, build_step_batch
from hy3c.recipe import load_recipe

BW = 4.25e12
BF16_FLOPS, FP8_FLOPS = 790e12, 1367e12  # dense tensor-core limits (BENCHMARKS.md, "Limits")
PAGE = 64
RESULTS: dict[str, object] = {}


class _Rows(list):
    """Table rows, also printed as they come (a run cut short still shows what it measured)."""

    def append(self, row: tuple[str, ...]) -> None:
        super().append(row)
        print("| " + " | ".join(row) + " |", flush=True)


ROWS: list[tuple[str, ...]] = _Rows()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int = 5) -> float:
    """Median wall ms of fn() over reps (after one warm-up), synchronizing around each."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def prefill_batch(tokens: int, device) -> object:
    pages = list(range(-(-tokens // PAGE)))
    ids = [1 + i % 500 for i in range(tokens)]  # valid for every preset's vocabulary
    return build_step_batch([SeqChunk(ids, 0, pages, "last")], PAGE, device)


def decode_batch(batch: int, context: int, device) -> object:
    per = -(-(context + 1) // PAGE)
    chunks = [SeqChunk([7 + r], context, list(range(r * per, (r + 1) * per)), "last") for r in range(batch)]
    return build_step_batch(chunks, PAGE, device)


def kv_pages(prefill_sizes: list[int], decode_sizes: list[int], context: int) -> int:
    """Pages for the largest prefill, or for every decode request's context (decode_batch's layout)."""
    return max(-(-max(prefill_sizes) // PAGE), max(decode_sizes) * -(-(context + 1) // PAGE)) + 1


def fill_kv(kv: torch.Tensor) -> None:
    for layer in range(kv.shape[0]):  # random K/V (bounded: e4m3 casts on CUDA do not saturate)
        kv[layer].copy_(torch.randn(kv[layer].shape, device=kv.device).clamp_(-8, 8).to(kv.dtype))


def floor_ms(
    config,
    batch: int,
    context: int,
    kv_elem_bytes: int,
    weight_bytes: float,
    expert_bytes: float | None = None,
) -> float:
    """Bytes floor of a decode step: every weight read once (the routed experts' at `expert_bytes` per
    weight, e.g. W4A8's half byte plus its group scales), plus the KV cache, at copy bandwidth."""
    h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    moe_layers = config.layer_types.count("sparse")
    expert = 3 * h * inter * (weight_bytes if expert_bytes is None else expert_bytes)
    shared = 3 * h * inter * weight_bytes
    active = e * (1 - (1 - config.num_experts_per_tok / e) ** batch)  # expected distinct experts
    attn = (config.q_size * 2 + config.kv_size * 2) * h * weight_bytes
    dense = 3 * h * config.intermediate_size * weight_bytes
    weights = (
        config.num_hidden_layers * attn
        + dense
        + moe_layers * (active * expert + shared + e * h * 4)
        + config.vocab_size * h * 2
    )
    kv = batch * context * config.num_hidden_layers * config.kv_size * 2 * kv_elem_bytes
    return (weights + kv) / BW * 1e3


def prefill_floor_ms(config, tokens: int, fp8_gemms: bool, fp8_attention: bool, cached: int = 0) -> float:
    """Compute floor of one request's prefill of `tokens` tokens after `cached` tokens of its prompt
    already in the KV cache (a prefix hit): every GEMM's FLOPs (projections, the dense FFN, the top-k
    routed and the shared experts, the router, the last token's lm_head) at the tensor-core limit of its
    operands (FP8 for FP8 or W4A8 weights, whose int4 is widened to FP8), plus attention's (QKᵀ and PV
    of each new token over the cached ones and the new ones before it) at the limit of its products
    (e4m3 with an FP8 KV cache, else bf16)."""
    h, inter = config.hidden_size, config.moe_intermediate_size
    moe_layers = config.layer_types.count("sparse")
    projections = (config.q_size + 2 * config.kv_size) * h + config.q_size * h
    experts = (
        config.num_experts_per_tok + config.num_shared_experts
    ) * 3 * h * inter + config.num_experts * h
    macs = tokens * (
        config.num_hidden_layers * projections
        + (config.num_hidden_layers - moe_layers) * 3 * h * config.intermediate_size
        + moe_layers * experts
    )
    macs += config.vocab_size * h
    attention_flops = (
        config.num_hidden_layers
        * config.num_attention_heads
        * 4
        * tokens
        * (cached + tokens / 2)
        * config.head_dim
    )
    gemm_ms = 2 * macs / (FP8_FLOPS if fp8_gemms else BF16_FLOPS) * 1e3
    return gemm_ms + attention_flops / (FP8_FLOPS if fp8_attention else BF16_FLOPS) * 1e3


def measure(
    runner,
    label: str,
    config,
    decode_sizes,
    prefill_sizes,
    context: int,
    weight_bytes: float,
    expert_bytes: float | None = None,
) -> dict:
    device = runner.device
    out: dict[str, float] = {}
    kv = runner.allocate_kv_cache(kv_pages(prefill_sizes, decode_sizes, context), PAGE)
    fp8_attention = kv.dtype not in (torch.bfloat16, torch.float16, torch.float32)
    for tokens in prefill_sizes:
        batch = prefill_batch(tokens, device)
        ms = timed(lambda b=batch: runner.step(b, kv), device)
        floor = prefill_floor_ms(config, tokens, weight_bytes < 2, fp8_attention)
        out[f"prefill_{tokens}_ms"] = ms
        out[f"prefill_{tokens}_floor_ms"] = floor
        ROWS.append(
            (
                f"{label} prefill {tokens // 1024}K",
                f"{ms:.1f}",
                f"{tokens / ms * 1e3:.0f} tok/s",
                f"compute floor {floor:.1f} ms = {ms / floor:.2f}×",
            )
        )
    fill_kv(kv)
    per = -(-(context + 1) // PAGE)
    if device.type == "cuda":
        reason = runner.capture_decode_graphs(kv, max_pages=per, batch_sizes=list(decode_sizes))
        out["cuda_graphs"] = reason or "captured"
    kv_bytes = kv.element_size()
    for b in decode_sizes:
        batch = decode_batch(b, context, device)
        ms = timed(lambda bt=batch: runner.step(bt, kv), device, reps=20)
        floor = floor_ms(config, b, context, kv_bytes, weight_bytes, expert_bytes)
        out[f"decode_B{b}_ms"] = ms
        out[f"decode_B{b}_floor_ms"] = floor
        ROWS.append(
            (
                f"{label} decode B={b}",
                f"{ms:.2f}",
                f"{b / ms * 1e3:.0f} tok/s",
                f"floor {floor:.2f} ms = {floor / ms * 100:.0f}%",
            )
        )
    return out


def hf_peer(layers: int, decode_sizes, prefill_sizes, context: int, device) -> dict:
    from transformers import HYV3Config, HYV3ForCausalLM

    cfg = HYV3Config(num_hidden_layers=layers, enable_moe_fp32_combine=False)
    with torch.device(device):
        model = HYV3ForCausalLM._from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa", experts_implementation="grouped_mm"
        ).eval()

    def gen(ids, n):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync(device)
        return (time.perf_counter() - start) * 1e3

    out = {}
    for tokens in prefill_sizes:
        ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)
        gen(ids, 1)
        out[f"prefill_{tokens}_ms"] = min(gen(ids, 1) for _ in range(2))
        ROWS.append((f"transformers prefill {tokens // 1024}K", f"{out[f'prefill_{tokens}_ms']:.1f}", "", ""))
    for b in decode_sizes:
        ids = torch.randint(0, cfg.vocab_size, (b, context), device=device)
        gen(ids, 2)
        steps = 8
        ms = (gen(ids, steps + 1) - gen(ids, 1)) / steps
        out[f"decode_B{b}_ms"] = ms
        ROWS.append((f"transformers decode B={b}", f"{ms:.2f}", f"{b / ms * 1e3:.0f} tok/s", ""))
    return out


def plain_compile_peer(model, decode_sizes, prefill_sizes, context: int) -> dict:
    """Our eager model (torch reference ops) under torch.compile, no hy3c passes, no CUDA graphs."""
    device = model.device
    compiled = torch.compile(model, dynamic=True)
    out = {}
    kv = model.allocate_kv_cache(kv_pages(prefill_sizes, decode_sizes, context), PAGE)
    for tokens in prefill_sizes:
        batch = prefill_batch(tokens, device)
        with torch.no_grad():
            ms = timed(lambda b=batch: compiled(*b.model_args(kv)), device, reps=3)
        out[f"prefill_{tokens}_ms"] = ms
        ROWS.append((f"torch.compile (no hy3c passes) prefill {tokens // 1024}K", f"{ms:.1f}", "", ""))
    for b in decode_sizes:
        batch = decode_batch(b, context, device)
        with torch.no_grad():
            ms = timed(lambda bt=batch: compiled(*bt.model_args(kv)), device, reps=5)
        out[f"decode_B{b}_ms"] = ms
        ROWS.append((f"torch.compile (no hy3c passes) decode B={b}", f"{ms:.2f}", "", ""))
    return out


def _gpu_intervals(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel / copy / memset the profiler saw on the GPU, by start."""
    spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    ]
    return sorted(spans)


def _graph_replay_profile(graph: torch.cuda.CUDAGraph, device) -> dict:
    """Where the GPU time of one CUDA-graph decode step goes (inputs already staged): the span from its
    first to its last GPU activity, the union of the busy intervals (kernels launched with PDL may
    overlap their predecessor's tail), and the largest gaps with their neighbours."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        sync(device)
    spans = _gpu_intervals(prof)
    if not spans:
        return {"error": "the profiler saw no GPU activity in the graph replay"}
    busy, reach, gaps = 0.0, spans[0][0], []
    previous = spans[0][2]
    for start, end, name in spans:
        if start > reach:
            gaps.append((start - reach, previous, name))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, previous = end, name
    span = reach - spans[0][0]
    gaps.sort(reverse=True)
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_pct": (1 - busy / span) * 100,
        "activities": len(spans),
        "gaps": len(gaps),
        "gap_us_total": sum(g for g, _, _ in gaps),
        "largest_gaps_us": [(round(g, 2), a[:40], b[:40]) for g, a, b in gaps[:6]],
    }


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    """GPU ms per replay of a captured step, replays back to back (the host queues ahead)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def switch_ab(runner, sizes: list[int], context: int, variable: str, rounds: int = 3) -> dict:
    """Decode steps captured with an override off and on (HY3C_PDL: programmatic dependent launch;
    HY3C_GLUON: the Gluon kernels; `hy3c.kernels.overrides`), alternating in one process (the override
    is read at launch, so each capture takes the setting of its moment): graph replay ms and the whole step's wall ms (input
    staging included), medians over the rounds."""
    device = runner.device
    per = -(-(context + 1) // PAGE)
    kv = runner.allocate_kv_cache(max(sizes) * per + 1, PAGE)
    fill_kv(kv)
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for on in (False, True):
            with overrides.forced(variable, on):
                runner.capture_decode_graphs(kv, max_pages=per, batch_sizes=sizes)
                for b in sizes:
                    batch = decode_batch(b, context, device)
                    name = f"B{b}_{variable}_{int(on)}"
                    samples.setdefault(f"{name}_step_ms", []).append(
                        timed(lambda bt=batch: runner.step(bt, kv), device, reps=20)
                    )
                    samples.setdefault(f"{name}_replay_ms", []).append(
                        replay_ms(runner.decode_graphs.graphs[b].graph)
                    )
    result = {key: sorted(v)[len(v) // 2] for key, v in samples.items()}
    for b in sizes:
        off, on = result[f"B{b}_{variable}_0_replay_ms"], result[f"B{b}_{variable}_1_replay_ms"]
        ROWS.append(
            (f"graph replay B={b}: {variable}=0 / 1", f"{off:.3f} / {on:.3f}", f"{off / on:.2f}×", "")
        )
    return result


def profile_decode(runner, config, batch_size: int, context: int) -> dict:
    """One decode step: kernel time by name (an uncaptured step, launched without PDL so that no kernel's
    time holds its wait for the one before), then the CUDA-graph step: its wall
    time (host input preparation included) and, under the profiler, its GPU busy/idle split (3 replays,
    the median by idle share)."""
    device = runner.device
    per = -(-(context + 1) // PAGE)
    kv = runner.allocate_kv_cache(batch_size * per + 1, PAGE)
    fill_kv(kv)
    batch = decode_batch(batch_size, context, device)
    for _ in range(3):
        runner(*batch.model_args(kv))
    sync(device)
    from torch.profiler import ProfilerActivity, profile

    with overrides.forced(overrides.PDL, False):  # kernels launched with PDL would count their wait
        runner(*batch.model_args(kv))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner(*batch.model_args(kv))
            sync(device)
    kernels: dict[str, float] = {}
    launches = 0
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            kernels[event.key[:60]] = event.self_device_time_total / 1e3
            launches += event.count
    busy = sum(kernels.values())
    runner.capture_decode_graphs(kv, max_pages=per, batch_sizes=[batch_size])
    step = timed(lambda: runner.step(batch, kv), device, reps=20)
    graph = runner.decode_graphs.graphs[batch_size].graph
    replays = sorted(
        (_graph_replay_profile(graph, device) for _ in range(3)), key=lambda r: r.get("idle_pct", 100.0)
    )
    top = dict(sorted(kernels.items(), key=lambda kv_: -kv_[1])[:12])
    return {
        "step_ms": step,
        "kernel_ms": busy,
        "gpu_idle_pct": max(0.0, (1 - busy / step) * 100),
        "kernel_launches": launches,
        "graph_replay_ms": replay_ms(graph),
        "graph_replay": replays[1],
        "top_kernels_ms": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--preset", default="real-shapes", help="real-shapes (uses --layers) or tiny")
    parser.add_argument("--part", choices=("main", "fp8", "peers", "gluon-ab", "w4a8"), default="main")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (logic check)")
    parser.add_argument("--skip-peers", action="store_true", help="main: skip the peers (see --part peers)")
    parser.add_argument("--no-ablation", action="store_true", help="fp8: skip the pass ablation")
    parser.add_argument("--ablate", default="", help="fp8: comma list of the passes to ablate (default: all)")
    parser.add_argument("--no-profile", action="store_true", help="fp8: skip the profile and PDL A/B")
    parser.add_argument("--decode", default="1,8,32,128", help="comma list of decode batch sizes")
    parser.add_argument("--prefill", default="2048,8192,32768", help="comma list of prefill lengths")
    args = parser.parse_args()
    device = torch.device(args.device)
    preset = f"real-shapes:{args.layers}" if args.preset == "real-shapes" else args.preset
    config = preset_config(preset, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    context = 128 if args.quick else 2048
    decode_sizes = [1, 8] if args.quick else [int(n) for n in args.decode.split(",")]
    prefill_sizes = [256] if args.quick else [int(n) for n in args.prefill.split(",")]
    start = time.perf_counter()
    model = random_model(config, torch.bfloat16 if device.type == "cuda" else torch.float32, str(device))
    RESULTS["build_model_s"] = time.perf_counter() - start
    cpu = device.type == "cpu"
    if args.part == "peers":
        RESULTS["plain_torch_compile"] = plain_compile_peer(
            model, decode_sizes[:1] + decode_sizes[2:3], prefill_sizes[1:2] or prefill_sizes, context
        )
        del model
        if not cpu:
            torch.cuda.empty_cache()
            RESULTS["transformers"] = hf_peer(args.layers, decode_sizes, prefill_sizes[:2], context, device)
    elif args.part == "gluon-ab":
        if cpu:
            raise SystemExit("--part gluon-ab captures CUDA graphs: it needs a CUDA device")
        for recipe_name, overrides in (("h200-bf16", []), ("h20-w8a8c8", ["quant.activations=dynamic"])):
            runner, _ = compile_model(model, load_recipe(recipe_name, overrides), compile=False)
            ROWS.append((recipe_name, "", "", ""))
            RESULTS[f"gluon_ab_{recipe_name}"] = switch_ab(runner, decode_sizes, context, overrides.GLUON)
            del runner
    elif args.part == "w4a8":  # the same slice with FP8 experts and with W4A8 experts, one after the other
        cpu_sets = (
            ["target=cpu", "quant.kv=bf16", "dtype=float32", "passes.lower.priority=[torch]"] if cpu else []
        )
        group = ["quant.group_size=32"] if config.moe_intermediate_size % 128 else []
        for name, recipe_name, sets, experts in (
            ("hy3c fp8", "h20-w8a8c8", ["quant.activations=dynamic"], 1.0),
            ("hy3c w4a8", "h20-w4a8c8", group, 0.5 + 4 / 128),
        ):
            runner = compile_model(model, load_recipe(recipe_name, [*sets, *cpu_sets]), compile=False)[0]
            key = name.replace(" ", "_")
            RESULTS[key] = measure(runner, name, config, decode_sizes, prefill_sizes, context, 1, experts)
            del runner  # the FP8 slice's weights and graphs go before the W4A8 one is built
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
        for b in decode_sizes:
            fp8, w4a8 = RESULTS["hy3c_fp8"][f"decode_B{b}_ms"], RESULTS["hy3c_w4a8"][f"decode_B{b}_ms"]
            ROWS.append((f"w4a8 vs fp8 decode B={b}", f"{w4a8:.2f}", f"{fp8 / w4a8:.2f}x faster", ""))
    elif args.part == "main":
        recipe = load_recipe("cpu-reference" if cpu else "h200-bf16")
        runner, _ = compile_model(model, recipe, compile=False)
        RESULTS["hy3c_bf16_eager_graph"] = measure(
            runner, "hy3c bf16", config, decode_sizes, prefill_sizes, context, 2
        )
        start = time.perf_counter()
        compiled, _ = compile_model(model, recipe, compile=True)
        RESULTS["hy3c_bf16_inductor"] = measure(
            compiled, "hy3c bf16 + Inductor", config, decode_sizes, prefill_sizes, context, 2
        )
        RESULTS["hy3c_bf16_inductor"]["compile_and_measure_s"] = time.perf_counter() - start
        del runner, compiled
        if not args.skip_peers:
            RESULTS["plain_torch_compile"] = plain_compile_peer(
                model, [1, 32] if not args.quick else [1], [8192] if not args.quick else [256], context
            )
            del model
            if not cpu:
                torch.cuda.empty_cache()
                RESULTS["transformers"] = hf_peer(
                    args.layers, decode_sizes, prefill_sizes[:2], context, device
                )
    else:
        overrides = ["quant.activations=dynamic"] + (
            ["target=cpu", "quant.kv=bf16", "dtype=float32", "passes.lower.priority=[torch]"] if cpu else []
        )
        base = load_recipe("h20-w8a8c8", overrides)
        runner, _ = compile_model(model, base, compile=False)
        RESULTS["hy3c_fp8"] = measure(runner, "hy3c fp8", config, decode_sizes, prefill_sizes, context, 1)
        if not cpu and not args.no_profile:
            RESULTS["profile_decode_B1"] = profile_decode(runner, config, 1, context)
            RESULTS["profile_decode_B32"] = profile_decode(runner, config, 32, context)
            RESULTS["pdl_ab"] = switch_ab(runner, [1, 32], context, overrides.PDL)
        del runner
        chosen = set(args.ablate.split(",")) if args.ablate else None
        for spec in [] if args.no_ablation else base.passes:
            if spec.name in ("lower", "cleanup") or (chosen is not None and spec.name not in chosen):
                continue
            recipe = load_recipe("h20-w8a8c8", [*overrides, f"passes.{spec.name}.enabled=false"])
            try:
                runner, _ = compile_model(model, recipe, compile=False)
                RESULTS[f"ablation_no_{spec.name}"] = measure(
                    runner,
                    f"fp8 without {spec.name}",
                    config,
                    [1, 32] if not args.quick else [1],
                    [8192] if not args.quick else [256],
                    context,
                    2 if spec.name == "quantize" else 1,  # without it the weights stay bf16
                )
            except Exception as exc:  # a pass whose removal breaks a later one is reported, not fatal
                RESULTS[f"ablation_no_{spec.name}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                ROWS.append((f"fp8 without {spec.name}", "error", str(exc)[:60], ""))
            del runner
    print("| case | ms | throughput | floor |")
    print("|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
    print(json.dumps({k: v for k, v in RESULTS.items() if k.startswith("profile")}, default=str)[:6000])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"e2e_{args.part}.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
