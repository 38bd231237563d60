"""Layer-steps decided per second by the scheduler, on one core, per policy.

A 48-layer, 128-expert, top-8 synthetic trace (traces.synth's qwen3-30b-a3b preset) is driven
through each policy with no timing, side by side in one process: the decision loop alone
(scheduler.drive: plan, commit, completions, background work), and again with an Audit observing
every item (what a backend adds to count hits and bytes). ``hybrid-cost`` prices its decisions
with the cost model of the qwen3-30b-a3b preset on ``--hardware`` (scheduler.costs), its floor
tuned by shadow policies (on its default ``shadow_layers`` of the 48 layers).

The last column is the executor's whole host loop per layer step when a token graph computed
every token (GPU stubbed): execute.driver.run over the trace's routes as settled steps
(execute.driver.settled_steps, as TokenGraph.steps yields them), with the audit, and
ExpertEngine.settle_layer carrying out each decision (its copies not queued). ``gpu`` runs with
every expert resident.

``--base REV``: the decision loop alone of lru, hybrid, static, gpu and cpu under the scheduler (and
traces) of git revision REV and under this tree, each in its own process, alternated ``--repeats``
times on the same trace; prints both speeds, their ratio and whether the decisions are the same
(a digest of every decision).

Usage: python experiments/bench_scheduler.py [--tokens N] [--slots S] [--repeats R] [--hardware H] [--json]
       python experiments/bench_scheduler.py --base REV [--tokens N] [--slots S] [--repeats R]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from scheduler import Audit, Capacity, Geometry, Profile, Token, drive, make_policy, replay


def synthetic_tokens(num_tokens: int, seed: int) -> list[Token]:
    """The traces.synth qwen3-30b-a3b preset (calibrated to published 48x128 top-8 LRU hit rates)."""
    from traces import synth

    preset = synth.PRESETS["qwen3-30b-a3b"]
    trace = synth.generate(48, 128, 8, num_tokens, preset.params, np.random.default_rng(seed))
    return list(trace.tokens())


class _GraphModel:
    """A model all of whose tokens a token graph computed: each token's steps are the trace's routes
    (random router weights) as ``settled_steps`` yields them after a graph's read-back."""

    step_done = False
    router_predictor = token_graph = None

    def __init__(self, tokens: list[Token], seed: int):
        rng = np.random.default_rng(seed)
        self.ids = [np.array([s.experts for s in t.steps], np.int64) for t in tokens]
        self.w = [rng.random(a.shape, dtype=np.float32) for a in self.ids]
        self.info = SimpleNamespace(num_layers=len(tokens[0].steps))
        self.rows = [None] * self.info.num_layers
        self.pos = 0

    def reset(self) -> None:
        self.pos = 0

    def chunk_steps(self, ids, routes, all_logits, rollback):
        from execute.driver import settled_steps

        a, w = self.ids[self.pos], self.w[self.pos]
        self.pos += 1
        return settled_steps(self, a, w, a.tolist(), w.astype(np.float64).tolist(), self.rows)


def executor_loop(policy, tokens: list[Token], geometry: Geometry, model: _GraphModel) -> None:
    """execute.driver.run over ``tokens`` with every step settled (``_GraphModel``) by an expert
    engine without a GPU (its copies into slots are not queued), audited as the executor does."""
    from execute.driver import TokenInput, run
    from execute.engine import ExpertEngine, LayerStats

    engine = ExpertEngine.__new__(ExpertEngine)  # settle_layer's state only: no GPU, no CPU pool
    noop = lambda *a: None  # noqa: E731
    engine.stats, engine.slot_of = LayerStats(), dict(policy.cache.slot)
    engine.gpu = SimpleNamespace(begin_copies=noop, upload=noop, compute_after_copies=noop)
    backend = SimpleNamespace(settle_layer=engine.settle_layer, start_background=noop, await_background=noop)
    model.reset()
    inputs = [TokenInput(t.index, 0, t.index, "decode", 0) for t in tokens]
    run(model, backend, policy, inputs, audit=Audit(geometry))


BASE_POLICIES = ("lru", "hybrid", "static", "gpu", "cpu")


def decide_only(args) -> dict:
    """Per policy of BASE_POLICIES: layer-steps decided per second (best of ``--repeats``, the
    decision loop alone) and a digest of every decision, under whichever scheduler imports."""
    tokens = synthetic_tokens(args.tokens, args.seed)
    geometry = Geometry.uniform(48, 128, 8, 5_000_000)
    capacity, full = Capacity.per_layer(geometry, args.slots), Capacity.per_layer(geometry, 128)
    counts = np.zeros((48, 128))
    for t in tokens:
        for s in t.steps:
            counts[s.layer, list(s.experts)] += 1
    profile, steps, out = Profile.from_counts(counts), sum(len(t.steps) for t in tokens), {}
    for name in BASE_POLICIES:
        options = {"profile": profile} if name == "static" else {}
        best, digest = float("inf"), hashlib.sha256()
        for r in range(args.repeats):
            policy = make_policy(name, geometry, full if name == "gpu" else capacity, **options)
            t0 = time.process_time()
            for _ in drive(policy, tokens):
                pass
            best = min(best, time.process_time() - t0)
        for item in drive(make_policy(name, geometry, full if name == "gpu" else capacity, **options), tokens):
            d = getattr(item, "decision", None)
            digest.update(repr((type(item).__name__, tuple(d)[1:] if d is not None else getattr(item, "moves", ()))).encode())
        out[name] = {"layer_steps_per_s": steps / best, "digest": digest.hexdigest()[:16]}
    return out


