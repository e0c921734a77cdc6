# The GPU runs that wait for a lease, each a named step; one call runs the steps it names in order,
# each under its own timeout, its output written to $OUT/<step>.txt (never only through a pipe that a
# timeout would cut), a table's tail printed after it.
#   STEPS="probe decode-tests json" bash bench/gpu_lease.sh     (on the GPU machine, carrying .whl)
# Steps:
#   decode-tests  GPU tests of the decode graphs: written inputs, sampled graphs, draft graphs, captured
#                 speculative steps (greedy and sampled)
#   probe         engine_probe on the 4-layer FP8 slice (random weights), C=1 and 32, decode steps
#                 written into the graphs' inputs and staged from batches, gap table (issue 27)
#   mtp-sampled   engine_probe under MTP K=1 with sampled requests (temperature 0.8, top-p 0.95),
#                 C=1 and 32: the captured sampled step against the same steps uncaptured (issue 27)
#   json          json_schema vs free-text TPOT at C=32 over HTTP, engine process, two passes each (the
#                 first builds the masked kernels) (issue 29)
#   sampler-mask  the fused sampler with and without a grammar mask at batch 1 / 32 / 128, eager calls and
#                 CUDA-graph replays (issue 29's "≤ 10% slower" at batch 1, whose eager rows are host-bound)
#   json-probe    engine_probe at C=32 with and without a json_schema, profiled steps and the kernel table:
#                 where json_schema's longer step goes (issue 29)
#   ttft          one request's TTFT at 8K and 32K prompts with an 80% prefix hit from L1 and from L2
#                 against cold and the compute floor, with its device breakdown (issue 28)
#   tiers-tests   GPU tests of the KV tiers (real side-stream copies, a load beside a running request)
#   tiers         prefix repetition at 0% and 80% hit, L1 only / + L2 / + file L3 (issue 28; the
#                 whole of bench/kv_tiers_serve.sh needs a call of its own; SETTINGS="l1-l2" etc.
#                 runs one server of it, N=192 PREFIXES=24 fewer prompts, RATIOS others)
#   tiers-32k     prefix repetition at 80% hit with 32,768-token prompts (the Hy3 stack's prompts average
#                 68K), L1 only and L1 + L2, 4 at a time, a GPU pool of 1.5 GiB (~4.8 prompts; the working
#                 set of 12 prefixes ~2.3× that)
#   tiers-ab      the file tier's cost at 0% hit as A/B/A/B (L1 only, L1 + L2 + file L3, twice each): a
#                 drift of the machine between servers shows as the two L1-only rows' difference
#   tiers-paths   the KV tiers' data paths (L2 → GPU loads, GPU → L2 saves) against plain pinned copies
#   shared        16 requests on 61,440-token shared prefixes: prompt tokens computed against the ideal,
#                 one prefix in L1, and two alternating through L1 only / L2 / file L3 (issue 28)
#   moe-prefill   FusedMoE bf16 / FP8 at 1K / 8K / 32K tokens against the peers (and the persistent Gluon
#                 GEMMs, after moe-persistent-test passed in the same call), the FP8 path's per-kernel
#                 breakdown against cuBLAS dense FP8 (issue 30)
#   moe-sweep     the prefill config sweep at 8K tokens (bf16, FP8): this GPU's table, fused_moe_<gpu>.json
#   moe-sweep-prefill  from the shipped 8K / 32K configs, the down GEMM's own tiles and the persistent
#                 Gluon GEMMs' configs (only after moe-persistent-test passed in the same call); then the
#                 FP8 breakdown against cuBLAS dense FP8 per GEMM (issue 30). moe-sweep-down: without them
#   moe-persistent-test  GPU tests of the persistent Gluon FusedMoE GEMMs at Hy3's shapes (issue 30)
#   moe-persistent  the short form: those tests at 8K tokens, then only the persistent configs against the
#                 shipped one at 8K, and the FP8 breakdown
#   w4a8-test     GPU tests of the W4A8 GEMMs at Hy3's shapes (issue 30)
#   w4a8-moe      W4A8 FusedMoE vs FP8 and bf16 with a config sweep of both widenings (issue 30; a call
#                 of its own: up to 8 minutes)
#   w4a8-e2e      4-layer slice decode and prefill with W4A8 experts vs FP8 (issue 30)
set -uo pipefail
source bench/device_env.sh
out=${OUT:-/tmp/lease}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
slice=/tmp/lease-slice
compiled() {  # the random-weight 4-layer FP8 slice, compiled once per call
  [ -d $slice ] || python3 -m hy3c compile --preset real-shapes:4 --recipe h20-w8a8c8 \
    --set quant.activations=dynamic --out $slice >"$out/compile.txt" 2>&1
}
persistent_smoke() {  # one small case of the persistent Gluon GEMMs first: a hang costs 2 minutes, not a step
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/test_gpu_kernels.py \
    -k "persistent and 1024 and 128 and dynamic" >"$out/persistent-smoke.txt" 2>&1
  local rc=$?; echo "persistent smoke rc=$rc"; tail -n 5 "$out/persistent-smoke.txt"; return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >>"$out/gpu.txt"
for step in ${STEPS:-probe}; do
  echo "== $step $(date +%T)"
  case $step in
    decode-tests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/serve/engine/test_written_decode.py tests/serve/engine/test_sampled_graphs.py \
        tests/runtime/test_draft_graphs.py tests/serve/engine/test_spec_steps.py >"$out/$step.txt" 2>&1 ;;
    probe) compiled; timeout 300 python3 bench/engine_probe.py $slice --random-weights 0 --concurrency 1 32 \
        --overlap on --written both --output-len 300 --gap-table >"$out/$step.txt" 2>&1 ;;
    mtp-sampled) compiled; timeout 300 python3 bench/engine_probe.py $slice --random-weights 0 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' --temperature 0.8 --top-p 0.95 \
        --concurrency 1 32 --overlap on --written both --output-len 200 >"$out/$step.txt" 2>&1 ;;
    json) compiled; ART=$slice RANDOM_WEIGHTS=1 SAMPLER=0 SERVERS=--engine-process KINDS="${KINDS:-free json free json}" \
        timeout 320 bash bench/structured_serve.sh >"$out/$step.txt" 2>&1
      grep -hE "engine_(warmed_up|ready)|kernel_build" /tmp/structured/serve.log | tail -5 >>"$out/$step.txt" ;;
    sampler-mask) for graph in "" --graph; do timeout 200 python3 bench/grammar_sampler_bench.py $graph; done \
        >"$out/$step.txt" 2>&1 ;;
    json-probe) compiled; schema='{"type": "object", "required": ["notes"], "properties": {"notes": {"type": "array",
        "minItems": 64, "items": {"type": "string", "maxLength": 40}}}}'
      for extra in "" "--json-schema"; do timeout 200 python3 bench/engine_probe.py $slice --random-weights 0 \
        --concurrency 32 --output-len 160 --profile-steps 20 --overlap on --kernel-table \
        ${extra:+$extra "$schema"}; done >"$out/$step.txt" 2>&1 ;;
    ttft) compiled; for len in 8192 32768; do timeout 240 python3 bench/prefix_ttft_probe.py $slice \
        --random-weights 0 --prompt-len $len --repeats 5; done >"$out/$step.txt" 2>&1 ;;
    tiers-tests) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/serve/engine/test_kv_tiers_gpu.py \
        >"$out/$step.txt" 2>&1 ;;
    tiers) compiled; ART=$slice RANDOM_WEIGHTS=1 RATIOS="${RATIOS:-0 0.8}" TRACE=0 SHARED=0 \
        timeout 540 bash bench/kv_tiers_serve.sh >"$out/$step.txt" 2>&1 ;;
    tiers-32k) compiled; ART=$slice RANDOM_WEIGHTS=1 RATIOS=0.8 TRACE=0 SHARED=0 PROMPT_LEN=32768 KV_GIB=1.5 N=96 \
        PREFIXES=12 CONCURRENCY=4 SETTINGS="l1-only l1-l2" timeout 480 bash bench/kv_tiers_serve.sh >"$out/$step.txt" 2>&1 ;;
    tiers-ab) compiled; ART=$slice RANDOM_WEIGHTS=1 RATIOS=0 TRACE=0 SHARED=0 \
        SETTINGS="l1-only l1-l2-file l1-only l1-l2-file" timeout 400 bash bench/kv_tiers_serve.sh >"$out/$step.txt" 2>&1 ;;
    tiers-paths) compiled; timeout 240 python3 bench/kv_tiers_bench.py --artifact $slice --pages 1024 --rounds 5 \
        >"$out/$step.txt" 2>&1 ;;
    shared) compiled; ART=$slice RANDOM_WEIGHTS=1 MAIN=0 SHARED=1 \
        timeout 540 bash bench/kv_tiers_serve.sh >"$out/$step.txt" 2>&1 ;;
    moe-prefill)  # the persistent Gluon GEMMs' rows only after their GPU tests passed in this call
      persistent=$([ -e "$out/persistent-ok" ] || echo --no-persistent)
      timeout 300 python3 bench/moe_bench.py --parts moe,breakdown --tokens 1024,8192,32768 $persistent \
        >"$out/$step.txt" 2>&1 ;;
    moe-sweep) timeout 540 python3 bench/moe_bench.py --parts moe --tokens 8192 --sweep >"$out/$step.txt" 2>&1 ;;
    moe-persistent-test) persistent_smoke && timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
        tests/kernels/test_gpu_kernels.py -k "persistent or fused_moe_real" >"$out/$step.txt" 2>&1 \
        && touch "$out/persistent-ok" ;;
    moe-persistent)  # the short form: its GPU tests at 8K, then the persistent configs against the shipped one
      persistent_smoke && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/test_gpu_kernels.py \
        -k "persistent and 8192 and (dynamic or bf16 or static)" >"$out/$step-test.txt" 2>&1 \
        && timeout 300 python3 bench/moe_bench.py --parts moe,breakdown --tokens 8192 --sweep-from-shipped \
        --no-down-tiles >"$out/$step.txt" 2>&1; tail -n 15 "$out/$step-test.txt" ;;
    moe-sweep-prefill|moe-sweep-down)  # the persistent configs only after their GPU tests passed in this call
      persistent=$([ "$step" = moe-sweep-prefill ] && [ -e "$out/persistent-ok" ] || echo --no-persistent)
      timeout 420 python3 bench/moe_bench.py --parts moe,breakdown --tokens 8192,32768 --sweep-from-shipped \
        $persistent >"$out/$step.txt" 2>&1 ;;
    w4a8-test) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_w4a8.py \
        >"$out/$step.txt" 2>&1 ;;
    w4a8-moe) timeout 480 python3 bench/moe_w4a8_bench.py --sweep >"$out/$step.txt" 2>&1 ;;
    w4a8-e2e) timeout 420 python3 bench/e2e.py --layers 4 --part w4a8 --decode 1,32 --prefill 8192,32768 \
        >"$out/$step.txt" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "rc=$? $(date +%T)"; tail -n 25 "$out/$step.txt"
done
