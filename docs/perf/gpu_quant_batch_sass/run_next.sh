#!/bin/bash
# gpuquant: GPU only, <= 80 s. The every-layout batched expert kernels (issue 29, GPU side). Not run in
# session 11 (no device): run first next session. Defaults unchanged (GENERIC_BATCH _q8m2, whose SASS is
# byte-identical to the measured one; ONE_PROGRAMMATIC False): flip them only from these figures.
#  (1) one module per type (-DGQ_ONLY, 5 in parallel) + the whole module for the GPU tests (background);
#  (2) 64 tokens through each of 8 experts and one token, 5 types, variants: part 6's _q8a2 (a pass's idle
#      warps on other chunks), _q8k2/_q8k4 (8 warps), _q8m2c/_q8k2c (sums converted without I2F, the same
#      bits) beside _q8m2 (the default), _q8, _q8m1 (rows flushed as they come);
#  (3) the routed shape 128 experts x 4 tokens (a 64-token batch top-8 over 128), int8 variants only;
#  (4) the 128 x 4 f16 call (it crashed in session 10's check script) at 120 and 128 experts with
#      CUDA_LAUNCH_BLOCKING, then under compute-sanitizer memcheck: which kernel, which address;
#  (5) ncu of _q8m2 / _q8k2 (Q8_0, 64 x 8): speed of light, occupancy, warp stalls, pipes (the limiter);
#  (6) the GPU tests of test_gpu_quant.py (new: same bits, 128 experts, programmatic one-token launches)
#      and test_gpu_expert_types.py, in the background after the timings.
set -u
D="$OUT/gpuquant"; mkdir -p "$D"
T0=$(date +%s)
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
left() { local l=$(( $1 - ($(date +%s) - T0) )); [ "$l" -lt 1 ] && l=1; echo $l; }
git rev-parse HEAD > "$D/commit.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$D/smi.txt" 2>&1
(which ncu compute-sanitizer; ncu --version | tail -1) >> "$D/smi.txt" 2>&1
PIDS=""
for t in 8 12 39 14 23; do  # Q8_0 Q4_K MXFP4 Q6_K IQ4_XS
  timeout 40 python3 -c "
import time; t = time.time()
from execute.gpu_quant import kernel
kernel('qx8', ('GQ_ONLY=$t',)); print(f'GQ_ONLY=$t compiled in {time.time() - t:.1f} s', flush=True)" > "$D/compile_$t.log" 2>&1 &
  PIDS="$PIDS $!"
done
timeout 70 python3 -c "
import time; t = time.time()
from execute.gpu_quant import kernel
kernel('qx8'); print(f'whole module compiled in {time.time() - t:.1f} s', flush=True)" > "$D/compile_full.log" 2>&1 &
FULL=$!
wait $PIDS
el compile_types 0
V=_q8m2,_q8k2,_q8k4,_q8m2c,_q8k2c,_q8a2,_q8,_q8m1
timeout "$(left 46)" python3 experiments/gpu_quant_check.py --type-modules --variants $V --reps 10 --copies 4 \
  --types Q8_0,Q4_K,MXFP4,Q6_K,IQ4_XS --out "$D/batch64.json" > "$D/batch64.log" 2>&1
el batch64 $?
cat > /tmp/gq_routed.py <<'PY'
import sys, cupy as cp
from execute import quant as Q
from execute.gpu_quant import Experts
from execute.kernel_timing import graph_seconds
E, T, ffn, hidden = 128, 4, 768, 2048
for qt in (8, 12):  # Q8_0, Q4_K: random bytes (timing only)
    for v in sys.argv[1].split(","):
        eb = 2 * ffn * Q.row_bytes(qt, hidden, "", Q.LAYOUTS) + hidden * Q.row_bytes(qt, ffn, "", Q.LAYOUTS)
        w = ((cp.arange(E * eb, dtype=cp.uint32) * cp.uint32(2654435761)) >> 26).astype(cp.uint8).reshape(E, eb)  # bytes < 64
        x = cp.random.standard_normal((T, hidden), dtype=cp.float32)
        ex = Experts(w, (qt,) * 3, ffn, hidden, tokens=T, variant=v, defines=(f"GQ_ONLY={qt}",))
        s = graph_seconds(lambda: ex(x), 10)
        print(f"{qt} {E} x {T} {v or 'f16'}: {1e6 * s:.1f} us, {w.nbytes / s / 1e9:.0f} GB/s", flush=True)
