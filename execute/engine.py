"""The expert engine: carries out the scheduler driver's items for the MoE blocks of a model.

Calling it from a forward pass (one MoE layer of a step of T tokens)::

    engine.begin_layer(layer, x, topk_ids)  # optional, as soon as the routing is known (below)
    item = next(driver)                     # scheduler.drive.RunLayer for this layer
    out = engine.run_layer(item, x, topk_ids, topk_weights)
    # x: (T, hidden) float32, cupy when use_gpu else numpy; topk_ids: (T, k) int, topk_weights:
    # (T, k) float (numpy). out: (T, hidden) float32 on the same side as x:
    # out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), summed in j order.

and for the other items: ``StartBackground`` -> ``engine.start_background(item.moves)``,
``AwaitBackground`` -> ``engine.await_background(item.moves)``; ``EndToken`` needs nothing.
Background copies: the host never waits for them (the compute stream does; ``await_background``).
Before the first item, ``engine.load_residents(policy.cache.slot)`` uploads the experts a
policy placed at construction (profile pre-population; all experts for ``gpu``).

Per layer, the engine gathers the (expert, token) pairs by destination, in decision order:
GPU pairs (hits, uploads, streams) first, then CPU pairs. When there are CPU pairs the layer input
is copied to pinned host memory (an event, no stream sync) and the CPU pairs are submitted at once
(inputs from the fetched copy); then the layer's kernel metadata goes up in one copy, the uploads
and streams are queued on the copy stream, the kernels for the GPU pairs wait only for those
copies, and promotions follow on the compute stream. Then the CPU pairs are awaited, their
outputs copied up, and every token's pairs combined with the router weights in one kernel.
Without a GPU only decisions with CPU work alone are accepted.

One token whose experts are all on the GPU (hits and uploads, the decode step of ``gpu`` and
``lru``) takes a shorter path: no pair gathering and no metadata copy. The token's pair table
(each routed expert's address and router weight) is passed by value in the kernel launches,
``moe1_gate_up`` runs the pairs and ``moe1_down_combine`` applies down and combines them in one
launch (two launches per layer with fixed per-layer argument blocks, plus one batched copy of its
uploads, ``GpuExperts.copy_in``); one event marks the step's reads and hands the output back
(``engine_one``: this path and the early start below).

Early start. A forward pass may call ``engine.begin_layer(layer, x, topk_ids)`` as soon as the routing
is known, before the driver plans the step; ``run_layer`` then finishes it. For a single token,
``begin_layer`` queues the gate/up kernel of the routed experts resident now. No decision changes their
outcome: a step's hits are exactly the experts resident when it starts, and no eviction made for a step
removes an expert it uses (``scheduler.core``), so these experts are read from the slots they are in now,
and this step's uploads into other slots do not touch them. The same kernel covers the other routed
experts (``gpu_step.LateStart``): their blocks wait until the copy stream, after the step's uploads,
writes their slot addresses; a decision that does not upload them all releases them (they write
nothing) and runs them itself. Residency (``slot_of``) follows the policy's decisions and moves
(uploads, promotions and background moves when the driver passes their completion back); nothing flows
from the engine to the policy, so the decision log is identical with or without early starts. A
decision that does not list an early expert as a hit drops the early work and runs every pair again.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from scheduler.core import Capacity, Decision, Move
from scheduler.drive import RunLayer

from .cpu_pool import CpuExpertPool
from .engine_one import Early as _Early
from .engine_one import begin as _begin
from .engine_one import early_bases as _early_bases
from .engine_one import run_one as _run_one
from .experts import ExecutorError, LayerExperts
from .pairs import _SMALL_PAIRS, _pair_arrays, _pair_lists, gather_pairs

__all__ = ["BACKGROUND_WAITS", "ExpertEngine", "HANDOFF_PUTS", "LayerStats", "gather_pairs"]

BACKGROUND_WAITS = ("device", "host")  # await_background: the compute stream waits / the host blocks
HANDOFF_PUTS = ("early", "compute")  # handoff_put: own stream after the input / after early kernels


@dataclass
class LayerStats:
    """Counters of one engine, summed over the layers it ran."""

    steps: int = 0
    gpu_pairs: int = 0
    cpu_pairs: int = 0
    uploads: int = 0
    streams: int = 0
    cpu_compute_s: float = 0.0  # time the CPU pool spent computing
    cpu_wait_s: float = 0.0  # time the caller blocked on the CPU pool
    background_wait_s: float = 0.0
    host_plan_s: float = 0.0  # GPU path, host time: pairs, sources, metadata
    host_queue_s: float = 0.0  # GPU path, host time: copies, kernels, promotions queued
    input_wait_s: float = 0.0  # GPU path: waiting for the layer input the CPU pool needs
    host_combine_s: float = 0.0  # GPU path, host time: CPU result upload and combine queued
    early_pairs: int = 0  # pairs begin_layer started before the step's decision
    late_pairs: int = 0  # uploaded pairs begin_layer's kernel ran once their copy landed (LateStart)
    graph_steps: int = 0  # steps a token's graph computed (settle_layer)
    settled_moves: int = 0  # of those, steps whose decision still moved experts
    host_early_s: float = 0.0  # host time in begin_layer (its kernels queued)
    host_submit_s: float = 0.0  # of host_plan_s, the CPU pool's submit of a handed-off call
    handoff_calls: int = 0  # CPU calls handed off through mapped memory whose edges were measured
    handoff_in_s: float = 0.0  # their gate written (GPU) -> first CPU worker through it
    handoff_out_s: float = 0.0  # their last CPU output -> the GPU's waiting kernel sees it
    per_layer_cpu_s: dict = field(default_factory=dict)


class _Residency(dict):
    """``ExpertEngine.slot_of``: (layer, expert) -> slot, mirrored into a slot table of device
    addresses (``table[layer, expert]``, 0 when not resident) in pinned host memory, which
    :meth:`ExpertEngine.sync_table` copies to the device when it changed (the expert kernels of a
    token's graph read it there)."""

    def __init__(self, table: np.ndarray | None = None, slot_tables=()):
        super().__init__()
        self.table, self.slot_tables, self.dirty = table, slot_tables, True
        self.held: set[int] = set()  # device addresses of the slots that have held an expert
        # the table's words, written through a memoryview (a numpy item assignment costs several times
        # more), and read from ``rows``, a list per layer of the same words (``engine_one.begin``)
        self._words = None if table is None else memoryview(table.reshape(-1)).cast("B").cast("Q")
        self._width = 0 if table is None else table.shape[1]
        self.rows = [] if table is None else table.tolist()

    def __setitem__(self, key, slot) -> None:
        dict.__setitem__(self, key, slot)
        if self._words is not None:
            t = self.slot_tables[key[0]]
            if t is not None:
                self._words[key[0] * self._width + key[1]] = self.rows[key[0]][key[1]] = a = t[0] + slot * t[1]
                self.held.add(a)
                self.dirty = True

    def place(self, layer: int, items) -> None:
        """``self[(layer, e)] = s`` for each (expert, slot) of ``items``."""
        t = self.slot_tables[layer] if self._words is not None else None
        self.dirty = True
        if t is None:
            dict.update(self, {(layer, e): s for e, s in items})
            return
        words, row, first, held, put = self._words, self.rows[layer], layer * self._width, self.held, dict.__setitem__
        ptr, stride = t[0], t[1]
        for e, s in items:
            put(self, (layer, e), s)
            words[first + e] = row[e] = a = ptr + s * stride
            held.add(a)

    def fresh(self, layer: int, slot: int) -> bool:
        """Whether the slot has never held an expert (no kernel queued so far can read it)."""
        t = self.slot_tables[layer] if self.table is not None else None
        return t is not None and t[0] + slot * t[1] not in self.held

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        if self._words is not None:
            self._words[key[0] * self._width + key[1]] = self.rows[key[0]][key[1]] = 0
            self.dirty = True

    def pop(self, key, *default):
        had = key in self
        v = dict.pop(self, key, *default)
        if had and self._words is not None:
            self._words[key[0] * self._width + key[1]] = self.rows[key[0]][key[1]] = 0
            self.dirty = True
        return v


class ExpertEngine:
    """Runs MoE layers as the scheduler decides: GPU kernels + copies, and the CPU pool."""

    def __init__(self, layers: Sequence[LayerExperts | None], capacity: Capacity, threads: int, use_gpu: bool,
                 timeout_s: float = 30.0, scratch_slots: int = 16, pinned: bool = True, gpu=None,
                 background_wait: str = "device", handoff_put: str = "early"):
        for name, v, ok in (("background_wait", background_wait, BACKGROUND_WAITS),
                            ("handoff_put", handoff_put, HANDOFF_PUTS)):
            if v not in ok:
                raise ValueError(f"{name}: {v!r}, expected one of {', '.join(ok)}")
        self.background_wait = background_wait
        self.layers = list(layers)
        self.use_gpu = bool(use_gpu)
        self.timeout_s = float(timeout_s)
        self.gpu = None
        self._own_gpu = gpu is None
        if self.use_gpu and gpu is not None:  # reuse pinned host weights and streams (benchmarks)
            gpu.wait(gpu.all_done_event(), "GPU work")
            gpu.set_capacity(capacity)
            self.gpu = gpu
        elif self.use_gpu:
            from .gpu_experts import GpuExperts

            self.gpu = GpuExperts(self.layers, capacity, scratch_slots, pinned, timeout_s)
        # with a GPU, one token's CPU pairs are handed off through mapped memory (execute.handoff;
        # the pool's counters live there); MOELAB_HANDOFF=0: fetched and awaited by the host
        self.handoff = None
        if self.gpu is not None and not self.gpu.generic_layers and os.environ.get("MOELAB_HANDOFF", "1") != "0":
            from .handoff import Handoff

            self.handoff = Handoff(self.gpu.compute, timeout_s, early_put=handoff_put == "early")
        self.pool = CpuExpertPool(threads, timeout_s, ctrl=None if self.handoff is None else self.handoff.ctrl)
        self.slot_of: dict[tuple[int, int], int] = _Residency()
        self.table_dev = None  # (layers, max experts) uint64 device addresses, see _Residency
        if self.gpu is not None:
            import cupy as cp

            width = max((l.num_experts for l in self.layers if l is not None), default=1)
            mem = cp.cuda.alloc_pinned_memory(8 * len(self.layers) * width)
            table = np.frombuffer(mem, np.uint64, len(self.layers) * width).reshape(len(self.layers), width)
            table[:] = 0
            self._table_mem = mem
            self.table_dev = cp.zeros((len(self.layers), width), cp.uint64)
            self.slot_of = _Residency(table, self.gpu.slot_tables)
            self._dense_waits = [cp.cuda.Event(disable_timing=True) for _ in range(4)]
            self._next_wait = 0
        self._pending: dict[int, tuple[tuple[Move, ...], object]] = {}
        self._handed_back = False
        self._early: _Early | None = None
        self._ones: dict = {}  # layer -> engine_one.OneLayer or None
        self._cpu_seen = False  # a step's CPU pairs were handed off (begin_layer then marks x_ready)
        self._late = None  # early starts cover a step's uploads too (gpu_step.LateStart; MOELAB_LATE_START=1: on)
        self._max_k = 0
        if self.gpu is not None:
            from .gpu_experts import MAX_TOP_K
            from .gpu_step import LateStart
            from .xp import env_switch

            self._max_k = MAX_TOP_K
            if env_switch("MOELAB_LATE_START", default="0"):
                self._late = LateStart(self.gpu, 2 * self.timeout_s)
        self.stats = LayerStats()

    # residency ---------------------------------------------------------------------------------
    def load_residents(self, slots: Mapping[tuple[int, int], int]) -> None:
        """Upload pre-placed experts into their slots and wait for the copies."""
        if not slots:
            return
        self._need_gpu("pre-placed residents")
        self.gpu.begin_copies()
        for (layer, expert), slot in slots.items():
            self.gpu.upload(layer, expert, slot)
            self.slot_of[(layer, expert)] = slot
        self.gpu.wait(self.gpu.copies_event(), "upload of pre-placed residents")

    def _need_gpu(self, what: str) -> None:
        if self.gpu is None:
            raise ExecutorError(f"{what} need a GPU (this engine runs without one: use policy 'cpu', "
                                f"or run on a machine with CUDA and cupy)")

    # one layer ---------------------------------------------------------------------------------
    def begin_layer(self, layer: int, x, topk_ids: np.ndarray) -> None:
        """Start a one-token step's resident experts before the policy has planned it (see the
        module docstring; ``engine_one.begin``); ``run_layer`` with the same ``x`` and ids finishes
        it. Does nothing for a batch, without a GPU, or when no routed expert is resident."""
        _begin(self, layer, x, topk_ids)

    def run_layer(self, item: RunLayer, x, topk_ids: np.ndarray, topk_weights: np.ndarray):
        """Run one MoE layer as ``item.decision`` says; see the module docstring for shapes."""
        t0 = time.perf_counter()
        d = item.decision
        layer = d.layer
        early, self._early = self._early, None
        lx = self.layers[layer]
        if lx is None:
            raise ExecutorError(f"layer {layer} has no experts")
        gx = self.gpu
        if gx is not None:
            if early is not None and early.topk is topk_ids and early.x is x and early.layer == layer and \
                    isinstance(topk_ids, np.ndarray):  # begun for this step: x and the ids checked there
                one = getattr(topk_weights, "shape", None) == topk_ids.shape
            else:
                gx.after_caller()  # x may still be in the making on the caller's stream
                one = (len(topk_ids) == 1 and isinstance(topk_ids, np.ndarray) and
                       1 <= topk_ids.shape[1] <= self._max_k and getattr(x, "shape", None) == (1, lx.hidden)
                       and getattr(topk_weights, "shape", None) == topk_ids.shape)
            if one:
                if not d.cpu and not d.streams and not d.promotions:
                    out = _run_one(self, d, x, topk_ids, topk_weights, early, t0)
                    gx.end_step()  # hand_back(out, read=True)
                    self._handed_back = True
                    return out
                early = self._free_late(early)
                if self.handoff is not None and d.cpu:  # CPU pairs handed off, no host wait
                    if early is not None and not self._cpu_seen:  # the first: x_ready after the early kernels
                        self.handoff.mark_input()
                    self._cpu_seen = True  # from now on begin_layer records x_ready before its kernels
                    return self.hand_back(self.handoff.run_one(self, d, lx, x, topk_ids, topk_weights, early, t0),
                                          read=True)
            self._free_late(early)
        weights = np.asarray(topk_weights, np.float32)
        ids = np.asarray(topk_ids)
        if weights.shape != ids.shape or ids.ndim != 2 or x.shape != (weights.shape[0], lx.hidden):
            raise ValueError(f"layer {layer}: x {x.shape}, topk_ids {ids.shape}, topk_weights "
                             f"{weights.shape}: expected (T, {lx.hidden}), (T, k), (T, k)")
        st = self.stats
        st.steps += 1
        if self.gpu is None:
            experts, tok, pair_of, n_gpu, gpu_experts = gather_pairs(d, ids)
            st.gpu_pairs += n_gpu
            st.cpu_pairs += len(experts) - n_gpu
            if len(gpu_experts) or d.promotions:
                self._need_gpu(f"layer {layer}: decisions with GPU work ({len(gpu_experts)} experts)")
            job = self._cpu(lx, experts, tok, np.asarray(x))
            y = self._cpu_result(job, layer)
            return np.einsum("tk,tkh->th", weights, y[pair_of], dtype=np.float32)
        if ids.size > _SMALL_PAIRS:
            experts, tok, pair_of, n_gpu, _ = (a.tolist() if isinstance(a, np.ndarray) else a
                                               for a in _pair_arrays(d, ids))
            pair_of = [p for row in pair_of for p in row]
        else:
            experts, tok, pair_of, n_gpu, _ = _pair_lists(d, ids)
        st.gpu_pairs += n_gpu
        st.cpu_pairs += len(experts) - n_gpu
        return self.hand_back(self._run_gpu(d, lx, x, experts, tok, pair_of, n_gpu, weights, t0))

    def one_token_start(self, d: Decision, topk_ids: np.ndarray, topk_weights) -> tuple[list, list, tuple]:
        """A one-token step's routed ids and weights as lists and its layer's slot table
        (pointer, stride, slots), after dropping the decision's evictions from ``slot_of``."""
        if d.evictions:
            pop = self.slot_of.pop
            for v in d.evictions:
                pop(v, None)
        table = self.gpu.slot_tables[d.layer]
        if table is None:
            raise ExecutorError(f"layer {d.layer} has no cache pool; its experts cannot be on the GPU")
        w = topk_weights[0]
        if not (isinstance(w, np.ndarray) and w.dtype.char == "f"):
            w = np.asarray(topk_weights, np.float32)[0]
        return topk_ids[0].tolist(), w.tolist(), table

    def _free_late(self, early: _Early | None) -> _Early | None:
        """``early`` with its late pairs released (they write nothing; the step runs them itself)."""
        if early is not None and early.late:
            self._late.release(early.late, len(early.ids))
            return early._replace(late=0)
        return early

    def _not_on_gpu(self, layer: int, ids: list, hits: tuple, up: dict) -> None:
        """Raise the ExecutorError for a routed expert the decision does not place on the GPU."""
        missing = sorted({e for e in ids if e not in hits and e not in up})
        if missing:
            raise ExecutorError(f"layer {layer}: routed experts {missing} are not in the decision")
        e = next(e for e in ids if e not in up and (layer, e) not in self.slot_of)
        raise ExecutorError(f"layer {layer}: hit on expert {e}, which this engine never loaded")

    def _cpu(self, lx: LayerExperts, experts, tok, xh: np.ndarray, buffers: tuple | None = None):
        """Submit the CPU pairs; ``buffers`` = (inputs, outputs) staging of the right shape."""
        if buffers is None:
            return self.pool.submit(lx, experts, np.ascontiguousarray(xh[tok], np.float32))
        np.take(xh, tok, axis=0, out=buffers[0])
        return self.pool.submit(lx, experts, buffers[0], out=buffers[1])

    def _cpu_result(self, job, layer: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = job.result()
        st = self.stats
        st.cpu_wait_s += time.perf_counter() - t0
        st.cpu_compute_s += job.compute_s
        st.per_layer_cpu_s[layer] = st.per_layer_cpu_s.get(layer, 0.0) + job.compute_s
        return out

    def _run_gpu(self, d: Decision, lx: LayerExperts, x, experts: list, tok: list, pair_of: list, n_gpu: int,
                 weights: np.ndarray, t0: float):
        """GPU pairs on the GPU, the rest on the CPU pool (input fetched to pinned memory and the
        job submitted first, then the GPU pairs' tables built and their work queued), then the
        combine; no host sync but the wait for the CPU pool's input."""
        gx = self.gpu
        layer = d.layer
        st = self.stats
        n_pairs = len(experts)
        x = gx.as_input(x)
        job = None
        st.host_plan_s += time.perf_counter() - t0
        if n_gpu < n_pairs:
            # the CPU pool is the layer's longest path: its input is fetched and its call submitted
            # before anything else is prepared (the GPU pairs' tables are built while it computes;
            # the pool's workers are native threads that never take the GIL)
            xh, ev = gx.fetch_input(x)
            t1 = time.perf_counter()
            gx.wait(ev, "copy of the layer input for the CPU pool")
            buffers = gx.cpu_buffers(n_pairs - n_gpu, lx.hidden)
            job = self._cpu(lx, experts[n_gpu:], tok[n_gpu:], xh, buffers)
            st.input_wait_s += time.perf_counter() - t1
        t1 = time.perf_counter()
        for v in d.evictions:
            self.slot_of.pop(v, None)
        bases, gstart, round_end, scratch = self._groups(d, experts, n_gpu)
        meta = gx.layer_meta(bases, gstart, tok[:n_gpu], pair_of, weights.ravel().tolist(), weights.shape[1])
        y = gx.pair_outputs(layer, n_pairs)
        t3 = time.perf_counter()
        st.host_plan_s += t3 - t1
        t1 = t3
        self._gpu_rounds(d, meta, round_end, scratch, x, n_pairs)
        t2 = time.perf_counter()
        st.host_queue_s += t2 - t1
        if job is not None:
            res = self._cpu_result(job, layer)
            t2 = time.perf_counter()
            gx.put_rows(y, n_gpu, res)
        out = gx.combine_meta(meta, y)
        st.host_combine_s += time.perf_counter() - t2
        return out

    def _groups(self, d: Decision, experts: list, n_gpu: int) -> tuple[list, list, list, list]:
        """Expert addresses and first pairs of the GPU groups (pairs of one expert are contiguous),
        where each round's groups end, and the scratch buffer of each stream (reserved here; the
        copies are queued round by round in ``_gpu_rounds``). Round 0: hits, uploads and the
        first ``scratch_slots`` streams; each later round the next ``scratch_slots`` streams."""
        gx = self.gpu
        layer = d.layer
        src_of: dict[int, int] = {}
        for e in d.hits:
            try:
                src_of[e] = self.slot_of[(layer, e)]
            except KeyError:
                raise ExecutorError(f"layer {layer}: hit on expert {e}, which this engine never loaded") from None
        for e, s in zip(d.uploads, d.slots):
            src_of[e] = s
        round_of, scratch = {}, []
        for i, e in enumerate(d.streams):
            scratch.append(gx.reserve_scratch())
            src_of[e] = -1 - scratch[-1]  # gpu_experts.scratch_source
            round_of[e] = i // gx.scratch_slots
        bases, gstart, round_end = [], [], []
        prev = None
        for p in range(n_gpu):
            e = experts[p]
            if e == prev:
                continue
            prev = e
            r = round_of.get(e, 0)
            while len(round_end) < r:
                round_end.append(len(bases))
            bases.append(gx.source_ptr(layer, src_of[e]))
            gstart.append(p)
        gstart.append(n_gpu)
        rounds = -(-len(d.streams) // gx.scratch_slots) if d.streams else 1
        while len(round_end) < rounds:
            round_end.append(len(bases))
        return bases, gstart, round_end, scratch

    def _gpu_rounds(self, d: Decision, meta, round_end: list, scratch: list, x, n_pairs: int) -> None:
        """Per round: its copies (uploads in round 0, that round's streams), kernels over its
        groups, then promotions of its streamed experts; ``last_read`` after each round."""
        gx = self.gpu
        layer = d.layer
        st = self.stats
        st.uploads += len(d.uploads)
        st.streams += len(d.streams)
        promo = dict(zip(d.promotions, d.promotion_slots))
        for v in d.retired:  # residents that leave after this step; their slots take promotions
            self.slot_of.pop(v, None)
        n = gx.scratch_slots
        g0 = 0
        for r, g1 in enumerate(round_end):
            chunk = d.streams[r * n:(r + 1) * n]
            if (r == 0 and d.uploads) or chunk:
                gx.begin_copies()
                if r == 0:
                    for e, s in zip(d.uploads, d.slots):
                        gx.upload(layer, e, s)
                for i, e in enumerate(chunk):
                    gx.stream_to(layer, e, scratch[r * n + i])
                gx.compute_after_copies()
            gx.run_groups(layer, meta, g0, g1, x, n_pairs)
            for i, e in enumerate(chunk):
                if e in promo:
                    gx.promote(layer, scratch[r * n + i], promo[e])
                    self.slot_of[(layer, e)] = promo[e]
            gx.mark_read()
            g0 = g1
        for e, s in zip(d.uploads, d.slots):
            self.slot_of[(layer, e)] = s

    def hand_back(self, out, read: bool = False):
        """``out`` (a layer's output, on the compute stream) once the caller's current stream
        waits on the device for the work queued so far: the caller reads ``out``, and frees and
        reuses its input's memory, in its own stream's order (no host wait). ``read``: the step
        has not marked its reads yet; ``last_read`` is recorded there, and is the caller's event."""
        if read:
            self.gpu.end_step()
        else:
            self.gpu.to_caller()
        self._handed_back = True
        return out

    def dense_after_experts(self) -> None:
        """Make the caller's current stream (the dense path's) wait on the device for the expert
        work queued so far (no host wait); nothing to do right after ``run_layer`` (``hand_back``)."""
        import cupy as cp

        if self._handed_back:
            self._handed_back = False
            return
        ev = self._dense_waits[self._next_wait]
        self._next_wait = (self._next_wait + 1) % len(self._dense_waits)
        cp.cuda.runtime.eventRecord(ev.ptr, self.gpu.compute.ptr)
        cp.cuda.runtime.streamWaitEvent(cp.cuda.get_current_stream().ptr, ev.ptr)

    @contextmanager
    def on_compute(self):
        """A context in which the caller's current stream is the engine's compute stream: the
        dense path queued there runs in order with the expert work, so no step needs the events
        between the two streams (``after_caller``, ``to_caller``: three runtime calls a step);
        ``execute.driver.run`` decodes in it with ``MOELAB_DENSE_ON_COMPUTE=1`` (off by default).
        On entry the compute stream waits for the caller's work so far; on exit the caller's
        stream waits for the compute stream's (not after an error: a CUDA error would hide it).
        Without a GPU: nothing."""
        gx = self.gpu
        if gx is None:
            yield
            return
        gx.after_caller()
        with gx.compute:
            yield
        gx.to_caller()

    # a token's graph ---------------------------------------------------------------------------
    def sync_table(self, stream_ptr: int) -> None:
        """Queue the copy of the slot table to the device on ``stream_ptr`` when residency changed
        since the last copy. The caller waits for that stream's work before residency changes
        again (the host table is copied from, asynchronously)."""
        res = self.slot_of
        if res.dirty and self.table_dev is not None:
            from .gpu_experts import copy_to_device

            copy_to_device(self.table_dev, res.table, stream_ptr)
            res.dirty = False

    def settle_layer(self, item: RunLayer) -> None:
        """Carry out a step that a token's graph already computed on the GPU (every routed expert
        was resident when it ran): nothing to run; residency follows the decision. A decision that
        is not all hits (a policy's prefetch evicted an expert the graph read, or one moved it)
        keeps its residency effects: its uploads and promotions are copied into their slots, its
        evictions and retired experts leave (``stats.settled_moves`` counts such steps)."""
        d = item.decision
        st = self.stats
        st.steps += 1
        st.gpu_pairs += len(d.step.experts)
        st.graph_steps += 1
        if not (d.uploads or d.promotions or d.evictions or d.retired):
            return
        st.settled_moves += 1
        slot_of = self.slot_of
        for v in d.evictions:
            slot_of.pop(v, None)
        for v in d.retired:
            slot_of.pop(v, None)
        moves = list(zip(d.uploads, d.slots)) + list(zip(d.promotions, d.promotion_slots))
        if moves:
            gx = self.gpu
            gx.begin_copies()
            for e, s in moves:
                gx.upload(d.layer, e, s)
            gx.compute_after_copies()
            for e, s in moves:
                slot_of[(d.layer, e)] = s

    # background --------------------------------------------------------------------------------
    def start_background(self, moves: tuple[Move, ...]) -> None:
        """Queue fills and swaps on the background stream, after ``last_read`` (the kernels queued so
        far) unless every move fills a slot that never held an expert (no kernel can read it)."""
        if not moves:
            return
        self._need_gpu("background fills and swaps")
        gx = self.gpu
        res = self.slot_of
        if self.background_wait == "host" or any(m.victim or not res.fresh(m.layer, m.slot) for m in moves):
            gx.begin_copies(gx.background)
        for m in moves:
            if m.victim is not None:
                res.pop(m.victim, None)
            gx.upload(m.layer, m.expert, m.slot, gx.background)
        self._pending[id(moves)] = (moves, gx.copies_event(gx.background))

    def await_background(self, moves: tuple[Move, ...]) -> None:
        """Make ``moves`` resident (hits) once copied: "device" (``background_wait``): the compute
        stream, which the token graph waits for, waits for them, and ``last_read`` after that (a
        later copy into their slots waits too); "host": the host blocks (ExecutorError at timeout)."""
        if not moves:
            return
        try:
            _, ev = self._pending.pop(id(moves))
        except KeyError:
            raise ExecutorError("await_background: these moves were never started") from None
        if self.background_wait == "device":
            self._early = self._free_late(self._early)  # last_read moves past its kernel
            self.gpu.compute.wait_event(ev)
            self.gpu.mark_read()
        else:
            t0 = time.perf_counter()
            self.gpu.wait(ev, "background copy")
            self.stats.background_wait_s += time.perf_counter() - t0
        for m in moves:
            self.slot_of[(m.layer, m.expert)] = m.slot

    def synchronize(self) -> None:
        """Wait for all queued GPU work (no-op without a GPU)."""
        if self.gpu is not None:
            self._early = self._free_late(self._early)
            self.gpu.wait(self.gpu.all_done_event(), "GPU work")
            if self._late is not None:
                self._late.check()
        if self.handoff is not None:
            self.handoff.check(self.pool)
            self.handoff.collect(self.stats)

    def close(self) -> None:
        self._early = self._free_late(self._early)
        self.pool.close()
        if self.gpu is not None and self._own_gpu:
            self.gpu.close()

