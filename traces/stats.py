"""Statistics of a trace: coverage, adjacent-token overlap, reuse distances, and hit-rate sweeps.

Two kinds of hit rate:

- ``lru_hit_rates``: a reference per-layer LRU in numpy (all of a step's experts are requested at
  once; hits are those resident at the start of the step; then the step's experts become most
  recent, later router ranks more recent, and only the ``C`` most recent stay). It also works with
  fewer slots than top-k, which the scheduler's ``lru`` refuses.
- ``sweep``: the scheduler's own policies replayed over the trace (``scheduler.replay``, no timing:
  a prefetch lands at once, so it counts as a hit whatever the link). ``summarize(timed=...)`` runs
  them through a timed backend instead (``moelab trace stats`` passes the simulator), so that a
  prefetch landing after its step is no hit, as in ``moelab simulate``. Both report the *demand*
  hit rate beside the hit rate (``DemandAudit``: hits resident before any prefetch of the step).
  ``hybrid-cost`` prices its split with ``default_cost_model`` (the simulator's default model and
  hardware), so its hit rate depends on that preset. ``summarize`` also reports each replay's
  experts moved over PCIe per token (uploads, streams, fills and swaps).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from scheduler import Audit, AwaitBackground, Capacity, CapacityError, Profile, RunLayer, make_policy, replay

from .format import Trace

__all__ = ["DemandAudit", "default_cost_model", "coverage", "adjacent_overlap", "layer_novelty_correlation", "reuse_distances", "lru_hit_rates",
           "sweep", "summarize", "COVERAGE_SHARES"]

COVERAGE_SHARES = (0.5, 0.8, 0.9)


class DemandAudit(Audit):
    """An :class:`~scheduler.Audit` that also counts *demand hits*: hits on experts that were
    resident before any background copy (prefetch or fill) completed since the previous step, i.e.
    what a cache without that step's prefetch would have hit. ``demand_hits`` <= ``hits``."""

    def __init__(self, geometry, **kw):
        super().__init__(geometry, **kw)
        self.demand_hits = 0
        self._fresh: set[tuple[int, int]] = set()

    def observe(self, item) -> None:
        t = type(item)
        if t is RunLayer:
            d = item.decision
            fresh, layer = self._fresh, d.step.layer
            self.demand_hits += sum(1 for e in d.hits if (layer, e) not in fresh) if fresh else len(d.hits)
            fresh.clear()
        elif t is AwaitBackground:
            self._fresh.update((m.layer, m.expert) for m in item.moves)
        super().observe(item)

    def rates(self) -> dict:
        """hit rate, demand hit rate and experts moved over PCIe per token (uploads, streams,
        fills and swaps)."""
        t = self.totals
        served = t["hits"] + t["uploads"] + t["streams"] + t["cpu"]
        moved = t["uploads"] + t["streams"] + t["fills"] + t["swaps"]
        return {"hit_rate": t["hits"] / served if served else 0.0,
                "demand_hit_rate": self.demand_hits / served if served else 0.0,
                "moved_per_token": moved / self.tokens if self.tokens else 0.0}


def _ids(trace: Trace, phase: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids of the MoE layers of the phase's rows (T, L', k) as int64, their sequence ids)."""
    rows = trace.rows(phase)
    moe = list(trace.moe_layers)
    return np.asarray(trace.expert_ids[rows])[:, moe].astype(np.int64), np.asarray(trace.seq[rows])


def coverage(trace: Trace, phase: str | None = None, shares: Sequence[float] = COVERAGE_SHARES) -> dict[str, float]:
    """Share of all (layer, expert) pairs that carry ``share`` of the activations (fewest pairs)."""
    counts = trace.routing_counts(phase)[list(trace.moe_layers)]
    pairs = sum(trace.num_experts)
    flat = np.sort(counts.ravel())[::-1]
    total = flat.sum()
    out = {}
    for s in shares:
        n = int(np.searchsorted(np.cumsum(flat), s * total - 1e-9) + 1) if total else 0
        out[f"{int(round(s * 100))}%"] = n / pairs
    out["touched"] = float((flat > 0).sum() / pairs)
    return out


def _overlaps(ids: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Per consecutive row pair of one sequence and per layer: shared experts / k, shape (N, L)."""
    same = seq[1:] == seq[:-1]
    a, b = ids[1:][same], ids[:-1][same]  # (N, L, k)
    k = ids.shape[2]
    out = np.empty(a.shape[:2])
    step = 16384
    for i in range(0, len(a), step):
        x, y = a[i:i + step], b[i:i + step]
        hit = ((x[..., :, None] == y[..., None, :]) & (x[..., :, None] >= 0)).any(axis=-1)
        out[i:i + step] = hit.sum(axis=-1) / k
    return out


