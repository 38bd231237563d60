# profile call: where does moelab run's time go (gpu and cpu policies), pool spin before/after
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
M=/tmp/m8.gguf
python3 -m scheduler model synth $M --preset qwen3-30b-a3b --layers 8 --vocab 32000 --quant Q8_0 --quiet || exit 1
P="$(python3 -c 'print(" ".join(["the quick brown fox jumps over the lazy dog"]*28))')"
R="python3 -m scheduler run $M -p \"\$P\" --threads 15 --json --raw"
run() { name=$1; shift; timeout 120 "$@" > $OUT/$name.json 2>/dev/null; python3 - $OUT/$name.json $name <<'PY'
import json, sys
t = open(sys.argv[1]).read(); d = json.loads(t[t.index("\n{") + 1:])
print(sys.argv[2], {k: round(d[k], 3) for k in ("prompt_tokens_per_s", "decode_tokens_per_s", "first_token_s", "hit_rate") if k in d})
PY
}
run warm python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 4 --policy cpu
run gpu python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 128 --policy gpu
run gpu_nograph env MOELAB_CUDA_GRAPHS=0 python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 128 --policy gpu
run cpu_spin100 python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 64 --policy cpu
run cpu_spin2000 env MOELAB_POOL_SPIN_US=2000 python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 64 --policy cpu
run lru python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 64 --policy lru --cache-mib 680
run hybrid_spin2000 env MOELAB_POOL_SPIN_US=2000 python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 64 --policy hybrid --cache-mib 680
run hybrid python3 -m scheduler run $M -p "$P" --threads 15 --json --raw -n 64 --policy hybrid --cache-mib 680
python3 -m cProfile -o /tmp/prof_gpu.out -m scheduler run $M -p "$P" --threads 15 --raw -n 128 --policy gpu --prefill-chunk 256 > /dev/null 2>&1
MOELAB_POOL_SPIN_US=2000 python3 -m cProfile -o /tmp/prof_cpu.out -m scheduler run $M -p "$P" --threads 15 --raw -n 64 --policy cpu > /dev/null 2>&1
for p in gpu cpu; do python3 -c "
import pstats; s = pstats.Stats('/tmp/prof_$p.out'); s.sort_stats('tottime').print_stats(28)" > $OUT/prof_$p.txt 2>&1; done
head -c 5000 $OUT/prof_gpu.txt | tail -c 3800
for s in 100 2000; do MOELAB_POOL_SPIN_US=$s timeout 60 python3 experiments/bench_cpu_experts.py --threads 15 --types Q8_0 --per-core '' 2>/dev/null | tail -1; done
