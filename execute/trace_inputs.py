"""Traces driving the executor: a trace checked against (``check_trace``) or folded onto
(``fold_trace``) the model's geometry, its recorded batches (``trace_batches``), and its rows as
scheduler Tokens (``trace_tokens``, for ``scheduler.replay``) or as run inputs with forced routes
(``trace_inputs``)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from .driver import ChunkInput, TokenInput
from .experts import ExecutorError
from .routing import Route, _merge

__all__ = ["check_trace", "fold_trace", "trace_batches", "trace_tokens", "trace_inputs"]


def check_trace(trace, info) -> None:
    """Raise ExecutorError unless ``trace`` routes this model's geometry exactly."""
    if tuple(trace.num_experts) != tuple(info.num_experts) or trace.top_k != info.top_k:
        raise ExecutorError(
            f"trace geometry ({trace.num_layers} layers, experts {_short(trace.num_experts)}, top-{trace.top_k}) "
            f"differs from the model's {info.path} ({info.num_layers} layers, experts {_short(info.num_experts)}, "
            f"top-{info.top_k}); pass --map to fold the trace's layer and expert ids onto the model")


def _short(ns) -> str:
    ns = list(ns)
    return f"{ns[0]} x {len(ns)}" if len(set(ns)) == 1 else str(ns)


def fold_trace(trace, info):
    """A trace of the model's geometry made from another one (``--map``).

    Model block ``m`` takes the trace's layer ``m % L_trace``; each expert id ``e`` becomes
    ``e % E_model``; duplicates that folding creates are dropped (first in rank order kept), and
    the first ``top_k`` (the model's) remaining ids are kept. Weights, when the trace has them,
    follow their ids and are renormalised to sum 1 over the kept ids when the model renormalises
    its top-k. Sequence, position and phase are unchanged."""
    from traces import Trace

    lt = trace.num_layers
    src = [m % lt for m in range(info.num_layers)]
    ids = np.asarray(trace.expert_ids)[:, src, :].astype(np.int64)  # (T, L, k_t)
    e_model = np.asarray(info.num_experts, dtype=np.int64)[None, :, None]
    ids = np.where((ids >= 0) & (e_model > 0), ids % np.maximum(e_model, 1), -1)
    for j in range(1, ids.shape[2]):
        dup = (ids[:, :, :j] == ids[:, :, j:j + 1]).any(axis=2)
        ids[:, :, j][dup] = -1
    order = np.argsort(ids < 0, axis=2, kind="stable")  # valid ids first, rank order kept
    k = min(info.top_k, ids.shape[2])
    ids = np.take_along_axis(ids, order, axis=2)[:, :, :k]
    weights = None
    if trace.weights is not None:
        w = np.take_along_axis(np.asarray(trace.weights, dtype=np.float64)[:, src, :], order, axis=2)[:, :, :k]
        w = np.where(ids >= 0, w, np.nan)
        if info.norm_topk:
            w = w / np.nansum(w, axis=2, keepdims=True)
        weights = w.astype(np.float32)
    meta = dict(trace.meta, folded_from=trace.model)
    return Trace(f"{trace.model} folded onto {Path(info.path).name}", info.num_experts, k, ids, trace.seq,
                 trace.pos, trace.phase, weights, meta)


def trace_batches(trace) -> np.ndarray | None:
    """Batch number of each row of a trace recorded with multi-token steps (``meta["batches"]``:
    the row count of each batch, in order), or None when the trace has no batches (one row each)."""
    b = trace.meta.get("batches")
    if b is None:
        return None
    if (not isinstance(b, list) or not all(isinstance(n, int) and n >= 1 for n in b) or sum(b) != len(trace)):
        raise ExecutorError(f"trace {trace.model!r}: meta field 'batches' must be a list of row counts >= 1 "
                            f"summing to the trace's {len(trace)} rows")
    return np.repeat(np.arange(len(b)), b)


def _row_groups(trace, phase, start, limit) -> Iterator[list]:
    """The selected rows' scheduler Tokens, grouped into the recorded batches (cut where the
    selection or the sequence is)."""
    rows = trace.rows(phase)[start:]
    if limit is not None:
        rows = rows[:limit]
    batch = trace_batches(trace)
    group, last = [], None
    for r, tok in zip(rows.tolist(), trace.tokens(phase, start, limit)):
        key = (tok.seq, r if batch is None else int(batch[r]))
        if group and key != last:
            yield group
            group = []
        group.append(tok)
        last = key
    if group:
        yield group


def trace_tokens(trace, phase: str | None = None, start: int = 0, limit: int | None = None) -> Iterator:
    """scheduler Tokens of ``trace``'s rows with the recorded batches merged (``merge_step`` per
    block): what the run that recorded it planned, for ``scheduler.replay``. A trace without
    batches gives its rows as they are."""
    from scheduler import Token

    for i, group in enumerate(_row_groups(trace, phase, start, limit)):
        first = group[0]
        if len(group) == 1:
            yield Token(i, first.seq, first.pos, first.phase, first.steps)
            continue
        per_layer: dict[int, list] = {}
        for tok in group:
            for st in tok.steps:
                per_layer.setdefault(st.layer, []).append((st.experts, st.weights))
        yield Token(i, first.seq, first.pos, first.phase,
                    tuple(_merge(l, per_layer[l]) for l in sorted(per_layer)), len(group))


def trace_inputs(trace, info, phase: str | None = None, start: int = 0, limit: int | None = None,
                 seed: int = 0) -> Iterator[TokenInput | ChunkInput]:
    """Inputs replaying ``trace`` rows: routes forced to the trace's steps (a block the row does not
    route uses the model's router), input token ids drawn uniformly from the vocabulary by
    ``np.random.default_rng(seed)`` (a trace holds routing, not text). Rows of one recorded batch
    (``trace_batches``) run as one ChunkInput, with the recorded positions (so rejected drafts
    roll the KV cache back as they did)."""
    rng = np.random.default_rng(seed)
    for i, group in enumerate(_row_groups(trace, phase, start, limit)):
        all_routes, ids = [], []
        for tok in group:
            routes = [None] * info.num_layers
            for s in tok.steps:
                routes[s.layer] = Route(s.experts, s.weights)
            all_routes.append(tuple(routes))
            ids.append(int(rng.integers(info.vocab)))
        first = group[0]
        if len(group) == 1:
            yield TokenInput(i, first.seq, first.pos, first.phase, ids[0], all_routes[0])
        else:
            yield ChunkInput(i, first.seq, first.pos, first.phase, tuple(ids), tuple(all_routes))
