# W4A8 on one GPU (H200), in one lease: the GPU tests of the W4A8 GEMMs at Hy3's shapes, the FusedMoE
# benchmark against our FP8 and bf16 (with a config sweep), and the 4-layer slice's decode and prefill
# with W4A8 experts against FP8.
#   bash bench/w4a8_gpu.sh     (on the GPU machine; STEPS="test moe e2e" picks the steps; each writes
#   its output to $OUT/w4a8-<step>.txt — never through a pipe that a timeout would cut)
set -uo pipefail
source bench/device_env.sh
out=${OUT:-/tmp/w4a8}; mkdir -p $out
for step in ${STEPS:-test moe e2e}; do
  echo "== $step $(date +%T)"
  case $step in
    test) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_w4a8.py \
            >$out/w4a8-test.txt 2>&1 ;;
    moe) timeout 300 python3 bench/moe_w4a8_bench.py --sweep >$out/w4a8-moe.txt 2>&1 ;;
    e2e) timeout 420 python3 bench/e2e.py --layers 4 --part w4a8 --decode 1,32 --prefill 8192,32768 \
           >$out/w4a8-e2e.txt 2>&1 ;;
  esac
  echo "rc=$? $(date +%T)"; tail -n 25 $out/w4a8-$step.txt
done
