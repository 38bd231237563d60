"""The expert engine's host path per one-token layer step, on any machine: a stand-in for cupy.

The engine (``ExpertEngine`` over ``GpuExperts``) runs a policy's decode steps as
``bench_executor.py`` does, over a stand-in for cupy whose runtime and driver calls are plain
Python functions that count themselves: what is left is the host path's Python work and its count
of runtime calls (each ~0.6-14 us more on the H200's host). Model: ``--layers`` x ``--experts``
small Q8_0 experts routed by the ``traces.synth`` qwen3-30b-a3b preset, ``--slots`` per layer,
top-8, no hand-off (``MOELAB_HANDOFF=0``: the stand-in maps no memory).

Prints, per policy: the engine's host time per layer step (thread CPU time of the fastest of ``--repeats``
passes with the engine's calls minus the fastest without; per-layer launches built before); its
wall-clock phases (bench_executor's columns); calls per step by name, uploads per step, decisions' digest.

``--dense-stream``: the caller's current stream is a stream of its own (``caller``, the default:
events between the two each step) or the engine's compute stream (``compute``, as
``execute.driver.run`` decodes with ``MOELAB_DENSE_ON_COMPUTE=1``).
``--base REV``: the same under REV's ``execute`` / ``scheduler`` / ``traces`` and under this tree,
each in its own process, alternated ``--rounds`` times; the decisions' digests are compared.
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
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine_standin import CALLS, Dev, Handle, counted, current, standin_cupy

def workload(args):
    """The engine's layers (Q8_0, hidden 256, ffn 128), their geometry, the routed tokens (the
    qwen3-30b-a3b synthetic preset, top-8) and the routing weights ``(T, L, 1, 8)``."""
    from execute import quant as Q
    from execute.experts import random_layer
    from scheduler import Geometry
    from traces import synth

    base = random_layer(np.random.default_rng(args.seed), 0, args.experts, 256, 128, Q.Q8_0)
    layers = [replace(base, layer=l) for l in range(args.layers)]
    geo = Geometry((args.experts,) * args.layers, 8, (base.expert_bytes,) * args.layers)
    trace = synth.generate(args.layers, args.experts, 8, args.tokens, synth.PRESETS["qwen3-30b-a3b"].params,
                           np.random.default_rng(args.seed + 1))
    tokens = list(trace.tokens())
    weights = np.random.default_rng(args.seed + 2).dirichlet(np.ones(8), (len(tokens), args.layers, 1))
    return layers, geo, tokens, weights.astype(np.float32)


def run(args) -> dict:
    """Per policy: the engine's host us per step and its calls per step (this process's tree)."""
    os.environ["MOELAB_HANDOFF"] = "0"
    sys.modules["cupy"] = standin_cupy()
    from execute.engine import ExpertEngine
    from execute.gpu_experts import GpuExperts
    from scheduler import Capacity, make_policy

    import execute.gpu_step as S
    copy_plan = getattr(S, "_copy_plan", lambda gx, l: None)  # (a tree from before the plans: nothing)
    layers, geo, tokens, weights = workload(args)
    out = {}
    for name in args.policies.split(","):
        cap = Capacity.per_layer(geo, args.experts if name == "gpu" else args.slots)
        best, bare = None, float("inf")
        for i in range(args.repeats + args.bytecodes):
            for timed in (False, True):  # the pass without the engine's calls, then with them
                pol = make_policy(name, geo, cap)
                gx = GpuExperts(layers, cap, scratch_slots=16, pinned=False)
                gx._batch._fn, gx._batch._fail_idx = counted("memcpyBatchAsync", 0), False
                current(sys.modules["cupy"], gx.compute if args.dense_stream == "compute" else Handle())
                engine = ExpertEngine(layers, cap, threads=1, use_gpu=True, gpu=gx)
                engine.load_residents(pol.cache.slot)
                for l in range(len(layers)):  # the per-layer launches and copy plans (a decode builds them once)
                    gx._one(l), getattr(engine, "_late", None) and engine._late._launch(l)
                    copy_plan(gx, l)
                if i == args.repeats:  # one more pass, counting the engine's bytecodes (--bytecodes)
                    if timed:
                        best["bytecodes"] = bytecodes(lambda: loop(pol, engine, tokens, weights))
                    engine.close()
                    continue
                r = loop(pol, engine if timed else None, tokens, weights)
                engine.close()
                if not timed:
                    bare = min(bare, r["cpu_s"])
                elif best is None or r["cpu_s"] < best["cpu_s"]:
                    best = r
        out[name] = _with_bare(best, bare)
    return out


def bytecodes(run) -> dict:
    """Bytecodes the interpreter ran in ``execute/`` per step during ``run()`` (which returns
    ``loop``'s dict), by file and function, most first (sys.settrace's opcode events)."""
    ops: Counter = Counter()

    def each(frame, event, _):
        if event == "opcode":
            ops[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
        return each

    def enter(frame, *_):
        if f"{os.sep}execute{os.sep}" in frame.f_code.co_filename:
            frame.f_trace_opcodes = True
            return each
        return None

    sys.settrace(enter)
    try:
        steps = run()["steps"]
    finally:
        sys.settrace(None)
    return {k: v / steps for k, v in ops.most_common()}


def _with_bare(r: dict, bare_s: float) -> dict:
    """``r`` (the fastest pass with the engine) with the fastest without it and their difference per step."""
    return dict(r, bare_s=bare_s, cpu_us=1e6 * (r["cpu_s"] - bare_s) / r["steps"])


def loop(pol, engine, tokens, weights) -> dict:
    """One pass of ``pol`` over ``tokens``, the engine's calls made when ``engine`` is given; the
    thread's CPU time of the whole pass and the engine's counters per step."""
    from scheduler.drive import EndToken, RunLayer, drive

    x, state, digest = Dev((1, 256)), {}, hashlib.sha256()

    def forward(tok):
        for step in tok.steps:
            ids = np.array([step.experts], np.int64)
            state["ids"], state["w"] = ids, weights[tok.index][step.layer]
            if engine is not None:
                engine.begin_layer(step.layer, x, ids)
            yield step

    steps = ups = hits = 0
    CALLS.clear()
    t0 = time.thread_time()
    for item in drive(pol, (replace(t, steps=forward(t)) for t in tokens)):
        if isinstance(item, RunLayer):
            if engine is not None:
                engine.run_layer(item, x, state["ids"], state["w"])
            d = item.decision
            steps, ups, hits = steps + 1, ups + len(d.uploads), hits + len(d.hits)
            digest.update(repr(tuple(d)[1:]).encode())
        elif not isinstance(item, EndToken):
            raise SystemExit(f"background moves are not timed here ({type(item).__name__})")
    r = {"steps": steps, "cpu_s": time.thread_time() - t0, "uploads": ups / steps, "hits": hits / steps,
         "digest": digest.hexdigest()[:16], "calls": {k: v / steps for k, v in sorted(CALLS.items())}}
    if engine is not None:
        s = engine.stats
        r.update({k: 1e6 * v / steps for k, v in
                  (("early_us", s.host_early_s), ("plan_us", s.host_plan_s), ("queue_us", s.host_queue_s))})
    return r


def in_both_trees(rev: str, cmd: list[str], rounds: int = 1):
    """Yields ("base" | "this", JSON printed by ``cmd``) run on REV's packages or this tree's, alternated."""
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        arc = subprocess.run(["git", "archive", rev, "execute", "scheduler", "traces"], cwd=repo, capture_output=True)
        if arc.returncode:
            sys.exit(f"--base: git archive {rev!r} failed: {arc.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=arc.stdout, check=True)
        for _ in range(rounds):
            for tree, path in (("base", tmp), ("this", str(repo))):
                env = dict(os.environ, PYTHONPATH=path)
                yield tree, json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True, text=True).stdout)


def compare_base(args) -> dict:
    """``run`` under REV's packages and this tree's, in child processes, alternated."""
    res = {}
    cmd = [sys.executable, __file__, "--json", "--policies", args.policies] + [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("repeats", "tokens", "layers", "experts", "slots", "seed", "dense_stream")] + \
        ["--bytecodes"] * args.bytecodes
    for tree, got in in_both_trees(args.base, cmd, args.rounds):
        for name, r in got.items():
            old = res.get((tree, name), r)
            res[tree, name] = _with_bare(min(r, old, key=lambda v: v["cpu_s"]), min(r["bare_s"], old["bare_s"]))
    return {f"{tree}:{name}": r for (tree, name), r in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="lru,gpu")
    for name, default in (("layers", 48), ("experts", 128), ("tokens", 60), ("repeats", 3), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--slots", type=int, default=32, help="cache slots per layer (gpu: every expert)")
    ap.add_argument("--rounds", type=int, default=2, help="--base: processes per tree, alternated")
    ap.add_argument("--base", help="git revision whose engine to time beside this tree's")
    ap.add_argument("--dense-stream", choices=("caller", "compute"), default="caller",
                    help="the caller's current stream: one of its own, or the engine's compute stream")
    ap.add_argument("--bytecodes", action="store_true", help="also count the engine's bytecodes per step (one more pass)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1 or args.rounds < 1 or args.layers < 1 or not 8 <= args.slots <= args.experts:
        ap.error("--tokens, --repeats, --rounds and --layers must be >= 1, --slots in 8..--experts")
    if not set(args.policies.split(",")) <= {"lru", "gpu"}:
        ap.error(f"--policies: lru and gpu only (no CPU work over the stand-in), got {args.policies!r}")
    res = compare_base(args) if args.base else run(args)
    if args.json:
        return print(json.dumps(res))
    print(f"host us per layer step over a stand-in cupy ({args.layers} layers x {args.experts} experts, top-8, "
          f"{args.slots} slots, {args.tokens} tokens), best of {args.repeats}")
    print(f"  {'run':<14} {'early':>6} {'plan':>6} {'queue':>6} {'sum':>6} {'cpu':>6}  up/step  digest            "
          f"runtime calls per step")
    for key, r in res.items():
        phases = [r["early_us"], r["plan_us"], r["queue_us"]]
        print(f"  {key:<14} " + " ".join(f"{v:>6.2f}" for v in phases + [sum(phases), r["cpu_us"]]) + f"  "
              f"{r['uploads']:>7.2f}  {r['digest']}  {sum(r['calls'].values()):.2f}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["calls"].items()))
        if r.get("bytecodes"):
            top = list(r["bytecodes"].items())
            print(f"  {'':<14} engine bytecodes per step {sum(v for _, v in top):.0f}: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in top[:8]))


if __name__ == "__main__":
    main()
