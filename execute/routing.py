"""Routing of tokens at one block, on the host: the top-k rule of every gating
(``route_weights``, float64, ties: lower id first), a forced route (``Route``, trace replay), the
scheduler Step of a batch (``merge_step``: distinct experts, token counts, summed weights) and the
next block's router measured as a predictor of its experts (``RouterPredictor``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from scheduler import Step

__all__ = ["Route", "softmax_topk", "route_weights", "merge_step", "RouterPredictor"]


def softmax_topk(probs: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` ids of a probability vector (descending, ties: lower id first) and their weights."""
    ids = np.argsort(-probs, kind="stable")[:k]
    w = probs[ids]
    return ids, (w / w.sum() if norm else w)


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _group_mask(scores: np.ndarray, groups: int, used: int) -> np.ndarray:
    """``scores`` with the experts outside the ``used`` best groups set to -inf; a group's score
    is the sum of its two best expert scores (llama.cpp / DeepSeek V3)."""
    g = scores.reshape(groups, -1)
    best = -np.sort(-g, axis=1)[:, : min(2, g.shape[1])].sum(axis=1)  # (groups,)
    keep = np.argsort(-best, kind="stable")[:used]
    out = np.full_like(g, -np.inf)
    out[keep] = g[keep]
    return out.reshape(-1)


def route_weights(info, logits: np.ndarray, exp_probs_b=None, forced: "Route | None" = None):
    """Expert ids (rank order) and weights of one token at one block from its router logits
    (float64, bias already added), by ``info.gating`` (see ``execute.archs``)."""
    if info.gating == "softmax":
        probs = _softmax(logits)
    elif info.gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:  # softmax_topk: select on the logits, softmax over the selected ones
        probs = logits
    if forced is not None:
        ids = np.asarray(forced.experts, dtype=np.int64)
        if forced.weights is not None:
            return ids, np.asarray(forced.weights, dtype=np.float64)
    else:
        sel = probs if exp_probs_b is None else probs + exp_probs_b
        if info.expert_groups > 1:
            sel = _group_mask(sel, info.expert_groups, info.expert_groups_used)
        ids = np.argsort(-sel, kind="stable")[: info.top_k]
    w = probs[ids]
    if info.gating == "softmax_topk":
        w = _softmax(w)
    if info.norm_topk:
        w = w / max(w.sum(), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids, w


@dataclass(frozen=True, slots=True)
class Route:
    """A forced routing for one block: expert ids in rank order, and weights when known."""

    experts: tuple[int, ...]
    weights: tuple[float, ...] | None = None


def merge_step(layer: int, ids: np.ndarray, weights: np.ndarray | None, lengths: Sequence[int] | None = None) -> Step:
    """The Step of a batch at one block from each token's ids and weights ``(T, k)`` (row t's first
    ``lengths[t]`` entries): distinct experts in order of first appearance, ``counts`` = tokens per
    expert, weights summed in token order. One token: ``counts`` None and its own weights."""
    lengths = [ids.shape[1]] * len(ids) if lengths is None else lengths
    w = [None] * len(ids) if weights is None else np.asarray(weights).tolist()
    return _merge(layer, [(r[:n], None if v is None else v[:n]) for r, v, n in zip(np.asarray(ids).tolist(), w, lengths)])


def _merge(layer: int, parts: Sequence[tuple[Sequence[int], Sequence[float] | None]]) -> Step:
    """``merge_step`` on per-token (experts, weights or None) in rank order."""
    if len(parts) == 1:
        e, w = parts[0]
        return Step(layer, tuple(int(x) for x in e), None, None if w is None else tuple(float(v) for v in w))
    acc: dict[int, list] = {}
    known = all(w is not None for _, w in parts)
    for experts, ws in parts:
        for i, e in enumerate(experts):
            a = acc.get(e)
            v = ws[i] if known else 0.0
            if a is None:
                acc[e] = [1, v]
            else:
                a[0] += 1
                a[1] += v
    return Step(layer, tuple(int(e) for e in acc), tuple(a[0] for a in acc.values()),
                tuple(float(a[1]) for a in acc.values()) if known else None)


class RouterPredictor:
    """How well the next block's router, applied to the current block's hidden state, predicts the
    next block's experts: a measurement, set on :attr:`MoeModel.router_predictor` (None: off).

    At MoE block l followed by MoE block l + 1, each token's prediction is block l + 1's routing
    rule (:func:`route_weights`: gating, selection bias, groups; ties: lower id) on block l + 1's
    router logits (bias added) of block l's residual stream after attention, normed by block
    l + 1's ffn norm weight: what block l + 1 computes, on the state block l's experts have not yet
    added to. When block l + 1 routes, its experts are looked up in the predicted top-k and top-2k
    (at most the block's experts). Counts per phase (``phase``, set by :meth:`phased` for each
    batch ``run`` drives) and predicted block; a forced route (trace replay) is the actual one."""

    def __init__(self, info):
        import dataclasses

        moe = [n for n in info.num_experts if n]
        self.k = info.top_k
        self.num_experts = min(moe) if moe else 0
        self._wide = dataclasses.replace(info, top_k=min(2 * self.k, max(self.num_experts, 1)))
        self.phase = "decode"
        self.pending: dict[int, np.ndarray] = {}  # block -> (T, 2k) predicted ids in rank order
        self.counts: dict[tuple[str, int], list[int]] = {}  # (phase, block) -> [positions, routed, hits@k, hits@2k]

    def phased(self, phase: str, steps):
        """``steps`` (a batch's generator), counted under ``phase`` from its first step on."""
        self.phase = phase
        self.pending.clear()
        yield from steps

    def predict(self, layer: int, logits: np.ndarray, exp_probs_b) -> None:
        """Predict block ``layer``'s experts from router logits ``(T, experts)`` float64."""
        self.pending[layer] = np.stack([route_weights(self._wide, row, exp_probs_b)[0] for row in logits])

    def observe(self, layer: int, ids: np.ndarray, lengths: Sequence[int]) -> None:
        """Block ``layer``'s routing (row t's first ``lengths[t]`` ids) against its prediction, if any."""
        pred = self.pending.pop(layer, None)
        if pred is None:
            return
        c = self.counts.setdefault((self.phase, layer), [0, 0, 0, 0])
        for row, n, p in zip(np.asarray(ids).tolist(), lengths, pred.tolist()):
            got = set(row[:n])
            c[0] += 1
            c[1] += len(got)
            c[2] += len(got.intersection(p[: self.k]))
            c[3] += len(got.intersection(p))

    def summary(self) -> dict:
        """Recall at k and at 2k (share of the routed experts found in the predicted top-k, top-2k;
        ``top_2k`` is 2k capped at the experts) per phase, overall and per predicted block, with the
        recall of a uniform guess (``chance_*``)."""
        E, wide = self.num_experts, self._wide.top_k
        out = {"k": self.k, "top_2k": wide, "chance_k": self.k / E if E else None,
               "chance_2k": wide / E if E else None}

        def figures(c) -> dict:
            return {"positions": c[0], "routed": c[1], "recall_k": c[2] / c[1] if c[1] else None,
                    "recall_2k": c[3] / c[1] if c[1] else None}

        for phase in ("prefill", "decode"):
            layers = sorted(l for p, l in self.counts if p == phase)
            rows = [self.counts[phase, l] for l in layers]
            total = [sum(c[i] for c in rows) for i in range(4)]
            total[0] = max((c[0] for c in rows), default=0)  # positions: each is counted at every block
            out[phase] = {**figures(total), "per_layer": [{"layer": l, **figures(c)} for l, c in zip(layers, rows)]}
        return out
