"""Routing of a whole batch at one block in array operations: the same ids, weights and Step as
``execute.routing.route_weights`` row by row and ``merge_step`` (bit for bit: the same float64
operations in the same order), without a Python loop over the tokens, which costs tens of
milliseconds per block in a chunk of hundreds of tokens."""
from __future__ import annotations

import numpy as np

from scheduler import Step

__all__ = ["route_rows", "merge_rows"]


def _softmax_rows(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def route_rows(info, logits: np.ndarray, exp_probs_b=None) -> tuple[np.ndarray, np.ndarray] | None:
    """Ids ``(T, k)`` int64 (rank order, ties: lower id first) and weights ``(T, k)`` float64 of
    every row of ``logits`` ``(T, experts)`` float64 (bias added), as ``route_weights`` gives them
    row by row; None for routing with expert groups (the caller routes row by row)."""
    if info.expert_groups > 1:
        return None
    if info.gating == "softmax":
        probs = _softmax_rows(logits)
    elif info.gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:  # softmax_topk: select on the logits, softmax over the selected ones
        probs = logits
    sel = probs if exp_probs_b is None else probs + exp_probs_b
    ids = np.argsort(-sel, axis=1, kind="stable")[:, : info.top_k]
    w = np.take_along_axis(probs, ids, axis=1)
    if info.gating == "softmax_topk":
        w = _softmax_rows(w)
    if info.norm_topk:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids.astype(np.int64, copy=False), w


def merge_rows(layer: int, ids: np.ndarray, weights: np.ndarray) -> Step:
    """``merge_step(layer, ids, weights)`` of a batch of T > 1 tokens with k experts each: distinct
    experts in order of first appearance, tokens per expert, weights summed in token order."""
    flat = np.asarray(ids).reshape(-1)
    wf = np.asarray(weights, np.float64).reshape(-1)
    uniq, first = np.unique(flat, return_index=True)
    experts = uniq[np.argsort(first, kind="stable")]
    size = int(uniq[-1]) + 1 if len(uniq) else 1
    counts = np.bincount(flat, minlength=size)[experts]
    sums = np.zeros(size)
    np.add.at(sums, flat, wf)
    return Step(layer, tuple(experts.tolist()), tuple(counts.tolist()), tuple(sums[experts].tolist()))
