# Sourced by the serving bench scripts (after bench/device_env.sh): the real-shape 4-layer FP8 slice
# they serve, and a server's start.
stamp() { echo "[bench $(date +%T)] $*"; }

# slice_artifact DIR: the artifact to serve — $ART when set, else one built in DIR/art: a random
# real-shapes:4 FP8-static checkpoint compiled with --recipe h20-w8a8c8, or with RANDOM_WEIGHTS=1 the
# preset compiled without weights (FP8 with dynamic activation scales), served with seeded random
# weights (no 15 GB checkpoint written and read: ~2 minutes less); sets $art and the flags the server
# then needs, $slice_flags.
slice_artifact() {
  art=${ART:-$1/art}
  slice_flags=()
  [ "${RANDOM_WEIGHTS:-0}" = 1 ] && slice_flags=(--random-weights 0)
  [ -n "${ART:-}" ] && return
  stamp compile
  if [ "${RANDOM_WEIGHTS:-0}" = 1 ]; then
    python3 -m hy3c compile --preset real-shapes:4 --recipe h20-w8a8c8 --set quant.activations=dynamic \
      --out "$art" 2>/dev/null | tail -1
    return
  fi
  stamp checkpoint
  python3 -m hy3c init-checkpoint --preset real-shapes:4 --fp8 static --device cuda --out "$1/ckpt" >/dev/null 2>&1
  python3 -m hy3c compile --model "$1/ckpt" --recipe h20-w8a8c8 --out "$art" 2>/dev/null | tail -1
  rm -rf "$1/ckpt"
}

# wait_healthy PORT PID LOG: 0 once the server on PORT answers /health; 1 (with its log's tail) when
# process PID exited first or 300 s passed.
wait_healthy() {
  for _ in $(seq 300); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited"; tail -3 "$3"; return 1; }
    sleep 1
  done
  echo "the server did not answer /health in 300 s"; return 1
}
