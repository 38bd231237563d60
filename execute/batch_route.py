"""Routing of a whole batch at one block in array operations: the same ids, weights and Step as
``execute.routing.route_weights`` row by row and ``merge_step`` (bit for bit: the same float64
operations in the same order), without a Python loop over the tokens, which costs tens of
milliseconds per block in a chunk of hundreds of tokens."""
from __future__ import annotations

import numpy as np

from scheduler import Step

__all__ = ["route_rows", "merge_rows", "settle", "stable_order", "group_pairs", "max_tiles"]


def _softmax_rows(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _top_k(sel: np.ndarray, k: int) -> np.ndarray:
    """``np.argsort(-sel, axis=1, kind="stable")[:, :k]`` (largest first, ties: lower id first)
    without sorting whole rows: each row's k-th largest value by a partition, the ids above it and
    the lowest-id ties at it (exactly k per row), then those k sorted. Rows with NaN take the sort."""
    n = sel.shape[1]
    if k >= n or not np.isfinite(sel).all():
        return np.argsort(-sel, axis=1, kind="stable")[:, :k]
    kth = -np.partition(-sel, k - 1, axis=1)[:, k - 1:k]  # (T, 1): the k-th largest value
    above = sel > kth
    tied = sel == kth
    need = k - above.sum(axis=1, keepdims=True)  # >= 1: the k-th value itself is tied
    pick = above | (tied & (np.cumsum(tied, axis=1) <= need))
    cand = np.nonzero(pick)[1].reshape(len(sel), k)  # ids ascending in each row
    order = np.argsort(-np.take_along_axis(sel, cand, axis=1), axis=1, kind="stable")
    return np.take_along_axis(cand, order, axis=1)


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
    ids = _top_k(sel, info.top_k)
    w = np.take_along_axis(probs, ids, axis=1)
    if info.gating == "softmax_topk":
        w = _softmax_rows(w)
    if info.norm_topk:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids.astype(np.int64, copy=False), w


def stable_order(a: np.ndarray) -> np.ndarray:
    """``np.argsort(a, kind="stable")`` of 1-D integers; values in 0..32767 sort as int16 (numpy's
    radix sort: a few times faster than the merge sort of wider integers, the same order)."""
    if len(a) and a.dtype.kind in "iu" and int(a.min()) >= 0 and int(a.max()) < 1 << 15:
        a = a.astype(np.int16)
    return np.argsort(a, kind="stable")


def merge_rows(layer: int, ids: np.ndarray, weights: np.ndarray) -> Step:
    """``merge_step(layer, ids, weights)`` of a batch of T > 1 tokens with k experts each: distinct
    experts in order of first appearance, tokens per expert, weights summed in token order."""
    flat = np.asarray(ids).reshape(-1)
    wf = np.asarray(weights, np.float64).reshape(-1)
    order = stable_order(flat)
    s = flat[order]
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1]))) if len(s) else np.zeros(0, np.int64)
    uniq = s[starts]
    experts = uniq[np.argsort(order[starts])]  # by first appearance (distinct positions)
    size = int(uniq[-1]) + 1 if len(uniq) else 1
    counts = np.bincount(flat, minlength=size)[experts]
    sums = np.bincount(flat, weights=wf, minlength=size)  # in index order from 0.0, as np.add.at
    return Step(layer, tuple(experts.tolist()), tuple(counts.tolist()), tuple(sums[experts].tolist()))


def max_tiles(pairs: int, experts: int, tile_rows: int = 32) -> int:
    """Tiles of at most ``tile_rows`` rows that ``pairs`` rows grouped over ``experts`` experts can
    need: each expert's group adds at most one partial tile."""
    return -(-pairs // tile_rows) + min(experts, pairs)


def group_pairs(ids: np.ndarray, experts: int, tile_rows: int = 32, tiles: int | None = None):
    """The grouping of a chunk's (token, rank) pairs that ``pf_group`` computes on the device (its
    reference): ids ``(T, k)`` in ``0 .. experts - 1`` -> ``tok`` (the token of each row: pairs
    sorted by expert, tokens ascending within one), ``pair_of`` (each pair's row, token-major), and
    tiles ``(row, n, expert)`` of up to ``tile_rows`` rows of one expert, experts ascending, padded
    with ``(0, 0, 0)`` to ``tiles`` entries (default :func:`max_tiles`)."""
    ids = np.asarray(ids)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = stable_order(flat)
    pair_of = np.empty(len(flat), np.int32)
    pair_of[order] = np.arange(len(flat), dtype=np.int32)
    counts = np.bincount(flat, minlength=experts)
    starts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    ntile = -(-counts // tile_rows)
    g = np.repeat(np.arange(experts), ntile)
    j = np.arange(len(g)) - np.repeat(np.cumsum(ntile) - ntile, ntile)
    n_t = max_tiles(len(flat), experts, tile_rows) if tiles is None else tiles
    out = np.zeros((3, n_t), np.int32)
    out[:, : len(g)] = starts[g] + j * tile_rows, np.minimum(tile_rows, counts[g] - j * tile_rows), g
    return (order // k).astype(np.int32), pair_of, out


def settle(model, kept, rows):
    """Yield the Step of each MoE block of a chunk already run, in block order (``kept``: (layer, ids
    ``(T, k)``, float64 weights ``(T, k)``)), the model's per-step state set as block by block leaves
    it; ``rows``: the per-token route log, appended to (or None)."""
    for l, ids, wts in kept:
        model.last_input, model.last_ids, model.last_weights = None, ids, wts.astype(np.float32)
        model._out = None
        if rows is not None:  # one conversion per block (per row: ~2x the host time of a recorded chunk)
            for row, i, w in zip(rows, ids.tolist(), wts.tolist()):
                row.append((l, i, w))
        model.step_done = True
        try:
            yield merge_rows(l, ids, wts)
        finally:
            model.step_done = False
