#!/usr/bin/env bash
# `hy3c bench serve` against `hy3c serve` of a compiled real-shape Hy3 slice, at several concurrencies:
# random checkpoint (built on the GPU, FP8 with static activation scales) → `hy3c compile --recipe
# h20-w8a8c8` → `hy3c serve` in the background → one `hy3c bench serve` per concurrency, each with
# the engine's step and host time from /metrics.
#
#   bash bench/serve_bench.sh                                # real-shapes:4 on cuda, concurrency 1 8 32
#   PRESET=tiny DEVICE=cpu RECIPE=cpu-reference FP8= CONCURRENCY="1 4" PROMPTS=4 INPUT_LEN=32 OUTPUT_LEN=8 bash bench/serve_bench.sh
#
# Environment: PRESET (real-shapes:4), DEVICE (cuda), RECIPE (h20-w8a8c8),
# FP8 (static: the checkpoint's FP8 activation scheme; empty: a BF16 checkpoint), WORK (a new temporary directory), PORT (8011),
# CONCURRENCY ("1 8 32"), PROMPTS (prompts per concurrency level: 4 × concurrency, at least 8),
# INPUT_LEN (1024), OUTPUT_LEN (128), SERVE_ARGS (extra `hy3c serve` options), OUT_JSON (a directory
# for the per-level JSON results, `vllm bench serve`'s keys).
set -euo pipefail
preset=${PRESET:-real-shapes:4}
device=${DEVICE:-cuda}
work=${WORK:-$(mktemp -d)}
port=${PORT:-8011}
url="http://127.0.0.1:$port"
mkdir -p "$work"

server_pid=
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  [ -z "${WORK:-}" ] && rm -rf "$work"
  return 0
}
trap cleanup EXIT

stamp() { echo "[serve_bench $(date +%T)] $*" >&2; }
hy3c=(hy3c)
command -v hy3c >/dev/null || hy3c=(python3 -m hy3c)  # a checkout on PYTHONPATH, not installed
healthy() { python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=2)" 2>/dev/null; }

fp8=${FP8-static}
stamp "checkpoint $preset (FP8 activations: ${fp8:-none}) on $device"
"${hy3c[@]}" init-checkpoint --preset "$preset" ${fp8:+--fp8 "$fp8"} --device "$device" --out "$work/ckpt" --overwrite >/dev/null
recipe=${RECIPE:-h20-w8a8c8}
stamp "compile --recipe $recipe"
"${hy3c[@]}" compile --model "$work/ckpt" --recipe "$recipe" --out "$work/artifact" --overwrite | tail -1
rm -rf "$work/ckpt"

stamp "serve on $url"
# shellcheck disable=SC2086
"${hy3c[@]}" serve "$work/artifact" --port "$port" --device "$device" ${SERVE_ARGS:-} >"$work/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 600); do
  healthy && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
  sleep 1
done
healthy || { stamp "server not healthy after 600 s"; cat "$work/serve.log" >&2; exit 1; }
stamp "server ready"

for c in ${CONCURRENCY:-1 8 32}; do
  prompts=${PROMPTS:-$((4 * c > 8 ? 4 * c : 8))}
  stamp "concurrency $c, $prompts prompts"
  json=()
  [ -n "${OUT_JSON:-}" ] && json=(--save-result --result-dir "$OUT_JSON" --result-filename "serve_c$c.json")
  "${hy3c[@]}" bench serve --base-url "$url" --dataset-name random --num-prompts "$prompts" \
    --max-concurrency "$c" --random-input-len "${INPUT_LEN:-1024}" --random-output-len "${OUTPUT_LEN:-128}" \
    --temperature 0 --disable-tqdm "${json[@]}"
done
builds=$(grep -c kernel_built_while_serving "$work/serve.log" || true)
stamp "kernel variants built after warm-up: ${builds:-0}"
grep kernel_built_while_serving "$work/serve.log" | sed 's/.*kernel=//' | sort | uniq -c >&2 || true
