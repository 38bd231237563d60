#!/bin/bash
# gpuquant (rerun version): the 05:20 call timed out in gpu_quant.cu's first NVRTC compile (> 30 s cold,
# each later phase compiled again). So: compile once first (writes CuPy's cache), then the check.
# Measures the int8 batched kernels (_q8 / _q8m2 / _q8m1: 64 / 32 / 16 rows a block; _q8s2 / _q8s1
# weight tiles copied first) beside the f16 default, and the one-token _d (dependent launch) beside
# the default, 64 tokens / 1 token through 8 experts; GPU only, <= 60 s. Results: $OUT/gpuquant/
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
timeout 50 python3 -c "from execute.gpu_quant import kernel; kernel('qx8')" > "$D/compile.log" 2>&1
el compile $?
left=$(( 59 - ($(date +%s) - T0) ))
timeout "$left" python3 experiments/gpu_quant_check.py --no-matmul --variants --probe --reps 10 --copies 4 \
  --types Q4_K,Q8_0,Q5_K,Q6_K,IQ4_XS,Q4_0 --out "$D/check.json" > "$D/check.log" 2>&1
el check $?
touch "$D/DONE"
