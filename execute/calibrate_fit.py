"""Calibration fits: samples reduced to the figures a hardware file holds.

``stats`` (median, percentiles, count) and ``fit_line``/``fit_table`` (least-squares lines) serve
every measurement; the ``replay_*`` reductions turn a calibration replay's per-layer records
(``calibrate_replay.replay_engine``'s ``layer_log``) into the executor's host-lane fields, the CPU
pool's cost per call and the host's time between layers; ``unlogged_host_fields`` refits the
GPU-only-layer fields from the totals of unlogged runs. Pure numpy: no GPU, no clock.
"""
from __future__ import annotations

import numpy as np

__all__ = ["stats", "fit_line", "fit_table", "replay_host_fields", "replay_pool_fit", "replay_between_fields",
           "unlogged_host_fields", "call_factors", "pool_count_fit", "pool_stat", "POOL_STATS", "POOL_MIN_CALLS",
           "BETWEEN_MIN_LAYERS"]


def stats(samples) -> dict:
    """Median, 10th/90th percentiles and count of ``samples`` (ValueError when empty)."""
    a = np.asarray(list(samples), np.float64)
    if a.size == 0:
        raise ValueError("stats: no samples")
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(a.size)}


def fit_line(x, y) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b). Needs two distinct x."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or len(np.unique(x)) < 2:
        raise ValueError(f"fit_line: need matching x, y with two distinct x (got {x.tolist()})")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def fit_table(table: dict) -> tuple[float, float]:
    """Fit ``median = a + b x`` over a {x: stats} table."""
    xs = sorted(table, key=float)
    return fit_line([float(x) for x in xs], [table[x]["median"] for x in xs])


def replay_host_fields(records: list[dict]) -> dict:
    """The executor's host-lane fields (``scheduler.hardware.EXECUTOR_KEYS``) from a replay's
    per-layer records (``replay_engine``'s ``layer_log``, in replay order).

    GPU-only layers: the plan's growth per copy of the previous record (copies in flight) by
    least squares, its level and the combine as medians; queue = fixed + per further GPU expert +
    once per layer with copies (the copy round) + per copy (least squares). Layers with CPU
    experts (``parts``): their plan beyond a GPU-only layer's and the submit count as
    ``host_cpu_submit_s``; hand-off, pool start, pool end -> caller and combine medians; the
    queue less the per-expert and copy terms. Raises ValueError when the records lack either
    kind of layer."""
    prev = [0] + [r["n_up"] for r in records[:-1]]
    gpu = [(r, u) for r, u in zip(records, prev) if r["n_cpu"] == 0 and r["n_gpu"] > 0]
    cpu = [(r, u) for r, u in zip(records, prev) if "parts" in r]
    if len(gpu) < 8 or len(cpu) < 8:
        raise ValueError(f"replay_host_fields: {len(gpu)} GPU-only and {len(cpu)} CPU layers, expected >= 8 of each")
    med = lambda v: float(np.median(v))
    lsq = lambda rows, y: np.linalg.lstsq(np.array(rows, np.float64), np.array(y), rcond=None)[0]
    plan_copy = max(float(lsq([[1.0, u] for _, u in gpu], [r["host_plan_s"] for r, _ in gpu])[1]), 0.0)
    q_fixed, q_expert, q_round, q_copy = (max(float(c), 0.0) for c in lsq(
        [[1.0, r["n_gpu"] - 1, r["n_up"] > 0, r["n_up"]] for r, _ in gpu], [r["host_queue_s"] for r, _ in gpu]))
    plan = med([r["host_plan_s"] - plan_copy * u for r, u in gpu])
    combine = med([r["host_combine_s"] for r, _ in gpu])
    part = lambda k: med([r["parts"][k] for r, _ in cpu])
    mixed = [r for r, _ in cpu if r["n_gpu"]]
    copies = lambda r: q_expert * (r["n_gpu"] - 1) + q_round * (r["n_up"] > 0) + q_copy * r["n_up"]
    cpu_queue = med([r["parts"]["queue"] - copies(r) for r in mixed]) if mixed else q_fixed
    cpu_plan = med([r["parts"]["plan"] - plan_copy * u for r, u in cpu])
    return {"host_dense_s": med([r["dense_s"] for r in records]),
            "host_layer_plan_s": plan, "host_layer_combine_s": combine, "host_plan_copy_s": plan_copy,
            "host_gpu_layer_s": plan + q_fixed + combine, "host_gpu_expert_s": q_expert,
            "host_copy_round_s": q_round, "host_copy_s": q_copy,
            "host_cpu_submit_s": max(cpu_plan - plan + part("submit"), 0.0),
            "host_cpu_handoff_s": max(part("handoff"), 0.0), "host_cpu_queue_s": max(cpu_queue, 0.0),
            "host_cpu_combine_s": max(part("combine"), 0.0), "cpu_start_s": max(part("start"), 0.0),
            "cpu_return_s": max(part("ret"), 0.0)}


