"""Near ties in ``moelab kld``: which top-1 disagreements rounding alone can cause.

The policy's tiles round differently from the float32 numpy reference (docs/EXECUTOR.md states
how: activations as two f16 halves, ~22 bits, float32 accumulation in another order), and a
random-weight model's next-token logits are nearly uniform, so some positions' top-1 and top-2 are
closer together than that rounding can resolve. The measure of "closer than rounding" does not come
from the policy's own run (a bug would widen it) but from a **rounding twin**: the reference run
once more, its routes forced to the reference's (the twin's own routing differences would spread
through the KV cache and measure those, not rounding), with every matrix product's output (q/k/v, attention output, router, head:
:class:`TwinModel`) and every MoE block's output ``y`` multiplied elementwise by ``1 + d``, ``d``
uniform in ``[-r, r]`` (seeded), i.e. the reference's own sensitivity to perturbations of the
path's rounding. That size (:func:`rounding`) is the halves' 2^-22 plus the typical rounding of a
float32 sum over the product's K terms in another order, ``sqrt(K) 2^-24`` (MoE outputs: K =
hidden, 3.0e-6 at 2048; the attention output: heads x head_dim). The attention's scores and
softmax, norms and residual sums are float32 in both and not perturbed.

At position ``i``, with ``a``, ``b`` the reference's top-1 and top-2 logits, the margin is
``m_i = ref[i, a] - ref[i, b]`` and the twin's spread ``s_i`` the RMS over the vocabulary of
``twin[i] - ref[i]`` less its mean (a shift of every logit changes nothing). The margin of a
difference of two logits each moved by about ``s_i`` moves by about ``sqrt(2) s_i``; the position is
a **logit near tie** when ``m_i < Z sqrt(2) s_i`` (:data:`Z` = 4: a margin that rounding of this
size flips with probability below 1e-4 under Gaussian spread is not one).

Routing likewise: at each MoE block the reference's selection values (what top-k compares:
softmax probabilities, sigmoid, or logits for softmax-over-top-k gating, plus a selection bias) and
the twin's; where the policy routed position ``i`` to a different set, the **routing margin** is
the largest ``sel[out] - sel[in]`` over the experts the reference chose and the policy did not
(``out``) and those the policy chose instead (``in``), and the bound ``Z sqrt(2)`` times the RMS of
the twin's deviation over the block's experts.

A routing difference travels: it changes its position's residual stream, so that position's later
blocks, and through the KV cache every later position's attention from the next block on. A
difference at (position i, block l) is **downstream** when an earlier one can reach it: (i, l' < l),
or (j < i, l' < l). The others are **roots**; a root whose margin is below its bound is a routing
near tie. A position's logits are **route-affected** when a root reaches them (its own, or one at
an earlier position before the last block), and a **routing near tie** when every root that
reaches them is a near tie (what caused them was a tie). Flips at positions reached by a root
beyond its bound count against agreement, as flips at unaffected positions outside logit ties do.
``spread_ratio_median_unaffected`` compares the policy's spread with the twin's where no routing
difference reaches: the numerics alone. Routing with expert groups is not analysed (its masked
values have no margin).

:func:`numerics` compares a run of the policy with the reference's routes forced (the router's own
weights of those ids): the tiles' rounding without routing differences, against the same twin.

:func:`ties` returns the figures ``moelab kld`` prints: agreement outside near ties, and every
flipped position with its margins and bounds."""
from __future__ import annotations

import numpy as np

from .backends import NumpyExperts
from .model import MoeModel

__all__ = ["Z", "JITTER", "RouterProbe", "TwinModel", "rounding", "selection", "spread", "ties", "roots", "numerics",
           "kl_divergence"]

Z = 4.0
JITTER = 2.0 ** -22  # the activation halves' relative precision (execute.prefill, prefill_dense)


def rounding(hidden: int) -> float:
    """The twin's relative perturbation for a model of width ``hidden``: the halves' 2^-22 plus
    ``sqrt(hidden) 2^-24``, the typical relative rounding of a float32 sum of ``hidden`` products
    of random sign accumulated in another order (the chunk path's against numpy's)."""
    return JITTER + float(np.sqrt(hidden)) * 2.0 ** -24
_ROWS = 64