def adjacent_overlap(trace: Trace, phase: str | None = None) -> float:
    """Mean share of a token's experts (per layer) also routed at the previous token of its sequence."""
    ids, seq = _ids(trace, phase)
    ov = _overlaps(ids, seq)
    return float(ov.mean()) if ov.size else 0.0


def layer_novelty_correlation(trace: Trace, phase: str | None = None) -> float:
    """Mean correlation, over pairs of layers, of per-token novelty (1 - overlap with the previous token).

    High when a token that departs from its context does so at every layer at once."""
    ids, seq = _ids(trace, phase)
    nov = 1.0 - _overlaps(ids, seq)
    if len(nov) < 3 or nov.shape[1] < 2:
        return 0.0
    sd = nov.std(axis=0)
    keep = sd > 0
    if keep.sum() < 2:
        return 0.0
    c = np.corrcoef(nov[:, keep].T)
    n = c.shape[0]
    return float((c.sum() - n) / (n * (n - 1)))


def _lru_sweep(ids: np.ndarray, seq: np.ndarray, E: int, capacities: Sequence[int], reset: bool):
    """Hits per capacity and reuse distances, by per-layer recency stamps (see the module docstring)."""
    T, L, k = ids.shape
    caps = np.asarray(capacities)
    stamp = np.full((L, E + 1), -1, dtype=np.int64)  # column E absorbs masked (-1) entries
    last_tok = np.full((L, E + 1), -1, dtype=np.int64)
    hits = np.zeros(len(caps), dtype=np.int64)
    routed = 0
    dists = []
    lrow = np.arange(L)[:, None]
    rank_stamp = np.arange(k)[None, :]
    for t in range(T):
        if t and reset and seq[t] != seq[t - 1]:
            stamp.fill(-1)
            last_tok.fill(-1)
        e = ids[t]
        e = np.where(e >= 0, e, E)
        valid = e < E
        s = stamp[lrow, e]  # (L, k)
        order = -np.sort(-stamp[:, :E], axis=1)  # (L, E) descending
        cols = np.minimum(caps, E) - 1
        thr = order[:, cols]  # (L, C): stamp of the C-th most recent
        res = (s[:, :, None] >= thr[:, None, :]) & (s[:, :, None] >= 0) & valid[:, :, None]
        hits += res.sum(axis=(0, 1))
        routed += int(valid.sum())
        lt = last_tok[lrow, e]
        dists.append((t - lt)[valid & (lt >= 0)])
        stamp[lrow, e] = t * k + rank_stamp
        last_tok[lrow, e] = t
    return hits, routed, np.concatenate(dists) if dists else np.zeros(0, np.int64)


def lru_hit_rates(trace: Trace, capacities: Sequence[int], phase: str | None = None,
                  reset_per_sequence: bool = False) -> dict[int, float]:
    """Reference per-layer LRU hit rate at each capacity (slots per layer, each >= 1; see the module
    docstring)."""
    bad = [c for c in capacities if int(c) < 1]
    if bad:
        raise ValueError(f"capacities: {bad[0]} slots, expected cache sizes >= 1 slot")
    ids, seq = _ids(trace, phase)
    hits, routed, _ = _lru_sweep(ids, seq, max(trace.num_experts), capacities, reset_per_sequence)
    return {int(c): (float(h) / routed if routed else 0.0) for c, h in zip(capacities, hits)}