PY
CUDA_LAUNCH_BLOCKING=0 timeout "$(left 54)" python3 /tmp/gq_routed.py _q8m2,_q8a2,_q8k2,_q8k4,_q8m2c,_q8k2c > "$D/routed.log" 2>&1
el routed $?
cat > /tmp/gq_f16.py <<'PY'
import sys, cupy as cp
from execute import quant as Q
from execute.gpu_quant import Experts
E, T, ffn, hidden, qt = int(sys.argv[2]), 4, 768, 2048, 8
eb = 2 * ffn * Q.row_bytes(qt, hidden, "", Q.LAYOUTS) + hidden * Q.row_bytes(qt, ffn, "", Q.LAYOUTS)
w = cp.zeros((E, eb), cp.uint8)
x = cp.random.standard_normal((T, hidden), dtype=cp.float32)
for v in sys.argv[1].split(","):
    v = "" if v == "f16" else v
    y = Experts(w, (qt,) * 3, ffn, hidden, tokens=T, variant=v, defines=(f"GQ_ONLY={qt}",))(x)
    cp.cuda.runtime.deviceSynchronize()
    print(f"{E} x {T} {v or 'f16'}: ok, finite {bool(cp.isfinite(y).all())}", flush=True)
PY
( timeout "$(left 79)" python3 -m pytest tests/execute/test_gpu_quant.py -m gpu -v --tb=short -p no:cacheprovider \
    -k "same_bits or routed_batch or tensor_cores or programmatic" > "$D/gpu_tests.log" 2>&1; el gpu_tests_new $?
  timeout "$(left 79)" python3 -m pytest tests/execute/test_gpu_quant.py -m gpu -v --tb=short -p no:cacheprovider \
    -k "not same_bits and not routed_batch and not tensor_cores and not programmatic" >> "$D/gpu_tests.log" 2>&1; el gpu_tests_rest $? ) &
( timeout "$(left 79)" python3 -m pytest tests/execute/test_gpu_expert_types.py -m gpu -v --tb=short -p no:cacheprovider \
    > "$D/gpu_tests_types.log" 2>&1; el gpu_tests_types $? ) &
TESTS2=$!
TESTS=$!
CUDA_LAUNCH_BLOCKING=1 timeout "$(left 57)" python3 /tmp/gq_f16.py f16,_q8m2 120 > "$D/f16_128.log" 2>&1  # (not 2 MiB-aligned)
CUDA_LAUNCH_BLOCKING=1 timeout "$(left 60)" python3 /tmp/gq_f16.py f16,_q8m2 128 >> "$D/f16_128.log" 2>&1  # 306 x 2 MiB exactly
el f16_128_blocking $?
timeout "$(left 68)" compute-sanitizer --tool memcheck --print-limit 8 python3 /tmp/gq_f16.py f16 128 > "$D/sanitizer.log" 2>&1
el sanitizer $?
cat > /tmp/gq_ncu.py <<'PY'
import cupy as cp
from execute import quant as Q
from execute.gpu_quant import Experts
E, T, ffn, hidden, qt = 8, 64, 768, 2048, 8
eb = 2 * ffn * Q.row_bytes(qt, hidden, "", Q.LAYOUTS) + hidden * Q.row_bytes(qt, ffn, "", Q.LAYOUTS)
w = ((cp.arange(E * eb, dtype=cp.uint32) * cp.uint32(2654435761)) >> 26).astype(cp.uint8).reshape(E, eb)
x = cp.random.standard_normal((T, hidden), dtype=cp.float32)
for v in ("_q8m2", "_q8k2"):
    Experts(w, (qt,) * 3, ffn, hidden, tokens=T, variant=v, defines=(f"GQ_ONLY={qt}",))(x)
cp.cuda.runtime.deviceSynchronize()
PY
timeout "$(left 79)" ncu --clock-control none -k "regex:qmoe_(gate_up|down)_q8" -c 4 --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section InstructionStats --section LaunchStats python3 /tmp/gq_ncu.py > "$D/ncu.log" 2>&1
el ncu $?
wait $TESTS $TESTS2 $FULL 2>/dev/null
touch "$D/DONE"
