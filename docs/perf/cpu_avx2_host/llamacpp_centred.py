"""Q4_1 or Q5_K files as llamacpp_more_types.py writes them (the same quants, scales and d), but with
their offsets centring the weights, checked against llama.cpp as the default check does. The
synthetic blocks (quant.random_blocks) set every f16 field to d: Q4_1's m = d, so w = d (q + 1) > 0;
Q5_K's dmin = d, so w = d (sc q - m) has mean ~15.5 d sc - d m > 0. Centred: Q4_1 m = -7.5 d (each
block's mean 0); Q5_K dmin = 15.5 d (a sub-block's mean 15.5 d (sc - m): 0 on average, sc and m
being independent and alike).

    python docs/perf/cpu_avx2_host/llamacpp_centred.py Q4_1 OUT qwen3moe,qwen2moe,olmoe,llama,granitemoe,gpt-oss,deepseek2
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import numpy as np
from execute import llamacpp_check as lc, synth

QTYPE, OUT, ARCHS = sys.argv[1].upper(), sys.argv[2], sys.argv[3].split(",")
BLOCK, FACTOR = {"Q4_1": (20, -7.5), "Q5_K": (176, 15.5)}[QTYPE]  # block bytes; the f16 at byte 2 = FACTOR x d
orig = synth.random_blocks


def centred(rng, qtype, rows, cols, std):
    out = orig(rng, qtype, rows, cols, std)
    if qtype.upper() == QTYPE:
        b = out.reshape(-1, BLOCK)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        b[:, 2:4] = (FACTOR * d).astype(np.float16).view(np.uint8)
    return out


synth.random_blocks = centred
lc.LIMITS.setdefault(QTYPE, 1e-3)
cache = Path.home() / ".cache" / "moelab" / "llamacpp"
config = {"archs": ARCHS, "quants": [QTYPE], "mla": ["split"], "dense_quant": "F16", "seed": 0,
          "tokens": len(lc.TOKENS), "extra_bufts": "auto"}
sys.exit(lc.check(lc.site(cache, "0.3.36"), Path(OUT), config))
