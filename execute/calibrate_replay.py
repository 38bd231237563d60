"""Calibration replays: a synthetic trace decoded through the expert engine and the dense stand-in
as a replay runs it, to time the host where it shares the machine with the CPU pool.

``replay_engine`` decodes tokens under a policy, optionally logging every layer (decision sizes,
engine phases, CPU job stamps, the host's time between layers); ``calibration_replay`` logs the
calibration workload under lru and hybrid; ``calibration_runs`` times the same workload unlogged
(phase totals, decision totals, seconds per token); ``replay_summary`` reduces both with the fits
of ``calibrate_fit``.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from scheduler.core import Capacity, Geometry
from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from scheduler.policies import make_policy

from .calibrate_fit import replay_between_fields, replay_host_fields, replay_pool_fit, unlogged_host_fields
from .calibrate_measure import PHASES, cpu_layer_parts, synth_tokens
from .standin import StandIn

__all__ = ["replay_engine", "replay_setup", "calibration_replay", "calibration_runs", "decision_totals",
           "stats_delta", "replay_summary", "REPLAY_CONFIGS", "RUN_CONFIGS", "RUN_PHASES", "HYBRID_96",
           "POOL_ONLY", "POOL_TOKENS", "POOL_RUN"]


def replay_engine(cp, engine, policy, tokens, dense, x0, layer_log: list | None = None) -> tuple[list, list, list]:
    """Decode ``tokens`` through ``engine`` under ``policy`` as a replay does: per layer the dense
    stand-in, the router logits read back, ``run_layer`` (equal router weights); per token the
    head and its sampled id read back. No garbage collection inside (collected before).

    Returns (scheduler items, wall seconds per token, the CPU jobs). With ``layer_log`` (a list), appends per
    layer the decision's sizes (``n_gpu``, ``n_up``: uploads + streams, ``n_cpu``), the host time
    of the dense issue (``dense_s``), the engine's phase deltas (``PHASES``), for a layer with
    CPU experts its ``cpu_layer_parts`` (``parts``), and the host's time between layers: in the
    driver producing this step (``sched_s``: the policy's plan and commit, the previous step's
    completions), reading the router logits back (``read_s``, including any wait for the GPU)
    and, after another layer of the same token, from that layer's ``run_layer`` return to this
    one's call (``gap_s``; the logging itself left out)."""
    gx = engine.gpu
    k = policy.geometry.top_k
    w = np.full((1, k), 1.0 / k, np.float32)
    st = engine.stats
    snap = lambda: {p: getattr(st, p) for p in PHASES}
    jobs = []
    submit = engine.pool.submit

    def capture(*a, **kw):  # the engine's CPU jobs, for their stamps
        jobs.append(submit(*a, **kw))
        return jobs[-1]

    engine.pool.submit = capture
    items, times = [], []
    x = x0
    gc.collect()
    gc.disable()  # a collection inside a timed token is noise no model describes
    try:
        with gx.compute:
            t_prev = time.perf_counter()
            t_body = t_prev  # end of the previous item's handling: the driver's time starts there
            t_layer = None  # the previous layer's run_layer return (logging left out), same token only
            for item in drive(policy, tokens):
                t_item = time.perf_counter()
                items.append(item)
                kind = type(item)
                if kind is RunLayer:
                    t_d = time.perf_counter()
                    x, logits = dense.layer(x, item.step.layer)
                    t_r = time.perf_counter()
                    logits.get(stream=gx.compute)  # the router's read-back
                    t_g = time.perf_counter()
                    ids = np.asarray(item.step.experts, np.int64)[None, :]
                    if layer_log is None:
                        x = engine.run_layer(item, x, ids, w[:, :ids.shape[1]])
                        continue
                    t_call = time.perf_counter()
                    n_jobs, s0, t0 = len(jobs), snap(), time.perf_counter()
                    x = engine.run_layer(item, x, ids, w[:, :ids.shape[1]])
                    t1, s1, d = time.perf_counter(), snap(), item.decision
                    rec = {"dense_s": t_r - t_d, "sched_s": t_item - t_body, "read_s": t_g - t_r,
                           "n_gpu": len(d.hits) + len(d.uploads) + len(d.streams),
                           "n_up": len(d.uploads) + len(d.streams), "n_cpu": len(d.cpu),
                           **{p: s1[p] - s0[p] for p in PHASES}}
                    if t_layer is not None:
                        rec["gap_s"] = t_call - t_layer
                    if len(jobs) > n_jobs:
                        rec["parts"] = cpu_layer_parts(t0, t1, rec, jobs[-1])
                        if jobs[-1].gated:  # handed off: its compute time is known once it is done
                            rec["_job"] = jobs[-1]
                    layer_log.append(rec)
                    t_body = t_layer = time.perf_counter()  # from here: the logging is not counted
                    continue
                t_layer = None
                if kind is StartBackground:
                    engine.start_background(item.moves)
                elif kind is AwaitBackground:
                    engine.await_background(item.moves)
                elif kind is EndToken:
                    dense.head(x).get(stream=gx.compute)  # the sampled id's read-back
                    t = time.perf_counter()
                    times.append(t - t_prev)
                    t_prev = t
                    x = x0
                t_body = time.perf_counter()
    finally:
        gc.enable()
        del engine.pool.submit
    if layer_log is not None and any("_job" in r for r in layer_log):
        engine.synchronize()
        for r in layer_log:
            job = r.pop("_job", None)
            if job is not None:
                job.poll()
                r["parts"]["compute"] = job.compute_s
    return items, times, jobs