POOL_MIN_CALLS = 8  # calls of one expert count needed before that count gets its own factor


POOL_STATS = ("mean", "median")


def pool_count_fit(by_count: dict, stat: str = "mean") -> dict:
    """The CPU pool's cost per call from per-count call statistics ({count: ``stats`` + mean}, keys
    int or str): least squares of each count's ``stat`` call on the count, weighted by its calls ->
    {"task_s", "expert_s", "by_count", "factor": {n: stat / (task_s + n x expert_s)} for each count
    of at least ``POOL_MIN_CALLS`` calls, "stat"}. The mean where the host was quiet (a run's
    tokens/s follows the sum of its calls, the executor's own slow calls included); the median
    where a host check found it busy (``pool_stat``: the tails are then the host's, which the run
    it predicts need not share). A count without a mean (files written before it) takes its
    median. ValueError with fewer than two counts or another ``stat``."""
    if stat not in POOL_STATS:
        raise ValueError(f"pool_count_fit: stat {stat!r}, expected one of {', '.join(POOL_STATS)}")
    by = {int(n): dict(st) for n, st in by_count.items()}
    counts = sorted(by)
    if len(counts) < 2:
        raise ValueError(f"pool_count_fit: CPU calls of expert counts {counts}, expected two or more counts")
    val = {n: by[n].get(stat, by[n]["median"]) for n in counts}
    w = np.sqrt([float(by[n]["n"]) for n in counts])
    a = np.array([[1.0, n] for n in counts]) * w[:, None]
    task, per = np.linalg.lstsq(a, np.array([val[n] for n in counts]) * w, rcond=None)[0]
    task = max(float(task), 0.0)
    factor = {}
    for n in counts:
        fit = task + n * float(per)
        if by[n]["n"] >= POOL_MIN_CALLS and fit > 0:
            factor[n] = min(max(val[n] / fit, 0.25), 4.0)
    return {"task_s": task, "expert_s": float(per), "by_count": by, "factor": factor, "stat": stat}


def pool_stat(busy: bool) -> str:
    """The statistic ``pool_count_fit`` takes: the median when a host check found the host busy
    while the calls were timed, else the mean."""
    return "median" if busy else "mean"


def replay_pool_fit(records: list[dict], stat: str = "mean") -> dict:
    """The CPU pool's cost per call as a replay sees it (between layers, after idling while the
    GPU-only layers run): each CPU layer's compute time (job start -> end) per expert count
    (``stats`` + mean), reduced by ``pool_count_fit`` (``stat``, weighted by calls)."""
    cpu = [r for r in records if "parts" in r]
    by = {}
    for n in sorted({r["n_cpu"] for r in cpu}):
        v = [r["parts"]["compute"] for r in cpu if r["n_cpu"] == n]
        by[n] = {**stats(v), "mean": float(np.mean(v))}
    if len(by) < 2:
        raise ValueError(f"replay_pool_fit: CPU layers with expert counts {sorted(by)}, expected two or more counts")
    return pool_count_fit(by, stat)


