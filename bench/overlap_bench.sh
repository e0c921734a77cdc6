# `hy3c serve` of one real-shape 4-layer FP8 slice under several engine settings, in one GPU lease:
# overlapped scheduling on (the default) and off, and — when the artifact holds the MTP program —
# MTP speculative decoding in the forced-acceptance benchmark mode (alpha 0.57 and 0.9, K = 1 and 2).
#   bash bench/overlap_bench.sh          (on the GPU machine; carry .whl; MTP=0 skips the MTP runs,
#   MTP_CONFIGS="1:0.57 2:0.9" picks K:alpha pairs; LEVELS="1 32" the concurrencies of the first two;
#   RUNS="sync overlap thread" the runs without MTP;
#   ART=DIR serves an artifact compiled before instead of building one)
set -uo pipefail
source bench/device_env.sh
w=/tmp/overlap; rm -rf $w; mkdir -p $w
source bench/slice_serve.sh
slice_artifact $w
run() {  # name, then hy3c serve's extra flags
  local name=$1; shift
  stamp "serve $name"
  python3 -m hy3c serve $art "${slice_flags[@]}" --port 8011 "$@" >$w/serve-$name.log 2>&1 &
  local pid=$!
  wait_healthy 8011 $pid $w/serve-$name.log || { echo "$name: not served"; return; }
  for c in ${LEVELS:-1 32 1 32}; do
    n=$((c == 1 ? 16 : 4 * c))
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8011 --dataset-name random --num-prompts $n \
      --max-concurrency $c --random-input-len 1024 --random-output-len 128 --temperature 0 --disable-tqdm \
      | grep -E "Output token throughput|Mean step|of which host|Median TPOT|Mean TPOT|acceptance|Acceptance" \
      | sed "s/^/$name c=$c /"
  done
  kill $pid; wait $pid 2>/dev/null || true
}
declare -A run_flags=([sync]=--no-async-scheduling [overlap]="" [thread]=--no-engine-process)
for name in ${RUNS:-sync overlap}; do  # thread: overlap, the engine on a thread of the HTTP process
  run "$name" ${run_flags[$name]}
done
[ "${MTP:-1}" = 0 ] && exit 0
for config in ${MTP_CONFIGS:-1:0.57 1:0.9 2:0.57 2:0.9}; do  # K:alpha
  k=${config%%:*} alpha=${config##*:}
  LEVELS="1 32" run "mtp-k$k-a$alpha" --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k, \"forced_acceptance\": $alpha}"
done