REPLAY_CONFIGS = (("lru", {}), ("hybrid", {"adaptive": True, "miss_frac_256": 96}), ("cpu", {}))
POOL_ONLY = ("cpu",)  # replayed for the pool's calls of top-k experts only: not in the host-lane fits
POOL_TOKENS = 16  # logged tokens of the POOL_ONLY configs (after 4 unlogged)
HYBRID_96 = {"adaptive": True, "miss_frac_256": 96}
# the unlogged calibration runs: (policy, options, cache as a divisor of the experts per layer)
RUN_CONFIGS = (("lru", {}, 5), ("lru", {}, 2), ("hybrid", HYBRID_96, 5))
POOL_RUN = ("cpu", {}, 5)  # run by sim_vs_real's session beside RUN_CONFIGS: every layer on the pool (not in the
# host-lane fits; simulate.fidelity.fit_lane's CPU-layer term)
RUN_PHASES = ("host_plan_s", "host_queue_s", "host_combine_s", "input_wait_s", "cpu_wait_s")


def replay_setup(cp, gx, layers, args, dense):
    """(geometry, the calibration trace's tokens, dense stand-in, layer input) for the calibration replays."""
    L, E = len(layers), layers[0].num_experts
    geo = Geometry((E,) * L, args.top_k, (layers[0].expert_bytes,) * L)
    tokens, _ = synth_tokens(L, E, args.top_k, 64, args.seed + 31)
    if dense is None:
        dense = StandIn(cp, L, args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim, E,
                        args.vocab, args.seed)
    with gx.compute:
        x0 = cp.asarray(np.random.default_rng(args.seed + 5).standard_normal((1, args.hidden)).astype(np.float32))
    return geo, tokens, dense, x0