def selection(info, logits: np.ndarray, exp_probs_b=None) -> np.ndarray:
    """The values the top-k rule compares, ``(T, experts)`` float64, from router logits (bias
    added), as ``execute.routing.route_weights`` forms them (no expert groups)."""
    x = np.asarray(logits, np.float64)
    if info.gating == "softmax":
        e = np.exp(x - x.max(axis=1, keepdims=True))
        x = e / e.sum(axis=1, keepdims=True)
    elif info.gating == "sigmoid":
        x = 1.0 / (1.0 + np.exp(-x))
    return x if exp_probs_b is None else x + exp_probs_b


class TwinModel(MoeModel):
    """The reference model of the rounding twin: every matrix product's output (q/k/v, attention
    output, router, head; dense FFNs) multiplied by ``1 + U(-r, r)`` with ``r`` =
    :func:`rounding` of its inner length (or ``size`` when given), drawn from ``rng``. The router
    logits a block routed with are kept in ``routed_logits`` for the probe."""

    def __init__(self, weights, rng: np.random.Generator, size: float | None = None, **kwargs):
        super().__init__(weights, **kwargs)
        self.rng, self.size = rng, size
        self.routed_logits = None
        self._routing = False

    def _proj(self, x, m):
        y = super()._proj(x, m)
        r = self.size if self.size is not None else rounding(int(x.shape[-1]))
        y = (y * (1.0 + self.rng.uniform(-r, r, y.shape))).astype(np.float32)
        if self._routing:
            self.routed_logits = y
        return y

    def _route(self, l: int, hn, forced):
        self._routing, self.routed_logits = True, None
        try:
            return super()._route(l, hn, forced)
        finally:
            self._routing = False


class RouterProbe(NumpyExperts):
    """The numpy reference backend that also keeps, per MoE block, each position's selection values
    ``sel[layer]`` ``(N, experts)`` and ids ``ids[layer]`` ``(N, k)``; with ``jitter`` (a seeded
    ``np.random.Generator``) every block's output is multiplied by ``1 + U(-size, size)``.
    ``model`` (set once the MoeModel exists) gives the router weights and the chunk's position."""

    def __init__(self, weights, positions: int, jitter: np.random.Generator | None = None, size: float = JITTER):
        super().__init__(weights)
        self.size = size
        self.info = weights.info
        self.model = None
        self.jitter = jitter
        self.positions = positions
        self.sel: dict[int, np.ndarray] = {}
        self.ids: dict[int, np.ndarray] = {}

    def run_layer(self, item, x, ids, weights):
        l, w = item.step.layer, self.model.layers[item.step.layer]
        xs = np.asarray(x, np.float32)
        routed = getattr(self.model, "routed_logits", None)  # a TwinModel's: what it routed with
        logits = (routed if routed is not None else (w["router"] @ xs[0])[None] if len(xs) == 1
                  else xs @ w["router"].T).astype(np.float64)
        if w["router_bias"] is not None:
            logits = logits + w["router_bias"]
        if l not in self.sel:
            self.sel[l] = np.full((self.positions, logits.shape[1]), np.nan)
            self.ids[l] = np.full((self.positions, np.asarray(ids).shape[1]), -1, np.int64)
        p = self.model.pos
        self.sel[l][p:p + len(xs)] = selection(self.info, logits, w["exp_probs_b"])
        self.ids[l][p:p + len(xs)] = ids
        y = super().run_layer(item, x, ids, weights)
        if self.jitter is not None:
            y = (y * (1.0 + self.jitter.uniform(-self.size, self.size, y.shape))).astype(np.float32)
        return y


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per row, ``KL(softmax(ref) || softmax(logits))`` in float64: ``(N, vocab)`` each -> ``(N,)``.

    A row of ``logits`` holding NaN or Inf gives inf."""
    out = np.empty(len(ref_logits))
    for i in range(0, len(ref_logits), _ROWS):
        p = np.asarray(ref_logits[i:i + _ROWS], np.float64)
        q = np.asarray(logits[i:i + _ROWS], np.float64)
        lp = p - p.max(axis=1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
        with np.errstate(invalid="ignore", over="ignore"):
            lq = q - q.max(axis=1, keepdims=True)
            lq -= np.log(np.exp(lq).sum(axis=1, keepdims=True))
            kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
        kl[~np.isfinite(q).all(axis=1)] = np.inf
        out[i:i + len(p)] = np.maximum(kl, 0.0)  # rounding can leave -1e-17 where p == q
    return out


def spread(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per row, the RMS of ``other - ref`` less the row's mean difference (float64): ``(N, V)`` -> ``(N,)``."""
    out = np.empty(len(ref))
    for i in range(0, len(ref), _ROWS):
        d = np.asarray(other[i:i + _ROWS], np.float64) - np.asarray(ref[i:i + _ROWS], np.float64)
        d -= d.mean(axis=1, keepdims=True)
        out[i:i + len(d)] = np.sqrt((d * d).mean(axis=1))
    return out


