#!/bin/bash
# bgmove (issue: the hybrid pays): background copies waited for on the device, the hand-off's input
# copy on its own stream, CPU rows read back by a kernel -- each measured against the former path in
# one process (bench_executor --engine-variants; WAIT:PUT:ROWS, host:compute:copy = before 3c639be).
# 12 layers x 128 Q8_0 experts (48-block budgets scaled: 17 slots/layer = 4 GiB, 53 = 12 GiB),
# lru vs hybrid f=44 with its default fills and with none (--max-fills 512,0), --sync layer; four engine
# variants at 4 GiB, the former and the new default at 12 GiB.
# Then the GPU tests of the engine's background / hand-off. Total <= 125 s. Results: $OUT/bgmove/
set -u
D="$OUT/bgmove"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
B="--layers 12 --distinct-layers 1 --cache-frac 1 --warmup 16 --tokens 64 --threads 15 --policies lru,hybrid
   --miss-fracs 44 --max-fills 512,0 --sync layer"
timeout 55 python3 experiments/bench_executor.py $B --cache-mib 1024 --out "$D/be_4g" \
  --engine-variants host:compute:copy,device:compute:copy,device:early:copy,device:early:kernel > "$D/be_4g.log" 2>&1
el bench_4g $?
timeout 35 python3 experiments/bench_executor.py $B --cache-mib 3072 --out "$D/be_12g" \
  --engine-variants host:compute:copy,device:early:copy > "$D/be_12g.log" 2>&1
el bench_12g $?
left=$(( 122 - ($(date +%s) - T0) ))
if [ "$left" -gt 8 ]; then
  timeout "$left" python3 -m pytest -v -p no:xdist -o addopts="" -m gpu tests/execute/test_engine_background.py \
    tests/execute/test_handoff.py tests/execute/test_bench_layers.py tests/execute/test_engine.py \
    tests/execute/test_prefetch_replay.py > "$D/gpu_tests.log" 2>&1
  el gpu_tests $?
fi
grep -E "tok/s|hybrid /" "$D/be_4g.log" "$D/be_12g.log" | head -60
grep -E "PASSED|FAILED|ERROR|passed|failed" "$D/gpu_tests.log" | tail -40
cat "$D/times.txt"
