"""Q4_1 files as llamacpp_more_types.py writes them (the same quants and d), but with each block's
offset m set to -7.5 d, centring the weights (the synthetic blocks have m = d, so w = d (q + 1) > 0),
checked against llama.cpp as the default check does:

    python docs/perf/cpu_avx2_host/llamacpp_q4_1_centred.py OUT qwen3moe,qwen2moe,olmoe,llama,granitemoe,gpt-oss,deepseek2
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import numpy as np
from execute import llamacpp_check as lc, synth
orig = synth.random_blocks
def centred(rng, qtype, rows, cols, std):
    out = orig(rng, qtype, rows, cols, std)
    if qtype.upper() == "Q4_1":
        b = out.reshape(-1, 20)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        b[:, 2:4] = (-7.5 * d).astype(np.float16).view(np.uint8)
    return out
synth.random_blocks = centred
lc.LIMITS.setdefault("Q4_1", 1e-3)
cache = Path.home() / ".cache" / "moelab" / "llamacpp"
config = {"archs": sys.argv[2].split(","), "quants": ["Q4_1"], "mla": ["split"], "dense_quant": "F16", "seed": 0,
          "tokens": len(lc.TOKENS), "extra_bufts": "auto"}
sys.exit(lc.check(lc.site(cache, "0.3.36"), Path(sys.argv[1]), config))
