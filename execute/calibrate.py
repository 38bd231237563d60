"""``moelab calibrate``: measure this machine as moelab's executor uses it; write a hardware file.

The file is in the simulator's format (``scheduler/hardware.py``: ``moelab simulate --hardware
FILE``). Every number is measured here, from the executor's own code paths, repeated: the JSON keeps
the median as the field and every sample's median, 10th and 90th percentile and count under
``"_calibration"`` (which the simulator ignores), with a ``sources`` line per field.

What is measured (GPU timings use CUDA events with the stream held by a spin kernel while the work
is queued, so they are GPU time alone; host timings are the Python thread's wall time of calls
made back to back, warm, as in a replay; layers with CPU experts are timed one at a time, since in
a replay too the thread waits for the pool before each):

- link: pinned host->device copies by size (fit: latency + bytes / GB/s), pageable by size, and
  expert uploads through ``GpuExperts.upload`` (three copies each), back to back;
- GPU: device copy GB/s, fp16 matmul TFLOP/s, one expert batch as the engine queues it (packed
  metadata copy + ``GpuExperts.run_groups``) of 1..16 experts (fit: fixed + experts x bytes /
  GB/s), the combine, the dense stand-in (``StandIn``: fused F16 GEMVs for the attention
  projections and the router, launched raw, like ``experiments/sim_vs_real.py`` runs it) at four
  widths (fit: fixed + bytes / GB/s), the router read-back;
- host: a kernel launch, issuing the dense stand-in and the head, one call each of the engine's
  per-layer primitives (``layer_meta``, ``run_groups``, ``combine_meta``), ``ExpertEngine.run_layer``
  for hits-only and upload layers (whole and by phase: plan, queue, combine; fit per expert),
  queueing one upload, and layers with one hit and 1..8 CPU experts split by ``cpu_layer_parts``
  (the engine's phase counters and the ``CpuJob`` stamps: submit, hand-off, queue while the pool
  runs, pool start, pool end -> caller, combine), the scheduler's planning per layer step for
  each policy, the engine's polling interval;
- host, in a replay (``engine_replay``; these host-lane fields replace the one-call figures above):
  a 64-token synthetic trace of its own seed (not the one ``experiments/sim_vs_real.py`` checks
  against) decoded through ``replay_engine`` under lru and hybrid (96/256) with 20% of the experts
  cached, every layer's ``run_layer`` phases, decision sizes and CPU job stamps logged and reduced
  by ``replay_host_fields``: the host thread is as fast as it is in a replay, between layers that
  share the machine with the CPU pool, not as in an isolated call; with ``MOELAB_CALIBRATE_MOVES=1``
  the streamed steps' host time (``calibrate_moves``: hits against an upload, one and two streams);
- token graph (``calibrate_graph``): decode tokens as one CUDA graph each, pipelined, under
  ``gpu`` on synthetic models of the calibration's shape at 2 and 6 blocks: the device time of one
  block in the graph and the host's time per step the graph computed and per token (fit over the
  blocks), for the simulator's graph lane;
- CPU pool (``CpuExpertPool`` via the engine, cold experts): time per call of 1..8 experts (fit:
  task + experts x bytes / GB/s), other quant types and thread counts (not with ``--quick``), and
  the host memory read bandwidth.

``--cpu-only`` (no GPU needed): measures the CPU pool, memory bandwidth, planning and polling, and
writes them over the GPU and link fields of ``--base FILE`` (a hardware JSON), without executor
host-lane costs. Its pool timings rotate over a cold set of random experts bounded by
``COLD_SET_BYTES`` (384 MiB: the model's shape, with fewer experts per layer where it is larger),
the other quant types' layers by half as many bytes, and the memory read buffer
(``MEM_READ_BYTES``, 512 MiB) is freed before the experts are built: at the default shape the
process peaks under 1 GB. Whatever kernels ``execute/cpu_experts.py`` has at run time are what
is measured.

Host check (``calibrate_host``): before measuring, what other processes keep busy and the memory
read; a busy host is waited for (``--host-wait``), then refused (exit 3); after measuring, the same
check, the memory read against the one before and the measurements against each other
(``measurement_problems``): a host that got busy is measured once more, then refused (a memory read that
fell while measuring, alone, is a warning, and the pool fit then takes medians). ``--busy-ok`` measures and writes anyway; both states are kept in ``_calibration.host_state``.

This module runs the command and writes the file (``measure_all`` -> ``hardware_json`` -> ``write_json``);
the parts live in ``calibrate_measure`` (each part timed alone), ``calibrate_replay`` (the
calibration replays), ``calibrate_fit`` (samples -> fields) and ``standin`` (the dense stand-in).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np

from scheduler.args import ArgumentParser, int_at_least
from scheduler.core import Capacity, Geometry
from scheduler.files import OutputPathError, atomic_write, check_output
from scheduler.hardware import RATIO_KEYS

from . import quant as Q

# The measurements, fits and replays live in calibrate_measure, calibrate_fit and calibrate_replay;
# their names are importable from here too, for scripts that take them with the command.
from .calibrate_fit import (BETWEEN_MIN_LAYERS, POOL_MIN_CALLS, call_factors, fit_line, fit_table, pool_count_fit,
                            pool_stat, replay_between_fields, replay_host_fields, replay_pool_fit, stats, unlogged_host_fields)
from .calibrate_measure import (MEM_READ_BYTES, PHASES, PLAN_POLICIES, GpuTimer, build_layers, cold_set_shape,
                                cpu_layer_parts, measure_cpu_mem_gbps, measure_cpu_pool, measure_cpu_types,
                                measure_dense, measure_engine, measure_gpu_basics, measure_gpu_experts, measure_link,
                                measure_plan_s, measure_poll_s, synth_tokens)
from .calibrate_graph import measure_token_graph
from .calibrate_memory import apply_mapped
from .calibrate_moves import apply_moves, calibration_moves
from .calibrate_replay import (HYBRID_96, REPLAY_CONFIGS, RUN_CONFIGS, RUN_PHASES, calibration_replay,
                               calibration_runs, decision_totals, replay_engine, replay_setup, replay_summary,
                               stats_delta)
from .standin import StandIn

__all__ = ["main", "hardware_json", "apply_replay", "apply_between", "write_json", "measure_all", "cpu_model",
           "add_shape_args",
           # re-exported
           "stats", "fit_line", "fit_table", "replay_host_fields", "replay_pool_fit", "replay_between_fields",
           "unlogged_host_fields", "POOL_MIN_CALLS", "BETWEEN_MIN_LAYERS", "PHASES", "PLAN_POLICIES", "GpuTimer",
           "build_layers", "cpu_layer_parts", "measure_cpu_mem_gbps", "measure_cpu_pool", "measure_plan_s",
           "measure_poll_s", "synth_tokens", "HYBRID_96", "REPLAY_CONFIGS", "RUN_CONFIGS", "RUN_PHASES",
           "calibration_replay", "calibration_runs", "decision_totals", "replay_engine", "replay_setup",
           "replay_summary", "stats_delta", "StandIn"]


def apply_between(executor: dict, between: dict, src: dict | None = None) -> dict:
    """``executor`` (a hardware file's block) with the between-layer host costs of
    ``replay_between_fields``: ``host_dense_s``, ``readback_s``, and ``plan_s`` of each replayed
    policy as the driver's median time per step there; the other policies' ``plan_s`` move by the
    mean difference (replay - file) over the replayed ones (the driver's own work, common to all)."""
    ex = dict(executor, host_dense_s=between["host_dense_s"], readback_s=between["readback_s"])
    plan = dict(ex.get("plan_s", {}))
    known = {p: v for p, v in between["sched_s"].items() if p in plan}
    shift = float(np.mean([v - plan[p] for p, v in known.items()])) if known else 0.0
    ex["plan_s"] = {p: between["sched_s"].get(p, max(v + shift, 0.0)) for p, v in plan.items()}
    for p, v in between["sched_s"].items():
        ex["plan_s"].setdefault(p, v)
    if src is not None:
        src["executor.between"] = ("measured: host time between layers in the calibration replay (replay_engine: "
                                   "driver per step -> plan_s of the replayed policies, others shifted by their mean "
                                   "difference; read-back after copy-free layers -> readback_s; the rest of the gap "
                                   "between run_layer calls -> host_dense_s)")
    return ex


def apply_replay(hw: dict, summary: dict, expert_bytes: int, threads: int, src: dict | None = None,
                 alone: dict | None = None, busy: bool = False) -> dict:
    """``hw`` (a hardware file's dict) with the host-lane fields and the CPU pool's cost (fit and
    per-count factors, ``call_factors`` over the pool measured alone: ``alone``, else ``hw``'s
    ``_calibration.cpu_pool``) taken from a calibration replay's ``replay_summary`` (``src``: its
    sources lines, updated); the pool fit over each count's mean call, its median where ``busy``
    (a host check found the host busy while the replay ran: ``pool_stat``)."""
    hw = dict(hw)
    hw["executor"] = {**hw.get("executor", {}), **summary["fields"]}
    if summary.get("unlogged"):  # GPU-only layers as unlogged replays run them
        hw["executor"].update(summary["unlogged"]["fields"])
        if src is not None:
            src["executor.unlogged"] = ("measured: GPU-only-layer plan, queue (level, copy round, copy) and combine "
                                        "from unlogged calibration runs (calibration_runs: engine phase totals per "
                                        "step fit on copies and CPU layers per step; unlogged_host_fields)")
    if summary.get("between"):
        hw["executor"] = apply_between(hw["executor"], summary["between"], src)
    pool = pool_count_fit(summary["pool"]["by_count"], pool_stat(busy))  # this version's fit, stored summaries too
    if pool["expert_s"] > 0:  # the pool as a replay sees it, over the back-to-back calls
        hw.update(cpu_task_s=min(pool["task_s"], 0.5), cpu_thread_gbps=expert_bytes / pool["expert_s"] / 1e9 / threads)
        alone = ((hw.get("_calibration") if alone is None else {"cpu_pool": alone}) or {}).get("cpu_pool", {})
        hw["cpu_call_factor"] = {str(n): f for n, f in call_factors(pool, alone.get("compute_s")).items()}
        if src is not None:
            src["cpu_thread_gbps"] = ("measured: CPU pool time per expert in the calibration replay (engine_replay: "
                                      "compute time of each CPU layer's job; each expert count's mean call (median "
                                      "where the host was found busy), fit over the counts weighted by calls), / threads")
            src["cpu_task_s"] = "measured: intercept of the same fit"
            src["cpu_call_factor"] = (f"measured: per expert count with >= {POOL_MIN_CALLS} calls in the calibration "
                                      f"replay, the {pool['stat']} call time / the same fit's; counts between them interpolated; "
                                      "counts above them: the largest one's time plus the pool alone's growth to "
                                      "them (cpu_pool, call_factors); counts not listed: the fit")
    return hw


# the hardware file -----------------------------------------------------------------------------
def hardware_json(m: dict, name: str, base: dict | None = None) -> dict:
    """The hardware file (simulator format) from a measurement dict ``m`` (see ``measure_all``).

    ``m`` keys used: ``threads``, ``expert_bytes``, ``cpu_mem``, ``cpu_pool`` (compute_s table),
    ``plan_s``, ``poll_s``, ``cpu_quant`` (optional {type: GB/s}); with a GPU also ``gpu``,
    ``link``, ``experts``, ``dense``, ``engine``. Without ``gpu`` the GPU and link fields come from
    ``base`` and no executor costs are written."""
    eb = m["expert_bytes"]
    T = int(m["threads"])
    med = lambda st: st["median"]
    table = m["cpu_pool"]["compute_s"]
    task, per = fit_table(table)
    if not per > 0:  # noise above the per-expert cost (tiny experts): the largest call's mean per expert
        most = max(table, key=float)
        task, per = 0.0, table[most]["median"] / float(most)
    cpu_rate = eb / per / 1e9
    mem = max(med(m["cpu_mem"]), cpu_rate)
    eff = {"Q8_0": 1.0}
    b_eff = (base or {}).get("cpu_quant_efficiency", {})
    for q, v in b_eff.items():  # types not measured here keep the base file's ratios to Q8_0
        if b_eff.get("Q8_0"):
            eff[q] = min(4.0, max(1e-3, v / b_eff["Q8_0"]))
    for q, gbps in (m.get("cpu_quant") or {}).items():
        eff[q] = min(4.0, max(1e-3, gbps / cpu_rate))
    src = {
        "cpu_threads": f"the engine's CPU pool threads (--threads {T})",
        "cpu_mem_gbps": f"measured: Numba parallel read of {m.get('cpu_mem_bytes', 1 << 30) >> 20} MiB (median; "
                        f"at least the pool's Q8_0 rate)",
        "cpu_thread_gbps": "measured: CpuExpertPool Q8_0 time per expert, slope over 1..8 cold experts per call "
                           "(the 8-expert call's mean per expert where noise makes the slope <= 0), / threads",
        "cpu_task_s": "measured: CpuExpertPool intercept of the same fit",
        "cpu_quant_efficiency": _efficiency_source(sorted(m.get("cpu_quant") or {}), sorted(set(eff) - {"Q8_0"})),
    }
    hw = dict(base or {})
    hw.pop("_about", None)
    hw.pop("_calibration", None)
    hw.pop("executor", None)
    hw.pop("cpu_call_factor", None)  # the base's pool factors belong to the base's pool fit
    hw.update(name=name, cpu_name=m.get("cpu_name", platform.processor() or platform.machine()), cpu_threads=T,
              cpu_mem_gbps=mem, cpu_thread_gbps=cpu_rate / T, cpu_task_s=min(max(task, 0.0), 0.5),
              cpu_quant_efficiency=eff)
    if "gpu" in m:
        hw.update(_gpu_fields(m, eb, src))
        if "engine_replay" in m:  # host lane and pool as a replay runs them, over the one-call figures
            from .calibrate_host import found_busy

            busy = found_busy(m)  # the pool fit then takes each count's median call
            hw = apply_replay(hw, m["engine_replay"], eb, T, src, alone=m["cpu_pool"], busy=busy)
        apply_mapped(hw, m, src)
        apply_moves(hw, m, src)
        if (m.get("token_graph") or {}).get("fields"):
            hw["executor"] = {**hw["executor"], **m["token_graph"]["fields"]}
            src["executor.token_graph"] = ("measured: decode tokens as one CUDA graph each under gpu, pipelined, on "
                                           "synthetic models of the calibration's shape and 2 and 6 blocks "
                                           "(calibrate_graph): device time per token (CUDA events) and host time "
                                           "less the wait for the graphs, fit over the blocks")
    elif not base:
        raise ValueError("hardware_json: no GPU measurements and no base hardware file for the GPU fields")
    hw["sources"] = {**(base or {}).get("sources", {}), **src}
    hw["_about"] = (f"measured by moelab calibrate on {m.get('host', socket.gethostname())} at {m.get('date', '')}"
                    + (" (CPU side only; GPU and link fields from the base file)" if "gpu" not in m else ""))
    hw["_calibration"] = m
    return hw


def _efficiency_source(measured: list[str], given: list[str]) -> str:
    """Where ``cpu_quant_efficiency`` comes from: only the types measured are called measured."""
    rest = [q for q in given if q not in measured]
    text = (f"measured: pool GB/s of {', '.join(measured)} / Q8_0's (8 experts per call)" if measured
            else "Q8_0 1.0 by definition; no other type measured (--quick)")
    return text + (f"; {', '.join(rest)}: the base file's ratios to Q8_0, not measured here" if rest else "")


def _gpu_fields(m: dict, eb: int, src: dict) -> dict:
    med = lambda st: st["median"]
    g, link, ex, dn, en = m["gpu"], m["link"], m["experts"], m["dense"], m["engine"]
    gbps = g["d2d_gbps"]  # read + write traffic of a device copy: what a GEMV's weight reads can reach
    up_a, up_b = fit_table(ex["upload"])  # per expert, back to back
    pcie = link["pinned_fit"]["gbps"]
    lat = max(up_b - eb / (pcie * 1e9), 0.0)
    top_k = int((m.get("shape") or {}).get("top_k", 8))
    expert_fields, q8 = expert_gpu_fields(ex, eb, gbps, top_k, src)
    whole = {n: v["whole"] for n, v in en["hits"].items()}
    hits_a, hits_b = fit_table(whole)
    upl_a, upl_b = fit_table({n: v["whole"] for n, v in en["uploads"].items()})
    cpu = lambda part: float(np.median([med(v[part]) for v in en["cpu_layer"].values()]))
    plan = {p: med(v) for p, v in m["plan_s"].items()}
    one = en["hits"][min(en["hits"], key=float)]
    executor = {
        "host_dense_s": med(dn["host"]), "dense_fixed_s": dn["fit"]["fixed_s"], "readback_s": med(dn["readback"]),
        "host_head_s": med(dn["head_host"]),
        "host_gpu_layer_s": max(hits_a + hits_b, 0.0), "host_gpu_expert_s": max(hits_b, 0.0),
        "host_layer_plan_s": med(one["plan"]), "host_layer_combine_s": med(one["combine"]),
        "host_copy_s": max(upl_b - hits_b, 0.0),
        "host_cpu_submit_s": max(cpu("submit"), 0.0), "host_cpu_handoff_s": max(cpu("handoff"), 0.0),
        "host_cpu_queue_s": max(cpu("queue"), 0.0), "host_cpu_combine_s": max(cpu("combine"), 0.0),
        "cpu_start_s": max(cpu("start"), 0.0), "cpu_return_s": max(cpu("ret"), 0.0),
        "wait_poll_s": med(m["poll_s"]), "plan_s": plan, **expert_fields,
    }
    if "handoff" in en:  # the executor hands CPU experts off through mapped memory (MOELAB_HANDOFF)
        executor["handoff_in_s"], executor["handoff_out_s"] = med(en["handoff"]["in"]), med(en["handoff"]["out"])
    src.update({
        "gpu_mem_bytes": "measured: cudaMemGetInfo total", "gpu_mem_gbps": "measured: 1 GiB device-to-device copy, (read + write) bytes / s",
        "gpu_tflops": "measured: fp16 8192^3 cupy.matmul", "launch_s": "measured: host time of a one-element cupy kernel",
        "pcie_h2d_gbps": "measured: pinned copies of 1-64 MiB, slope of the fit over size",
        "pageable_gbps": "measured: pageable 64 MiB copies", "copy_latency_s": "measured: GpuExperts.upload per expert "
        "(three copies) back to back, slope minus bytes / pcie_h2d_gbps",
        "gpu_quant_efficiency": "measured: Q8_0 = GpuExperts.run_groups slope per expert over 1..top_k experts (a "
        "one-token step's counts); F16 = the dense stand-in's slope over four widths; both / gpu_mem_gbps",
        "executor": "measured: see _calibration; host-lane fields from a replay of a synthetic trace of its own seed "
                    "under lru and hybrid (engine_replay: run_layer phases per layer, CPU job stamps, the stand-in's "
                    "issue), the rest from one-call figures (engine), the fused dense stand-in and spin-held CUDA events",
    })
    return {
        "gpu_name": g["gpu_name"], "gpu_mem_bytes": g["gpu_mem_bytes"], "gpu_mem_gbps": gbps,
        "gpu_tflops": g["matmul_tflops"], "launch_s": med(g["launch_s"]), "pcie_h2d_gbps": pcie,
        "pageable_gbps": link["pageable_gbps"], "copy_latency_s": lat,
        "gpu_quant_efficiency": {"Q8_0": q8,
                                 "F16": min(4.0, dn["fit"]["gbps"] / gbps)},
        "executor": executor,
    }


def expert_gpu_fields(ex: dict, eb: int, gbps: float, top_k: int, src: dict) -> tuple[dict, float]:
    """The executor's GPU expert fields from ``measure_gpu_experts``' tables (``ex``) of experts of
    ``eb`` bytes on a GPU of ``gbps`` device-copy GB/s: (``gpu_batch_s``, ``combine_s`` and, where
    ``ex`` has the one-token path, ``gpu_one_s`` and ``gpu_one_expert_scale``; Q8_0's
    ``gpu_quant_efficiency``). ``src`` gets the one-token path's source.

    The batch is fit over the counts a one-token step can have (1..``top_k``): the larger ones bend
    the line (at 8 experts the fit over 1..16 overcharged the H200's measured batch by 22%)."""
    decode = {n: v for n, v in ex["batch"].items() if float(n) <= max(top_k, 2)}
    batch_a, batch_b = fit_table(decode if len(decode) >= 2 else ex["batch"])
    batch_b = max(batch_b, eb / (4.0 * gbps * 1e9))  # noise: at most 4x the device copy's rate
    out = {"gpu_batch_s": max(batch_a, 0.0), "combine_s": ex["combine"]["median"]}
    if ex.get("one"):  # the one-token path (engine._run_one: hits and uploads only, one token)
        one_a, one_b = fit_table(ex["one"])
        out["gpu_one_s"] = max(one_a, 0.0)
        out["gpu_one_expert_scale"] = min(max(one_b / batch_b, 0.01), 4.0)
        src["executor.one_token"] = ("measured: GpuExperts.gate_up1 + down_combine1 (the pair table by value) over "
                                     "1..8 resident experts, CUDA events: intercept -> gpu_one_s, slope / the "
                                     "batch's -> gpu_one_expert_scale")
    return out, min(4.0, eb / batch_b / 1e9 / gbps)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (temp file, then rename), mode 0o666 less the umask."""
    atomic_write(path, json.dumps(data, indent=1, default=_jsonable))


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# the whole run ---------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Stages:
    """The measurement stages as a progress bar on stderr: ``stage(name)`` ends the previous one."""

    def __init__(self, total: int, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="stage", desc="calibrate", disable=quiet, file=sys.stderr,
                        dynamic_ncols=True)
        self.started = False

    def __call__(self, name: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(name)


def measure_all(args, layers=None, gx=None, partial: dict | None = None) -> dict:
    """Every measurement (see the module docstring); reuses ``layers``/``gx`` when given. Results
    go into ``partial`` (a dict, also returned) as they come. Stages are shown on stderr unless
    ``args.quiet``."""
    total = (layers is None) + 3 + 2 * (not args.quick) + (0 if args.cpu_only else 9)
    stage = _Stages(total, getattr(args, "quiet", False))
    try:
        m = _measure(args, stage, layers, gx, partial)
        stage("done")
        return m
    finally:
        stage.bar.close()


def _measure(args, stage, layers, gx, partial) -> dict:
    reps = 5 if args.quick else 11
    rng = np.random.default_rng(args.seed)
    stage("host memory bandwidth")  # first: its buffer is freed before the experts are built
    mem_bytes = MEM_READ_BYTES if not args.small else 1 << 24
    cpu_mem = measure_cpu_mem_gbps(args.threads, mem_bytes)
    if layers is None:
        # --cpu-only: a bounded cold set (the pool's timings need experts out of cache, not the model's
        # every expert); with a GPU: the model's shape, which the uploads and replays use
        eb = 2 * args.ffn * Q.row_bytes(Q.Q8_0, args.hidden) + args.hidden * Q.row_bytes(Q.Q8_0, args.ffn)
        n_layers, n_experts = (cold_set_shape(args.layers, args.experts, eb) if args.cpu_only
                               else (args.layers, args.experts))
        stage(f"building {n_layers} x {n_experts} Q8_0 experts")
        layers = build_layers(rng, n_layers, n_experts, args.hidden, args.ffn)
    eb = layers[0].expert_bytes
    num_layers = args.layers if args.cpu_only else len(layers)
    geo = Geometry((args.experts,) * num_layers, args.top_k, (eb,) * num_layers)
    m = partial if partial is not None else {}
    m.update({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": socket.gethostname(), "threads": args.threads,
         "expert_bytes": eb, "quick": bool(args.quick), "cpu_name": cpu_model(),
         "shape": {k: getattr(args, k) for k in ("layers", "experts", "hidden", "ffn", "top_k", "heads", "kv_heads",
                                                  "head_dim", "vocab")}})
    stage("scheduler planning per policy")
    tokens, _ = synth_tokens(len(layers), args.experts, args.top_k, 48, args.seed + 11)
    m["plan_s"] = measure_plan_s(geo, max(args.top_k, args.experts // 4), tokens)
    m["poll_s"] = measure_poll_s()
    m["cpu_mem"], m["cpu_mem_bytes"] = cpu_mem, mem_bytes
    m["cpu_cold_set"] = {"layers": len(layers), "experts": layers[0].num_experts,
                         "bytes": sum(lx.num_experts * lx.expert_bytes for lx in layers)}
    stage("CPU pool")
    m["cpu_pool"] = measure_cpu_pool(layers, args.threads, reps=reps, seed=args.seed)
    if not args.quick:
        stage("CPU pool: quant types and thread counts")
        m["cpu_quant"], m["cpu_threads_q8"] = measure_cpu_types(args, layers, rng)
        stage("CPU pool on a memory-mapped file")
        m["cpu_mapped"] = _mapped_pool(args, layers)
    if args.cpu_only:
        return m
    import cupy as cp

    from .engine import ExpertEngine
    from .gpu_experts import GpuExperts

    timer = GpuTimer(cp)
    stage("GPU basics")
    m["gpu"] = measure_gpu_basics(cp, timer, reps)
    stage("link")
    m["link"] = measure_link(cp, timer, reps)
    cap = Capacity.per_layer(geo, 32)
    own = gx is None
    if own:
        gx = GpuExperts(layers, cap, scratch_slots=16, pinned=True, timeout_s=60)
    engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
    try:
        stage("expert uploads and batches")
        gx.begin_copies()
        for e in range(16):
            gx.upload(0, e, e)
        gx.wait(gx.copies_event())
        m["experts"] = measure_gpu_experts(cp, timer, gx, layers, reps)
        stage("dense stand-in")
        m["dense"] = measure_dense(cp, timer, gx, args, reps)
        stage("engine host costs")
        m["engine"] = measure_engine(cp, timer, engine, layers, reps, args.seed)
        engine.synchronize()
        engine.pool.close()
        stage("engine host costs in a replay")
        records = calibration_replay(cp, gx, layers, args)
        stage("engine host costs in unlogged replays")
        m["calibration_runs"] = calibration_runs(cp, gx, layers, args)
        m["engine_replay"] = replay_summary(records, m["calibration_runs"])
        stage("uploads, streams and swaps (moves probe)")
        m["moves"] = calibration_moves(cp, gx, layers, args)
        stage("token graph")
        m["token_graph"] = _token_graph(args, reps)
    finally:
        engine.synchronize()
        engine.pool.close()
        if own:
            gx.close()
    return m


def _mapped_pool(args, layers) -> dict:
    """``calibrate_memory.measure_pool_memory`` on two of the layers (a file in a temporary folder);
    a failure is recorded, with a warning, and gives no ``cpu_mapped_factor``."""
    import tempfile

    from .calibrate_memory import measure_pool_memory

    try:
        with tempfile.TemporaryDirectory(prefix="moelab-calibrate-") as tmp:
            return measure_pool_memory(layers[:2], args.threads, Path(tmp) / "experts.bin", seed=args.seed,
                                       rounds=max(1, min(3, layers[0].num_experts // 40)))
    except Exception as exc:  # noqa: BLE001 - the rest of the calibration stands without the factor
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"moelab calibrate: warning: the pool on a memory-mapped file not measured ({msg})", file=sys.stderr)
        return {"error": msg}


def _token_graph(args, reps: int) -> dict:
    """``calibrate_graph.measure_token_graph`` on models written to a temporary folder; a failure
    (a graph that cannot be captured here) is recorded, with a warning, and gives no graph fields."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="moelab-calibrate-") as tmp:
            return measure_token_graph(args, Path(tmp), reps=max(3, reps // 2))
    except Exception as exc:  # noqa: BLE001 - the rest of the calibration stands without the graph's fields
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"moelab calibrate: warning: token graph not measured ({msg}); the file has no graph fields",
              file=sys.stderr)
        return {"error": msg}


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model-shape flags shared with experiments/sim_vs_real.py (Qwen3-30B-A3B's by default)."""
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="moelab calibrate", description="Measure this machine as moelab's executor "
                                 "uses it and write a hardware file for moelab simulate --hardware.")
    ap.add_argument("--out", default="calibrated.json", help="hardware JSON to write (default calibrated.json)")
    ap.add_argument("--name", default=None, help="the hardware's name (default calibrated-<host>)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; Q8_0 and the pool's thread count only")
    ap.add_argument("--cpu-only", action="store_true", help="no GPU: CPU pool, memory and planning over --base's fields")
    ap.add_argument("--base", default=None,
                    help="hardware preset name or JSON file whose GPU and link fields --cpu-only keeps")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="CPU pool threads")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of random experts (cold-cache rotation)")
    add_shape_args(ap)
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    ap.add_argument("--refit", default=None, metavar="FILE",
                    help="measure nothing: write the hardware file that FILE's stored measurements (a calibrated "
                         "file's _calibration) give with this version's fits (no GPU needed)")
    ap.add_argument("--host-wait", type=float, default=60.0, metavar="S",
                    help="seconds to wait for a busy host to quiet down before refusing (default 60)")
    ap.add_argument("--busy-ok", action="store_true",
                    help="measure and write on a busy host too (its state is kept in _calibration.host_state)")
    ap.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # tests: a 16 MiB memory read
    return ap


def main(argv=None) -> int:
    """``moelab calibrate``: measure, then write the hardware JSON (exit 2 on bad arguments, 3 on a busy host)."""
    args = _parser().parse_args(argv)
    if args.refit:
        return _refit(args)
    if args.cpu_only and not args.base:
        print("moelab calibrate: --cpu-only needs --base PRESET|FILE (a hardware preset or JSON for the GPU and "
              "link fields)", file=sys.stderr)
        return 2
    try:
        check_output(args.out, "--out")
    except OutputPathError as e:
        print(f"moelab calibrate: {e}", file=sys.stderr)
        return 2
    for flag in ("layers", "experts", "hidden", "ffn", "top_k", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(args, flag) < 1:
            print(f"moelab calibrate: --{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 1", file=sys.stderr)
            return 2
    if not args.host_wait >= 0:
        print(f"moelab calibrate: --host-wait {args.host_wait}: expected seconds >= 0", file=sys.stderr)
        return 2
    if args.top_k > args.experts:
        print(f"moelab calibrate: --top-k {args.top_k}: expected <= --experts {args.experts}", file=sys.stderr)
        return 2
    block = 32 if args.quick else 256  # the largest block of the types measured: Q8_0; Q4_K, Q6_K
    for flag in ("hidden", "ffn"):
        if getattr(args, flag) % block:
            print(f"moelab calibrate: --{flag} {getattr(args, flag)}: expected a multiple of {block} (the block of "
                  f"the quant types moelab calibrate {'--quick ' if args.quick else ''}measures)", file=sys.stderr)
            return 2
    base = None
    if args.base:
        try:
            base = json.loads(_base_path(args.base).read_text())
            if not isinstance(base, dict):
                raise ValueError("expected a JSON object")
            _check_base(base)
        except (OSError, ValueError, TypeError) as e:
            print(f"moelab calibrate: --base {args.base}: not a hardware preset or readable hardware JSON ({e})",
                  file=sys.stderr)
            return 2
    if not args.cpu_only:
        problem = _gpu_problem()
        if problem:
            print(f"moelab calibrate: no usable CUDA GPU ({problem}); without one, measure the CPU side only: "
                  f"moelab calibrate --cpu-only --base PRESET|FILE (e.g. --base rtx4060-laptop)", file=sys.stderr)
            return 2
    import numba

    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
        print(f"moelab calibrate: --threads {args.threads}, expected 1..{numba.config.NUMBA_NUM_THREADS}",
              file=sys.stderr)
        return 2
    m = _measure_on_quiet_host(args)
    if isinstance(m, int):
        return m
    hw = hardware_json(m, args.name or f"calibrated-{socket.gethostname()}", base if args.cpu_only else None)
    write_json(Path(args.out), hw)
    if not args.quiet:
        print(f"wrote {args.out}: hardware {hw['name']}", file=sys.stderr)
    _print_summary(hw)
    return 0


def _measure_on_quiet_host(args) -> dict | int:
    """``measure_all`` between two host checks (``calibrate_host``): on a busy host it waits up to
    ``--host-wait`` s, then refuses (exit 3); when the host got busy while measuring it measures
    once more, then refuses, keeping what was measured in OUT.partial.json. ``--busy-ok`` (and the
    tests' ``--small``) measure and write whatever the host does; the states go into ``m["host_state"]``."""
    from .calibrate_host import HOST_MEM_BYTES, host_problem, host_state, measurement_problems, quiet_host, summary

    say = lambda line: print(f"moelab calibrate: {line}", file=sys.stderr)
    lenient = args.busy_ok or args.small
    mem = 1 << 24 if args.small else HOST_MEM_BYTES
    probe = lambda t, b: host_state(t, b, interval_s=0.05 if args.small else 0.5)
    partial = Path(str(args.out) + ".partial.json")
    for attempt in (0, 1):
        before, problem = quiet_host(args.threads, 0.0 if lenient else args.host_wait,
                                     (lambda line: None) if args.quiet else say, mem, probe)
        if problem and not lenient:
            say(f"refusing to measure on a busy host: {problem} (--busy-ok measures anyway)")
            return 3
        m = {}
        try:
            m = measure_all(args, partial=m)
        except BaseException as exc:
            if m:  # what was measured before the failure, for the record (not a hardware file)
                write_json(partial, m)
            if isinstance(exc, KeyboardInterrupt):
                kept = f"what was measured is in {partial} (not a hardware file)" if m else "nothing was written"
                print(f"\nmoelab calibrate: interrupted; {kept}", file=sys.stderr)
                return 130
            raise
        after = probe(args.threads, mem)
        problem = host_problem(after, args.threads) or next(iter(measurement_problems(m)), None)
        # a memory read that fell while measuring, alone, is a warning: on a quiet H200 host the read
        # fell from 118 to 45 GB/s and from 147 to 43 in two measurements one after the other
        drop = None if problem else host_problem(after, args.threads, before)
        m["host_state"] = {**summary(before, after), "problem": problem, "warning": drop}
        if drop and not args.quiet:
            say(f"warning: {drop} (written; recorded in _calibration.host_state, the pool fit takes medians)")
        if not problem or lenient:
            if problem and not args.quiet:
                say(f"warning: {problem} (--busy-ok: written anyway; recorded in _calibration.host_state)")
            return m
        if attempt == 0:
            say(f"the host got busy while measuring: {problem}; measuring again")
    write_json(partial, m)
    say(f"refusing to write a hardware file: {problem} in both measurements; what was measured is in {partial} "
        f"(--busy-ok writes it anyway)")
    return 3


def _refit(args) -> int:
    """``--refit FILE``: FILE's ``_calibration`` through ``hardware_json`` (its name kept unless
    ``--name``), written to ``--out``; exit 2 when FILE holds no GPU calibration."""
    try:
        check_output(args.out, "--out")
        old = json.loads(Path(args.refit).read_text())
        m = old.get("_calibration") if isinstance(old, dict) else None
        if not isinstance(m, dict) or "gpu" not in m:
            raise ValueError("no _calibration with GPU measurements (a file written by moelab calibrate)")
        hw = hardware_json(m, args.name or old.get("name", "calibrated"))
    except OutputPathError as e:
        print(f"moelab calibrate: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"moelab calibrate: --refit {args.refit}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from .calibrate_host import measurement_problems

    for line in [] if args.quiet else measurement_problems(m):  # measured on a busy host: said, refit (medians)
        print(f"moelab calibrate: warning: {args.refit}: {line}", file=sys.stderr)
    hw["_about"] = f"{old.get('_about', '')}; refit by moelab calibrate --refit (no measurement)"
    write_json(Path(args.out), hw)
    if not args.quiet:
        print(f"wrote {args.out}: hardware {hw['name']} (refit of {args.refit})", file=sys.stderr)
    return 0


def _check_base(base: dict) -> None:
    """The fields ``base`` gives, checked as a hardware file's (ValueError naming the field): the
    fields it lacks are taken from a bundled preset for the check only."""
    from scheduler.hardware import HARDWARE_DIR, Hardware

    filler = json.loads((HARDWARE_DIR / "rtx4060-laptop.json").read_text())
    Hardware(**{k: v for k, v in {**filler, **base}.items() if not k.startswith("_")})


def _base_path(base: str) -> Path:
    """``--base``: a JSON file, or the name of a bundled hardware preset."""
    from scheduler.hardware import HARDWARE_DIR

    p = Path(base)
    if not p.exists() and not p.suffix and (HARDWARE_DIR / f"{base}.json").is_file():
        return HARDWARE_DIR / f"{base}.json"
    return p


def _gpu_problem() -> str | None:
    """Why the GPU measurements cannot run here (no CuPy, no device), or None; checked first."""
    try:
        from .gpu_experts import gpu_available
    except Exception as e:  # CuPy missing, or its CUDA libraries
        return f"{type(e).__name__}: {e}"
    return None if gpu_available() else "CuPy sees no CUDA device"


def _print_summary(hw: dict) -> None:
    keys = ("gpu_mem_gbps", "pcie_h2d_gbps", "copy_latency_s", "launch_s", "cpu_threads", "cpu_thread_gbps",
            "cpu_task_s", "cpu_mem_gbps")
    for k in keys:
        if k in hw:
            print(f"{k:<18} {hw[k]:.4g}")
    for k, v in hw.get("executor", {}).items():
        if k == "plan_s":
            print("plan_s             " + ", ".join(f"{p} {s * 1e6:.1f} us" for p, s in v.items()))
        elif k in RATIO_KEYS:
            print(f"{k:<18} {v:.3f}")
        else:
            print(f"{k:<18} {v * 1e6:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
