"""A layer step's (expert, token) pairs in destination order, as the expert engine's grouped path
runs them: the GPU experts' pairs (hits, uploads, streams) first, then the CPU pairs; within an
expert, tokens ascend."""
from __future__ import annotations

import numpy as np

from scheduler.core import Decision

from .experts import ExecutorError

__all__ = ["gather_pairs"]

_SMALL_PAIRS = 512  # gather_pairs works on Python lists up to this many pairs, else numpy


def _pair_lists(decision: Decision, ids: np.ndarray) -> tuple[list, list, list, int, tuple]:
    """gather_pairs on Python lists (small steps): (experts, tokens, pair_of flat, n_gpu, gpu)."""
    t, k = ids.shape
    gpu = decision.hits + decision.uploads + decision.streams
    rank = {e: i for i, e in enumerate(gpu + decision.cpu)}
    flat = ids.ravel().tolist()
    try:
        keys = [rank[e] for e in flat]
    except KeyError:
        missing = sorted({e for e in flat if e not in rank})
        raise ExecutorError(f"layer {decision.layer}: routed experts {missing} are not in the decision") from None
    order = sorted(range(t * k), key=keys.__getitem__)  # stable: tokens ascend within an expert
    pair_of = [0] * (t * k)
    for i, p in enumerate(order):
        pair_of[p] = i
    n = len(gpu)
    return [flat[p] for p in order], [p // k for p in order], pair_of, sum(r < n for r in keys), gpu


def _pair_arrays(decision: Decision, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """gather_pairs with numpy (large steps)."""
    t, k = ids.shape
    gpu = np.asarray(decision.hits + decision.uploads + decision.streams, np.int64)
    dest = np.concatenate([gpu, np.asarray(decision.cpu, np.int64)])
    rank = np.full(max(int(ids.max(initial=0)), int(dest.max(initial=0))) + 1, -1, np.int64)
    rank[dest] = np.arange(len(dest))
    flat = ids.reshape(-1).astype(np.int64)
    r = rank[flat]
    if (r < 0).any():
        missing = sorted(set(flat[r < 0].tolist()))
        raise ExecutorError(f"layer {decision.layer}: routed experts {missing} are not in the decision")
    tok = np.repeat(np.arange(t), k)
    order = np.lexsort((tok, r))
    pair_of = np.empty(t * k, np.int64)
    pair_of[order] = np.arange(t * k)
    n_gpu = int((r < len(gpu)).sum())
    return flat[order], tok[order], pair_of.reshape(t, k), n_gpu, gpu


def gather_pairs(decision: Decision, topk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """Pairs in destination order: (pair_expert, pair_token, pair_of (T, k), n_gpu, gpu_experts).

    GPU experts (hits, uploads, streams) come first, then cpu; within an expert, tokens ascend.
    ``pair_of[t, j]`` is the pair of ``topk_ids[t, j]``. ExecutorError when a routed expert is
    missing from the decision.
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids: expected (tokens, k), got shape {ids.shape}")
    if ids.size > _SMALL_PAIRS:
        return _pair_arrays(decision, ids)
    experts, tok, pair_of, n_gpu, gpu = _pair_lists(decision, ids)
    return (np.array(experts, np.int64), np.array(tok, np.int64), np.array(pair_of, np.int64).reshape(ids.shape),
            n_gpu, np.array(gpu, np.int64))
