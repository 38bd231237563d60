#!/bin/bash
# gpuquant (every quant type, GPU kernels). <= 70 s wall. Results: $OUT/gpuquant/
# 1) clocks / MIG state of the card (last session's copy rates were far below the card's).
# 2) gpu_quant_check on ALL 20 quantized types (most used first; output flushed per type, so a
#    timeout keeps what ran): errors and GB/s of the one-token expert call for the default (direct)
#    kernels and the new _r kernels side by side, each launch alone, the _r down launch at 2 and 8
#    rows per block, the _r launches without their dots (--probe: where the time goes), the
#    64-token batched call (default and the unrolled _u twin); copy rates measured in the same run
#    (element-wise, memcpy in a graph, memcpy by events).
# 3) the GPU expert-kernel tests (every type and mixes: one token default and _r, batched default and _u)
#    with what is left.
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
timeout 8 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate,mig.mode.current,temperature.gpu \
  --format=csv > "$D/smi.txt" 2>&1
el smi $?
timeout 50 python3 experiments/gpu_quant_check.py --no-matmul --occupancy --variants --probe --down-rows 2,8 --reps 10 --copies 4 \
  --types Q4_K,Q8_0,Q6_K,Q5_K,IQ4_XS,MXFP4,Q4_0,Q3_K,Q2_K,IQ3_XXS,IQ2_XXS,IQ1_S,Q4_1,Q5_0,Q5_1,IQ4_NL,IQ3_S,IQ2_XS,IQ2_S,IQ1_M \
  --out "$D/check.json" > "$D/check.log" 2>&1
el check $?
timeout 5 nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,pstate --format=csv >> "$D/smi.txt" 2>&1
left=$(( 68 - ($(date +%s) - T0) ))
if [ "$left" -gt 5 ]; then
  timeout "$left" python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu \
    tests/execute/test_gpu_quant.py -k "expert_kernels_match or batched_expert_kernels" > "$D/gpu_tests.log" 2>&1
  el gpu_tests $?
fi
cat "$D/smi.txt" "$D/check.log"
tail -15 "$D/gpu_tests.log" 2>/dev/null
