"""Executor benchmark: cpu, lru, static and hybrid side by side on real kernels, beside the bound.

A Qwen3-30B-A3B-shaped Q8_0 MoE (default 48 layers x 128 experts, hidden 2048, ffn 768, top-8:
5.0 MB per expert, ~31 GB) built in host RAM from random Q8_0 blocks (``--distinct-layers``
distinct layers, the others copies; no GGUF file: loading files is ``moelab replay``'s job), routed
by a synthetic trace, with a fixed GPU stand-in for the dense part of each layer. The GPU expert
cache is capped at ``--cache-mib`` MiB and at ``--cache-frac`` of each layer's experts (the
smaller). ``static`` is pre-placed from a profile of the trace's warm-up tokens; ``hybrid`` is the
scheduler's default without a profile, or with the warm-up profile (``--hybrid-profile warmup``),
once per ``--miss-fracs`` value; ``gpu`` runs with every expert resident (~31 GB at the default
shape), whatever ``--cache-mib``. ``--no-early`` turns off the engine's early start of resident
experts; ``--sync layer`` waits for each layer's GPU work after ``run_layer``, as the model's next
router read-back does (without it a GPU-bound run charges the queue's back-pressure to whichever
host phase waits). ``--engine-variants`` runs hybrid once per engine variant (how background
copies are waited for, where the hand-off's input copy runs); ``--late-start 0,1`` runs every policy
once per ``MOELAB_LATE_START`` value (``gpu_step.LateStart``), in one process. ``--hardware FILE`` gives the
policies that read a cost model the one that file gives this shape (``bench_cost_model``): then
``hybrid-cost`` and ``lookahead`` can run, and ``cost`` in ``--miss-fracs`` runs ``hybrid`` with its
cost-model share. ``--dense-stream caller,compute`` runs each policy with the caller's current
stream on the legacy default stream (the default: events between the two streams a step) and on
the engine's compute stream (``ExpertEngine.on_compute``, as ``execute.driver.run`` decodes with
``MOELAB_DENSE_ON_COMPUTE=1``).
``--rates-from FILE`` reuses an earlier run's rates instead of measuring them. A ``--policies``
entry may carry config fields: ``hybrid-cost:prefetch=4``.

Method, bound and breakdown: ``execute.bench_layers``. Prints the results, hybrid / best non-hybrid
and a per-layer host-time breakdown (hand-off edge columns included); writes
``bench_executor.json``, ``bench_executor.csv`` and ``bench_executor.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from execute.bench_layers import (NO_CPU, Dense, bench_cost_model, build_layers, engine_variant, label, make_trace,
                                  measure_rates, policy_spec, report, run_policy, warmup_profile, write_outputs)
from scheduler.core import Capacity, Geometry
from scheduler.hardware import HardwareError, load_hardware
from scheduler.policies import CONFIGS, POLICIES


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--distinct-layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cache-mib", type=float, default=4096)
    ap.add_argument("--cache-frac", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--policies", default="cpu,lru,static,hybrid")
    ap.add_argument("--miss-fracs", default="16,44,96,160",
                    help="hybrid miss_frac_256 values to run (comma list; 'cost': the cost model's share, --hardware)")
    ap.add_argument("--hardware", default=None, help="hardware preset or file: the policies' cost model")
    ap.add_argument("--hybrid-profile", choices=("none", "warmup"), default="none",
                    help="hybrid's profile: none, or counted on the trace's warm-up tokens")
    ap.add_argument("--sync", choices=("none", "layer", "both"), default="none",
                    help="wait for each layer's GPU work after run_layer (as the model's router read-back "
                         "does): none, layer, or both (each policy run twice)")
    ap.add_argument("--no-early", action="store_true", help="no early start of resident experts (begin_layer)")
    ap.add_argument("--max-fills", default="", help="hybrid max_fills values to run (comma list; empty: its default)")
    ap.add_argument("--engine-variants", default="",
                    help="hybrid runs once per engine variant WAIT:PUT (comma list; device:early = the defaults, "
                         "host:compute = the former path); empty: the defaults, unlabelled")
    ap.add_argument("--late-start", default="",
                    help="run each policy once per MOELAB_LATE_START value (comma list of 0 and 1; empty: the "
                         "environment's)")
    ap.add_argument("--dense-stream", default="caller",
                    help="where the caller's current stream is while a policy runs (the dense stand-in always "
                         "queues on the engine's compute stream): caller (the legacy default stream) and/or "
                         "compute (ExpertEngine.on_compute: no events between streams a step); comma list")
    ap.add_argument("--rates-from", default=None,
                    help="an earlier bench_executor.json whose rates (bound, breakdown) to reuse instead of "
                         "measuring them (saves the set-up's kernel compiles and timing loops)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_executor"))
    args = ap.parse_args(argv)
    try:
        fracs = [f if f == "cost" else int(f) for f in args.miss_fracs.split(",")]
    except ValueError:
        ap.error(f"--miss-fracs: expected integers 0..256 (or 'cost') separated by commas, got {args.miss_fracs!r}")
    try:
        args.fill_caps = [int(f) for f in args.max_fills.split(",") if f] or [None]
    except ValueError:
        ap.error(f"--max-fills: expected integers separated by commas, got {args.max_fills!r}")
    if not all(f == "cost" or 0 <= f <= 256 for f in fracs):
        ap.error(f"--miss-fracs: expected integers 0..256, got {args.miss_fracs!r}")
    args.hw = None
    if args.hardware is not None:
        try:
            args.hw = load_hardware(args.hardware)
        except HardwareError as exc:
            ap.error(f"--hardware: {exc}")
    if "cost" in fracs and args.hw is None:
        ap.error("--miss-fracs: 'cost' needs --hardware (hybrid's cost-model share)")
    try:
        args.specs = [policy_spec(p) for p in args.policies.split(",") if p]
        for name, options in args.specs:  # every name and field checked before the model is built
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
            if options:
                known = {f.name for f in fields(CONFIGS[name])} if name in CONFIGS else set()
                if set(options) - known:
                    raise ValueError(f"policy {name!r}: unknown option {', '.join(sorted(set(options) - known))}")
                CONFIGS[name](**options)
            if name in ("hybrid-cost", "lookahead") and args.hw is None:
                raise ValueError(f"{name} needs --hardware (its cost model)")
    except ValueError as exc:
        ap.error(f"--policies: {exc}")
    if not 1 <= args.distinct_layers <= args.layers:
        ap.error(f"--distinct-layers: expected 1..{args.layers}, got {args.distinct_layers}")
    if args.hidden % 8 or args.warmup < 1 or args.tokens < 1:
        ap.error("--hidden must be a multiple of 8; --warmup and --tokens at least 1")
    args.lates = [v for v in args.late_start.split(",") if v] or [None]
    if not set(args.lates) <= {"0", "1", None}:
        ap.error(f"--late-start: expected 0 and/or 1 separated by commas, got {args.late_start!r}")
    args.dense_streams = [v for v in args.dense_stream.split(",") if v]
    if not args.dense_streams or not set(args.dense_streams) <= {"compute", "caller"}:
        ap.error(f"--dense-stream: expected compute and/or caller separated by commas, got {args.dense_stream!r}")
    args.rates = None
    if args.rates_from is not None:
        try:
            args.rates = json.loads(Path(args.rates_from).read_text())["rates"]
            args.rates["dense_s_per_layer"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--rates-from: {args.rates_from}: expected a bench_executor.json with rates ({exc})")
    variants = [v for v in args.engine_variants.split(",") if v] or [None]
    for v in variants:
        if v is not None:
            try:
                engine_variant(v)
            except ValueError as exc:
                ap.error(f"--engine-variants: {exc}")
    return args, fracs, variants


def main(argv=None) -> int:
    args, fracs, variants = parse(argv)
    import cupy as cp

    from execute.cpu_pool import CpuExpertPool
    from execute.gpu_experts import GpuExperts

    rng = np.random.default_rng(args.seed)
    log(f"building {args.layers} x {args.experts} Q8_0 experts in host RAM")
    layers = build_layers(args, rng)
    eb = layers[0].expert_bytes
    geo = Geometry((args.experts,) * args.layers, args.top_k, (eb,) * args.layers)
    slots = min(Capacity.from_mib(geo, args.cache_mib).pools[0][1], int(args.cache_frac * args.experts))
    cap = Capacity.per_layer(geo, slots)
    log(f"{geo.total_expert_bytes / 1e9:.1f} GB of experts, {eb} B each; cache {slots} slots/layer = "
        f"{cap.slot_bytes(geo) / 2**20:.0f} MiB")
    total = args.warmup + args.tokens
    trace, trace_src = make_trace(args, args.seed + 1, total)
    profile = warmup_profile(trace, args.warmup, slots * args.layers)
    tokens = list(trace.tokens())
    wrng = np.random.default_rng(args.seed + 3)
    routing = [[(trace.expert_ids[t, l].astype(np.int64), wrng.dirichlet(np.ones(args.top_k)).astype(np.float32))
                for l in range(args.layers)] for t in range(total)]
    t0 = time.perf_counter()
    gx = GpuExperts(layers, cap, scratch_slots=16, pinned=True, timeout_s=60)
    pin_s = time.perf_counter() - t0
    log(f"pinned {len(gx.registered)} host buffers in {pin_s:.1f} s (staging: {gx.staging is not None})")
    dense = Dense(cp, args.layers, args.hidden, rng, gx.compute)
    if args.rates is not None:
        rates = args.rates
    elif {p for p, _ in args.specs} <= NO_CPU:  # no CPU work: the pool's rate (and compile) not needed
        rates = measure_rates(cp, layers, gx, None, dense)
    else:
        with CpuExpertPool(args.threads, timeout_s=120) as pool:
            rates = measure_rates(cp, layers, gx, pool, dense)
    log("rates: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items() if isinstance(v, float)))
    runs = [(p, o, profile if p == "static" else None, None) for p, o in args.specs if p != "hybrid"]
    hp = profile if args.hybrid_profile == "warmup" else None
    runs += [("hybrid", o | ({} if f == "cost" else {"miss_frac_256": f}) | ({} if m is None else {"max_fills": m}),
              hp, v) for p, o in args.specs if p == "hybrid" for f in fracs for m in args.fill_caps for v in variants]
    results = []
    syncs = {"none": (False,), "layer": (True,), "both": (False, True)}[args.sync]
    for name, options, prof, variant in runs:
        for sync in syncs:
            for late, where in [(a, b) for a in args.lates for b in args.dense_streams]:
                if late is not None:  # the engine reads MOELAB_LATE_START when it is built
                    os.environ["MOELAB_LATE_START"] = late
                cm = None if args.hw is None else bench_cost_model(args, args.hw, name)
                gx.after_caller()  # (x0 and the set-up's work, queued on the legacy default stream)
                with gx.compute if where == "compute" else contextlib.nullcontext():
                    r = run_policy(cp, name, args, layers, geo, cap, prof, tokens, routing, dense, gx, rates,
                                   options, sync, variant, cm)
                gx.compute.synchronize()
                if late is not None:
                    r["options"] = dict(r["options"], late_start=int(late))
                if len(args.dense_streams) > 1:
                    r["options"] = dict(r["options"], dense=where)
                results.append(r)
                pl = r["per_layer_us"]
                log(f"{label(r)}: {r['tokens_per_s']:.1f} tok/s, hits {r['hit_rate']:.3f}, bound "
                    f"{r['bound_tokens_per_s']:.1f}; host us per layer step: early {pl['host_early_us']:.1f}, plan "
                    f"{pl['host_plan_us']:.1f} (submit {pl['host_submit_us']:.1f}), queue {pl['host_queue_us']:.1f}, "
                    f"sum {pl['host_early_us'] + pl['host_plan_us'] + pl['host_queue_us']:.1f}, combine "
                    f"{pl['host_combine_us']:.1f}")
    gx.close()
    config = {k: v for k, v in vars(args).items() if k not in ("hw", "specs", "rates")}
    config.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), trace=trace_src, slots_per_layer=slots,
                  expert_bytes=eb, total_expert_gb=geo.total_expert_bytes / 1e9, pin_s=pin_s,
                  gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), static_profile="warm-up tokens",
                  hybrid_profile=args.hybrid_profile)
    text, summary = report(results, rates)
    print(text, flush=True)
    write_outputs(Path(args.out), config, rates, results, summary)
    log(f"wrote {args.out}/bench_executor.{{json,csv,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
