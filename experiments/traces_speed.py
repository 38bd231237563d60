"""Tokens/s of Trace.tokens alone and of an LRU replay over a synthetic 48x128 top-8 trace.

Usage: python experiments/traces_speed.py [TOKENS]   (prints JSON; ratios are from one run)
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from scheduler import Capacity, make_policy, replay
from traces.synth import PRESETS, generate


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 20000
    p = PRESETS["qwen3-30b-a3b"]
    t = generate(48, 128, 8, n, p.params, np.random.default_rng(0), num_seqs=max(1, n // 129))
    t0 = time.perf_counter()
    count = sum(len(tok.steps) for tok in t.tokens())
    iterate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    count = sum(len(tok.steps) for tok in t.tokens())
    cached_s = time.perf_counter() - t0
    g = t.geometry(1)
    t0 = time.perf_counter()
    hit = replay(make_policy("lru", g, Capacity.per_layer(g, 32)), t.tokens(), lag_tokens=0).summary()["hit_rate"]
    replay_s = time.perf_counter() - t0
    print(json.dumps({"tokens": n, "steps": count, "tokens_per_s_first_pass": n / iterate_s,
                      "tokens_per_s_cached": n / cached_s, "lru32_replay_tokens_per_s": n / replay_s,
                      "lru32_hit_rate": hit}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
