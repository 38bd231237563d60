"""Policies measured with the link and the CPU charged, on any routing trace; the evaluation set and
its leave-one-trace-out selection of defaults.

``measure`` simulates one policy on one trace (``Simulator``, driver lag 1): the trace's MoE
layers on a model preset reshaped to the trace's geometry (``trace_model``: the preset's expert
and dense sizes, the trace's layer count, experts and top-k), so traces of any model are priced by
the same hardware. It reports the simulator's hit rate (a prefetch that lands after its step could
start is no hit: ``SimResult.late_hits``), the demand hit rate (``traces.stats.DemandAudit``),
experts moved over PCIe per token, simulated tokens/s and the policy's planning time per layer step
(the CPU time of ``drive``'s work while the simulator consumes it: compare within one run).

``cross_validate``: each policy family has a grid of configurations; for each trace, the
configuration chosen on the *other* traces (highest geometric mean of tokens/s over ``lru``, over
their hardware presets and cache sizes) is the one reported for it (held out), and the one chosen
on all traces is the family's default.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from scheduler import Capacity, CapacityError, drive, make_policy
from scheduler.costs import DEFAULT_MODEL, Costs, ExecConfig
from scheduler.hardware import Hardware, load_hardware
from scheduler.models import ModelSpec, load_model
from traces import Trace
from traces.stats import DemandAudit

from .engine import Simulator

__all__ = ["trace_model", "moe_only", "measure", "Case", "synthetic_cases", "SYNTH_FAMILIES", "cross_validate",
           "gap_closed", "VARIANTS", "forecast_precision"]


def moe_only(trace: Trace) -> Trace:
    """``trace`` with its dense (masked) layers dropped, MoE layers renumbered 0.."""
    moe = list(trace.moe_layers)
    if len(moe) == trace.num_layers:
        return trace
    ids = np.asarray(trace.expert_ids)[:, moe]
    return Trace(trace.model, [trace.num_experts[l] for l in moe], trace.top_k, ids, trace.seq, trace.pos,
                 trace.phase, None if trace.weights is None else np.asarray(trace.weights)[:, moe], trace.meta)


def trace_model(trace: Trace, base: str = DEFAULT_MODEL) -> ModelSpec:
    """Model preset ``base`` reshaped to the MoE layers of ``trace`` (one expert count for all)."""
    moe = trace.moe_layers
    num = {trace.num_experts[l] for l in moe}
    if len(num) != 1:
        raise ValueError(f"trace {trace.model}: MoE layers with different expert counts {sorted(num)}")
    m = load_model(base)
    return replace(m, name=f"{base} as {len(moe)}x{num.pop()} top-{trace.top_k}", num_layers=len(moe),
                   num_experts=max(trace.num_experts), top_k=trace.top_k, first_dense_layers=0,
                   layer_expert_bytes=())


def measure(tokens: Sequence, model: ModelSpec, hw: Hardware | str, policy: str, slots: int,
            options: dict | None = None, lag_tokens: int = 1, profile=None) -> dict | None:
    """Simulate ``policy`` (a ``make_policy`` name and its ``options``) over ``tokens`` (a list of
    scheduler tokens of ``model``'s geometry) with ``slots`` per layer on ``hw``: hit rate, demand hit
    rate, experts moved per token, tokens/s, late hits, ``plan_us`` (the policy's own work per layer
    step, CPU microseconds in ``drive``) and lookahead's ``followed`` (the share of tokens its
    guard followed hybrid); None when the policy refuses the capacity."""
    hw = load_hardware(hw) if isinstance(hw, str) else hw
    geometry = model.geometry()
    costs = Costs(model, hw, ExecConfig(policy=policy))
    try:  # static with no profile: the tokens' own route counts (an oracle profile)
        pol = make_policy(policy, geometry, Capacity.per_layer(geometry, slots), profile, tokens=tokens,
                          cost_model=costs.cost_model(), **(options or {}))
    except CapacityError:
        return None
    audit = DemandAudit(geometry, keep_records=False)
    spent = [0.0]
    res = Simulator(costs).run(_timed(drive(pol, tokens, lag_tokens), spent), audit)
    s = res.summary()
    out = audit.rates()
    out.update(hit_rate=s["hit_rate"], late_hits=s["late_hits"], tokens_per_s=s["tokens_per_s"],
               plan_us=1e6 * spent[0] / max(sum(len(t.steps) for t in tokens), 1))
    guard = getattr(pol, "guard", None)
    if guard is not None:  # lookahead's: the share of tokens it followed hybrid
        out["followed"] = guard.followed / max(len(tokens), 1)
    return out


def _timed(items, spent: list):
    """``items`` (``drive``'s generator) with the CPU time spent producing them, the policy's own
    work (plan, commit, completions, background and prefetch moves), added to ``spent[0]``."""
    while True:
        t = time.process_time()
        item = next(items, None)
        spent[0] += time.process_time() - t
        if item is None:
            return
        yield item


@dataclass(frozen=True)
class Case:
    """One trace of the evaluation set: its name, family, tokens, model and two cache sizes."""

    name: str
    family: str
    tokens: tuple
    model: ModelSpec
    slots: tuple[int, int]


# synthetic families: (name, layers, experts, top-k, SynthParams fields); they span top-1..top-8,
# 8..256 experts, strong/weak temporal locality (reuse_prob) and high/low cross-layer correlation
SYNTH_FAMILIES = (
    ("synth k1 e16 weak-reuse high-cross", 12, 16, 1, dict(zipf_s=1.0, reuse_prob=0.15, cross_layer=0.9)),
    ("synth k2 e8 strong-reuse high-cross", 12, 8, 2, dict(zipf_s=0.6, reuse_prob=0.7, cross_layer=0.9)),
    ("synth k4 e64 strong-reuse low-cross", 12, 64, 4, dict(zipf_s=0.8, reuse_prob=0.7, cross_layer=0.1)),
    ("synth k8 e256 weak-reuse low-cross", 8, 256, 8, dict(zipf_s=1.2, reuse_prob=0.2, cross_layer=0.1)),
)


def synthetic_cases(num_tokens: int, seed: int = 0, base: str = DEFAULT_MODEL) -> list[Case]:
    """The synthetic families above, and the ``qwen3-30b-a3b`` preset's fitted parameters on 12
    layers (``num_tokens`` decode rows in 3 sequences each; caches of 1/4 and 1/2 of the experts)."""
    from traces import synth

    fams = [(n, L, E, k, synth.SynthParams(**p)) for n, L, E, k, p in SYNTH_FAMILIES]
    q = synth.PRESETS["qwen3-30b-a3b"]
    fams.append(("synth k8 e128 fit to qwen3", 12, q.num_experts, q.top_k, q.params))
    out = []
    for i, (name, L, E, k, params) in enumerate(fams):
        t = synth.generate(L, E, k, num_tokens, params, np.random.default_rng([seed, i]), num_seqs=3)
        out.append(Case(name, "synthetic", tuple(t.tokens()), trace_model(t, base), (max(k, E // 4), max(k, E // 2))))
    return out


def gap_closed(x: float, lo: float, hi: float) -> float | None:
    """Share of the ``lo`` -> ``hi`` gap that ``x`` closes (None when ``hi <= lo``)."""
    return None if hi <= lo else (x - lo) / (hi - lo)


def cross_validate(score: Callable[[str, int], float], cases: Iterable[str], grid_size: int) -> tuple[int, dict]:
    """Leave-one-trace-out choice among ``grid_size`` configurations. ``score(case, i)``: the
    log-ratio (summed over a case's hardware and cache sizes) of configuration ``i`` on that case.
    Returns (configuration chosen on all cases, {case: configuration chosen without it})."""
    cases = list(cases)
    table = [[score(c, i) for i in range(grid_size)] for c in cases]
    best = lambda rows: max(range(grid_size), key=lambda i: (sum(r[i] for r in rows), -i))
    held = {c: best([r for j, r in enumerate(table) if j != n]) for n, c in enumerate(cases)}
    return best(table), held


def log_ratio(x: float | None, ref: float | None) -> float:
    """log(x / ref), -inf when x is missing, 0 when the reference is."""
    if ref is None or ref <= 0:
        return 0.0
    return -math.inf if x is None or x <= 0 else math.log(x / ref)


# the policies every case is measured with (at their defaults), and the families chosen by
# cross-validation: their grids (index 0 is the family's default before selection)
BASELINES = ("lru", "freq-lru", "hybrid", "hybrid-cost", "static", "belady", "oracle", "oracle-demand", "oracle-prefetch",
             "oracle-fills")
# baselines that are a policy with options: oracle with its moves ahead of use (prefetch, fills) both off, or one
VARIANTS = {"oracle-demand": ("oracle", {"prefetch": False, "fills": False}),
            "oracle-prefetch": ("oracle", {"prefetch": True, "fills": False}),
            "oracle-fills": ("oracle", {"prefetch": False, "fills": True})}
GRIDS = {
    "predict": ({}, {"max_prefetch": 0}, {"misses": "cpu"}),
    "lookahead": tuple({"values": v, "fill_share": f, "confidence": c}
                       for v in ("recency", "adaptive", "forecast") for f in (1.0, 0.5) for c in (0.3, 0.8)),
}
# they read the replayed tokens (an oracle profile, the future)
OFFLINE = ("static", "belady", "oracle", "oracle-demand", "oracle-prefetch", "oracle-fills")


def run_set(cases: Sequence[Case], hardware: Sequence[str], baselines=BASELINES, grids=GRIDS,
            progress: Callable[[str], None] | None = None) -> dict:
    """Every baseline and every grid configuration on every case, hardware preset and cache size:
    ``{(case, hardware, slots, label): measure(...)}``, ``label`` a baseline name or ``name#i``."""
    out = {}
    hws = {h: load_hardware(h) for h in hardware}
    for c in cases:
        for h in hardware:
            for s in c.slots:
                runs = [(p, *VARIANTS.get(p, (p, None))) for p in baselines]
                runs += [(f"{n}#{i}", n, o) for n, g in grids.items() for i, o in enumerate(g)]
                for label, name, opts in runs:
                    out[c.name, h, s, label] = measure(c.tokens, c.model, hws[h], name, s, opts)
                if progress:
                    progress(f"{c.name} {h} {s} slots")
    return out


def select(res: dict, cases: Sequence[Case], hardware: Sequence[str], grids=GRIDS) -> dict:
    """{family: (default index, {case: held-out index})}: ``cross_validate`` on tokens/s over lru."""
    out = {}
    for name, grid in grids.items():
        def score(case, i, name=name):
            c = next(x for x in cases if x.name == case)
            return sum(log_ratio(_tps(res[case, h, s, f"{name}#{i}"]), _tps(res[case, h, s, "lru"]))
                       for h in hardware for s in c.slots)
        out[name] = cross_validate(score, [c.name for c in cases], len(grid))
    return out


def _tps(r: dict | None) -> float | None:
    return None if r is None else r["tokens_per_s"]


def view(res: dict, chosen: dict, held_out: bool) -> dict:
    """``res`` with each grid family under its own name: its held-out configuration per case
    (``held_out``) or its default for all (else)."""
    out = {k: v for k, v in res.items() if "#" not in k[3]}
    for (case, h, s, label), r in res.items():
        if "#" in label:
            name, i = label.split("#")
            default, held = chosen[name]
            if int(i) == (held[case] if held_out else default):
                out[case, h, s, name] = r
    return out


def summary(res: dict, cases: Sequence[Case], hardware: Sequence[str], policy: str = "lookahead") -> list[dict]:
    """Per case, hardware and cache size: ``policy``'s tokens/s over lru and over max(lru, hybrid),
    oracle's over lru, and the share of the lru -> oracle tokens/s gap it closes (``res``: a ``view``)."""
    rows = []
    for c in cases:
        for h in hardware:
            for i, s in enumerate(c.slots):
                t = {p: _tps(res.get((c.name, h, s, p))) for p in ("lru", "hybrid", "oracle", policy)}
                lru, best = t["lru"], max(x for x in (t["lru"], t["hybrid"]) if x is not None)
                rows.append({"case": c.name, "hardware": h, "slots": s, "smallest": i == 0,
                             "x_lru": t[policy] / lru if lru and t[policy] else None,
                             "oracle_x_lru": t["oracle"] / lru if lru and t["oracle"] else None,
                             "x_best": t[policy] / best if best and t[policy] else None,
                             "gap": gap_closed(t[policy], lru, t["oracle"]) if lru and t[policy] and t["oracle"] else None})
    return rows


def forecast_precision(tokens: Sequence, model: ModelSpec, slots: int, memory: float | None = None) -> dict:
    """How well lookahead's forecaster picks an early move on ``tokens``: at each step, among the
    experts absent from an ``lru`` cache of ``slots`` per layer, the share of steps where the one it
    ranks first is routed there, by the cross-layer forecast from the token's previous step (what a
    prefetch reads, ``cross``) and by the temporal one from the layer's last step (what a move at a
    token's end reads, ``temporal``), against a pick at random among them (``random``: routed absent
    experts over absent ones, averaged); ``miss``: the share of steps with a miss. Learnt online as
    lookahead learns (``PredictPolicy``'s statistics folded in at each token's end)."""
    from scheduler.cache import ABSENT
    from scheduler.core import Decision
    from scheduler.policies.lookahead import LookaheadConfig
    from scheduler.policies.predict import PredictConfig, PredictPolicy

    g = model.geometry()
    lru = make_policy("lru", g, Capacity.per_layer(g, slots))
    fc = PredictPolicy(g, Capacity.per_layer(g, g.max_experts), None,
                       PredictConfig(memory=memory or LookaheadConfig().memory, max_prefetch=0))
    n = {"cross": [0, 0], "temporal": [0, 0], "random": [0.0, 0], "miss": [0, 0]}
    for tok in tokens:
        above = None
        for step in tok.steps:
            layer, used = step.layer, set(step.experts)
            absent = np.flatnonzero(np.frombuffer(lru.cache.state[layer], np.uint8)[:g.num_experts[layer]] == ABSENT)
            if len(absent):
                for key, prev, f in (("cross", above, fc.forecast_below), ("temporal", fc.prev[layer], fc.forecast)):
                    if prev:
                        r = f(layer, prev)[absent]
                        n[key][0] += int(absent[int(np.argmax(r))]) in used
                        n[key][1] += 1
                n["random"][0] += sum(int(e) in used for e in absent) / len(absent)
                n["random"][1] += 1
            n["miss"][0] += bool(len(absent)) and any(int(e) in used for e in absent)
            n["miss"][1] += 1
            d = lru.plan(step)
            lru.commit(d)
            for e in d.uploads:
                lru.complete(layer, e)
            fc.commit(Decision(step, step.experts))
            above = step.experts
        lru.commit_background(lru.plan_background())
        fc.commit_background(())
    return {k: (a / b if b else None) for k, (a, b) in n.items()}
