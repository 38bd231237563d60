#!/bin/bash
# cpukern: the CPU expert kernels per quant type on the H200 host (16 cores, Emerald Rapids), at
# most 90 s. Run from the repo root; writes $OUT/cpukern/. No GPU used.
#   1. the tree's state, lscpu, the load
#   2. every CPU type's row kernel compiled cold in parallel (one process per type: each type is
#      its own Numba cache entry), beside one process compiling the pool's loop and the bench's
#      streaming sum
#   3. bench_cpu_experts.py --threads 15 --types all --shapes 8x1 --per-core '' --reps 3
#      --isa vnni,avx2 --no-old (types.json / types.log)
#   4. the i-quants' grid gather modes interleaved, blend / loads / vgather twice
#      (gather.json / gather.log), in what time is left
set -u
T0=$(date +%s)
D="$OUT/cpukern"
mkdir -p "$D"
THREADS=${CPUKERN_THREADS:-15}
left() { echo $(( ${CPUKERN_BUDGET:-86} - ($(date +%s) - T0) )); }
stamp() { echo "$(( $(date +%s) - T0 )) s: $*" >> "$D/steps.txt"; }

{ git rev-parse HEAD 2>/dev/null; git status --short -- execute experiments 2>/dev/null; sha1sum execute/cpu_*.py; } > "$D/tree.txt" 2>&1
lscpu > "$D/lscpu.txt" 2>&1
{ uptime; nproc; python3 -c "import numba; print('numba', numba.__version__)"; } > "$D/host.txt" 2>&1
stamp "start"

# the kernels' cache stamp written once, before the parallel compiles (cpu_simd.drop_stale_kernel_caches)
python3 -c "import execute.cpu_experts" >> "$D/warm.log" 2>&1
TYPES=$(python3 -c "from execute import quant as Q; print(' '.join(Q.LAYOUTS[t].name for t in sorted(Q.CPU_QTYPES)))")
stamp "types: $TYPES"
pids=()
for t in $TYPES; do
  [ "$t" = Q8_0 ] && continue  # the pool's warm-up below compiles Q8_0's
  timeout 45 python3 -c "import sys, time; t0 = time.time(); from execute import cpu_experts as C, quant as Q; C.row_kernel(Q.QTYPE_BY_NAME['$t']); print('$t', round(time.time() - t0, 1), 's')" >> "$D/warm.log" 2>&1 &
  pids+=($!)
done
timeout 45 python3 - >> "$D/warm.log" 2>&1 <<'EOF' &
import sys, time
t0 = time.time()
sys.path.insert(0, "experiments")
import numpy as np
import bench_cpu_experts as B
from execute import quant as Q
from execute.cpu_pool import CpuExpertPool
from execute.experts import random_layer
B._stream_sum(np.ones(1024, np.float32))
layer = random_layer(np.random.default_rng(0), 0, 2, 256, 256, Q.Q8_0, exact=False)
with CpuExpertPool(2, timeout_s=60) as pool:
    pool.submit(layer, [0], np.ones((1, 256), np.float32)).result()
print("pool loop + Q8_0 + stream sum", round(time.time() - t0, 1), "s")
EOF
pids+=($!)
wait "${pids[@]}"
stamp "compiled"

timeout "$(( $(left) - 18 ))" python3 experiments/bench_cpu_experts.py --threads "$THREADS" --types all --shapes 8x1 \
  --per-core '' --isa vnni,avx2 --reps 3 --no-old --out "$D/types.json" > "$D/types.log" 2>&1
stamp "types rc=$?"
uptime >> "$D/host.txt"

G=IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M
timeout "$(( $(left) > 5 ? $(left) : 5 ))" python3 experiments/bench_cpu_experts.py --threads "$THREADS" --types "$G" \
  --shapes 8x1 --per-core '' --reps 3 --no-old --out "$D/gather.json" \
  --isa vnni:2k:blend,vnni:2k:loads,vnni:2k:vgather,vnni:2k:blend,vnni:2k:loads,vnni:2k:vgather > "$D/gather.log" 2>&1
stamp "gather rc=$?"
uptime >> "$D/host.txt"
