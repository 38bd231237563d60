"""The expert engine: carries out the scheduler driver's items for the MoE blocks of a model.

Calling it from a forward pass (one MoE layer of a step of T tokens)::

    item = next(driver)                     # scheduler.drive.RunLayer for this layer
    out = engine.run_layer(item, x, topk_ids, topk_weights)
    # x: (T, hidden) float32, cupy when use_gpu else numpy; topk_ids: (T, k) int, topk_weights:
    # (T, k) float (numpy). out: (T, hidden) float32 on the same side as x:
    # out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), summed in j order.

and for the other items: ``StartBackground`` -> ``engine.start_background(item.moves)``,
``AwaitBackground`` -> ``engine.await_background(item.moves)``; ``EndToken`` needs nothing.
Before the first item, ``engine.load_residents(policy.cache.slot)`` uploads the experts a
policy placed at construction (profile pre-population; all experts for ``gpu``).

Per layer, the engine gathers the (expert, token) pairs by destination, in decision order:
GPU pairs (hits, uploads, streams) first, then CPU pairs. The CPU pairs go to the CPU pool at
once (their inputs copied to the host); meanwhile the uploads and streams are queued on the copy
stream, the kernels for all GPU pairs wait only for those copies, and promotions follow on the
compute stream. The CPU outputs are then copied up and every token's pairs are combined with the
router weights in one kernel. Without a GPU only decisions with CPU work alone are accepted.

The engine follows residency only to know which slot holds an expert (from the decisions and
moves it executes); all choices are the policy's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from scheduler.core import Capacity, Decision, Move
from scheduler.drive import RunLayer

from .cpu_experts import CpuExpertPool
from .experts import ExecutorError, LayerExperts

__all__ = ["ExpertEngine", "LayerStats", "gather_pairs"]


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
    per_layer_cpu_s: dict = field(default_factory=dict)


def gather_pairs(decision: Decision, topk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """Pairs in destination order: (pair_expert, pair_token, pair_of (T, k), n_gpu, gpu_experts).

    GPU experts (hits, uploads, streams) come first, then cpu; within an expert, tokens ascend.
    ``pair_of[t, j]`` is the pair of ``topk_ids[t, j]``. ExecutorError when a routed expert is
    missing from the decision.
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids: expected (tokens, k), got shape {ids.shape}")
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


