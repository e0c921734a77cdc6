# `hy3c serve` of one real-shape 4-layer FP8 slice with a GPU KV pool smaller than the working set, with
# the KV tiers off and on, under `hy3c bench serve`'s prefix-repetition workload at several hit ratios,
# then the hy3-trace workload: mean / p99 TTFT and throughput per setting (MAIN=0 skips); then (SHARED=1, the default)
# 16 requests on 61,440-token shared prefixes with 4,096 own tokens each: prompt tokens computed
# (/metrics: prompt tokens − prefix-cache hits) against the ideal, with one prefix in a pool that holds
# it, and with two prefixes alternating in a pool that holds only one (L1 loses each to the other;
# L2 / L3 bring it back) (one GPU lease).
#   bash bench/kv_tiers_serve.sh        (on the GPU machine; carry .whl; ART=DIR serves an artifact
#   compiled before; KV_GIB, the GPU pool's size (default 0.75: 78K tokens of 10 KiB, less than the working set);
#   RATIOS="0 0.2 0.5 0.8" (the share of prompt tokens a cache that never forgets serves: the prefix
#   is R · N / (N − PREFIXES) of each prompt of PROMPT_LEN tokens, default 8192); N prompts per level (default 768) over
#   PREFIXES prefixes (default 48: a working set of ~340K tokens at 80%, four times the pool, so L1
#   alone keeps little: with 16 prefixes (105K tokens, run K) L1 alone hit 36%, which capped the
#   TTFT gain the tiers could show under the 3× goal); CONCURRENCY (default 8); TRACE=0 skips the trace (TRACE_N prompts,
#   default 96); SETTINGS: settings of "l1-only l1-l2 l1-l2-file" run in that order, a repeat again
#   ("l1-only l1-l2-file l1-only l1-l2-file": an A/B/A/B of the file tier's cost))
set -uo pipefail
source bench/device_env.sh
w=/tmp/kv-tiers; rm -rf $w; mkdir -p $w/store && chmod 700 $w/store
source bench/slice_serve.sh
slice_artifact $w
run() {  # name, then hy3c serve's extra flags
  local name=$1; shift
  stamp "serve $name"
  python3 -m hy3c serve $art "${slice_flags[@]}" --port 8012 --kv-memory ${KV_GIB:-0.75} "$@" >$w/serve-$name.log 2>&1 &
  local pid=$!
  wait_healthy 8012 $pid $w/serve-$name.log || { echo "$name: not served"; return; }
  for r in ${RATIOS:-0 0.2 0.5 0.8}; do
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8012 --dataset-name prefix_repetition \
      --num-prompts ${N:-768} --max-concurrency ${CONCURRENCY:-8} --prefix-repetition-prefix-len $((${PROMPT_LEN:-8192} / 2)) \
      --prefix-repetition-suffix-len $((${PROMPT_LEN:-8192} / 2)) --prefix-repetition-hit-ratio $r --prefix-repetition-num-prefixes ${PREFIXES:-48} \
      --prefix-repetition-output-len 16 --temperature 0 --ignore-eos --disable-tqdm \
      | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Request throughput|Engine steps|Mean step|of which host|Engine busy|idle, |Server TTFT|arrival to scheduled|scheduled to first token|hit rate|pages found" | sed "s/^/$name hit=$r /"
  done
  [ "${TRACE:-1}" = 1 ] && python3 -m hy3c bench serve --base-url http://127.0.0.1:8012 --dataset-name hy3-trace --trace-scale 0.1 \
    --trace-reuse 0.8 --num-prompts ${TRACE_N:-96} --max-concurrency 8 --temperature 0 --disable-tqdm \
    | grep -E "Output token throughput|Mean TTFT|P99 TTFT|Mean TPOT|P99 TPOT|hit rate|pages found" | sed "s/^/$name trace /"
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8012/metrics').read().decode())" | grep -E "^hy3c:kv_tier_pages|^hy3c:kv_l3_degraded|prefix_cache_hits_total" | sed "s/^/$name /"
  kill $pid; wait $pid 2>/dev/null || true
}
computed() {  # prompt tokens the server on port 8012 computed so far (not found in any KV tier)
  python3 -c "
import urllib.request as u
m = {l.split('{')[0].split()[0]: float(l.split()[-1]) for l in u.urlopen('http://127.0.0.1:8012/metrics').read().decode().splitlines() if l.startswith('hy3c:')}
print(int(m['hy3c:prompt_tokens_total'] - m['hy3c:prefix_cache_hits_total']))"
}
shared() {  # name, KV GiB, prefixes, concurrencies ("1 8"), then hy3c serve's extra flags
  local name=$1 gib=$2 prefixes=$3 concurrencies=$4; shift 4
  stamp "shared prefix $name"
  python3 -m hy3c serve $art "${slice_flags[@]}" --port 8012 --kv-memory $gib "$@" >$w/shared-$name.log 2>&1 &
  local pid=$!
  wait_healthy 8012 $pid $w/shared-$name.log || { echo "$name: not served"; return; }
  for c in $concurrencies; do
    local before; before=$(computed)
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8012 --dataset-name prefix_repetition \
      --num-prompts 16 --max-concurrency $c --prefix-repetition-prefix-len 61440 \
      --prefix-repetition-suffix-len 4096 --prefix-repetition-num-prefixes $prefixes --seed $c \
      --prefix-repetition-output-len 4 --temperature 0 --ignore-eos --disable-tqdm \
      | grep -E "Mean TTFT|hit rate|pages found" | sed "s/^/shared $name C=$c /"
    # ideal: each prefix once (its first request; later ones recompute only their last token) and every
    # request's own tokens
    echo "shared $name C=$c computed $(($(computed) - before)) ideal $((prefixes * 61440 + 16 * 4096))"
  done
  kill $pid; wait $pid 2>/dev/null || true
}
if [ "${MAIN:-1}" = 1 ]; then
  for setting in ${SETTINGS:-l1-only l1-l2 l1-l2-file}; do  # in the order given; a repeat runs again
    case $setting in
      l1-only) run l1-only ;;
      l1-l2) run l1-l2 --kv-host-gib ${HOST_GIB:-16} ;;
      l1-l2-file) rm -rf $w/store/*; run l1-l2-file --kv-host-gib ${HOST_GIB:-16} --kv-store file:$w/store ;;
      *) echo "unknown setting $setting" ;;
    esac
  done
fi
if [ "${SHARED:-1}" = 1 ]; then
  rm -rf $w/store; mkdir -p $w/store && chmod 700 $w/store
  shared one-prefix 4 1 "1 8"
  # 0.7 GiB: 72K tokens (10 KiB each: 4 layers and the MTP layer), one prefix and one request's own
  # tokens (so one at a time), not two prefixes; L2 of 0.75 GiB holds one prefix (61,440 tokens:
  # 600 MiB) and not two (it keeps what was published last, as L1 does), so L3 brings back the other
  shared two-l1-only 0.7 2 1
  shared two-l1-l2 0.7 2 1 --kv-host-gib ${HOST_GIB:-16}
  shared two-l1-l3 0.7 2 1 --kv-host-gib 0.75 --kv-store file:$w/store
fi