def _flips(ids: np.ndarray, sel: np.ndarray) -> int:
    """Positions whose top-k of selection values ``sel`` (N, E) is not the set ``ids`` (N, k): the
    routing decisions the twin's rounding would have changed (its routes are forced)."""
    ok = ~np.isnan(sel).any(axis=1)
    top = np.argsort(-sel[ok], axis=1, kind="stable")[:, :ids.shape[1]]
    return int((np.sort(top, axis=1) != np.sort(ids[ok], axis=1)).any(axis=1).sum())


def _policy_ids(route_log, layers, positions: int) -> dict[int, list]:
    """``route_log`` ((pos, [(layer, ids, weights)]) per position) -> per layer, each position's id set."""
    out = {l: [None] * positions for l in layers}
    for pos, rows in route_log:
        for l, ids, _ in rows:
            if l in out and pos < positions:
                out[l][pos] = set(ids)
    return out


def _route_flips(ref_probe, twin_probe, route_log, positions: int) -> dict[int, list]:
    """Per position, its blocks routed differently by the policy: ``[layer, margin, bound]`` in block order."""
    layers = sorted(ref_probe.sel)
    got = _policy_ids(route_log, layers, positions)
    out: dict[int, list] = {}
    for l in layers:
        sel, ids = ref_probe.sel[l], ref_probe.ids[l]
        s = spread(sel, twin_probe.sel[l])
        for i in range(positions):
            ref_set, pol = set(ids[i].tolist()), got[l][i]
            if pol is None or pol == ref_set:
                continue
            gone, came = sorted(ref_set - pol), sorted(pol - ref_set)
            margin = max((sel[i, a] - sel[i, b] for a in gone for b in came), default=0.0)
            out.setdefault(i, []).append([l, float(margin), float(Z * np.sqrt(2) * s[i])])
    return out


def roots(routes: dict[int, list], positions: int, last_block: int) -> tuple[dict[int, list], np.ndarray, np.ndarray]:
    """From each position's differently routed blocks (``[layer, margin, bound]`` in block order):
    the roots (position -> its first difference, when no earlier difference reaches it), and per
    position whether a root reaches its logits and whether every root that does is a near tie
    (module docstring)."""
    found: dict[int, list] = {}
    prev = None  # the smallest first-difference block over earlier positions
    for i in sorted(routes):
        first = routes[i][0]
        if prev is None or first[0] <= prev:
            found[i] = first
        prev = first[0] if prev is None else min(prev, first[0])
    affected = np.zeros(positions, bool)
    clear = np.zeros(positions, bool)  # reached by a root beyond its bound
    reach_tie = reach_clear = False  # roots at earlier positions that reach later ones
    for i in range(positions):
        own = found.get(i)
        tie_here = reach_tie or (own is not None and own[1] < own[2])
        clear_here = reach_clear or (own is not None and own[1] >= own[2])
        affected[i], clear[i] = tie_here or clear_here, clear_here
        if own is not None and own[0] < last_block:
            reach_tie, reach_clear = reach_tie or own[1] < own[2], reach_clear or own[1] >= own[2]
    return found, affected, affected & ~clear


