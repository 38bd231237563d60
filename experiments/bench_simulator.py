"""Simulated decode tokens per wall-clock second: 48 layers x 128 experts x top-8 (Qwen3-30B-A3B
geometry), ``hybrid`` policy, one core. Prints the simulator (scheduler included) beside the
scheduler alone (``scheduler.replay``) on the same tokens, measured in the same run.

    python experiments/bench_simulator.py [--tokens 2000] [--policy hybrid] [--repeat 3] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from scheduler import Audit, Capacity, drive, make_policy, replay
from simulate import Costs, ExecConfig, Simulator, load_hardware, load_model
from traces import synth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--policy", default="hybrid")
    ap.add_argument("--slots", type=int, default=32, help="cache slots per layer (of 128)")
    ap.add_argument("--hardware", default="rtx4060-laptop")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one simulator run")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    model = load_model("qwen3-30b-a3b")
    geometry = model.geometry()
    trace = synth.generate(model.num_layers, model.num_experts, model.top_k, args.tokens, synth.SynthParams(),
                           np.random.default_rng(0))
    tokens = list(trace.tokens())
    costs = Costs(model, load_hardware(args.hardware), ExecConfig())
    capacity = Capacity.per_layer(geometry, args.slots)

    def sim():
        policy = make_policy(args.policy, geometry, capacity)
        return Simulator(costs).run(drive(policy, tokens), Audit(geometry, keep_records=False))

    def sched():
        policy = make_policy(args.policy, geometry, capacity)
        return replay(policy, tokens, audit=Audit(geometry, keep_records=False))

    def drive_only():
        policy = make_policy(args.policy, geometry, capacity)
        for _ in drive(policy, tokens):
            pass

    items = list(drive(make_policy(args.policy, geometry, capacity), tokens))

    def engine_only():  # the same work items, pre-computed: the simulator's own cost (with the audit)
        return Simulator(costs).run(iter(items), Audit(geometry, keep_records=False))

    runs = (("simulator (scheduler + audit + SimPy)", sim), ("scheduler.replay (scheduler + audit)", sched),
            ("scheduler.drive alone", drive_only), ("simulator on recorded items (no scheduler)", engine_only))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(args.repeat):  # interleaved, so that load from other processes hits all alike
        for name, fn in runs:
            t = time.process_time()  # CPU time of this process: other load on the core is not counted
            fn()
            times[name].append(time.process_time() - t)
    best = {name: min(ts) for name, ts in times.items()}
    n = len(tokens)
    print(f"{model.num_layers} layers x {model.num_experts} experts top-{model.top_k}, policy {args.policy}, "
          f"{args.slots} slots/layer, {n} decode tokens, best of {args.repeat}, one core (process CPU time)")
    for name, s in best.items():
        print(f"  {name:<40} {n / s:9.0f} tokens/s  ({s / (n * model.num_layers) * 1e6:6.1f} us per layer-step)")
    sim_s, eng_s = best["simulator (scheduler + audit + SimPy)"], best["simulator on recorded items (no scheduler)"]
    print(f"  the simulator's own work is {eng_s / sim_s:.0%} of the full run; the scheduler the rest")
    print(f"simulated decode tokens per wall-clock second: {n / sim_s:.0f}")
    if args.profile:
        import cProfile
        import pstats

        cProfile.runctx("sim()", globals(), {"sim": sim}, "/tmp/bench_simulator.prof")
        pstats.Stats("/tmp/bench_simulator.prof", stream=sys.stdout).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