def reuse_distances(trace: Trace, phase: str | None = None, reset_per_sequence: bool = False) -> dict:
    """Tokens since the same (layer, expert) was last routed, over routes that had a previous use."""
    ids, seq = _ids(trace, phase)
    _, routed, d = _lru_sweep(ids, seq, max(trace.num_experts), [1], reset_per_sequence)
    if not len(d):
        return {"routes": routed, "first_use": routed}
    q = np.percentile(d, [50, 90, 99])
    return {"routes": routed, "first_use": routed - len(d), "median": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "share_1": float((d == 1).mean()), "share_le_4": float((d <= 4).mean()),
            "share_le_16": float((d <= 16).mean())}


def default_cost_model(trace: Trace):
    """A ``scheduler.CostModel`` for ``trace``: the simulator's default model on its default
    hardware (``scheduler.costs.DEFAULT_MODEL`` and ``DEFAULT_HARDWARE``, the simulator's defaults); when the trace's geometry differs, that model's first MoE
    layer's costs on every layer of the trace."""
    from scheduler import CostModel
    from scheduler.costs import DEFAULT_HARDWARE, DEFAULT_MODEL, Costs, ExecConfig
    from scheduler.hardware import load_hardware
    from scheduler.models import load_model

    model = load_model(DEFAULT_MODEL)
    cm = Costs(model, load_hardware(DEFAULT_HARDWARE), ExecConfig()).cost_model()
    if tuple(model.geometry().num_experts) == tuple(trace.num_experts):
        return cm
    l, n = model.geometry().moe_layers[0], trace.num_layers
    pick = lambda v: None if v is None else (v[l],) * n
    return CostModel(pick(cm.gpu_expert_s), pick(cm.gpu_token_s), pick(cm.upload_s), pick(cm.cpu_expert_s),
                     pick(cm.cpu_token_s), cm.cpu_task_s, pick(cm.gpu_read_s), pick(cm.cpu_read_s),
                     pick(cm.layer_s), cm.cpu_delay_s, cm.cpu_copy_s, cm.cpu_combine_s,
                     cm.gpu_batch_s)


def _replay_rate(trace: Trace, name: str, slots: int, phase: str | None, seqs: list[list[int]],
                 timed=None) -> dict | None:
    """Hit rate, demand hit rate and experts moved over PCIe per token of scheduler policy ``name``
    at ``slots`` per layer (and tokens/s when ``timed``); None when it refuses the capacity.

    ``timed(tokens, name, slots)``: a run with the link and the CPU charged (``moelab trace stats``
    passes the simulator's, ``simulate.evaluate.measure``), returning those figures, or None."""
    geometry = trace.geometry(1)
    capacity = Capacity.per_layer(geometry, slots)
    sums = dict.fromkeys(("hits", "demand", "served", "moved", "tokens", "seconds"), 0.0)
    for group in seqs:
        part = trace if group is None else trace.select(phase, group)
        toks = list(part.tokens(phase if group is None else None))
        if timed is not None:
            r = timed(toks, name, slots)
            if r is None:
                return None
            n = len(toks)
            served = n * geometry.top_k * len(geometry.moe_layers)  # decode rows: top_k each
            sums["hits"] += r["hit_rate"] * served
            sums["demand"] += r["demand_hit_rate"] * served
            sums["served"] += served
            sums["moved"] += r["moved_per_token"] * n
            sums["tokens"] += n
            sums["seconds"] += n / r["tokens_per_s"] if r["tokens_per_s"] else 0.0
            continue
        try:
            kw = {}  # belady's future: the steps of toks
            if name in ("hybrid-cost", "lookahead", "oracle"):
                kw["cost_model"] = default_cost_model(trace)
            if name == "static":
                kw["profile"] = Profile.from_counts(part.routing_counts(phase if group is None else None))
            policy = make_policy(name, geometry, capacity, tokens=toks, **kw)
        except CapacityError:
            return None
        audit = replay(policy, toks, lag_tokens=0, audit=DemandAudit(geometry, keep_records=False))
        t = audit.totals
        served = t["hits"] + t["uploads"] + t["streams"] + t["cpu"]
        sums["hits"] += t["hits"]
        sums["demand"] += audit.demand_hits
        sums["served"] += served
        sums["moved"] += t["uploads"] + t["streams"] + t["fills"] + t["swaps"]
        sums["tokens"] += audit.tokens
    sv, n = sums["served"] or 1.0, sums["tokens"] or 1.0
    out = {"hit_rate": sums["hits"] / sv, "demand_hit_rate": sums["demand"] / sv, "moved_per_token": sums["moved"] / n}
    if timed is not None:
        out["tokens_per_s"] = sums["tokens"] / sums["seconds"] if sums["seconds"] else 0.0
    return out