def call_factors(pool: dict, alone: dict | None = None) -> dict[int, float]:
    """The pool's per-count call factors of a replay fit (``replay_pool_fit``), extended: counts
    between two counts with factors take the call time (the fit's ``stat``) interpolated linearly
    between theirs; counts of ``alone`` (the pool measured alone, {count: stats}, ``calibrate``'s
    ``cpu_pool`` table) above the largest count ``r`` with a factor take r's call time plus what the pool
    alone adds from r to them (the replay's per-call context, the pool's own growth per expert:
    an 8-expert call is not 8 times a 1-expert call's work when the threads split few experts).
    {count: factor on task_s + count x expert_s}, each in [0.25, 4]."""
    fit = lambda n: pool["task_s"] + n * pool["expert_s"]
    by = {int(n): v for n, v in pool["by_count"].items()}
    out = {int(n): float(f) for n, f in pool["factor"].items()}
    if not out:
        return out
    anchors = sorted(out)
    stat = pool.get("stat", "mean")
    val = lambda n: by[n].get(stat, by[n]["median"])
    meds = [val(n) for n in anchors]
    for n in range(anchors[0] + 1, anchors[-1]):
        if n not in out and fit(n) > 0:
            out[n] = min(max(float(np.interp(n, anchors, meds)) / fit(n), 0.25), 4.0)
    top = anchors[-1]
    table = {int(n): st["median"] for n, st in (alone or {}).items()}
    if top in table:
        for n in sorted(c for c in table if c > top):
            t = val(top) + table[n] - table[top]
            if fit(n) > 0 and t > 0:
                out[n] = min(max(t / fit(n), 0.25), 4.0)
    return dict(sorted(out.items()))


BETWEEN_MIN_LAYERS = 8  # layers with a gap_s needed before the between-layer fields are taken


def replay_between_fields(records: list[dict]) -> dict | None:
    """The host's time between layers in a replay (``replay_engine``'s ``sched_s``, ``read_s``,
    ``gap_s``) -> {"host_dense_s": median of gap - driver - read-back (the dense issue and the
    loop's own work), "readback_s": median read-back of layers after a layer without copies (the
    GPU has little queued), "sched_s": {policy: median driver time per step} for records tagged
    with a ``policy``}; None for records without ``gap_s`` (recorded before it existed) or with
    fewer than ``BETWEEN_MIN_LAYERS`` of them."""
    gap = [r for r in records if "gap_s" in r]
    if len(gap) < BETWEEN_MIN_LAYERS:
        return None
    prev = [None] + records[:-1]
    quiet = [r["read_s"] for r, q in zip(records, prev) if "gap_s" in r and q is not None and q["n_up"] == 0]
    sched: dict[str, list] = {}
    for r in records:
        if "policy" in r:
            sched.setdefault(r["policy"], []).append(r["sched_s"])
    return {"host_dense_s": max(float(np.median([r["gap_s"] - r["sched_s"] - r["read_s"] for r in gap])), 0.0),
            "readback_s": float(np.median(quiet or [r["read_s"] for r in gap])),
            "sched_s": {p: float(np.median(v)) for p, v in sched.items()}}


def _lsq(rows, y) -> np.ndarray | None:
    """Least squares of ``y`` on ``rows``; None when the columns are not independent (too few configs)."""
    a = np.array(rows, np.float64)
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return np.linalg.lstsq(a, np.array(y, np.float64), rcond=None)[0]


