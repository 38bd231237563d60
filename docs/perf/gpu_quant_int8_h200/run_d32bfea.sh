#!/bin/bash
# gpuquant: GPU only, <= 60 s. Every log/JSON is written (flushed) row by row, so a cut run keeps its rows.
# The whole gpu_quant.cu module takes 30-45 s to compile cold (NVRTC, all 20+ types), so:
#  (0) the whole module compiles in the background (CPU only) for the last step;
#  (1) meanwhile one module per type (-DGQ_ONLY=<type>: ~8-12 s each, 5 in parallel);
#  (2) 64 tokens through each of 8 experts (2048 x 768, 4 copies beyond L2): every int8 batched variant
#      (_q8 _q8m2 _q8m1 _q8s2 _q8s1, the new pipelined _q8p _q8p2 _q8px, by dependent launch _q8pd _q8pxd) beside the f16 default, errors included;
#  (3) one token, the same types, with _d (dependent launch), _w (40 KB gate/up tiles) and the probes;
#  (4) Q8_0, Q4_K: 16 tokens through each of 32 experts (a routed 64-token batch's 512 pairs);
#  (5) when the whole module is ready: (2) again for Q8_0, Q4_K from it (the dispatch the engine runs).
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }
git rev-parse HEAD > "$D/commit.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,pstate --format=csv > "$D/smi.txt" 2>&1
( timeout 58 python3 -c "
import time; t = time.time()
from execute.gpu_quant import kernel
kernel('qx8'); print(f'whole gpu_quant.cu compiled in {time.time() - t:.1f} s', flush=True)" > "$D/compile_full.log" 2>&1
  echo "rc=$? at $(( $(date +%s) - T0 )) s" >> "$D/compile_full.log" ) &
FULL=$!
PIDS=""
for t in 8 12 39 14 23; do  # Q8_0 Q4_K MXFP4 Q6_K IQ4_XS
  timeout 40 python3 -c "
import time; t = time.time()
from execute.gpu_quant import kernel
kernel('qx8', ('GQ_ONLY=$t',)); print(f'GQ_ONLY=$t compiled in {time.time() - t:.1f} s', flush=True)" > "$D/compile_$t.log" 2>&1 &
  PIDS="$PIDS $!"
done
wait $PIDS
el compile_types 0
TYPES=Q8_0,Q4_K,MXFP4,Q6_K,IQ4_XS
l=$(left 40)
if [ "$l" -gt 3 ]; then
  timeout "$l" python3 experiments/gpu_quant_check.py --type-modules --no-one --variants --reps 10 --copies 4 \
    --types "$TYPES" --out "$D/batch64.json" > "$D/batch64.log" 2>&1
  el batch64 $?
fi
l=$(left 51)
if [ "$l" -gt 3 ]; then
  timeout "$l" python3 experiments/gpu_quant_check.py --type-modules --one --probe --reps 10 --copies 4 \
    --types "$TYPES" --out "$D/one.json" > "$D/one.log" 2>&1
  el one $?
fi
l=$(left 57)
if [ "$l" -gt 3 ]; then  # a routed batch's shape: 512 pairs as 16 tokens through each of 32 experts
  timeout "$l" python3 experiments/gpu_quant_check.py --type-modules --no-one --variants --experts 32 --tokens 16 \
    --reps 10 --copies 2 --types Q8_0,Q4_K --out "$D/spread.json" > "$D/spread.log" 2>&1
  el spread $?
fi
wait $FULL
el compile_full 0
l=$(left 59)
if [ "$l" -gt 3 ] && grep -q "compiled in" "$D/compile_full.log"; then
  timeout "$l" python3 experiments/gpu_quant_check.py --no-matmul --no-one --variants --reps 10 --copies 4 \
    --types Q8_0,Q4_K --out "$D/batch64_full.json" > "$D/batch64_full.log" 2>&1
  el batch64_full $?
fi
touch "$D/DONE"
