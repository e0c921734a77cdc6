# `hy3c serve` of one real-shape 4-layer FP8 slice with a GPU KV pool smaller than the working set, with
# the KV tiers off and on, under `hy3c bench serve`'s prefix-repetition workload at several hit ratios,
# then the hy3-trace workload: mean / p99 TTFT and throughput per setting (one GPU lease).
#   bash bench/kv_tiers_serve.sh        (on the GPU machine; carry .whl; ART=DIR serves an artifact
#   compiled before; KV_GIB, the GPU pool's size (default 1); RATIOS="0 0.2 0.5 0.8"; N prompts per level)
set -uo pipefail
source bench/device_env.sh
w=/tmp/kv-tiers; rm -rf $w; mkdir -p $w/store && chmod 700 $w/store
source bench/slice_serve.sh
slice_artifact $w
run() {  # name, then hy3c serve's extra flags
  local name=$1; shift
  stamp "serve $name"
  python3 -m hy3c serve $art --port 8012 --kv-memory ${KV_GIB:-1} "$@" >$w/serve-$name.log 2>&1 &
  local pid=$!
  wait_healthy 8012 $pid $w/serve-$name.log || { echo "$name: not served"; return; }
  for r in ${RATIOS:-0 0.2 0.5 0.8}; do
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8012 --dataset-name prefix_repetition \
      --num-prompts ${N:-96} --max-concurrency 8 --prefix-repetition-prefix-len 4096 \
      --prefix-repetition-suffix-len 4096 --prefix-repetition-hit-ratio $r --prefix-repetition-num-prefixes 24 \
      --prefix-repetition-output-len 16 --temperature 0 --ignore-eos --disable-tqdm \
      | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Request throughput" | sed "s/^/$name hit=$r /"
  done
  python3 -m hy3c bench serve --base-url http://127.0.0.1:8012 --dataset-name hy3-trace --trace-scale 0.1 \
    --trace-reuse 0.8 --num-prompts ${N:-96} --max-concurrency 8 --temperature 0 --disable-tqdm \
    | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT|P99 TPOT" | sed "s/^/$name trace /"
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8012/metrics').read().decode())" | grep -E "^hy3c:kv_tier_pages|^hy3c:kv_l3_degraded|prefix_cache_hits_total" | sed "s/^/$name /"
  kill $pid; wait $pid 2>/dev/null || true
}
run l1-only
run l1-l2 --kv-host-gib ${HOST_GIB:-16}
run l1-l2-file --kv-host-gib ${HOST_GIB:-16} --kv-store file:$w/store
