"""Does the simulator predict the executor? The executor side of ``sim_vs_real`` (GPU).

``run_device`` builds a Qwen3-30B-A3B-shaped model cut to ``--layers`` layers (Q8_0 experts with
random weights in pinned host RAM, the dense part by ``calibrate.StandIn``) and replays every
configuration through ``ExpertEngine``, interleaved over ``--repeats`` rounds (every other round in
reverse order, so drift spreads over the configs), recording every token's wall time, the decision
digest and the bytes uploaded. ``session_hardware`` applies the session's calibration replays to
a hardware file. The simulation side is ``simulate.fidelity``; ``moelab.sim_vs_real`` joins them.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["replay_executor", "run_device", "session_hardware", "calibrated_on_round", "log"]


def log(msg: str) -> None:
    print(f"[sim_vs_real {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warm_pool(pool, layers, n: int) -> float:
    """One call of ``n`` experts on every layer, as ``moelab run``'s prompt calls the pool before its
    first decode token (a fresh pool's first calls per layer ran 1-2 ms slower each on the H200
    host); the seconds it took."""
    t0 = time.perf_counter()
    for lx in layers:
        pool.submit(lx, list(range(min(n, lx.num_experts))), np.zeros((min(n, lx.num_experts), lx.hidden),
                                                                        np.float32)).result()
    return time.perf_counter() - t0


def replay_executor(cp, c: dict, layers, gx, dense, tokens, geometry, threads: int, make_policy_of,
                    cold_pool: bool = False) -> dict:
    """Run the tokens through the engine under config ``c`` (``execute.calibrate.replay_engine``);
    per-token wall times and what moved. ``make_policy_of(c, tokens, geometry)`` -> (policy, capacity).
    The engine's pool is warmed first (``warm_pool``, its seconds as ``pool_warm_s``) unless ``cold_pool``."""
    from scheduler import Audit

    from .calibrate import replay_engine
    from .engine import ExpertEngine

    pol, cap = make_policy_of(c, tokens, geometry)
    engine = ExpertEngine(layers, cap, threads=threads, use_gpu=True, timeout_s=120, gpu=gx)
    engine.load_residents(pol.cache.slot)
    pool_warm = None if cold_pool else warm_pool(engine.pool, layers, geometry.top_k)
    x0 = cp.asarray(np.random.default_rng(5).standard_normal((1, layers[0].hidden)).astype(np.float32))
    engine.synchronize()
    up0 = gx.bytes_uploaded
    items, times, jobs = replay_engine(cp, engine, pol, tokens, dense, x0)
    engine.synchronize()
    uploaded = gx.bytes_uploaded - up0
    engine.close()
    audit = Audit(geometry, keep_log=True, keep_records=False)
    for item in items:
        audit.observe(item)
    s = audit.summary()
    done = [j for j in jobs if j.collected_s]
    med = lambda v: float(np.median(v)) if v else None
    st = engine.stats
    return {"token_s": times, "upload_bytes": int(uploaded), "audit_upload_bytes": int(s["upload_bytes"]),
            "hit_rate": float(s["hit_rate"]), "digest": audit.digest(), "cpu_pairs": st.cpu_pairs,
            "cpu_compute_s": st.cpu_compute_s, "background_wait_s": st.background_wait_s,
            "cpu_start_s": med([j.started_s - j.submitted_s for j in done]),
            "cpu_return_s": med([j.collected_s - j.finished_s for j in done]),
            "host_s": {k: getattr(st, k) for k in ("host_plan_s", "host_queue_s", "input_wait_s", "cpu_wait_s",
                                                   "host_combine_s")}, "steps": st.steps, "pool_warm_s": pool_warm}


