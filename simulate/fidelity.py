"""Does the simulator predict the executor? The simulation and analysis side of ``sim_vs_real``.

A run's configurations (``configs``), the simulator on the same tokens, policy and cache
(``simulate_config``), and the comparison of an executor recording (``raw``: per config and repeat,
every token's measured time, the decision digest and bytes uploaded) with the predictions:
relative errors per metric, Spearman rank correlation, the measurement's own spread, a per-token
decomposition and the host-time split (diagnoses, no model input). The executor side lives in
``execute.fidelity``; ``moelab.sim_vs_real`` joins the two.
"""
from __future__ import annotations

import csv
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from scheduler import MISS_FRAC_256

__all__ = ["TARGETS", "METRICS", "configs", "select", "analyse", "compare", "calibration_check", "fit_lane", "decompose",
           "calibration_ratios",
           "between_split", "spread_summary", "print_table", "print_decompose", "print_between", "plot",
           "write_csv", "sim_model", "simulate_config", "profile_of", "options_of", "make_policy_of",
           "rel_error", "spearman", "fit_terms", "token_stats", "group_runs", "measured"]


TARGETS = {"tokens_per_s_median": 0.05, "tokens_per_s_max": 0.12, "p99_median": 0.10, "spearman": 0.95}


METRICS = ("tokens_per_s", "p50_token_s", "p99_token_s")
EARLY = 16  # tokens: the cache fills over the first ones (tokens/s over them and after, split in the table)


