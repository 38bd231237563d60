"""The expert engine's one-token step on the GPU: ``ExpertEngine.begin_layer`` and the step's
shorter path (``ExpertEngine`` docstring: early start, one token), kept to few Python operations.

Per layer, :class:`OneLayer` holds what a step reads every time (the input shape, the layer's row
of the residency's slot table, the slot table, the two launches with their argument blocks), so a
step makes no method call to build them. ``begin`` finds the resident routed experts from the
table row and starts their gate/up (or, with ``gpu_step.LateStart``, every routed pair's);
``run_one`` takes that start when the decision keeps it (:func:`early_bases`), queues the uploads,
the gate/up of the pairs not started and the down/combine launch, and updates residency.
"""
from __future__ import annotations

import struct
import time
from itertools import compress
from operator import not_
from typing import NamedTuple

import numpy as np

from scheduler.core import Decision

from .experts import ExecutorError

__all__ = ["Early", "OneLayer", "begin", "early_bases", "one_layer", "pack1", "run_one"]

_perf = time.perf_counter
_MAX_K = 32  # MAXK of gpu_kernels.cu
_PACKS: dict[tuple[int, int, int], struct.Struct] = {}


def pack1(ex: np.ndarray, bases, weights, pick) -> None:
    """Write ``Experts1`` into ``ex`` (uint8, 16 * MAXK bytes) in one call: ``bases`` at 0,
    ``weights`` at 8 * MAXK, ``pick`` at 12 * MAXK; the bases and weights past their lists are
    zeroed, the picks past it left as they were (the kernels read the first k bases and weights
    and the first ``picks`` picks only)."""
    try:
        f = _PACKS[len(bases), len(weights), len(pick)]
    except KeyError:
        nb, nw, npk = len(bases), len(weights), len(pick)
        f = _PACKS[nb, nw, npk] = struct.Struct(f"<{nb}Q{8 * (_MAX_K - nb)}x{nw}f{4 * (_MAX_K - nw)}x{npk}i")
    f.pack_into(ex, 0, *bases, *weights, *pick)


class Early(NamedTuple):
    """What ``begin`` started: the layer, the caller's input (and its device form), the
    token's routed ids and the pairs whose gate/up kernels are queued."""

    layer: int
    x: object
    xd: object
    ids: list
    pick: list
    bases: list  # the slot address of each picked pair (0 for the others)
    got: tuple  # the picked experts, in routed order
    rest: list  # the pairs not picked
    late: int = 0  # the step's LateStart number when the kernel also waits for the rest, else 0
    topk: object = None  # the caller's routed ids array (run_one takes ``ids`` when given it again)


new_early = Early._make  # (a NamedTuple's own constructor costs more)


class OneLayer(NamedTuple):
    """A layer's one-token constants (``one_layer``)."""

    shape: tuple  # the input's (1, hidden)
    get: object  # the ``__getitem__`` of the residency's list of the layer's table words (always current)
    width: int  # its words
    late: bool  # whether LateStart takes the layer
    slots: tuple  # (first slot's address, stride, slots)
    gate_up: object  # the layer's moe1_gate_up FixedLaunch
    down: object  # its moe1_down_combine FixedLaunch
    hidden: int


def one_layer(eng, layer: int) -> OneLayer | None:
    """``eng``'s OneLayer of ``layer`` (a layer with a cache pool), else None; cached."""
    one = eng._ones.get(layer, False)
    if one is False:
        lx = eng.layers[layer] if 0 <= layer < len(eng.layers) else None
        gx = eng.gpu
        one = None
        if lx is not None and gx.slot_tables[layer] is not None:
            gu, dc = gx._one(layer)
            res = eng.slot_of
            one = OneLayer((1, lx.hidden), res.rows[layer].__getitem__, res._width,
                           eng._late is not None and layer not in gx.generic_layers, gx.slot_tables[layer], gu, dc,
                           lx.hidden)
        eng._ones[layer] = one
    return one


def early_bases(early: Early, d: Decision, up: dict | None, ptr: int, stride: int, n_slots: int):
    """``run_one``'s (bases, rest) from what ``begin`` found, when the decision keeps it: its
    hits are the early-started experts in routed order (as policies list them), its uploads the
    other routed experts, into slots in range, and it evicts none of its hits. Else None: the
    caller's loop over the pairs decides (and raises for a decision that does not fit)."""
    got, rest = early.got, early.rest
    if d.hits != got or (up is None) != (not rest):
        return None
    if d.evictions:
        layer = d.layer
        for v in d.evictions:
            if v[1] in got and v[0] == layer:
                return None
    if up is None:
        return early.bases, ()
    if len(up) != len(rest):
        return None
    slots = list(map(up.get, map(early.ids.__getitem__, rest)))  # (no bytecode per pair)
    if None in slots or min(slots) < 0 or max(slots) >= n_slots:
        return None
    bases = list(early.bases)
    for j, s in zip(rest, slots):
        bases[j] = ptr + s * stride
    return bases, rest


_RANGES = [list(range(k)) for k in range(65)]  # every pair picked (read only)


