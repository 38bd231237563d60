#!/bin/bash
# The script run at adcb0d2 (twice; both calls timed out in gpu_quant.cu's cold compile: int8_adcb0d2.log).
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
timeout 5 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,pstate,mig.mode.current \
  --format=csv > "$D/smi.txt" 2>&1
el smi $?
timeout 30 python3 experiments/gpu_quant_check.py --no-matmul --occupancy --variants --probe --reps 10 --copies 4 \
  --types Q4_K,Q8_0,Q5_K,Q6_K,IQ4_XS,Q4_0,Q3_K,IQ2_XXS \
  --out "$D/check.json" > "$D/check.log" 2>&1
el check $?
left=$(( 50 - ($(date +%s) - T0) ))
if [ "$left" -gt 5 ]; then
  timeout "$left" python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu tests/execute/test_gpu_quant.py \
    -k "batched_expert_kernels or (expert_kernels_match and (Q4_K or Q8_0 or IQ2_XS))" > "$D/gpu_tests.log" 2>&1
  el gpu_tests $?
fi
left=$(( 59 - ($(date +%s) - T0) ))
if [ "$left" -gt 4 ]; then
  timeout "$left" python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu tests/execute/test_gpu_expert_types.py \
    -k "generic" > "$D/gpu_generic.log" 2>&1
  el gpu_generic $?
fi
touch "$D/DONE"