def run_device(args, runs: list[dict], make_policy_of) -> dict:
    """Build the model on this machine's GPU and replay every config of ``runs`` (``args``: the
    script's arguments); writes ``args.out/raw.json`` after every run; returns the raw results."""
    import cupy as cp

    from .calibrate import StandIn, build_layers, calibration_replay, calibration_runs, synth_tokens, write_json
    from .calibrate_replay import POOL_RUN, RUN_CONFIGS
    from .calibrate_measure import GpuTimer, measure_gpu_experts
    from .calibrate_moves import KINDS, measure_moves
    from .gpu_experts import GpuExperts
    from scheduler import Capacity, Geometry

    rng = np.random.default_rng(args.seed)
    log(f"building {args.layers} x {args.experts} Q8_0 experts")
    layers = build_layers(rng, args.layers, args.experts, args.hidden, args.ffn, distinct=2)  # copies: own memory
    eb = layers[0].expert_bytes
    geo = Geometry((args.experts,) * args.layers, args.top_k, (eb,) * args.layers)
    tokens, _ = synth_tokens(args.layers, args.experts, args.top_k, args.tokens, args.seed + 1)
    warm, _ = synth_tokens(args.layers, args.experts, args.top_k, 12, args.seed + 2)
    t0 = time.perf_counter()
    gx = GpuExperts(layers, Capacity.per_layer(geo, args.experts // 2), scratch_slots=16, pinned=True, timeout_s=120)
    log(f"pinned host weights in {time.perf_counter() - t0:.1f} s")
    dense = StandIn(cp, args.layers, args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim,
                    args.experts, args.vocab, args.seed)
    with gx.compute:  # the stand-in against float64 on layer 0
        xr = cp.asarray(rng.standard_normal((1, args.hidden)).astype(np.float32))
        y, logits = dense.layer(xr, 0)
        ry, rl = dense.reference(xr.get(), 0)
        dense_err = max(float(np.linalg.norm(y.get() - ry) / np.linalg.norm(ry)),
                        float(np.linalg.norm(logits.get() - rl) / np.linalg.norm(rl)))
    log(f"dense stand-in relative error vs float64: {dense_err:.1e}")
    experts = None
    try:  # the session's GPU expert tables (calibrate.measure_gpu_experts reads slots 0..15)
        gx.begin_copies()
        for e in range(16):
            gx.upload(0, e, e)
        gx.wait(gx.copies_event())
        experts = measure_gpu_experts(cp, GpuTimer(cp), gx, layers, 5)
    except Exception as e:  # noqa: BLE001 -- the check runs on with the file's GPU expert fields
        log(f"GPU expert tables not measured ({e!r}): the hardware file's fields are used")
    for c in (runs[0], runs[-1]):  # warm-up: kernels compiled, pools started (not recorded)
        replay_executor(cp, c, layers, gx, dense, warm, geo, args.threads, make_policy_of)
    for _ in range(args.warmup_rounds):  # the machine settles (clocks, caches, page tables): not recorded
        for c in runs:
            replay_executor(cp, c, layers, gx, dense, tokens, geo, args.threads, make_policy_of,
                            getattr(args, "cold_pool", False))
    log(f"{args.warmup_rounds} warm-up round(s) done")
    raw = {"args": vars(args), "expert_bytes": eb, "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dense_rel_err": dense_err, "runs": [], "failed": [],
           "gpu_experts": experts}
    raw["calibration_records"], raw["calibration_runs"], raw["host_state"] = [], [], []
    for rep in range(args.repeats):  # interleaved, every other round in reverse: drift spreads over configs
        before = _host(args, rep, "before")
        if args.host_calibration == "session":  # the calibration workload, in this process, this round
            raw["calibration_records"].extend({**r, "round": rep} for r in calibration_replay(cp, gx, layers, args, dense))
            t0 = time.perf_counter()
            cal = calibration_runs(cp, gx, layers, args, dense, RUN_CONFIGS + (POOL_RUN,))  # unlogged, as checked
            raw["calibration_runs"].extend({**r, "round": rep} for r in cal)
            log(f"[{rep}] unlogged calibration runs ({len(cal)} configs): {time.perf_counter() - t0:.1f} s")
        for c in (runs if rep % 2 == 0 else runs[::-1]):
            try:
                r = replay_executor(cp, c, layers, gx, dense, tokens, geo, args.threads, make_policy_of,
                                    getattr(args, "cold_pool", False))
            except Exception as e:  # noqa: BLE001 -- recorded and reported; the other configs still run
                log(f"{c['label']} (repeat {rep}): FAILED {e!r}")
                raw["failed"].append({**c, "repeat": rep, "error": repr(e)})
                continue
            t = np.asarray(r["token_s"], np.float64)
            log(f"[{rep}] {c['label']:<18} {len(t) / t.sum():7.1f} tok/s  p99 {np.percentile(t, 99) * 1e3:6.2f} ms  "
                f"hits {r['hit_rate']:.3f}  up {r['upload_bytes'] / 1e9:.2f} GB")
            raw["runs"].append({**c, **r, "repeat": rep})
            write_json(Path(args.out) / "raw.json", raw)  # kept if a later run or the analysis fails
        if getattr(args, "moves", False):  # the moves probe, one round of it per round (calibrate_moves)
            try:
                t0 = time.perf_counter()
                got = measure_moves(cp, gx, layers, dense, args.threads, rounds=1, tokens=20, top_k=args.top_k,
                                    kinds=KINDS if rep % 2 == 0 else KINDS[::-1])
                raw.setdefault("moves", []).extend({**r, "round": rep} for r in got)
                log(f"[{rep}] moves probe: " + ", ".join(f"{r['kind']} {np.mean(r['token_s']) * 1e3:.3f}" for r in got)
                    + f" ms/token ({time.perf_counter() - t0:.1f} s)")
                write_json(Path(args.out) / "raw.json", raw)
            except Exception as e:  # noqa: BLE001 -- recorded; the comparison runs on without it
                log(f"moves probe (round {rep}): FAILED {e!r}")
                raw.setdefault("failed", []).append({"label": "moves probe", "repeat": rep, "error": repr(e)})
        after = _host(args, rep, "after", before)
        if before and after:
            from .calibrate_host import summary

            raw["host_state"].append({"round": rep, **summary(before[0], after[0]), "problem": after[1] or before[1]})
            write_json(Path(args.out) / "raw.json", raw)
    gx.close()
    return raw


def _host(args, rep: int, when: str, before=None) -> tuple[dict, str | None] | None:
    """The host's state (``calibrate_host.host_state``) around a round and its problem, logged in one
    line when there is one; None where it could not be measured."""
    from .calibrate_host import host_problem, host_state

    try:
        state = host_state(args.threads, interval_s=0.3)
    except Exception as e:  # noqa: BLE001 -- the check is a record; the comparison runs on without it
        log(f"[{rep}] host state {when} the round not measured ({e!r})")
        return None
    problem = host_problem(state, args.threads, before[0] if before else None)
    busy = "?" if state["busy_cores"] is None else f"{state['busy_cores']:.1f}"
    log(f"[{rep}] host {when} the round: {busy} of {state['cores']} cores busy elsewhere, memory read "
        f"{state['mem_gbps']['median']:.0f} GB/s" + (f" -- BUSY: {problem}" if problem else ""))
    return state, problem


def calibrated_on_round(raw: dict, rnd: int, same: bool = False) -> dict:
    """``raw`` with the session calibration of round ``rnd`` only (its calibration replay's records
    and unlogged runs) and the checked runs of the other rounds only: a prediction from it is out
    of sample in time (calibrated on one round, checked on the others); ``same``: that round's own
    runs only (the host as it was in that round; the workload still another). Records without a round
    tag (recorded before the tag) are split evenly, in order, over the rounds (every round replays
    the same workload). ValueError when the recording has no such round or only one round."""
    rounds = int(raw["args"].get("repeats", 1))
    if not 0 <= rnd < rounds or (rounds < 2 and not same):
        raise ValueError(f"calibration round {rnd}: the recording has rounds 0..{rounds - 1}, expected another round to check")
    recs = raw.get("calibration_records") or []
    if recs and all("round" in r for r in recs):
        mine = [r for r in recs if r["round"] == rnd]
    else:
        n = len(recs) // rounds
        mine = recs[rnd * n:(rnd + 1) * n]
    if not mine:
        raise ValueError(f"calibration round {rnd}: no calibration replay recorded in that round")
    return {**raw, "calibration_records": mine,
            "calibration_runs": [r for r in raw.get("calibration_runs") or [] if r.get("round") == rnd],
            "moves": [r for r in raw.get("moves") or [] if r.get("round") == rnd],
            "runs": [r for r in raw["runs"] if (r["repeat"] == rnd) == same]}


def session_hardware(hw_file: str, raw: dict, out: Path) -> Path:
    """``hw_file`` with its host-lane fields and CPU pool cost from the calibration replays recorded
    in this session (``raw["calibration_records"]``: the calibration workload of ``moelab
    calibrate``, its own trace, run in the same process before each round, logged per layer; and
    where recorded ``raw["calibration_runs"]``: the same trace unlogged, whose aggregates set the
    GPU-only layers' fields); where recorded (``raw["gpu_experts"]``) the GPU expert fields
    (batch, one-token path, combine) from the session's own tables. Written to
    ``out/hardware-session.json``. The checked runs (``raw["runs"]``) are not read."""
    from .calibrate import apply_replay, expert_gpu_fields, replay_summary, write_json

    hw = json.loads(Path(hw_file).read_text())
    src = hw.setdefault("sources", {})
    if raw.get("gpu_experts"):  # efficiencies against the file's GPU bandwidth
        fields, q8 = expert_gpu_fields(raw["gpu_experts"], raw["expert_bytes"], hw["gpu_mem_gbps"],
                                       int(raw["args"].get("top_k", 8)), src)
        hw["executor"] = {**hw.get("executor", {}), **fields}
        hw.setdefault("gpu_quant_efficiency", {})["Q8_0"] = q8
        src["executor.gpu_experts"] = "measured in this session: sim_vs_real's GPU expert tables (expert_gpu_fields)"
    summary = replay_summary(raw["calibration_records"], raw.get("calibration_runs"))
    busy = any(h.get("problem") for h in raw.get("host_state") or ())  # the pool fit's medians then
    hw = apply_replay(hw, summary, raw["expert_bytes"], raw["args"]["threads"], src, busy=busy)
    if raw.get("moves"):  # the streamed steps' host time, from the session's moves probe
        from .calibrate_moves import moves_fields, moves_summary

        hw["executor"].update(moves_fields(moves_summary(raw["moves"]), hw["executor"]))
        src["executor.host_stream"] = "measured in this session: the moves probe's host phases (calibrate_moves.moves_fields)"
    hw["_about"] = f"{hw.get('_about', '')}; host lane and CPU pool from sim_vs_real's session calibration replays"
    hw.setdefault("_calibration", {})["session_replay"] = summary
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hardware-session.json"
    write_json(path, hw)
    return path