def compare_base(args) -> None:
    """``--base``: decide_only under REV's scheduler and this tree's, alternated in child processes."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.base, "scheduler", "traces"], cwd=repo, capture_output=True)
        if archive.returncode:
            sys.exit(f"--base: git archive {args.base!r} failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        trees, best, digests = {"base": tmp, "this": str(repo)}, {}, {}
        cmd = [sys.executable, __file__, "--decide-only", "--repeats", "1", "--tokens", str(args.tokens),
               "--slots", str(args.slots), "--seed", str(args.seed)]
        for _ in range(args.repeats):
            for tree, path in trees.items():
                env = dict(os.environ, PYTHONPATH=path)
                res = json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True, text=True).stdout)
                for name, r in res.items():
                    best[tree, name] = max(best.get((tree, name), 0.0), r["layer_steps_per_s"])
                    digests[tree, name] = r["digest"]
    print(f"decision loop, layer-steps/s ({args.tokens} tokens x 48 layers, top-8, {args.slots} slots/layer), "
          f"best of {args.repeats} alternated runs, one core (process CPU time)")
    print(f"  {'policy':<8} {args.base[:12]:>12} {'this tree':>12} {'ratio':>7}  same decisions")
    for name in BASE_POLICIES:
        b, t = best["base", name], best["this", name]
        same = "yes" if digests["base", name] == digests["this", name] else "NO"
        print(f"  {name:<8} {b:>12,.0f} {t:>12,.0f} {t / b:>6.2f}x  {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=32, help="cache slots per layer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default="h200-xeon16", help="hardware preset or file for hybrid-cost's cost model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--base", help="git revision whose scheduler to time beside this tree's")
    ap.add_argument("--decide-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1 or not 8 <= args.slots <= 128:
        ap.error("--tokens and --repeats must be >= 1, --slots in 8..128")
    if args.decide_only:
        print(json.dumps(decide_only(args)))
        return
    if args.base:
        compare_base(args)
        return
    from simulate import load_hardware, load_model
    from scheduler.costs import Costs

    cost_model = Costs(load_model("qwen3-30b-a3b"), load_hardware(args.hardware)).cost_model()
    tokens = synthetic_tokens(args.tokens, args.seed)
    geometry = Geometry.uniform(48, 128, 8, 5_000_000)
    capacity = Capacity.per_layer(geometry, args.slots)
    steps = sum(len(t.steps) for t in tokens)
    counts = np.zeros((48, 128))
    for t in tokens:
        for s in t.steps:
            counts[s.layer, list(s.experts)] += 1
    profile = Profile.from_counts(counts)

    full = Capacity.per_layer(geometry, 128)

    def policy(name):
        options = {"profile": profile} if name == "static" else {"cost_model": cost_model} if name == "hybrid-cost" else {}
        return make_policy(name, geometry, full if name == "gpu" else capacity, **options)

    def decide(name):  # the decision loop alone: plan, commit, completions, background work
        for _ in drive(policy(name), tokens):
            pass

    def audited(name):  # the same, with every item observed by an Audit (as backends do)
        return replay(policy(name), tokens, audit=Audit(geometry, keep_records=False))

    names = ("gpu", "hybrid", "lru", "static", "cpu", "hybrid-cost")
    times = {(n, k): float("inf") for n in names for k in ("decide", "audited", "executor")}
    hit = {}
    graph_model = _GraphModel(tokens, args.seed)
    for _ in range(args.repeats):  # interleaved, so that other load hits every policy alike
        for name in names:
            t0 = time.process_time()
            decide(name)
            t1 = time.process_time()
            hit[name] = audited(name).summary()["hit_rate"]
            t2 = time.process_time()
            executor_loop(policy(name), tokens, geometry, graph_model)
            t3 = time.process_time()
            times[name, "decide"] = min(times[name, "decide"], t1 - t0)
            times[name, "audited"] = min(times[name, "audited"], t2 - t1)
            times[name, "executor"] = min(times[name, "executor"], t3 - t2)
    results = {n: {"layer_steps_per_s": steps / times[n, "decide"],
                   "with_audit_layer_steps_per_s": steps / times[n, "audited"],
                   "executor_us_per_layer_step": 1e6 * times[n, "executor"] / steps, "hit_rate": hit[n]} for n in names}
    out = {"tokens": args.tokens, "layer_steps": steps, "slots_per_layer": args.slots, "policies": results,
           "hybrid_over_lru": results["hybrid"]["layer_steps_per_s"] / results["lru"]["layer_steps_per_s"],
           "hybrid_cost_time_over_hybrid": times["hybrid-cost", "decide"] / times["hybrid", "decide"]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{steps} layer-steps ({args.tokens} tokens x 48 layers, top-8, {args.slots} slots/layer), "
              f"best of {args.repeats}, one core (process CPU time)")
        print(f"  {'policy':<11} {'decided/s':>12} {'with audit/s':>13} {'executor us/step':>17}   hit rate")
        for name, r in results.items():
            print(f"  {name:<11} {r['layer_steps_per_s']:>12,.0f} {r['with_audit_layer_steps_per_s']:>13,.0f} "
                  f"{r['executor_us_per_layer_step']:>17.2f}   {r['hit_rate']:.3f}")
        print(f"  hybrid/lru speed ratio {out['hybrid_over_lru']:.2f}; "
              f"hybrid-cost planning time {out['hybrid_cost_time_over_hybrid']:.2f}x hybrid's")

if __name__ == "__main__":
    main()
