# A/B of `hy3c serve`: an older source tree against the working tree, one checkpoint, one GPU lease.
#   git archive REV hy3c passes kernels serve recipes | tar -x -C .oldtree   (a folder .git/info/exclude ignores)
#   OLD_TREE=.oldtree bash bench/serve_ab.sh      (on the GPU machine; carry .oldtree and .whl)
set -euo pipefail
repo=$(pwd)
old_tree=${OLD_TREE:?set OLD_TREE to the older source tree}
source bench/device_env.sh
new_path=$PYTHONPATH
old=/tmp/old-run; rm -rf $old; mkdir -p $old/hy3c
for e in "$repo/$old_tree"/hy3c/*; do ln -s "$e" $old/hy3c/$(basename "$e"); done
for s in passes kernels serve recipes; do ln -sfn "$repo/$old_tree/$s" $old/hy3c/$s; done
old_path=$old:/tmp/site
w=/tmp/ab; rm -rf $w; mkdir -p $w
stamp() { echo "[ab $(date +%T)] $*"; }
stamp checkpoint
python3 -m hy3c init-checkpoint --preset real-shapes:4 --fp8 static --device cuda --out $w/ckpt >/dev/null 2>&1
stamp compile
python3 -m hy3c compile --model $w/ckpt --recipe h20-w8a8c8 --out $w/art-new 2>/dev/null | tail -1
PYTHONPATH=$old_path python3 -m hy3c compile --model $w/ckpt --recipe h20-w8a8c8 --out $w/art-old 2>/dev/null | tail -1
rm -rf $w/ckpt
for side in old new; do
  if [ $side = old ]; then path=$old_path; else path=$new_path; fi
  stamp "serve $side"
  PYTHONPATH=$path python3 -m hy3c serve $w/art-$side --port 8011 >$w/serve-$side.log 2>&1 &
  pid=$!
  for _ in $(seq 300); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  stamp "ready $side"
  for c in 1 32 1 32; do
    n=$((c == 1 ? 8 : 128))
    python3 -m hy3c bench serve --base-url http://127.0.0.1:8011 --dataset-name random --num-prompts $n \
      --max-concurrency $c --random-input-len 1024 --random-output-len 128 --temperature 0 --disable-tqdm \
      | grep -E "Output token throughput|Mean step|of which host|Kernel variants|Median TPOT" | sed "s/^/$side c=$c /"
  done
  kill $pid; wait $pid 2>/dev/null || true
done
