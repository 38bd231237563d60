"""The llama.cpp cross-check (execute.llamacpp_check.check) over expert types outside its QUANTS, each
held to the issue's bound, NMSE <= 1e-3, with the default's tie rule, seed, tokens and F16 dense
weights; needs the default build (experiments/llamacpp_check.py build).

    python docs/perf/cpu_avx2_host/llamacpp_more_types.py OUT ARCH[,ARCH] TYPE[,TYPE]
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from execute import llamacpp_check as lc
out, archs, quants = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
for q in quants:
    lc.LIMITS.setdefault(q, 1e-3)
cache = Path.home() / ".cache" / "moelab" / "llamacpp"
config = {"archs": archs, "quants": quants, "mla": ["split"], "dense_quant": "F16", "seed": 0, "tokens": len(lc.TOKENS),
          "extra_bufts": "auto", "cache": str(cache), "version": "0.3.36"}
sys.exit(lc.check(lc.site(cache, "0.3.36"), Path(out), config))