def sweep(trace: Trace, slots: Sequence[int], policies: Sequence[str], phase: str | None = None,
          reset_per_sequence: bool = False, progress: bool = False) -> dict[str, dict[int, float | None]]:
    """Hit rate of each scheduler policy at each slot count, replaying the phase's rows in order.

    Caches carry across sequences unless ``reset_per_sequence`` (then a fresh policy per sequence,
    hits and routes summed). ``static`` gets the oracle top-C profile of the replayed rows (per
    sequence when reset). None marks a capacity the policy refuses (e.g. ``lru`` below top-k)."""
    with _bar(progress, len(policies) * len(slots)) as bar:
        both = _sweep(trace, slots, policies, phase, reset_per_sequence, bar)
    return {p: {c: None if r is None else r["hit_rate"] for c, r in v.items()} for p, v in both.items()}


def _bar(show: bool, total: int):
    """``trace stats``'s progress bar on stderr (a disabled one when not ``show``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="step", desc="trace stats", disable=not show, file=sys.stderr, dynamic_ncols=True)


def _sweep(trace, slots, policies, phase, reset_per_sequence, bar, timed=None) -> dict:
    """``sweep``'s replays: ``_replay_rate``'s figures or None, per policy and slot count; ``bar``
    advances by one per replay."""
    groups = [[s] for s in trace.select(phase).sequences()] if reset_per_sequence else [None]
    out: dict[str, dict[int, tuple[float, float] | None]] = {}
    for name in policies:
        out[name] = {}
        for c in slots:
            bar.set_postfix_str(f"{name} at {c} slots", refresh=False)
            out[name][int(c)] = _replay_rate(trace, name, int(c), phase, groups, timed)
            bar.update()
    return out


def summarize(trace: Trace, phase: str | None = None, slots: Sequence[int] = (), policies: Sequence[str] = (),
              reset_per_sequence: bool = False, progress: bool = False, timed=None) -> dict:
    """Everything ``moelab trace stats`` reports, as a JSON-ready dict; ``progress``: a bar of its
    statistics and replays on stderr; ``timed``: see ``_replay_rate`` (then the policies' figures,
    hit rates included, are the simulator's, and ``tokens_per_s`` is added)."""
    rows = trace.rows(phase)
    with _bar(progress, 5 + len(policies) * len(slots)) as bar:
        def step(name: str, fn, *args):
            bar.set_postfix_str(name, refresh=False)
            value = fn(*args)
            bar.update()
            return value

        out = {
            "model": trace.model,
            "rows": int(len(rows)),
            "sequences": len(trace.select(phase).sequences()) if len(rows) else 0,
            "phase": phase or "all",
            "geometry": {"num_layers": trace.num_layers, "num_experts": list(trace.num_experts), "top_k": trace.top_k},
            "reset_per_sequence": reset_per_sequence,
            "coverage": step("coverage", coverage, trace, phase),
            "adjacent_overlap": step("adjacent overlap", adjacent_overlap, trace, phase),
            "layer_novelty_correlation": step("cross-layer novelty", layer_novelty_correlation, trace, phase),
            "reuse_distance": step("reuse distances", reuse_distances, trace, phase, reset_per_sequence),
            "reference_lru": {str(c): r for c, r in step("reference LRU", lru_hit_rates, trace, slots, phase,
                                                         reset_per_sequence).items()} if slots else {},
        }
        if not slots:
            bar.update()
        both = _sweep(trace, slots, policies, phase, reset_per_sequence, bar, timed)
    pick = lambda key: {p: {str(c): None if r is None else r[key] for c, r in v.items()} for p, v in both.items()}
    out["hit_rate"] = pick("hit_rate")
    out["demand_hit_rate"] = pick("demand_hit_rate")
    out["pcie_experts_per_token"] = pick("moved_per_token")
    if timed is not None:
        out["tokens_per_s"] = pick("tokens_per_s")
    return out
