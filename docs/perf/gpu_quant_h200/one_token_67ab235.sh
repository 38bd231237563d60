#!/bin/bash
# gpuquant (every quant type, GPU kernels): where the one-token expert launches' ~20 us goes.
# 1) gpu_quant_check: each one-token launch alone (gate/up, down, us) and the call's GB/s on
#    4 copies of the weights (84 MB > L2), for the default kernels and the new direct _g kernels,
#    each also compiled in a module of the type alone (GQ_ONLY: the 20-type dispatch's cost apart),
#    the 64-token batched call likewise (matmul rates on a small 256 x 2048 matrix: not of interest);
#    --occupancy: registers, stack bytes, blocks per SM of each kernel (the driver's occupancy).
#    Types in order of interest: Q4_K, IQ1_S (51 us gate/up before), Q8_0. Output is flushed per
#    line, so a timeout still leaves what ran.
# 2) the GPU expert-kernel tests (every type, default and _g one-token kernels, batched kernels).
# Total <= 70 s. Results: $OUT/gpuquant/
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
timeout 52 python3 experiments/gpu_quant_check.py --only --occupancy --types Q4_K,IQ1_S,Q8_0 --reps 10 \
  --rows 256 --cols 2048 \
  --copies 4 --out "$D/one.json" > "$D/one.log" 2>&1
el check $?
left=$(( 68 - ($(date +%s) - T0) ))
if [ "$left" -gt 5 ]; then
  timeout "$left" python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu \
    tests/execute/test_gpu_quant.py -k "expert_kernels_match" > "$D/gpu_tests.log" 2>&1
  el gpu_tests $?
fi
cat "$D/one.log"
tail -15 "$D/gpu_tests.log" 2>/dev/null