def numerics(ref: np.ndarray, twin: np.ndarray, got: np.ndarray) -> dict:
    """A run with the reference's routes forced against the reference (both ``(N, vocab)``), with the
    twin's logit near ties: KL, top-1 agreement in all and outside logit ties, spread ratio."""
    n = len(ref)
    top2 = np.argsort(-ref, axis=1, kind="stable")[:, :2]
    rows = np.arange(n)
    margin = ref[rows, top2[:, 0]].astype(np.float64) - ref[rows, top2[:, 1]]
    s_twin, s_got = spread(ref, twin), spread(ref, got)
    tie = margin < Z * np.sqrt(2) * s_twin
    same = np.argmax(got, axis=1) == top2[:, 0]
    ratio = s_got / np.maximum(s_twin, np.finfo(np.float64).tiny)
    kl = kl_divergence(ref, got)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float(same.mean()),
            "logit_ties": int(tie.sum()), "positions_outside_ties": int((~tie).sum()),
            "top1_same_outside_ties": int((same & ~tie).sum()),
            "top1_agreement_outside_ties": float((same & ~tie).sum() / (~tie).sum()) if (~tie).any() else float("nan"),
            "flips_outside_ties": [int(i) for i in np.flatnonzero(~same & ~tie)],
            "spread_ratio_median": float(np.median(ratio)), "spread_ratio_p90": float(np.percentile(ratio, 90)),
            "spread_ratio_max": float(ratio.max())}


def ties(ref: np.ndarray, twin: np.ndarray, got: np.ndarray, ref_probe=None, twin_probe=None,
         route_log=None, grouped: bool = False, jitter: float = JITTER) -> dict:
    """The near-tie figures of logits ``(N, vocab)`` of the reference, its rounding twin and the
    policy; with the probes of both reference runs and the policy's route log, routing too."""
    n = len(ref)
    top2 = np.argsort(-ref, axis=1, kind="stable")[:, :2]
    a, b = top2[:, 0], top2[:, 1]
    rows = np.arange(n)
    margin = ref[rows, a].astype(np.float64) - ref[rows, b]
    s_twin, s_got = spread(ref, twin), spread(ref, got)
    bound = Z * np.sqrt(2) * s_twin
    logit_tie = margin < bound
    routes = None if route_log is None or ref_probe is None or grouped else _route_flips(
        ref_probe, twin_probe, route_log, n)
    root, affected, route_tie = {}, np.zeros(n, bool), np.zeros(n, bool)
    if routes is not None:
        root, affected, route_tie = roots(routes, n, max(ref_probe.sel))
    tie = logit_tie | route_tie
    same = np.argmax(got, axis=1) == a
    outside = ~tie
    flips = []
    for i in np.flatnonzero(~same):
        blocks = (routes or {}).get(int(i), [])
        flips.append({"position": int(i), "ref_top2": [int(a[i]), int(b[i])], "margin": float(margin[i]),
                      "bound": float(bound[i]), "policy_margin": float(got[i, a[i]] - got[i, b[i]]),
                      "spread_policy": float(s_got[i]), "spread_twin": float(s_twin[i]),
                      "logit_tie": bool(logit_tie[i]), "route_tie": bool(route_tie[i]),
                      "route_affected": bool(affected[i]),
                      "blocks_routed_differently": len(blocks), "first_route_difference": blocks[0] if blocks else None})
    ratio = s_got / np.maximum(s_twin, np.finfo(np.float64).tiny)
    own = margin < Z * np.sqrt(2) * s_got  # the policy's own spread as the bound (a check, not the measure)
    out = {"z": Z, "jitter": jitter, "near_ties": int(tie.sum()), "logit_ties": int(logit_tie.sum()),
           "route_ties": int(route_tie.sum()), "positions_outside_ties": int(outside.sum()),
           "top1_same_outside_ties": int((same & outside).sum()),
           "top1_agreement_outside_ties": float((same & outside).sum() / outside.sum()) if outside.any() else float("nan"),
           "twin_top1_agreement": float(np.mean(np.argmax(twin, axis=1) == a)),
           "own_spread_ties": int(own.sum()), "flips_within_own_spread": int((own & ~same).sum()),
           "spread_ratio_median": float(np.median(ratio)), "spread_ratio_max": float(ratio.max()),
           "routes_analysed": routes is not None, "flips": flips}
    if routes is not None:
        clean = ~affected
        out["route_roots"] = [[i, *r] for i, r in sorted(root.items())]
        out["route_root_ties"] = int(sum(r[1] < r[2] for r in root.values()))
        out["positions_route_affected"] = int(affected.sum())
        out["first_route_difference_position"] = min(routes) if routes else None
        out["spread_ratio_median_unaffected"] = float(np.median(ratio[clean])) if clean.any() else float("nan")
        out["positions_routed_differently"] = len(routes)
        out["blocks_routed_differently"] = sum(len(v) for v in routes.values())
        out["twin_route_flips"] = sum(_flips(ref_probe.ids[l], twin_probe.sel[l]) for l in ref_probe.ids)
    return out
