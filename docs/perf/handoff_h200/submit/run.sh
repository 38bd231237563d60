#!/bin/bash
# hybrid (the hybrid pays): the CPU pool's submit cost per wake setting on the H200 host (no GPU),
# bench_executor 12 layers lru vs hybrid f=44 with the pool's submit waking one lead worker vs every
# worker (the same command as last session's background run, whose hybrid host_submit was 40.1 us),
# the hand-off GPU tests and the pool tests. Total <= 80 s wall. Results under $OUT/hybrid/.
set -u
D="$OUT/hybrid"; mkdir -p "$D"
git rev-parse HEAD > "$D/commit.txt"
T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
# 1. pool submit, wake lead vs all, team hot (gap 50 us < spin 2000) and asleep (gap 3000 us): CPU only
timeout 15 python3 experiments/bench_handoff.py --submit --threads 15 --rows 2 --calls 400 --gap-us 50,3000 \
  --spin-us 2000 --out "$D/submit" > "$D/submit.log" 2>&1; stamp submit $?
# 2. bench_executor, 12 layers, 17 slots per layer, wake all then lead
B="--layers 12 --distinct-layers 1 --cache-mib 1024 --cache-frac 1.0 --threads 15 --warmup 16 --tokens 64 --policies lru,hybrid --miss-fracs 44 --sync layer"
for w in all lead; do
  MOELAB_POOL_WAKE=$w timeout 24 python3 experiments/bench_executor.py $B --out "$D/be12_$w" > "$D/be12_$w.log" 2>&1
  stamp "bench_executor_$w" $?
done
# 3. the hand-off's GPU tests and the pool ring tests
timeout 16 python3 -m pytest -m "not slow" -n 0 -q tests/execute/test_handoff.py tests/execute/test_pool_ring.py \
  > "$D/gpu_tests.log" 2>&1; stamp gpu_tests $?
touch "$D/DONE"