def calibration_replay(cp, gx, layers, args, dense=None) -> list[dict]:
    """Per-layer records (``replay_engine``'s ``layer_log``) of the calibration workload: a
    64-token synthetic trace of its own seed (``args.seed + 31``) replayed under lru and hybrid
    (miss fraction 96/256) with a cache of 20% of the experts, after 16 unlogged tokens each, and
    ``POOL_TOKENS`` of its tokens under cpu (every expert of a layer in one pool call), after 4."""
    from .engine import ExpertEngine

    geo, tokens, dense, x0 = replay_setup(cp, gx, layers, args, dense)
    records: list[dict] = []
    for name, opts in REPLAY_CONFIGS:
        cap = Capacity.per_layer(geo, max(args.top_k, geo.max_experts // 5))
        pol = make_policy(name, geo, cap, **opts)
        engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
        try:
            engine.load_residents(pol.cache.slot)
            pool_only = name in POOL_ONLY
            replay_engine(cp, engine, pol, tokens[:4 if pool_only else 16], dense, x0)  # warm: the cache fills
            n0 = len(records)
            replay_engine(cp, engine, pol, tokens[16:16 + POOL_TOKENS] if pool_only else tokens[16:], dense, x0, records)
            for r in records[n0:]:
                r["policy"] = name
            engine.synchronize()
        finally:
            engine.close()
    return records


def decision_totals(items) -> dict:
    """Totals over the ``RunLayer`` items of a replay: ``uploads`` (uploads + streams),
    ``copy_layers`` (layers with any), ``cpu_layers`` (layers with CPU experts), ``cpu_experts``,
    ``gpu_experts`` (hits + uploads + streams) and ``gpu_layers`` (layers with any)."""
    out = dict.fromkeys(("layers", "uploads", "copy_layers", "cpu_layers", "cpu_experts", "gpu_experts",
                         "gpu_layers"), 0)
    for item in items:
        if type(item) is not RunLayer:
            continue
        d = item.decision
        nu, nc = len(d.uploads) + len(d.streams), len(d.cpu)
        ng = len(d.hits) + nu
        out["layers"] += 1
        out["uploads"] += nu
        out["copy_layers"] += nu > 0
        out["cpu_layers"] += nc > 0
        out["cpu_experts"] += nc
        out["gpu_experts"] += ng
        out["gpu_layers"] += ng > 0
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """``{"steps", "host_s": {phase: seconds}}`` between two snapshots of the engine's counters
    (``{"steps", *RUN_PHASES}``), as ``experiments/sim_vs_real.py`` records its checked runs."""
    return {"steps": after["steps"] - before["steps"], "host_s": {p: after[p] - before[p] for p in RUN_PHASES}}


def calibration_runs(cp, gx, layers, args, dense=None, configs=RUN_CONFIGS) -> list[dict]:
    """Aggregates of UNLOGGED replays of the calibration trace (``configs``, by default
    ``RUN_CONFIGS``: lru at a fifth and at half of the experts, hybrid 96/256 at a fifth; with
    ``POOL_RUN`` the same under cpu), each after 16 warm-up tokens: per run the
    engine's phase totals and steps (``stats_delta``), the decisions' ``decision_totals`` and the
    wall seconds per token (``token_s``). Per-layer logging slows the engine's own phases at a high
    hit rate, and the checked replays are unlogged: these runs time the same way."""
    from .engine import ExpertEngine

    geo, tokens, dense, x0 = replay_setup(cp, gx, layers, args, dense)
    snap = lambda st: {"steps": st.steps, **{p: getattr(st, p) for p in RUN_PHASES}}
    out = []
    for name, opts, div in configs:
        slots = max(args.top_k, geo.max_experts // div)
        cap = Capacity.per_layer(geo, slots)
        pol = make_policy(name, geo, cap, **opts)
        engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
        try:
            engine.load_residents(pol.cache.slot)
            replay_engine(cp, engine, pol, tokens[:16], dense, x0)  # warm: the policy's cache fills
            s0 = snap(engine.stats)
            items, times, _ = replay_engine(cp, engine, pol, tokens[16:], dense, x0)
            out.append({"policy": name, "slots": slots, **opts, **stats_delta(s0, snap(engine.stats)),
                        **decision_totals(items), "token_s": times})
        finally:
            engine.close()
    return out


def replay_summary(records: list[dict], runs: list[dict] | None = None) -> dict:
    """``engine_replay`` of the measurements: host-lane fields, the pool's fit (over every record;
    the host-lane and between-layer fits leave out the ``POOL_ONLY`` configs' records), (for
    records with ``gap_s``) the between-layer host costs from ``records`` and (with unlogged ``runs`` that
    determine it) ``unlogged_host_fields``."""
    host = [r for r in records if r.get("policy") not in POOL_ONLY]  # the pool-only configs: pool fit only
    out = {"configs": [n for n, _ in REPLAY_CONFIGS], "layers": len(records),
           "cpu_layers": sum("parts" in r for r in records), "fields": replay_host_fields(host),
           "pool": replay_pool_fit(records)}
    between = replay_between_fields(host)
    if between is not None:
        out["between"] = between
    unlogged = unlogged_host_fields([r for r in runs or () if r.get("policy") not in POOL_ONLY], out["fields"])
    if unlogged is not None:
        out["unlogged"] = unlogged
    return out
