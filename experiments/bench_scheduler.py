"""Layer-steps decided per second by the scheduler, on one core, for hybrid and lru.

A 48-layer, 128-expert, top-8 synthetic trace (traces.synth's qwen3-30b-a3b preset when
available) is replayed through scheduler.replay with no timing; each policy runs in the same
process, side by side. Usage: python experiments/bench_scheduler.py [--tokens N] [--slots S] [--json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from scheduler import Audit, Capacity, Geometry, Token, make_policy, replay


def synthetic_tokens(num_tokens: int, seed: int) -> list[Token]:
    """The traces.synth qwen3-30b-a3b preset (calibrated to ANCHORS.md's 48x128 LRU figures)."""
    from traces import synth

    preset = synth.PRESETS["qwen3-30b-a3b"]
    trace = synth.generate(48, 128, 8, num_tokens, preset.params, np.random.default_rng(seed))
    return list(trace.tokens())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=32, help="cache slots per layer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tokens = synthetic_tokens(args.tokens, args.seed)
    geometry = Geometry.uniform(48, 128, 8, 5_000_000)
    capacity = Capacity.per_layer(geometry, args.slots)
    steps = sum(len(t.steps) for t in tokens)
    results = {}
    for name in ("hybrid", "lru", "static", "cpu"):
        best = float("inf")
        for _ in range(args.repeats):
            kw = {}
            if name == "static":
                from scheduler import Profile

                counts = np.zeros((48, 128))
                for t in tokens:
                    for s in t.steps:
                        counts[s.layer, list(s.experts)] += 1
                kw["profile"] = Profile.from_counts(counts)
            policy = make_policy(name, geometry, capacity, **kw)
            audit = Audit(geometry, keep_records=False)
            t0 = time.process_time()
            replay(policy, tokens, audit=audit)
            best = min(best, time.process_time() - t0)
        results[name] = {"layer_steps_per_s": steps / best, "hit_rate": audit.summary()["hit_rate"]}
    out = {"tokens": args.tokens, "layer_steps": steps, "slots_per_layer": args.slots, "policies": results,
           "hybrid_over_lru": results["hybrid"]["layer_steps_per_s"] / results["lru"]["layer_steps_per_s"]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{steps} layer-steps ({args.tokens} tokens x 48 layers, top-8, {args.slots} slots/layer), best of {args.repeats}, one core (process CPU time)")
        for name, r in results.items():
            print(f"  {name:<7} {r['layer_steps_per_s']:>10,.0f} layer-steps/s   hit rate {r['hit_rate']:.3f}")
        print(f"  hybrid/lru speed ratio {out['hybrid_over_lru']:.2f}")


if __name__ == "__main__":
    main()
