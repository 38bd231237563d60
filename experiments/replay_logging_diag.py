"""Diagnostic, on a GPU machine: do the calibration replay's per-layer logging, or its cache size,
change the engine's host phases?

docs/FIDELITY.md found the checked `lru 25%` / `lru 50%` runs' engine phases (plan, queue, combine)
at 0.67-0.78 of the session calibration's, while configs with CPU experts matched (0.95-1.1). The
calibration replay logs every layer (``replay_engine(..., layer_log)``) and runs lru with a cache of
a fifth of the experts; the checked runs are unlogged. This replays the calibration's own trace in
one process, in interleaved rounds, under lru at the calibration's cache and at half the experts,
and hybrid at 96/256, each logged and unlogged, and prints per layer step the engine's phase
counters (``engine.stats``, kept whether or not the layer is logged) and the median token time.

    python3 experiments/replay_logging_diag.py [--layers 12] [--rounds 3] [--threads 15]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

PHASES = ("host_plan_s", "host_queue_s", "host_combine_s", "input_wait_s")


def one(cp, ctx, policy, opts, slots, logged):
    """Per layer step phase seconds, median token seconds, layers logged (0 when unlogged)."""
    from execute.calibrate import replay_engine
    from execute.engine import ExpertEngine
    from scheduler import Capacity, make_policy

    layers, gx, dense, geo, tokens, x0, threads = ctx
    cap = Capacity.per_layer(geo, slots)
    pol = make_policy(policy, geo, cap, **opts)
    engine = ExpertEngine(layers, cap, threads=threads, use_gpu=True, timeout_s=60, gpu=gx)
    try:
        engine.load_residents(pol.cache.slot)
        replay_engine(cp, engine, pol, tokens[:16], dense, x0)  # as calibration_replay: the cache fills
        st = engine.stats
        s0, n0 = {p: getattr(st, p) for p in PHASES}, st.steps
        recs = [] if logged else None
        _, times, _ = replay_engine(cp, engine, pol, tokens[16:], dense, x0, recs)
        engine.synchronize()
        steps = st.steps - n0
        per = {p: (getattr(st, p) - s0[p]) / steps for p in PHASES}
    finally:
        engine.close()
    return per, float(np.median(times)), len(recs or ())


def main() -> int:
    from execute.calibrate import add_shape_args, build_layers, replay_setup

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    add_shape_args(ap)  # sim_vs_real's and calibrate's model shape
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import cupy as cp

    from execute.gpu_experts import GpuExperts
    from scheduler import Capacity, Geometry

    E = args.experts
    layers = build_layers(np.random.default_rng(args.seed), args.layers, E, args.hidden, args.ffn, distinct=2)
    geo = Geometry((E,) * args.layers, args.top_k, (layers[0].expert_bytes,) * args.layers)
    gx = GpuExperts(layers, Capacity.per_layer(geo, E // 2), scratch_slots=16, pinned=True, timeout_s=120)
    _, tokens, dense, x0 = replay_setup(cp, gx, layers, args, None)  # the calibration replay's trace and input
    ctx = (layers, gx, dense, geo, tokens, x0, args.threads)
    cells = [(p, o, s, lg) for p, o, s in (("lru", {}, E // 5), ("lru", {}, E // 2),
                                           ("hybrid", {"adaptive": True, "miss_frac_256": 96}, E // 5))
             for lg in (True, False)]
    got = {c[:1] + (c[2], c[3]): [] for c in cells}
    one(cp, ctx, "lru", {}, E // 5, True)  # warm-up: kernels, pools
    for r in range(args.rounds):
        for p, o, s, lg in (cells if r % 2 == 0 else cells[::-1]):
            got[(p, s, lg)].append(one(cp, ctx, p, o, s, lg))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    gx.close()
    print("policy  slots  logged | us per layer step: " + " ".join(f"{p[:-2]:>12}" for p in PHASES) + " | token ms")
    for (p, s, lg), runs in got.items():
        med = {ph: 1e6 * float(np.median([r[0][ph] for r in runs])) for ph in PHASES}
        tok = 1e3 * float(np.median([r[1] for r in runs]))
        print(f"{p:<7} {s:>5}  {'yes' if lg else 'no':>6} | {'':19}" + " ".join(f"{med[ph]:12.1f}" for ph in PHASES)
              + f" | {tok:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
