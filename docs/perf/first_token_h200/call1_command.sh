#!/bin/bash
# helper ttft: first-token breakdown before (0341086) / after (HEAD) on a 4-layer qwen3-30b-a3b Q8_0 synth,
# A/B of the staged expert upload and of MOELAB_GPU_INIT, a thread timeline, cProfile, prefill stages, GPU tests.
export PYTHONUNBUFFERED=1
O="$OUT/ttft"; mkdir -p "$O"; R=$PWD; M=/tmp/ttft4.gguf; BASE=0341086
exec > >(tee "$O/log.txt") 2>&1
t0=$SECONDS
timeout 45 python3 -m moelab model synth $M --preset qwen3-30b-a3b --vocab 32000 --quant Q8_0 --layers 4 --quiet || exit 1
echo "synth $((SECONDS - t0)) s"; timeout 10 cat $M > /dev/null
git worktree add --detach /tmp/ttft_base $BASE >/dev/null 2>&1 || git clone -q --no-checkout . /tmp/ttft_base && git -C /tmp/ttft_base checkout -q $BASE || echo "no base tree"
(cd /tmp/ttft_base && python3 -c "import execute, moelab; print('base tree imports', execute.__file__, moelab.__file__)"); nvidia-smi -L; nproc
P="$(timeout 20 python3 -c "from execute.prompt_bench import fit_prompt; from execute.tokenizer import Tokenizer; print(fit_prompt(Tokenizer.from_gguf('$M'), 256)[0])")"
PL="$(timeout 20 python3 -c "from execute.prompt_bench import fit_prompt; from execute.tokenizer import Tokenizer; print(fit_prompt(Tokenizer.from_gguf('$M'), 1024)[0])")"
cat > /tmp/ttft_drv.py <<'PY'
import json, os, sys, threading, time
T0 = time.perf_counter(); EV = []
def wrap(obj, name, label):
    f = getattr(obj, name)
    def w(*a, **k):
        s = time.perf_counter()
        try: return f(*a, **k)
        finally: EV.append((label, threading.current_thread().name, s - T0, time.perf_counter() - T0))
    setattr(obj, name, w)
import execute.gpu_upload as U, execute.first_token as F
U.STAGE_FULL = os.environ.get("TTFT_STAGE", "1") == "1"
if os.environ.get("TTFT_NOWARM"):
    F.GpuInit.warm = lambda self, *a: self._given.set()
if os.environ.get("TTFT_TIMELINE"):
    import execute.model as Mo, execute.backends as B, execute.cli_generate as G, execute.first_token as F
    import cupy_backends.cuda.api.runtime as rt
    for o, n, l in [(U, "register", "register"), (U.Staged, "put", "staged.put"), (U.Staged, "put_rows", "staged.put_rows"),
                    (U.Staged, "close", "staged.close"), (U.ExpertLoad, "_main", "expert_load"), (Mo.MoeModel, "__init__", "MoeModel"),
                    (Mo.MoeModel, "warm_up", "warm_up"), (Mo.MoeModel, "_decode_plans", "decode_plans"), (B.EngineExperts, "__init__", "backend"),
                    (B.EngineExperts, "prepare", "prepare"), (G, "build_capacity", "build_capacity"), (G, "run_policy", "run_policy"),
                    (F, "precompile_kernels", "precompile"), (rt, "hostRegister", "hostRegister"),
                    (U.Staged, "_fill", "staged.fill"), (U.Staged, "_switch", "staged.switch"), (U.Staged, "__init__", "staged.init"),
                    (Mo.MoeModel, "_dense_layer", "dense_layer"), (Mo.MoeModel, "_attention", "attention"), (Mo.MoeModel, "_route", "route"),
                    (Mo.MoeModel, "_rms", "rms"), (Mo.MoeModel, "_proj", "proj"), (Mo.MoeModel, "_token_fast", "token_fast"),
                    (F.GpuInit, "_main", "gpu_init")]:
        try: wrap(o, n, l)
        except Exception as e: print("no wrap", l, e, file=sys.stderr)
    import execute.gpu_dense as D, execute.token_graph as TG, execute.gguf_model as GM, execute.tokenizer as TK, cupy.cuda.compiler as CC
    for o, n, l in [(D.GpuDense, "capture", "gd.capture"), (TG.TokenGraph, "_build", "tg.build"), (TG.TokenGraph, "_launches", "tg.launches"),
                    (D, "stack_matrices", "stack_matrices"), (GM, "load_model", "load_model"), (TK.Tokenizer, "from_gguf", "tokenizer"),
                    (CC, "_compile_module_with_cache", "cupy.compile_cache"), (CC, "compile_using_nvrtc", "cupy.NVRTC"),
                    (B.EngineExperts, "start_prepare", "start_prepare"), (G, "make_backend", "make_backend")]:
        try: wrap(o, n, l)
        except Exception as e: print("no wrap", l, e, file=sys.stderr)
    fin = U.ExpertLoad.finish
    def finish(self, moe):
        try: return fin(self, moe)
        finally: EV.extend((f"stamp:{k}", "moelab-expert-load", v - T0, v - T0) for k, v in self.stamps.items())
    U.ExpertLoad.finish = finish
from execute.cli_run import run_main
rc = run_main(sys.argv[1:])
if os.environ.get("TTFT_TIMELINE"):
    json.dump({"events": EV}, open(os.environ["TTFT_TIMELINE"], "w"))
