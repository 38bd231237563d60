#!/bin/bash
# prompt (issue: prompt at llama.cpp's speed): where a whole 256-token chunk's host time goes when the
# model has many blocks, and moelab run's first-token breakdown, at HEAD. Total <= 100 s.
# 1. bytecode compiled (as an installed package has it) while two synthetic qwen3-30b-a3b Q8_0 files
#    are written in parallel: 24 and 6 blocks, ffn 64 (real attention/router/vocab shapes, small
#    experts so that the synthesis is short);
# 2. chunk_profile (bench_prefill_stages --model) on both: first chunk after the warm-up, warm
#    chunks, warm with gc.freeze, GC collections, cProfile of a warm chunk (per-block host cost
#    against the number of blocks);
# 3. moelab run --policy gpu on the 24-block file as the peer benchmark runs it, twice at HEAD and
#    twice at 6b0ef9f (interleaved; + one with -X importtime: the imports after the clock), the
#    first-token breakdown;
# 4. whether page-locking host memory on one thread stalls another thread's copies (the start-up's
#    expert registration against the dense upload), by piece size (reg_lock.json);
# 5. GPU tests of the prefill path: chunk dense (after step 2's first file), then batched experts
#    and model chunks with the time left.
# Results: $OUT/prompt/
set -u
export PYTHONUNBUFFERED=1
D="$OUT/prompt"; mkdir -p "$D"
T0=$(date +%s)
tmo() { local r=$(( 98 - ($(date +%s) - T0) )); [ $r -lt 1 ] && r=1; echo $(( $1 < r ? $1 : r )); }  # a step's limit within the total
el() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" | tee -a "$D/times.txt"; }
M24=/tmp/prompt24.gguf; M6=/tmp/prompt6.gguf
timeout $(tmo 40) python3 -m moelab model synth $M24 --preset qwen3-30b-a3b --layers 24 --ffn 64 --vocab 32000 --quant Q8_0 --quiet > "$D/synth24.log" 2>&1 &
S24=$!
timeout $(tmo 20) python3 -m moelab model synth $M6 --preset qwen3-30b-a3b --layers 6 --ffn 64 --vocab 32000 --quant Q8_0 --quiet > "$D/synth6.log" 2>&1
el synth6 $?
timeout $(tmo 12) python3 -m compileall -q -j 4 execute scheduler moelab traces simulate > /dev/null 2>&1
el compileall $?
timeout $(tmo 25) python3 experiments/bench_prefill_stages.py --out "$D/chunks6" --model $M6 --reps 5 > "$D/chunks6.log" 2>&1
el chunks6 $?
timeout $(tmo 20) python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu tests/execute/test_prefill_dense.py > "$D/gpu_tests_dense.log" 2>&1
el gpu_tests_dense $?
wait $S24; el synth24 $?  # (its own limit, 40 s, runs from the start)
timeout $(tmo 5) cat $M24 > /dev/null
timeout $(tmo 20) python3 experiments/bench_prefill_stages.py --out "$D/chunks24" --model $M24 --reps 5 > "$D/chunks24.log" 2>&1
el chunks24 $?
P="$(timeout $(tmo 10) python3 -c "from execute.prompt_bench import fit_prompt; from execute.tokenizer import Tokenizer; print(fit_prompt(Tokenizer.from_gguf('$M24'), 256)[0])")"
TH=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
BASE=6b0ef9f  # the previous session's state, for the same runs side by side
git worktree add --detach /tmp/prompt_base $BASE > /dev/null 2>&1 || echo "no base tree"
A=(run $M24 -p "$P" --raw -n 4 --policy gpu --json --quiet --threads $TH)
for r in 1 2; do
  (cd /tmp/prompt_base && timeout $(tmo 12) python3 -m moelab "${A[@]}" > "$D/run24_base_r$r.json" 2> "$D/run24_base_r$r.err")
  el run24_base_r$r $?
  timeout $(tmo 12) python3 -m moelab "${A[@]}" > "$D/run24_r$r.json" 2> "$D/run24_r$r.err"
  el run24_r$r $?