def begin(eng, layer: int, x, topk_ids) -> None:
    """``ExpertEngine.begin_layer`` (see its docstring)."""
    t0 = _perf()
    e = eng._early
    if e is not None:
        if e.late:
            eng._late.release(e.late, len(e.ids))
        eng._early = None
    if eng.gpu is None or len(topk_ids) != 1:
        return
    one = eng._ones.get(layer, False)
    if one is False:
        one = one_layer(eng, layer)
    if one is None or getattr(x, "shape", None) != one.shape:
        return
    row = topk_ids[0]
    ids = row.tolist() if isinstance(row, np.ndarray) else list(row)
    k = len(ids)
    if not 0 < k <= eng._max_k or min(ids) < 0:
        return
    try:
        bases = list(map(one.get, ids))  # each routed expert's slot address, 0 when not resident
    except IndexError:  # an id past the table: not resident
        return
    if 0 in bases:  # (compress and map: no bytecode per pair)
        pick = list(compress(_RANGES[k], bases))
        if not pick:
            return
        rest, got = list(compress(_RANGES[k], map(not_, bases))), tuple(compress(ids, bases))
    else:
        pick, rest, got = _RANGES[k], [], tuple(ids)
    gx = eng.gpu
    gx.after_caller()  # x may still be in the making on the caller's stream
    xd = gx.as_input(x)
    if eng._cpu_seen:  # a hand-off's input copy need not wait for these kernels
        eng.handoff.mark_input()
    late = 0
    if rest and one.late and not eng._cpu_seen:  # the rest once uploaded (released if not)
        late = eng._late.begin(layer, xd, bases, pick + rest, k)
    else:
        pack1(gx._ex, bases, (), pick)
        gu = one.gate_up
        gu.vals[0] = xd.data.ptr
        gu.launch(len(pick), 128, gx.compute.ptr)  # block 32 * WARPS, as GpuExperts.gate_up1
    eng._early = new_early((layer, x, xd, ids, pick, bases, got, rest, late, topk_ids))
    st = eng.stats
    st.early_pairs += len(pick)
    st.host_early_s += _perf() - t0


def run_one(eng, d: Decision, x, topk_ids: np.ndarray, topk_weights, early: Early | None, t0: float):
    """``ExpertEngine._run_one``: one token whose experts are all on the GPU (hits and uploads).
    The pair table goes by value in the launches (no metadata copy); the uploads are queued,
    ``moe1_gate_up`` runs over the pairs ``begin`` did not start, and ``moe1_down_combine`` gives
    the output."""
    gx = eng.gpu
    layer = d.layer
    slot_of = eng.slot_of
    if d.evictions:
        pop = slot_of.pop
        for v in d.evictions:
            pop(v, None)
    one = eng._ones.get(layer, False)
    if one is False:
        one = one_layer(eng, layer)
    if one is None:
        raise ExecutorError(f"layer {layer} has no cache pool; its experts cannot be on the GPU")
    w = topk_weights[0]  # (packed as float32: a float64 weight rounds as numpy's cast does)
    weights = w.tolist() if isinstance(w, np.ndarray) else np.asarray(topk_weights, np.float32)[0].tolist()
    uploads = d.uploads
    up = dict(zip(uploads, d.slots)) if uploads else None
    fast = None
    if early is not None:
        if early.topk is topk_ids and early.x is x and early.layer == layer:  # begun for this step
            ids = early.ids
            fast = early_bases(early, d, up, *one.slots)
        else:
            ids = topk_ids[0].tolist()
            if early.layer != layer or early.x is not x or early.ids != ids:
                early = eng._free_late(early) and None  # begun for another step: run every pair here
            else:
                fast = early_bases(early, d, up, *one.slots)
    else:
        ids = topk_ids[0].tolist()
    if fast:
        bases, rest = fast
        late = early.late  # the early kernel runs the rest
    else:
        late = 0
        early = eng._free_late(early)
        bases, rest = _all_pairs(eng, d, ids, up, one.slots, early.pick if early is not None else ())
    xd = early.xd if early is not None else gx.as_input(x)
    st = eng.stats
    k = len(ids)
    st.steps += 1
    st.gpu_pairs += k
    t1 = _perf()
    st.host_plan_s += t1 - t0
    compute = gx.compute.ptr
    if up is not None:
        if late:
            eng._late.copy_in(layer, uploads, d.slots, late, bases)
            st.late_pairs += len(rest)
        else:
            gx.copy_in(layer, uploads, d.slots)
        st.uploads += len(uploads)
    pack1(gx._ex, bases, weights, rest)
    if rest and not late:
        gu = one.gate_up
        gu.vals[0] = xd.data.ptr
        gu.launch(len(rest), 128, compute)
    dc = one.down
    out = gx._output(1, one.hidden)
    v = dc.vals
    v[1] = out.data.ptr
    v[2] = k
    dc.launch(1, 32 * k, compute)
    if d.retired:
        for v in d.retired:
            slot_of.pop(v, None)
    if up is not None:
        slot_of.place(layer, up.items())
    st.host_queue_s += _perf() - t1
    return out


def _all_pairs(eng, d: Decision, ids: list, up: dict | None, slots: tuple, picked) -> tuple[list, list]:
    """``run_one``'s (bases, rest) by a loop over the routed pairs (``picked``: the pairs an early
    kernel started and the decision keeps); raises for a pair the decision does not place."""
    layer = d.layer
    ptr, stride, n_slots = slots
    slot_of = eng.slot_of
    bases, rest, hits = [], [], d.hits
    for j, e in enumerate(ids):
        if up is not None and e in up:  # (an early-started expert uploaded anew runs again)
            s = up[e]
            if not 0 <= s < n_slots:
                raise ExecutorError(f"layer {layer}: slot {s} out of range for pool of {n_slots} slots")
            rest.append(j)
        else:
            s = slot_of.get((layer, e))
            if s is None or e not in hits:
                eng._not_on_gpu(layer, ids, hits, up or {})
            if j not in picked:
                rest.append(j)
        bases.append(ptr + s * stride)
    return bases, rest