class ExpertEngine:
    """Runs MoE layers as the scheduler decides: GPU kernels + copies, and the CPU pool."""

    def __init__(self, layers: Sequence[LayerExperts | None], capacity: Capacity, threads: int, use_gpu: bool,
                 timeout_s: float = 30.0, scratch_slots: int = 16, pinned: bool = True, gpu=None):
        self.layers = list(layers)
        self.use_gpu = bool(use_gpu)
        self.timeout_s = float(timeout_s)
        self.pool = CpuExpertPool(threads, timeout_s)
        self.gpu = None
        self._own_gpu = gpu is None
        if self.use_gpu and gpu is not None:  # reuse pinned host weights and streams (benchmarks)
            gpu.wait(gpu.all_done_event(), "GPU work")
            gpu.set_capacity(capacity)
            self.gpu = gpu
        elif self.use_gpu:
            from .gpu_experts import GpuExperts

            self.gpu = GpuExperts(self.layers, capacity, scratch_slots, pinned, timeout_s)
        self.slot_of: dict[tuple[int, int], int] = {}
        self._pending: dict[int, tuple[tuple[Move, ...], object]] = {}
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
    def run_layer(self, item: RunLayer, x, topk_ids: np.ndarray, topk_weights: np.ndarray):
        """Run one MoE layer as ``item.decision`` says; see the module docstring for shapes."""
        d = item.decision
        layer = d.layer
        lx = self.layers[layer]
        if lx is None:
            raise ExecutorError(f"layer {layer} has no experts")
        weights = np.asarray(topk_weights, np.float32)
        if weights.shape != np.shape(topk_ids) or x.shape != (weights.shape[0], lx.hidden):
            raise ValueError(f"layer {layer}: x {x.shape}, topk_ids {np.shape(topk_ids)}, topk_weights "
                             f"{weights.shape}: expected (T, {lx.hidden}), (T, k), (T, k)")
        experts, tok, pair_of, n_gpu, gpu_experts = gather_pairs(d, topk_ids)
        st = self.stats
        st.steps += 1
        st.gpu_pairs += n_gpu
        st.cpu_pairs += len(experts) - n_gpu
        if self.gpu is None:
            if len(gpu_experts) or d.promotions:
                self._need_gpu(f"layer {layer}: decisions with GPU work ({len(gpu_experts)} experts)")
            job = self._cpu(lx, experts, tok, np.asarray(x))
            y = self._cpu_result(job, layer)
            return np.einsum("tk,tkh->th", weights, y[pair_of], dtype=np.float32)
        return self._run_gpu(d, lx, x, experts, tok, pair_of, n_gpu, weights)

    def _cpu(self, lx: LayerExperts, experts: np.ndarray, tok: np.ndarray, xh: np.ndarray):
        return self.pool.submit(lx, experts, np.ascontiguousarray(xh[tok], np.float32))

    def _cpu_result(self, job, layer: int) -> np.ndarray:
        t0 = time.perf_counter()
        out = job.result()
        st = self.stats
        st.cpu_wait_s += time.perf_counter() - t0
        st.cpu_compute_s += job.compute_s
        st.per_layer_cpu_s[layer] = st.per_layer_cpu_s.get(layer, 0.0) + job.compute_s
        return out

    def _run_gpu(self, d: Decision, lx: LayerExperts, x, experts, tok, pair_of, n_gpu, weights):
        import cupy as cp

        gx = self.gpu
        layer = d.layer
        job = None
        if n_gpu < len(experts):
            xh = cp.asnumpy(x, stream=gx.compute)
            gx.compute.synchronize()
            job = self._cpu(lx, experts[n_gpu:], tok[n_gpu:], xh)
        with gx.compute:
            y = cp.empty((len(experts), lx.hidden), cp.float32)
        for v in d.evictions:
            self.slot_of.pop(v, None)
        self._gpu_rounds(d, x, experts[:n_gpu], tok[:n_gpu], y)
        if job is not None:
            y[n_gpu:].set(self._cpu_result(job, layer), stream=gx.compute)
        return gx.combine(y, pair_of, weights)

    def _gpu_rounds(self, d: Decision, x, experts: np.ndarray, tok: np.ndarray, y) -> None:
        """Uploads, streams (in rounds of at most scratch_slots), kernels, then promotions."""
        from .gpu_experts import scratch_source

        gx = self.gpu
        layer = d.layer
        self.stats.uploads += len(d.uploads)
        self.stats.streams += len(d.streams)
        src_of: dict[int, int] = {}
        for e in d.hits:
            try:
                src_of[e] = self.slot_of[(layer, e)]
            except KeyError:
                raise ExecutorError(f"layer {layer}: hit on expert {e}, which this engine never loaded") from None
        promo = dict(zip(d.promotions, d.promotion_slots))
        for v in d.retired:  # residents that leave after this step; their slots take promotions
            self.slot_of.pop(v, None)
        streams = list(d.streams)
        first = True
        while first or streams:
            chunk, streams = streams[: gx.scratch_slots], streams[gx.scratch_slots:]
            wait = []
            if (first and d.uploads) or chunk:
                gx.begin_copies()
                if first:
                    for e, s in zip(d.uploads, d.slots):
                        gx.upload(layer, e, s)
                        src_of[e] = s
                for e in chunk:
                    src_of[e] = scratch_source(gx.stream(layer, e))
                wait.append(gx.copies_event())
            round_experts = set(d.hits + d.uploads) if first else set()
            round_experts.update(chunk)
            sel = np.flatnonzero(np.isin(experts, list(round_experts)))
            if len(sel):
                # pairs of one expert are contiguous (gather_pairs), and so are a round's experts' pairs
                lo, hi = int(sel[0]), int(sel[-1]) + 1
                gx.run(layer, [src_of[int(e)] for e in experts[lo:hi]], x, tok[lo:hi], wait, out=y[lo:hi])
            for e in chunk:
                if e in promo:
                    gx.promote(layer, -1 - src_of[e], promo[e])
                    self.slot_of[(layer, e)] = promo[e]
            if any(e in promo for e in chunk):
                gx.last_read.record(gx.compute)
            first = False
        for e, s in zip(d.uploads, d.slots):
            self.slot_of[(layer, e)] = s

    # background --------------------------------------------------------------------------------
    def start_background(self, moves: tuple[Move, ...]) -> None:
        """Queue fills and swaps on the background stream (after the kernels that read victims)."""
        if not moves:
            return
        self._need_gpu("background fills and swaps")
        gx = self.gpu
        gx.begin_copies(gx.background)
        for m in moves:
            if m.victim is not None:
                self.slot_of.pop(m.victim, None)
            gx.upload(m.layer, m.expert, m.slot, gx.background)
        self._pending[id(moves)] = (moves, gx.copies_event(gx.background))

    def await_background(self, moves: tuple[Move, ...]) -> None:
        """Block until ``moves`` are copied (ExecutorError after the timeout); they become hits."""
        if not moves:
            return
        try:
            _, ev = self._pending.pop(id(moves))
        except KeyError:
            raise ExecutorError("await_background: these moves were never started") from None
        t0 = time.perf_counter()
        self.gpu.wait(ev, "background copy")
        self.stats.background_wait_s += time.perf_counter() - t0
        for m in moves:
            self.slot_of[(m.layer, m.expert)] = m.slot

    def synchronize(self) -> None:
        """Wait for all queued GPU work (no-op without a GPU)."""
        if self.gpu is not None:
            self.gpu.wait(self.gpu.all_done_event(), "GPU work")

    def close(self) -> None:
        self.pool.close()
        if self.gpu is not None and self._own_gpu:
            self.gpu.close()

