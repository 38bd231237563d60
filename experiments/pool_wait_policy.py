"""How the OpenMP wait policy of the Numba CPU pool trades the pool's per-call cost against the
engine's own thread.

The pool sets ``OMP_WAIT_POLICY=PASSIVE`` (execute/cpu_experts.py): its threads sleep as soon as a
parallel region ends, and each of a call's two regions (gate/up, then down) wakes them again. A
spinning team (``ACTIVE``, or libgomp's default) wakes at once but takes cores from the engine's
thread between calls. ``GOMP_SPINCOUNT=N`` spins N iterations, then sleeps: the down region can
find the team still awake after gate/up, while between layer calls the team sleeps.

Each setting runs in its own process (the OpenMP runtime reads the variables when it loads) on the
same layer, side by side, in interleaved rounds:

- ``call``: one call (``run_experts``, ``--experts`` experts, one token each) on the calling
  thread after an idle gap of ``--gap-us`` spent in Python on the main thread (as the engine
  issues GPU work between layer calls), median microseconds;
- ``gap``: the measured length of that gap's fixed Python work (``--gap-us`` long when nothing
  else runs): how much the team slows a Python thread working beside it;
- ``pool``: submit -> result through ``CpuExpertPool`` (hand-off to the pool's thread included),
  after the same gap.

    python experiments/pool_wait_policy.py [--threads T] [--hidden 2048 --ffn 768] [--rounds 3]

Prints each setting's medians and their ratio to PASSIVE. Results depend on the machine: run it
where the executor runs (on a 2-core VM the spinning team and the main thread share the cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

SETTINGS = {"PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin 1e3": {"GOMP_SPINCOUNT": "1000"},
            "spin 1e4": {"GOMP_SPINCOUNT": "10000"}, "spin 1e5": {"GOMP_SPINCOUNT": "100000"},
            "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"}}


def _busy(n: int) -> float:
    """``n`` steps of a Python loop; returns the seconds they took."""
    import time

    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return time.perf_counter() - t0


def _steps_per_us() -> float:
    """The Python loop's rate on this thread with nothing else running (before the team starts)."""
    return 200_000 / (1e6 * min(_busy(200_000) for _ in range(5)))


def child(a) -> dict:
    """Measure one setting in this process (see the module docstring)."""
    import time

    import numba

    from execute import cpu_experts as C
    from execute.cpu_pool import CpuExpertPool
    from execute.calibrate import build_layers

    steps = int(a.gap_us * _steps_per_us())  # the gap's Python work, fixed before any pool thread exists
    layer = build_layers(np.random.default_rng(0), 1, max(a.experts, 8), a.hidden, a.ffn, distinct=1)[0]
    views = (C.tensor_views(layer.gate), C.tensor_views(layer.up), C.tensor_views(layer.down))
    x = np.random.default_rng(1).standard_normal((a.experts, a.hidden)).astype(np.float32)
    experts = list(range(a.experts))
    numba.set_num_threads(a.threads)
    C.run_experts(layer, experts, x, a.threads, views)  # compile (cached) and start the team
    call, gap, pool = [], [], []
    with CpuExpertPool(a.threads) as p:
        p.warmup(layer)
        for _ in range(a.calls):
            gap.append(_busy(steps))
            t0 = time.perf_counter()
            C.run_experts(layer, experts, x, a.threads, views)
            call.append(time.perf_counter() - t0)
            _busy(steps)
            t0 = time.perf_counter()
            p.submit(layer, experts, x).result()
            pool.append(time.perf_counter() - t0)
    skip = a.calls // 10
    med = lambda v: 1e6 * float(np.median(v[skip:]))  # noqa: E731
    return {"call_us": med(call), "gap_us": med(gap), "pool_us": med(pool), "layer": numba.threading_layer()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--experts", type=int, default=2, help="CPU experts per call (one token each)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--gap-us", type=float, default=200.0, help="Python work on the main thread between calls")
    ap.add_argument("--calls", type=int, default=300, help="calls per setting and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the settings")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if a.threads < 1 or a.experts < 1 or a.calls < 10 or a.rounds < 1 or a.gap_us < 0:
        ap.error("--threads, --experts and --rounds must be >= 1, --calls >= 10, --gap-us >= 0")
    got: dict[str, list[dict]] = {k: [] for k in SETTINGS}
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    argv = [sys.executable, __file__, "--threads", str(a.threads), "--experts", str(a.experts), "--hidden",
            str(a.hidden), "--ffn", str(a.ffn), "--gap-us", str(a.gap_us), "--calls", str(a.calls)]
    for r in range(a.rounds):
        names = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
        for name in names:
            env = {**base, **SETTINGS[name], "PYTHONPATH": os.pathsep.join(filter(None, [
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))), base.get("PYTHONPATH")]))}
            done = subprocess.run(argv + ["--child", name], env=env, capture_output=True, text=True)
            if done.returncode:
                print(f"pool_wait_policy: {name}: child failed:\n{done.stderr}", file=sys.stderr)
                return 2
            got[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    layer = got["PASSIVE"][0]["layer"]
    print(f"{a.experts} experts x 1 token, hidden {a.hidden}, ffn {a.ffn}, Q8_0, {a.threads} threads, "
          f"threading layer {layer}; gap {a.gap_us:.0f} us of Python between calls; medians over {a.rounds} rounds")
    print(f"{'setting':<10} {'call us':>9} {'pool us':>9} {'gap us':>8} | vs PASSIVE: call  pool   gap")
    ref = {k: float(np.median([g[k] for g in got["PASSIVE"]])) for k in ("call_us", "pool_us", "gap_us")}
    for name, runs in got.items():
        m = {k: float(np.median([g[k] for g in runs])) for k in ref}
        print(f"{name:<10} {m['call_us']:9.1f} {m['pool_us']:9.1f} {m['gap_us']:8.1f} |             "
              f"{m['call_us'] / ref['call_us']:.2f}  {m['pool_us'] / ref['pool_us']:.2f}  {m['gap_us'] / ref['gap_us']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