def unlogged_host_fields(runs: list[dict], fields: dict) -> dict | None:
    """The GPU-only-layer host-lane fields from unlogged calibration runs (``calibration_runs``),
    over the logged fit ``fields`` (``replay_host_fields``) -> {"fields": the replaced fields,
    "fit": per phase its coefficients, "runs": count}; None without runs, or when the runs do not
    determine the fit (fewer than three configs of independent counts).

    Per phase, least squares over runs of (phase total / steps) on per-step counts, one column per
    model field it sets, so that three configs (any number of rounds) determine it:
    plan on [1, uploads, CPU layers] -> ``host_layer_plan_s``, ``host_plan_copy_s`` (per copy: a
    step's copies equal the next step's copies of the previous layer, up to one layer per run);
    queue less the logged ``host_gpu_expert_s`` per further GPU expert on [1, copy cost, CPU
    layers], copy cost = (``host_copy_round_s`` x layers with copies + ``host_copy_s`` x copies) of
    the logged fit, whose coefficient scales both (the logged replay gives the split between a
    copy round and a copy; [1, uploads, CPU layers] where both are 0) -> the GPU-only queue level,
    ``host_copy_round_s``, ``host_copy_s``; combine on [1, CPU layers] -> ``host_layer_combine_s``.
    The CPU-layer column absorbs those layers' own parts, which stay the logged fit's:
    ``host_cpu_submit_s`` takes the change of ``host_layer_plan_s`` so that a CPU layer's plan is
    charged as logged (the terms both kinds of layer share, per copy, per previous copy and per
    further GPU expert, are the unlogged fit's in CPU layers too). Coefficients below 0 are taken as 0, except a queue level below 0 (the
    runs' GPU-only layers all hold about top-k experts, so level and per-expert term are not
    separable in them): then ``host_gpu_expert_s`` takes the deficit over the GPU-only runs' mean
    further experts per layer, so that their queue is charged as fit."""
    runs = [r for r in runs or () if r.get("steps")]
    if not runs:
        return None
    per = lambda r, k: r[k] / r["steps"]
    rnd, cp_ = fields["host_copy_round_s"], fields["host_copy_s"]
    cost = ((lambda r: (rnd * r["copy_layers"] + cp_ * r["uploads"]) / r["steps"]) if rnd + cp_ > 0
            else (lambda r: per(r, "uploads")))
    further = lambda r: fields["host_gpu_expert_s"] * (r["gpu_experts"] - r["gpu_layers"]) / r["steps"]
    plan = _lsq([[1.0, per(r, "uploads"), per(r, "cpu_layers")] for r in runs],
                [r["host_s"]["host_plan_s"] / r["steps"] for r in runs])
    queue = _lsq([[1.0, cost(r), per(r, "cpu_layers")] for r in runs],
                 [(r["host_s"]["host_queue_s"] / r["steps"]) - further(r) for r in runs])
    comb = _lsq([[1.0, per(r, "cpu_layers")] for r in runs],
                [r["host_s"]["host_combine_s"] / r["steps"] for r in runs])
    if plan is None or queue is None or comb is None:
        return None
    p, pc, scale, c = (max(float(v), 0.0) for v in (plan[0], plan[1], queue[1], comb[0]))
    copy_round, copy = (scale * rnd, scale * cp_) if rnd + cp_ > 0 else (0.0, scale)
    out = {"host_layer_plan_s": p, "host_plan_copy_s": pc, "host_layer_combine_s": c,
           "host_copy_round_s": copy_round, "host_copy_s": copy,
           "host_cpu_submit_s": max(fields["host_cpu_submit_s"] + fields["host_layer_plan_s"] - p, 0.0)}
    q = float(queue[0])
    if q < 0:  # the logged per-expert term over-charges: the deficit goes to it, at the GPU-only runs' expert count
        gpu_only = [r for r in runs if not r["cpu_layers"]] or runs
        n = sum(r["gpu_experts"] - r["gpu_layers"] for r in gpu_only) / max(sum(r["gpu_layers"] for r in gpu_only), 1)
        out["host_gpu_expert_s"] = max(fields["host_gpu_expert_s"] + q / n, 0.0) if n > 0 else fields["host_gpu_expert_s"]
        q = 0.0
    out["host_gpu_layer_s"] = p + q + c
    fit = {"plan": [float(v) for v in plan], "queue": [float(v) for v in queue], "combine": [float(v) for v in comb]}
    return {"fields": out, "fit": fit, "runs": len(runs)}
