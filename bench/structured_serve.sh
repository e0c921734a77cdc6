# `hy3c serve` of the real-shape 4-layer FP8 slice with structured outputs: TPOT of chat requests under
# a json_schema response_format against free text (same prompts, same token budget), at concurrency 32
# (LEVELS to change), greedy (TEMPERATURE to sample), in one GPU lease, for each server in SERVERS ("--engine-process
# --no-engine-process" by default: the engine in its own process, then on a thread of the HTTP
# process); then the sampler benchmark with real grammar masks.
#   bash bench/structured_serve.sh        (on the GPU machine; carry .whl with llguidance; ART=DIR serves
#   an artifact compiled before; RANDOM_WEIGHTS=1 compiles the slice without weights; SAMPLER=0 skips
#   the sampler benchmark)
set -uo pipefail
source bench/device_env.sh
w=/tmp/structured; rm -rf $w; mkdir -p $w
source bench/slice_serve.sh
slice_artifact $w
# a document that cannot end before 128 tokens (64 strings at least): every request runs to its token
# budget, as the free-text ones do, so the two see the same batches and admissions (a schema that ends
# early keeps admitting new prompts, whose prefills then weigh on the TPOT)
schema='{"response_format": {"type": "json_schema", "json_schema": {"name": "notes", "strict": true, "schema":
 {"type": "object", "additionalProperties": false, "required": ["title", "notes"], "properties":
 {"title": {"type": "string", "maxLength": 60}, "notes": {"type": "array", "minItems": 64, "items":
 {"type": "string", "maxLength": 40}}}}}}}'
for server in ${SERVERS:---engine-process --no-engine-process}; do
stamp "serve $server"
python3 -m hy3c serve $art "${slice_flags[@]}" $server --port 8011 >$w/serve.log 2>&1 &
pid=$!
wait_healthy 8011 $pid $w/serve.log || exit 1
for c in ${LEVELS:-32}; do
  n=$((4 * c))
  for kind in ${KINDS:-free json free json}; do  # any: a grammar that allows every token (its cost alone)
    extra='{}'; [ $kind = json ] && extra=$schema
    [ $kind = any ] && extra='{"structured_outputs": {"regex": "[\\s\\S]*"}}'
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8011 --endpoint /v1/chat/completions \
      --dataset-name random --num-prompts $n --max-concurrency $c --random-input-len 1024 \
      --random-output-len 128 --temperature ${TEMPERATURE:-0} --disable-tqdm --extra-body "$extra" \
      --save-result --save-detailed --result-filename $w/$kind-c$c.json \
      | grep -E "Successful|Total generated|Output token throughput|Mean TPOT|Median TPOT|P99 TPOT|Mean step|of which host" \
      | sed "s/^/$server $kind c=$c /"
    python3 - "$w/$kind-c$c.json" "$kind" <<'PY'
import collections, json, sys
r = json.load(open(sys.argv[1]))
lens = collections.Counter(r["output_lens"])
starts = sum(t.startswith('{"title":') for t in r["generated_texts"])
print(f"{sys.argv[2]}: output lengths {dict(lens)}; {starts}/{len(r['output_lens'])} begin as the schema's object")
PY
    [ $kind = any ] && python3 - "$w/free-c$c.json" "$w/any-c$c.json" <<'PY'
import json, sys
free, any_ = (json.load(open(path))["generated_texts"] for path in sys.argv[1:])
print(f"any: {sum(a == b for a, b in zip(free, any_))}/{len(free)} outputs equal free text's")
PY
  done
done
kill $pid; wait $pid 2>/dev/null || true
done
[ "${SAMPLER:-1}" = 0 ] && exit 0
stamp sampler
python3 bench/grammar_sampler_bench.py