sys.exit(rc)
PY
A=(run $M -p "$P" --raw -n 4 --policy gpu --json --quiet --threads $(( $(nproc) > 1 ? $(nproc) - 1 : 1 )))  # as the peer benchmark's
run() { local tag=$1; shift; timeout 25 "$@" > "$O/$tag.json" 2> "$O/$tag.err"; echo "$tag rc=$? $((SECONDS - t0)) s"; }
run base_r0 bash -c "cd /tmp/ttft_base && python3 -m moelab ${A[*]@Q}"
run new_r0 python3 -m moelab "${A[@]}"
L=(run $M -p "$PL" --raw -n 2 --policy gpu --json --quiet)
for r in 1 2; do
  run base_r$r bash -c "cd /tmp/ttft_base && python3 -m moelab ${A[*]@Q}"
  run new_r$r python3 -m moelab "${A[@]}"
  TTFT_STAGE=0 MOELAB_GPU_INIT=0 run register_r$r python3 /tmp/ttft_drv.py "${A[@]:1}"  # = 0341086's start-up
  MOELAB_GPU_INIT=0 run staged_r$r python3 /tmp/ttft_drv.py "${A[@]:1}"
  [ $r = 1 ] && TTFT_NOWARM=1 run nowarm_r$r python3 /tmp/ttft_drv.py "${A[@]:1}"
  run drvnew_r$r python3 /tmp/ttft_drv.py "${A[@]:1}"
  MOELAB_PREFILL_EARLY=1 run early_r$r python3 -m moelab "${A[@]}"
  [ $r = 1 ] && MOELAB_PREFILL_EARLY=0 run long0_r$r python3 -m moelab "${L[@]}"
  [ $r = 1 ] && MOELAB_PREFILL_EARLY=1 run long1_r$r python3 -m moelab "${L[@]}"
done
TTFT_TIMELINE=$O/timeline_staged.json run tl_staged python3 /tmp/ttft_drv.py "${A[@]:1}"
TTFT_STAGE=0 MOELAB_GPU_INIT=0 TTFT_TIMELINE=$O/timeline_register.json run tl_register python3 /tmp/ttft_drv.py "${A[@]:1}"
run prof timeout 25 python3 -m cProfile -o $O/new.prof -m moelab "${A[@]}"
timeout 15 python3 - "$O" <<'PY' | tee "$O/summary.txt"
import json, sys, glob, os, statistics as st, pstats
o = sys.argv[1]
def load(f):
    t = open(f).read(); i = t.rfind("\n{\n")
    return json.loads(t[i + 1:]) if i >= 0 else None
rows = {}
for f in sorted(glob.glob(f"{o}/*_r[12].json")):
    d = load(f); tag = os.path.basename(f).rsplit("_r", 1)[0]
    if d: rows.setdefault(tag, []).append(d)
if not rows:
    print("no run gave JSON"); sys.exit(0)
keys = ["first_token_s", "prompt_tokens_per_s"] + list(next(iter(rows.values()))[0]["first_token_breakdown"])
print("field".ljust(22) + "".join(t.rjust(11) for t in rows))
for k in keys:
    v = [st.median([(d.get(k) if k in d else d["first_token_breakdown"].get(k)) or 0.0 for d in rows[t]]) for t in rows]
    print(k.ljust(22) + "".join(f"{x:11.3f}" for x in v))
print("digests:", {t: sorted({d["digest"][:12] for d in rows[t]}) for t in rows})
for f in glob.glob(f"{o}/timeline_*.json"):
    ev = json.load(open(f))["events"]; print("\n#", os.path.basename(f))
    agg = {}
    for l, th, a, b in ev:
        g = agg.setdefault((l, th), [0, 0.0, a, b, b - a]); g[0] += 1; g[1] += b - a; g[2] = min(g[2], a); g[3] = max(g[3], b)
    for (l, th), (n, s, a, b, d1) in sorted(agg.items(), key=lambda x: x[1][2]):
        print(f"{l:18s} {th[:22]:22s} n={n:5d} sum={s:7.3f} first_dur={d1:7.3f} start={a:7.3f} last_end={b:7.3f}")
try:
    p = pstats.Stats(f"{o}/new.prof", stream=open(f"{o}/profile.txt", "w"))
    p.sort_stats("cumulative").print_stats(70); p.sort_stats("tottime").print_stats(40)
except Exception as e:
    print("no profile:", e)
PY
[ $((SECONDS - t0)) -lt 100 ] && timeout 30 python3 experiments/bench_prefill_stages.py --gpu --reps 5 --out $O/stages > $O/stages.log 2>&1; echo "stages rc=$? $((SECONDS - t0)) s"
timeout $((145 - (SECONDS - t0) > 20 ? 145 - (SECONDS - t0) : 20)) python3 -m pytest -m gpu -q tests/execute/test_prefill.py::test_an_early_started_chunk_gives_the_same_bits_and_decisions tests/execute/test_prefill_dense.py::test_warm_library_runs_the_shapes_of_a_model_and_leaves_nothing tests/execute/test_gpu_upload.py 2>&1 | tail -15 > $O/tests.log; echo "tests rc=$? $((SECONDS - t0)) s"
git worktree remove --force /tmp/ttft_base >/dev/null 2>&1; touch "$O/END"
