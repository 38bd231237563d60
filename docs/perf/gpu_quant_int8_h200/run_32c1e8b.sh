#!/bin/bash
# gpuquant, second call: GPU only, <= 45 s. The int8 batched kernels after the change the first call
# pointed to (a tile's chunks multiplied branch-free). Rows written (flushed) as they come.
#  (1) one module per type (-DGQ_ONLY=<type>, 5 in parallel; the whole module would take ~40+ s);
#  (2) a routed batch: 4 tokens through each of 128 experts (64 tokens top-8 over 128 experts: every
#      expert's bytes read once), Q8_0 and Q4_K, every variant (GB/s = bytes of the 128 experts / time);
#  (3) 64 tokens through each of 8 experts, the five types, every variant (the first call's shape).
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }
git rev-parse HEAD > "$D/commit.txt" 2>&1
PIDS=""
for t in 8 12 39 14 23; do  # Q8_0 Q4_K MXFP4 Q6_K IQ4_XS
  timeout 33 python3 -c "
import time; t = time.time()
from execute.gpu_quant import kernel
kernel('qx8', ('GQ_ONLY=$t',)); print(f'GQ_ONLY=$t compiled in {time.time() - t:.1f} s', flush=True)" > "$D/compile_$t.log" 2>&1 &
  PIDS="$PIDS $!"
done
wait $PIDS
el compile_types 0
l=$(left 37)
if [ "$l" -gt 3 ]; then
  timeout "$l" python3 experiments/gpu_quant_check.py --type-modules --no-one --variants --experts 128 --tokens 4 \
    --reps 5 --copies 1 --types Q8_0,Q4_K --out "$D/routed.json" > "$D/routed.log" 2>&1
  el routed $?
fi
l=$(left 44)
if [ "$l" -gt 3 ]; then
  timeout "$l" python3 experiments/gpu_quant_check.py --type-modules --no-one --variants --reps 10 --copies 4 \
    --types Q8_0,Q4_K,MXFP4,Q6_K,IQ4_XS --out "$D/batch64.json" > "$D/batch64.log" 2>&1
  el batch64 $?
fi
touch "$D/DONE"