done
timeout $(tmo 12) python3 -X importtime -m moelab "${A[@]}" > "$D/run24_imp.json" 2> "$D/importtime.txt"
el run24_importtime $?
cat > /tmp/reg_lock.py <<'PYREG'
"""Does cudaHostRegister on one thread stall another thread's copies (the driver's lock)? 8 GiB of
host memory registered in pieces of 1 GiB / 64 MiB / 8 MiB on a thread while the main thread
times 32 MiB H2D copies from a pinned buffer (call + stream sync) back to back."""
import json, threading, time
import numpy as np
import cupy as cp

rt = cp.cuda.runtime
N = 8 << 30
t = time.perf_counter()
host = np.ones(N + (1 << 21), np.uint8)
p0 = (host.ctypes.data + 4095) // 4096 * 4096
touch_s = time.perf_counter() - t
src = cp.cuda.alloc_pinned_memory(32 << 20)
dst = cp.empty(32 << 20, cp.uint8)
s = cp.cuda.Stream(non_blocking=True)


def copy_once():
    t = time.perf_counter()
    rt.memcpyAsync(dst.data.ptr, src.ptr, 32 << 20, 1, s.ptr)
    s.synchronize()
    return time.perf_counter() - t


def stats(lat):
    a = np.array(lat) * 1e3
    return {"n": len(a), "median_ms": float(np.median(a)), "p90_ms": float(np.percentile(a, 90)), "max_ms": float(a.max()),
            "sum_ms": float(a.sum())}


for _ in range(20):
    copy_once()
out = {"touch_s": touch_s, "alone": stats([copy_once() for _ in range(40)])}
for piece in (1 << 30, 64 << 20, 8 << 20):
    regs, res = [], {}

    def reg():
        t = time.perf_counter()
        off = 0
        while off < N:
            n = min(piece, N - off)
            rt.hostRegister(p0 + off, n, 0)
            regs.append(p0 + off)
            off += n
        res["reg_s"] = time.perf_counter() - t

    th = threading.Thread(target=reg)
    lat = []
    t0 = time.perf_counter()
    th.start()
    while th.is_alive():
        lat.append(copy_once())
    th.join()
    wall = time.perf_counter() - t0
    t = time.perf_counter()
    for p in regs:
        rt.hostUnregister(p)
    res.update(unreg_s=time.perf_counter() - t, reg_gbps=N / res["reg_s"] / 1e9, copies=stats(lat),
               copy_gbps_during=len(lat) * (32 << 20) / wall / 1e9)
    out[f"piece_{piece >> 20}MiB"] = res
print(json.dumps(out, indent=1))
PYREG
timeout $(tmo 12) python3 /tmp/reg_lock.py > "$D/reg_lock.json" 2>&1
el reg_lock $?
left=$(( 97 - ($(date +%s) - T0) ))
if [ $left -gt 8 ]; then
  timeout $left python3 -m pytest -q -p no:xdist -p no:cacheprovider -o addopts="" -m gpu -x \
    tests/execute/test_prefill.py > "$D/gpu_tests.log" 2>&1
  el gpu_tests $?
fi
timeout 3 python3 - "$D" <<'PY' > "$D/summary.txt" 2>&1
import glob, json, os, sys
d = sys.argv[1]
for f in sorted(glob.glob(f"{d}/run24_*.json")):
    t = open(f).read(); i = t.rfind("\n{\n")
    if i < 0:
        print(os.path.basename(f), "no JSON"); continue
    j = json.loads(t[i + 1:]); b = j["first_token_breakdown"]
    print(os.path.basename(f), "prompt tok/s %.1f first_token_s %.3f" % (j["prompt_tokens_per_s"], j["first_token_s"]),
          " ".join("%s=%.3f" % (k[:-2], v) for k, v in b.items() if v is not None and v >= 0.005))
rows = []
for l in open(f"{d}/importtime.txt"):
    if l.startswith("import time:") and l.count("|") == 2:
        _, cum, name = l.split("|")
        if cum.strip().isdigit():
            rows.append((int(cum), name.rstrip()))
print("largest cumulative imports (us):")
for c, n in sorted(rows, reverse=True)[:25]:
    print(" ", c, n)
PY
git worktree remove --force /tmp/prompt_base > /dev/null 2>&1
cat "$D/times.txt" "$D/summary.txt"; tail -3 "$D/gpu_tests_dense.log" "$D/gpu_tests.log" 2>/dev/null; cat "$D/reg_lock.json"; head -8 "$D/chunks24/README.md" "$D/chunks6/README.md" 2>/dev/null