def configs(num_experts: int, budgets_mib=None, layers: int = 0, expert_bytes: int = 0) -> list[dict]:
    """The runs: label, policy, slots per layer, hybrid miss fraction (x/256) or None.

    Default: ``cpu``; ``lru``, ``static``, ``hybrid`` at about 10, 25 and 50% of each layer's experts;
    ``hybrid`` at miss fractions 0, 128, 256 at 25%. With ``budgets_mib`` (the peer benchmark's
    budgets): ``gpu`` (every expert resident), ``cpu``, and ``lru`` and ``hybrid`` at each budget's
    slots per layer (MiB x 2^20 // (layers x expert_bytes), at least top-k is the caller's check)."""
    if budgets_mib:
        out = [{"label": "gpu", "policy": "gpu", "slots": num_experts, "miss_frac_256": None},
               {"label": "cpu", "policy": "cpu", "slots": 0, "miss_frac_256": None}]
        for mib in budgets_mib:
            s = min(num_experts, int(mib * 2**20 // (layers * expert_bytes)))
            for pol in ("lru", "hybrid"):
                out.append({"label": f"{pol} {mib:g}MiB", "policy": pol, "slots": s,
                            "miss_frac_256": MISS_FRAC_256 if pol == "hybrid" else None})
        return out
    sizes = {f"{int(p * 100)}%": max(8, round(p * num_experts)) for p in (0.10, 0.25, 0.50)}
    out = [{"label": "cpu", "policy": "cpu", "slots": sizes["25%"], "miss_frac_256": None}]
    for pol in ("lru", "static", "hybrid"):
        for name, s in sizes.items():
            out.append({"label": f"{pol} {name}", "policy": pol, "slots": s,
                        "miss_frac_256": MISS_FRAC_256 if pol == "hybrid" else None})
    for f in (0, 128, 256):
        out.append({"label": f"hybrid 25% f={f}", "policy": "hybrid", "slots": sizes["25%"], "miss_frac_256": f})
    return out


def select(runs: list[dict], labels: str | None) -> list[dict]:
    """The runs named in ``labels`` (comma-separated, in the table's order); all when None."""
    if not labels:
        return runs
    want = [w.strip() for w in labels.split(",") if w.strip()]
    known = {c["label"] for c in runs}
    bad = [w for w in want if w not in known]
    if bad or not want:
        raise ValueError(f"--configs: unknown {bad or labels!r}; expected labels among {[c['label'] for c in runs]}")
    return [c for c in runs if c["label"] in want]


def rel_error(measured: float, predicted: float) -> float:
    """|predicted - measured| / measured."""
    if measured <= 0:
        raise ValueError(f"rel_error: measured {measured}, expected > 0")
    return abs(predicted - measured) / measured


def rank(a) -> np.ndarray:
    """Ranks 1..n, ties get their average rank."""
    a = np.asarray(a, np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    for v in np.unique(a):
        sel = a == v
        r[sel] = r[sel].mean()
    return r


def spearman(a, b) -> float:
    """Spearman rank correlation (Pearson on average ranks); nan when either side is constant."""
    ra, rb = rank(a), rank(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def error_stats(rows: list[dict]) -> dict:
    """Median and maximum relative error of each metric over ``rows`` (keys measured_/predicted_)."""
    out = {}
    for m in METRICS:
        e = [rel_error(r[f"measured_{m}"], r[f"predicted_{m}"]) for r in rows]
        out[m] = {"median": float(np.median(e)), "max": float(np.max(e)), "worst": rows[int(np.argmax(e))]["label"]}
    return out


def best_fraction(rows: list[dict]) -> dict:
    """The hybrid miss fraction with the most tokens/s, measured and predicted, over the rows that
    differ only in it (hybrid at the sweep's cache size)."""
    sweep = [r for r in rows if r["policy"] == "hybrid" and r["miss_frac_256"] is not None]
    slots = {r["slots"] for r in sweep if r["label"].startswith("hybrid 25%")}
    sweep = [r for r in sweep if r["slots"] in slots]
    if not sweep:
        return {"fractions": [], "measured": None, "predicted": None, "agree": False}
    meas = max(sweep, key=lambda r: r["measured_tokens_per_s"])["miss_frac_256"]
    pred = max(sweep, key=lambda r: r["predicted_tokens_per_s"])["miss_frac_256"]
    return {"fractions": sorted(r["miss_frac_256"] for r in sweep), "measured": meas, "predicted": pred,
            "agree": meas == pred}


def analyse(rows: list[dict]) -> dict:
    """Error statistics, rank correlation, best-fraction agreement, identical decisions, targets."""
    es = error_stats(rows)
    rho = spearman([r["measured_tokens_per_s"] for r in rows], [r["predicted_tokens_per_s"] for r in rows])
    best = best_fraction(rows)
    same = all(r["measured_upload_bytes"] == r["predicted_upload_bytes"]
               and r["measured_hit_rate"] == r["predicted_hit_rate"] and r["same_decisions"] for r in rows)
    met = {
        "tokens_per_s_median": es["tokens_per_s"]["median"] <= TARGETS["tokens_per_s_median"],
        "tokens_per_s_max": es["tokens_per_s"]["max"] <= TARGETS["tokens_per_s_max"],
        "p99_median": es["p99_token_s"]["median"] <= TARGETS["p99_median"],
        "spearman": rho >= TARGETS["spearman"],
        "bytes_and_hits_identical": same,
        "best_fraction_agrees": best["agree"],
    }
    return {"errors": es, "spearman_tokens_per_s": rho, "best_fraction": best, "identical_decisions": same,
            "targets": TARGETS, "met": met}


def token_stats(token_s) -> dict:
    t = np.asarray(token_s, np.float64)
    return {"tokens_per_s": len(t) / t.sum(), "p50_token_s": float(np.percentile(t, 50)),
            "p99_token_s": float(np.percentile(t, 99))}


def sim_model(layers: int, vocab: int):
    """The model preset cut to ``layers`` with F16 dense weights (the stand-in's)."""
    from scheduler.models import load_model

    m = load_model("qwen3-30b-a3b")
    return replace(m, num_layers=layers, vocab=vocab, dense_quant="F16", name=f"qwen3-30b-a3b/{layers}L")


def simulate_config(c: dict, hw, model, tokens) -> tuple[dict, str]:
    """(summary, decision digest) of the simulator on one config."""
    from scheduler import Audit, Capacity, drive, make_policy
    from .run import SimConfig, run

    cfg = SimConfig(model=model.name, hardware=hw.name, policy=c["policy"], cache_slots=c["slots"],
                    miss_fraction=None if c["miss_frac_256"] is None else c["miss_frac_256"] / 256,
                    token_graph=False)  # the engine's trace replay runs no token graph
    result, _ = run(cfg, hardware=hw, model=model, tokens=tokens)
    ref = Audit(model.geometry(), keep_log=True, keep_records=False)
    pol = make_policy(c["policy"], model.geometry(), Capacity.per_layer(model.geometry(), c["slots"]),
                      profile=profile_of(c, tokens, model.geometry()), **options_of(c))
    for item in drive(pol, tokens):
        ref.observe(item)
    return {**result.summary(), **early_late(result.token_s)}, ref.digest()


def early_late(token_s) -> dict:
    """tokens/s over the first ``EARLY`` tokens and over the rest (None where there are none)."""
    t = np.asarray(token_s, np.float64)
    rate = lambda v: float(len(v) / v.sum()) if len(v) and v.sum() > 0 else None
    return {"early_tokens_per_s": rate(t[:EARLY]), "late_tokens_per_s": rate(t[EARLY:])}


def profile_of(c, tokens, geometry):
    from scheduler import Profile
    from scheduler.policies import route_counts

    if c["policy"] != "static":
        return None
    return Profile.from_counts(route_counts(tokens, geometry))  # as simulate.run: the replayed tokens' own counts


def options_of(c) -> dict:
    if c["policy"] != "hybrid":
        return {}
    return {"adaptive": True, "miss_frac_256": c["miss_frac_256"]}


def base_label(label: str) -> str:
    """A run's config label (older recordings marked their one repeat with ' (repeat)')."""
    return label[:-len(" (repeat)")] if label.endswith(" (repeat)") else label


def group_runs(runs: list[dict]) -> dict[str, list[dict]]:
    """The recorded runs of each config label, in recording order (labels in first-seen order)."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(base_label(r["label"]), []).append(r)
    return out


def measured(reps: list[dict]) -> dict:
    """Per metric over a config's repeats: the median (the measured value), min, max and spread
    ((max - min) / median)."""
    per = [token_stats(r["token_s"]) for r in reps]
    out = {}
    for m in METRICS:
        v = np.array([p[m] for p in per])
        med = float(np.median(v))
        out[m] = {"median": med, "min": float(v.min()), "max": float(v.max()), "spread": float((v.max() - v.min()) / med)}
    return out


def compare(raw: dict, hw, tokens, model) -> list[dict]:
    """Simulate every recorded config once and pair the median of its measured repeats with the
    prediction; a config's decisions count as the same when every repeat's digest and uploaded
    bytes equal the simulator's. ``tokens`` and ``model``: the recording's trace and its model."""
    rows = []
    for label, reps in group_runs(raw["runs"]).items():
        c = reps[0]
        s, digest = simulate_config(c, hw, model, tokens)
        ms = measured(reps)
        row = {"label": label, "policy": c["policy"], "slots": c["slots"], "miss_frac_256": c["miss_frac_256"],
               "repeats": len(reps)}
        for m in METRICS:
            row[f"measured_{m}"] = ms[m]["median"]
            row[f"predicted_{m}"] = s[m]
        for m in METRICS:
            row[f"measured_{m}_min"], row[f"measured_{m}_max"] = ms[m]["min"], ms[m]["max"]
            row[f"spread_{m}"] = ms[m]["spread"]
            row[f"inside_{m}"] = len(reps) > 1 and ms[m]["min"] <= s[m] <= ms[m]["max"]
        for k in ("early_tokens_per_s", "late_tokens_per_s"):  # the median repeat's
            v = [early_late(r["token_s"])[k] for r in reps]
            row[f"measured_{k}"] = None if None in v else float(np.median(v))
            row[f"predicted_{k}"] = s.get(k)
        row.update({"measured_upload_bytes": c["upload_bytes"], "predicted_upload_bytes": s["upload_bytes"],
                    "measured_hit_rate": c["hit_rate"], "predicted_hit_rate": s["hit_rate"],
                    "same_decisions": all(r["digest"] == digest and r["upload_bytes"] == s["upload_bytes"]
                                          for r in reps),
                    "predicted_gpu_busy": s["gpu_busy"], "predicted_pcie_busy": s["pcie_busy"],
                    "predicted_cpu_busy": s["cpu_busy"]})
        rows.append(row)
    return rows


def calibration_check(raw: dict, hw, model, tokens, warm: int = 16) -> list[dict]:
    """The session's unlogged calibration runs (``raw["calibration_runs"]``: the calibration
    trace ``tokens``, its first ``warm`` tokens filling the cache unmeasured) predicted on ``hw``:
    per (policy, slots, miss fraction) the measured tokens/s (median over rounds) and the
    simulator's over the same tokens. A calibration that does not reproduce its own workload's
    runs (the check is in sample) will not reproduce another's. [] without runs."""
    from .run import SimConfig, run

    groups: dict = {}
    for c in raw.get("calibration_runs") or ():
        key = (c["policy"], c["slots"], c.get("miss_frac_256"))
        t = np.asarray(c["token_s"], np.float64)
        groups.setdefault(key, []).append(len(t) / t.sum())
    out = []
    for (policy, slots, frac), tps in groups.items():
        cfg = SimConfig(model=model.name, hardware=hw.name, policy=policy, cache_slots=slots,
                        miss_fraction=None if frac is None else frac / 256, token_graph=False)
        res, _ = run(cfg, hardware=hw, model=model, tokens=tokens)
        t = np.asarray(res.token_s, np.float64)[warm:]
        pred = len(t) / t.sum()
        meas = float(np.median(tps))
        out.append({"policy": policy, "slots": slots, "miss_frac_256": frac, "measured_tokens_per_s": meas,
                    "predicted_tokens_per_s": pred, "error": pred / meas - 1, "rounds": len(tps)})
    return out


LANE_BOUNDS_S = (0.0, 2e-4)  # the range searched for each of fit_lane's fields


def _solve(f, lo: float, hi: float, steps: int = 14) -> float:
    """x in [lo, hi] where the decreasing ``f`` crosses 0 (bisection); an end where it does not."""
    if f(lo) <= 0:
        return lo
    if f(hi) >= 0:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def fit_lane(raw: dict, hw, model, tokens) -> tuple[object, dict | None]:
    """``hw`` with the two host-lane terms the logged replay cannot separate from the GPU's own
    wait, solved so the simulator reproduces the session's unlogged calibration runs
    (``calibration_check``'s, its own trace ``tokens``; nothing of the checked runs is read):
    ``readback_s`` on the runs without CPU experts (lru: the mean log error of their tokens/s
    zero), then ``handoff_out_s`` (the GPU's wait for a CPU layer's rows past the pool's end;
    ``cpu_return_s`` without the hand-off) on those with CPU experts (hybrid). Both within
    ``LANE_BOUNDS_S``. Returns (hw, {field: (file value, solved)}); (hw, None) without runs of
    both kinds or without an executor block."""
    runs = raw.get("calibration_runs") or ()
    cpu_kinds = ("hybrid", "static", "cpu")
    kinds = {c["policy"] in cpu_kinds for c in runs}
    if not hw.executor or kinds != {True, False}:
        return hw, None

    def gap(field: str, cpu: bool, hw_now):
        def f(x: float) -> float:  # mean log(predicted / measured): decreasing in a cost
            h = replace(hw_now, executor={**hw_now.executor, field: x})
            own = [c for c in calibration_check(raw, h, model, tokens) if (c["policy"] in cpu_kinds) == cpu]
            return float(np.mean([np.log(c["predicted_tokens_per_s"] / c["measured_tokens_per_s"]) for c in own]))
        return f

    out, h = {}, hw
    cpu_field = "handoff_out_s" if "handoff_in_s" in hw.executor else "cpu_return_s"  # the path CPU layers take
    for field, cpu in (("readback_s", False), (cpu_field, True)):
        x = _solve(gap(field, cpu, h), *LANE_BOUNDS_S)
        out[field] = (float(h.executor.get(field, 0.0)), x)
        h = replace(h, executor={**h.executor, field: x})
    return h, out


DECOMPOSE_TERMS = ("token", "cpu_layer", "cpu_expert", "copy")


def token_features(c: dict, model, tokens) -> np.ndarray:
    """Per token of the replay under config ``c``: 1, its layers with CPU experts, its CPU experts
    beyond one per such layer, its copies (uploads + streams); one row per token."""
    from scheduler import Capacity, EndToken, RunLayer, drive, make_policy

    geo = model.geometry()
    pol = make_policy(c["policy"], geo, Capacity.per_layer(geo, c["slots"]), profile=profile_of(c, tokens, geo),
                      **options_of(c))
    rows, cur = [], [1, 0, 0, 0]
    for item in drive(pol, tokens):
        if type(item) is RunLayer:
            d = item.decision
            cur[1] += bool(d.cpu)
            cur[2] += max(len(d.cpu) - 1, 0)
            cur[3] += len(d.uploads) + len(d.streams)
        elif type(item) is EndToken:
            rows.append(cur)
            cur = [1, 0, 0, 0]
    return np.array(rows, np.float64)


def fit_terms(features: np.ndarray, token_s) -> dict:
    """Least squares of per-token times on ``features`` (``DECOMPOSE_TERMS``), seconds per unit;
    a term with no variation among the tokens (an all-zero column) gets None."""
    t = np.asarray(token_s, np.float64)
    if features.shape[0] != len(t):
        raise ValueError(f"fit_terms: {features.shape[0]} feature rows for {len(t)} token times")
    live = [j for j in range(features.shape[1]) if features[:, j].any()]
    coef = np.linalg.lstsq(features[:, live], t, rcond=None)[0]
    out = dict.fromkeys(DECOMPOSE_TERMS)
    for j, v in zip(live, coef):
        out[DECOMPOSE_TERMS[j]] = float(v)
    return out


def decompose(raw: dict, hw, tokens, model) -> list[dict]:
    """Per config, what a token costs by part, measured (each token's median over the repeats) and
    predicted: ``fit_terms`` of the per-token times on its CPU layers, further CPU experts and
    copies. A diagnosis of which kind of layer the model misprices; no model input."""
    from .run import SimConfig, run

    out = []
    for label, reps in group_runs(raw["runs"]).items():
        c = reps[0]
        f = token_features(c, model, tokens)
        meas = np.median(np.array([r["token_s"] for r in reps], np.float64), axis=0)
        cfg = SimConfig(model=model.name, hardware=hw.name, policy=c["policy"], cache_slots=c["slots"],
                        miss_fraction=None if c["miss_frac_256"] is None else c["miss_frac_256"] / 256,
                        token_graph=False)
        pred = run(cfg, hardware=hw, model=model, tokens=tokens)[0].token_s
        row = {"label": label, **{f"per_token_{k}": float(v) for k, v in zip(DECOMPOSE_TERMS[1:], f[:, 1:].mean(0))}}
        for side, t in (("measured", meas), ("predicted", pred)):
            for k, v in fit_terms(f, t).items():
                row[f"{side}_{k}_s"] = v
        out.append(row)
    return out


def print_decompose(rows: list[dict]) -> None:
    us = lambda v: "     -" if v is None else f"{v * 1e6:6.0f}"
    print(f"\n{'config':<18}{'cpuL':>6}{'cpuE+':>6}{'copy':>6} | us measured: token cpu_layer cpu_expert copy"
          " | predicted: token cpu_layer cpu_expert copy")
    for r in rows:
        m = " ".join(us(r[f"measured_{k}_s"]) for k in DECOMPOSE_TERMS)
        p = " ".join(us(r[f"predicted_{k}_s"]) for k in DECOMPOSE_TERMS)
        print(f"{r['label']:<18}{r['per_token_cpu_layer']:6.2f}{r['per_token_cpu_expert']:6.2f}"
              f"{r['per_token_copy']:6.2f} | {m} | {p}")
    print("(per token: least squares of token time on 1, layers with CPU experts, CPU experts beyond one per such "
          "layer, copies; measured = each token's median over the repeats; a term equal in every token shares its "
          "part with 'token'; - = no such work)")


PHASE_COUNTERS = ("host_plan_s", "input_wait_s", "host_queue_s", "host_combine_s")


def _layer_rows(rows) -> np.ndarray:
    """Per layer (n_gpu, n_up, n_cpu, the previous layer's n_up): GPU-only, with CPU experts, further
    GPU experts, a copy round, copies, copies of the previous layer, CPU experts."""
    return np.array([[n_cpu == 0, n_cpu > 0, max(n_gpu - 1, 0), n_up > 0, n_up, prev, n_cpu]
                     for n_gpu, n_up, n_cpu, prev in rows], np.float64)


def calibration_ratios(raw: dict, model, tokens) -> dict[str, dict]:
    """Per config, measured / calibrated for each engine phase counter and the pool's compute time
    (median over repeats): the calibration side is a least squares over the session's calibration
    records (per layer on ``_layer_rows``; the pool per call on 1 and its expert count), applied
    to the config's own decisions. A diagnosis; no model input. {} without calibration records."""
    from scheduler import Capacity, RunLayer, drive, make_policy

    recs = raw.get("calibration_records") or []
    if not recs:
        return {}
    prev = [0] + [r["n_up"] for r in recs[:-1]]
    f = _layer_rows([(r["n_gpu"], r["n_up"], r["n_cpu"], u) for r, u in zip(recs, prev)])
    coef = {k: np.linalg.lstsq(f, np.array([r[k] for r in recs]), rcond=None)[0] for k in PHASE_COUNTERS}
    cpu = [r for r in recs if "parts" in r]
    pool = np.linalg.lstsq(np.array([[1.0, r["n_cpu"]] for r in cpu]), np.array([r["parts"]["compute"] for r in cpu]),
                           rcond=None)[0]
    geo, out = model.geometry(), {}
    for label, reps in group_runs(raw["runs"]).items():
        c = reps[0]
        pol = make_policy(c["policy"], geo, Capacity.per_layer(geo, c["slots"]), profile=profile_of(c, tokens, geo),
                          **options_of(c))
        rows, u = [], 0
        for it in drive(pol, tokens):
            if type(it) is RunLayer:
                d = it.decision
                rows.append((len(d.hits) + len(d.uploads) + len(d.streams), len(d.uploads) + len(d.streams), len(d.cpu), u))
                u = rows[-1][1]
        lf = _layer_rows(rows)
        cal = {k: float((lf @ coef[k]).sum()) for k in PHASE_COUNTERS}
        cal["cpu_compute_s"] = float(sum(pool[0] + pool[1] * n for _, _, n, _ in rows if n))
        got = [r for r in reps if r.get("host_s")]
        meas = lambda k: np.median([r["host_s"][k] if k in r["host_s"] else r[k] for r in got]) if got else np.nan
        none = () if any(n for _, _, n, _ in rows) else ("input_wait_s", "cpu_compute_s")  # no CPU layers
        out[label] = {f"ratio_{k}": float(meas(k) / v) if v > 0 and k not in none else None for k, v in cal.items()}
    return out


def between_split(raw: dict, hw) -> list[dict]:
    """Per config (median over repeats), a step's host time inside ``run_layer`` (the engine's phase
    counters) and outside it (token time less those: driver, dense issue, router read-back and any
    wait there for the GPU, the head per layer), measured, beside the model's charge outside it
    when the host lane is critical (``plan_s`` of the policy + ``host_dense_s`` + ``readback_s`` +
    ``host_head_s`` / layers). A diagnosis; no model input. Runs without phase counters are skipped."""
    ex = hw.executor or {}
    layers = raw["args"]["layers"]
    out = []
    for label, reps in group_runs(raw["runs"]).items():
        reps = [r for r in reps if r.get("host_s") and r.get("steps")]
        if not reps or not ex:
            continue
        inside = np.array([sum(r["host_s"].values()) / r["steps"] for r in reps])
        total = np.array([sum(r["token_s"]) / r["steps"] for r in reps])
        plan = ex.get("plan_s", {}).get(reps[0]["policy"], 0.0)
        model = plan + ex.get("host_dense_s", 0.0) + ex.get("readback_s", 0.0) + ex.get("host_head_s", 0.0) / layers
        out.append({"label": label, "measured_step_s": float(np.median(total)),
                    "measured_inside_s": float(np.median(inside)), "measured_between_s": float(np.median(total - inside)),
                    "model_between_s": model})
    return out


def print_between(rows: list[dict]) -> None:
    keys = [f"ratio_{k}" for k in (*PHASE_COUNTERS, "cpu_compute_s")]
    r2 = lambda v: "     -" if v is None else f"{v:6.2f}"
    print(f"\n{'config':<18}{'us per layer step: total':>26}{'in run_layer':>14}{'between':>9}{'model between':>15}"
          " | measured / calibration: plan input_wait queue combine pool")
    for r in rows:
        print(f"{r['label']:<18}{r['measured_step_s'] * 1e6:26.0f}{r['measured_inside_s'] * 1e6:14.0f}"
              f"{r['measured_between_s'] * 1e6:9.0f}{r['model_between_s'] * 1e6:15.0f} | "
              + " ".join(r2(r.get(k)) for k in keys))
    print("(measured, median over repeats; between = token time less the engine's phase counters, per layer step; "
          "model between = plan_s + host_dense_s + readback_s + host_head_s / layers, the host's charge outside "
          "run_layer where it is not waiting for the GPU; measured / calibration: each engine phase counter and the "
          "pool's compute time over the session's calibration records fit per layer, on this config's decisions)")


def spread_summary(rows: list[dict]) -> dict | None:
    """The measurement's own noise: median and max over configs of each metric's spread across
    repeats, and how many configs' predictions fall inside their own measured range."""
    rep = [r for r in rows if r.get("repeats", 1) > 1]
    if not rep:
        return None
    out = {"configs": len(rep), "repeats": sorted({r["repeats"] for r in rep})}
    for m in METRICS:
        sp = [r[f"spread_{m}"] for r in rep]
        out[m] = {"median": float(np.median(sp)), "max": float(np.max(sp)),
                  "inside": int(sum(bool(r[f"inside_{m}"]) for r in rep))}
    return out


def print_table(rows: list[dict], an: dict, nz: dict | None) -> None:
    print(f"\n{'config':<18}{'n':>2}{'tok/s meas':>11}{'spread':>7}{'pred':>8}{'err':>7}{f'<{EARLY}':>8}{f'>={EARLY}':>7}"
          f"{'p50 ms m':>10}{'pred':>7}{'p99 ms m':>10}{'pred':>7}{'err':>7}{'GB up':>7}{'hits':>7}{'same':>6}")
    for r in rows:
        e = rel_error(r["measured_tokens_per_s"], r["predicted_tokens_per_s"])
        e99 = rel_error(r["measured_p99_token_s"], r["predicted_p99_token_s"])
        inside = "*" if r.get("inside_tokens_per_s") else " "
        print(f"{r['label']:<18}{r.get('repeats', 1):>2}{r['measured_tokens_per_s']:11.1f}"
              f"{100 * r.get('spread_tokens_per_s', 0.0):6.1f}%{r['predicted_tokens_per_s']:8.1f}{100 * e:6.1f}%{inside}"
              f"{_signed(r, 'early'):>8}{_signed(r, 'late'):>7}"
              f"{r['measured_p50_token_s'] * 1e3:9.2f}{r['predicted_p50_token_s'] * 1e3:7.2f}"
              f"{r['measured_p99_token_s'] * 1e3:10.2f}{r['predicted_p99_token_s'] * 1e3:7.2f}{100 * e99:6.1f}%"
              f"{r['measured_upload_bytes'] / 1e9:7.2f}{r['measured_hit_rate']:7.3f}"
              f"{'yes' if r['same_decisions'] and r['measured_upload_bytes'] == r['predicted_upload_bytes'] else 'NO':>6}")
    print(f"(measured = median of the repeats; spread = (max - min) / median; * = prediction inside the measured range; "
          f"<{EARLY} / >={EARLY}: predicted / measured - 1 of tokens/s over the first {EARLY} tokens / the rest)")
    es = an["errors"]
    print()
    for m in METRICS:
        print(f"{m:<14} relative error: median {100 * es[m]['median']:.1f}%, max {100 * es[m]['max']:.1f}% ({es[m]['worst']})")
    b = an["best_fraction"]
    print(f"Spearman rank correlation of tokens/s: {an['spearman_tokens_per_s']:.3f}")
    print(f"best hybrid miss fraction (x/256 of {b['fractions']}): executor {b['measured']}, simulator {b['predicted']}"
          f" -> {'agree' if b['agree'] else 'DISAGREE'}")
    print(f"bytes uploaded and hit rates identical in every config: {an['identical_decisions']}")
    if nz:
        for m in METRICS:
            print(f"measured spread of {m} over {nz['repeats']} repeats: median {100 * nz[m]['median']:.1f}%, "
                  f"max {100 * nz[m]['max']:.1f}%; prediction inside it in {nz[m]['inside']} of {nz['configs']} configs")
    print("targets met: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in an["met"].items()))


def _signed(r: dict, part: str) -> str:
    m, p = r.get(f"measured_{part}_tokens_per_s"), r.get(f"predicted_{part}_tokens_per_s")
    return "-" if not m or p is None else f"{100 * (p / m - 1):+.1f}%"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, m, unit, scale in ((axes[0], "tokens_per_s", "tokens/s", 1.0), (axes[1], "p99_token_s", "p99 token ms", 1e3)):
        x = np.array([r[f"measured_{m}"] for r in rows]) * scale
        y = np.array([r[f"predicted_{m}"] for r in rows]) * scale
        lo_x = np.array([r.get(f"measured_{m}_min", r[f"measured_{m}"]) for r in rows]) * scale
        hi_x = np.array([r.get(f"measured_{m}_max", r[f"measured_{m}"]) for r in rows]) * scale
        for pol, mk in (("cpu", "s"), ("lru", "o"), ("static", "^"), ("hybrid", "D")):
            sel = [i for i, r in enumerate(rows) if r["policy"] == pol]
            ax.errorbar(x[sel], y[sel], xerr=[x[sel] - lo_x[sel], hi_x[sel] - x[sel]], fmt=mk, ms=5, capsize=2,
                        label=f"{pol} (bar: measured min..max)" if pol == "cpu" else pol)
        for i, r in enumerate(rows):
            ax.annotate(r["label"], (x[i], y[i]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        lo, hi = min(x.min(), y.min()) * 0.8, max(x.max(), y.max()) * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
        ax.fill_between([lo, hi], [lo * 0.92, hi * 0.92], [lo * 1.08, hi * 1.08], color="0.9", label="±8%")
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel(f"measured {unit} (executor, median of repeats)"), ax.set_ylabel(f"predicted {unit} (simulator)")
        ax.legend(fontsize=7)
    fig.suptitle("simulator vs executor, same trace and decisions")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    os.replace(tmp, path)



def make_policy_of(c: dict, tokens, geometry):
    """(policy, capacity) of config ``c``, as both sides build it."""
    from scheduler import Capacity, make_policy

    cap = Capacity.per_layer(geometry, c["slots"])
    return make_policy(c["policy"], geometry, cap, profile=profile_of(c, tokens, geometry), **options_of(c)), cap
