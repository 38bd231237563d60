"""Multi-token MoE layers (prefill chunks) on tensor cores, carried out as the policy decided.

:class:`BatchedExperts` runs one layer's step of T tokens for an :class:`~execute.engine.ExpertEngine`
(its GPU arena, copy streams, CPU pool and residency ``slot_of``, which it updates exactly as the
engine's own path does), when :meth:`~BatchedExperts.takes` says so: T >= :data:`MIN_TOKENS`, a GPU,
and a layer whose experts the kernels read (gate, up and down in F16, Q8_0 or Q4_0; SiLU; no
biases). Other steps (decode, speculative verification, other types) stay on the engine.

Per layer:

1. The (token, rank) pairs are sorted by expert, in decision order (hits, uploads, streams, then
   CPU experts; token order within an expert): a group of rows per expert, cut into tiles of up to
   32 rows. The metadata (expert addresses, tiles, token rows, the combine's pair table and router
   weights) goes up in one copy.
2. CPU experts: the input is fetched to pinned memory and the pool started first, as the engine does.
3. The GPU experts run in rounds: round 0 the hits; then the uploads and streams, ``batch_experts``
   per round. A round's copies (uploads into their slots, streams into one half of a staging area
   of ``2 x batch_experts`` expert buffers) are queued on the copy stream and overlap the previous
   round's kernels; a round's kernels wait only for its own copies, and a half of the staging is
   refilled only after the kernels of the round before last. Every expert crosses PCIe once per
   chunk, whatever its number of tokens.
4. Per round: ``pf_mm`` gate+up (SiLU(g) * u, float32), ``pf_split`` of those rows, ``pf_mm`` down;
   promotions (staging -> slot) after the round's kernels. On layers whose experts are all Q8_0
   (``prefill_mm2.applies``) the products are ``pf_mm2``'s (the same values bit for bit, operands
   copied by ``cp.async``, about 9x faster); ``MOELAB_PREFILL_MM=1`` keeps ``pf_mm`` everywhere.
5. The CPU rows are uploaded and one ``moe_combine`` sums each token's pairs in rank order.

Numerics (``prefill_kernels.cu``): exact integer quants in f16 with the block scales applied in
float32, activations as two f16 halves of a power-of-two-scaled row (~22 bits), float32
accumulation: within a few float32 roundings of the engine's float32 kernels.

``MOELAB_PREFILL`` = 0 turns the path off (the engine's grouped kernels run every step), 1 (the
default) on; another value is an error.
"""
from __future__ import annotations

import time

import cupy as cp
import numpy as np

from scheduler.core import Decision, pad_slot_bytes

from . import prefill_mm2
from . import quant as Q
from .batch_route import stable_order
from .experts import ExecutorError, LayerExperts
from .gpu_experts import Launch
from .gpu_host import cuda_module
from .xp import env_switch

__all__ = ["BatchedExperts", "MIN_TOKENS", "TILE_ROWS", "prefill_env", "supported"]

MIN_TOKENS = 16  # steps of fewer tokens stay on the engine's kernels
TILE_ROWS = 32  # BM of prefill_kernels.cu
_N_GATE, _N_DOWN = 64, 128  # output columns per block of pf_mm, modes 0 and 1
_QTYPES = (Q.F16, Q.Q8_0, Q.Q4_0)
_META_BYTES = 1 << 20  # GpuExperts' metadata buffer
_rt = cp.cuda.runtime
_D2D = _rt.memcpyDeviceToDevice


def prefill_env() -> bool:
    """``MOELAB_PREFILL``: unset or 1 -> True, 0 -> False; another value is an ExecutorError."""
    return env_switch("MOELAB_PREFILL")


def _kernel(name: str):
    return cuda_module("prefill_kernels.cu").get_function(name)


def supported(lx: LayerExperts | None) -> bool:
    """Whether ``pf_mm`` reads the layer's experts: gate, up, down in F16, Q8_0 or Q4_0 (gate and
    up of one type), widths multiples of 32, SiLU, no biases (and, on the device, compute
    capability >= 8.0: ``BatchedExperts`` checks that)."""
    return (lx is not None and lx.gate.qtype in _QTYPES and lx.down.qtype in _QTYPES
            and lx.up.qtype == lx.gate.qtype and lx.hidden % 32 == 0 and lx.ffn % 32 == 0
            and lx.activation == "silu" and not lx.has_bias)


def _tiles(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tiles of groups of ``counts`` consecutive rows: (first row, rows, group) per tile, and the
    end tile of each group (cumulative)."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    ntile = -(-counts // TILE_ROWS)
    ends = np.cumsum(ntile)
    group = np.repeat(np.arange(len(counts)), ntile)
    within = np.arange(len(group)) - np.repeat(ends - ntile, ntile)
    row = starts[group] + within * TILE_ROWS
    n = np.minimum(TILE_ROWS, counts[group] - within * TILE_ROWS)
    return row.astype(np.int32), n.astype(np.int32), group.astype(np.int32), ends


class BatchedExperts:
    """Multi-token steps of an ExpertEngine with a GPU on the tensor-core kernels (module docstring)."""

    def __init__(self, engine, batch_experts: int = 16):
        if engine.gpu is None:
            raise ValueError("BatchedExperts needs an engine with a GPU")
        if batch_experts < 1:
            raise ValueError(f"BatchedExperts batch_experts: {batch_experts}, expected >= 1")
        self.engine, self.gx = engine, engine.gpu
        self.batch_experts = batch_experts
        # mma.sync m16n8k16 needs compute capability 8.0: an older GPU keeps every step on the engine
        # (pf_mm would not compile there, and the backend must still run)
        tensor_cores = int(cp.cuda.Device().compute_capability) >= 80
        self._ok = {l.layer: tensor_cores and supported(l) for l in engine.layers if l is not None}
        self._mm = Launch(_kernel("pf_mm"), 15) if any(self._ok.values()) else None
        self._split = Launch(_kernel("pf_split"), 6) if self._mm is not None else None
        # per layer: pf_mm2 where prefill_mm2 says it applies (Q8_0; MOELAB_PREFILL_MM=1 keeps pf_mm)
        self._use_mm2 = {l: ok and prefill_mm2.kernel_for(engine.layers[l]) == "pf_mm2" for l, ok in self._ok.items()}
        self._mm2 = Launch(prefill_mm2.kernel(), 15) if any(self._use_mm2.values()) else None
        moe = [l for l in engine.layers if l is not None]
        self._stage_bytes = max(pad_slot_bytes(l.expert_bytes) for l in moe)
        self._stage: cp.ndarray | None = None
        self._free = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        self._bufs: dict[str, cp.ndarray] = {}
        self.rounds = 0  # GPU rounds run (counters for reports)

    def takes(self, d: Decision, ids) -> bool:
        """Whether this step runs here: T >= MIN_TOKENS tokens, a supported layer, metadata that
        fits one copy."""
        t = len(ids)
        if t < MIN_TOKENS or not self._ok.get(d.layer, False) or np.ndim(ids) != 2:
            return False
        pairs = t * np.shape(ids)[1]
        return 8 * len(d.step.experts) + 12 * (pairs + len(d.step.experts)) + 12 * pairs + 256 < _META_BYTES

    # buffers -----------------------------------------------------------------------------------
    def _buf(self, name: str, n: int, dtype) -> cp.ndarray:
        """A device work buffer of at least ``n`` elements (grown on the compute stream)."""
        a = self._bufs.get(name)
        if a is None or a.size < n:
            with self.gx.compute:
                a = self._bufs[name] = cp.empty(max(n, 2 * (0 if a is None else a.size)), dtype)
        return a

    def _staging(self) -> int:
        if self._stage is None:
            with self.gx.compute:
                self._stage = cp.empty(2 * self.batch_experts * self._stage_bytes, cp.uint8)
        return int(self._stage.data.ptr)

    # one layer ---------------------------------------------------------------------------------
    def run_layer(self, d: Decision, x, topk_ids, topk_weights):
        """Run ``d`` for x ``(T, hidden)`` (cupy float32), ids and weights ``(T, k)``; -> ``(T, hidden)``
        on the compute stream (as ``ExpertEngine.run_layer``)."""
        t0 = time.perf_counter()
        eng, gx = self.engine, self.gx
        layer = d.layer
        lx = eng.layers[layer]
        ids = np.asarray(topk_ids)
        w = np.ascontiguousarray(topk_weights, np.float32)
        T, k = ids.shape
        H, F = lx.hidden, lx.ffn
        if w.shape != ids.shape or getattr(x, "shape", None) != (T, H):
            raise ValueError(f"layer {layer}: x {getattr(x, 'shape', None)}, topk_ids {ids.shape}, topk_weights "
                             f"{w.shape}: expected (T, {H}), (T, k), (T, k)")
        slot_of = eng.slot_of
        for v in d.evictions:
            slot_of.pop(v, None)
        misses = d.uploads + d.streams
        gpu_experts = d.hits + misses
        experts = gpu_experts + d.cpu
        rank = np.full(lx.num_experts, -1, np.int64)
        rank[list(experts)] = np.arange(len(experts))
        flat = ids.reshape(-1)
        r = rank[flat]
        if (r < 0).any():
            missing = sorted(set(flat[r < 0].tolist()))
            raise ExecutorError(f"layer {layer}: routed experts {missing} are not in the decision")
        order = stable_order(r)
        counts = np.bincount(r, minlength=len(experts))
        n_pairs, n_hit, G = T * k, len(d.hits), len(gpu_experts)
        n_gpu = int(counts[:G].sum())
        tok = (order // k).astype(np.int32)
        pair_of = np.empty(n_pairs, np.int32)
        pair_of[order] = np.arange(n_pairs, dtype=np.int32)
        bases, stage_of = self._bases(d, layer, misses, slot_of)
        trow, tn, tg, tend = _tiles(counts[:G])
        starts = np.concatenate([[0], np.cumsum(counts[:G])])
        d_base, d_row, d_n, d_g, d_tok, d_pair, d_w = gx._upload_meta(
            np.array(bases, np.uint64), trow, tn, tg, tok[:n_gpu], pair_of, w.reshape(-1))
        gx.after_caller()  # x may still be in the making on the caller's stream
        x = gx.as_input(x)
        job = None
        if n_gpu < n_pairs:  # the CPU pool first: usually the layer's longest path
            xh, ev = gx.fetch_input(x)
            gx.wait(ev, "copy of the layer input for the CPU pool")
            buffers = gx.cpu_buffers(n_pairs - n_gpu, H)
            job = eng._cpu(lx, flat[order[n_gpu:]].tolist(), tok[n_gpu:], xh, buffers)
            time.sleep(0)
        y = self._buf("y", n_pairs * H, cp.float32)
        s = gx.compute.ptr
        if n_gpu:
            ah, al = self._buf("xh", n_gpu * H, cp.uint16), self._buf("xl", n_gpu * H, cp.uint16)
            hf, ai = self._buf("hf", n_gpu * F, cp.float32), self._buf("xi", n_gpu, cp.float32)
            hh, hl = self._buf("hh", n_gpu * F, cp.uint16), self._buf("hl", n_gpu * F, cp.uint16)
            hi = self._buf("hi", n_gpu, cp.float32)
            self._split((n_gpu, 1), 256, s, x.data.ptr, d_tok, H, ah.data.ptr, al.data.ptr, ai.data.ptr)
            _, _, off_g, qt_g, rb_g, off_u, _, _, off_d, qt_d, rb_d, _, _ = gx._consts[layer]
            promo = dict(zip(d.promotions, d.promotion_slots))
            up = dict(zip(d.uploads, d.slots))
            for v in d.retired:  # residents that leave after this step; their slots take promotions
                slot_of.pop(v, None)
            mm = self._mm2 if self._use_mm2[layer] else self._mm
            B = self.batch_experts
            rounds = [(0, n_hit)] + [(n_hit + i, n_hit + min(i + B, len(misses))) for i in range(0, len(misses), B)]
            first_copy = True
            for ri, (g0, g1) in enumerate(rounds):
                if ri:
                    half = (ri - 1) % 2
                    if first_copy:
                        gx.begin_copies()  # after every kernel queued before this layer
                        first_copy = False
                    if ri > 2:
                        _rt.streamWaitEvent(gx.copy.ptr, self._free[half].ptr)
                    for e in gpu_experts[g0:g1]:
                        if e in stage_of:
                            gx._copy_expert(layer, e, stage_of[e], gx.copy)
                        else:
                            gx.upload(layer, e, up[e])
                    gx.compute_after_copies()
                t_lo, t_hi = (int(tend[g0 - 1]) if g0 else 0), (int(tend[g1 - 1]) if g1 else 0)
                if t_hi > t_lo:
                    r0, r1 = int(starts[g0]), int(starts[g1])
                    mm((-(-F // _N_GATE), t_hi - t_lo), 128, s, d_base, d_row + 4 * t_lo, d_n + 4 * t_lo,
                             d_g + 4 * t_lo, ah.data.ptr, al.data.ptr, ai.data.ptr, H, F, off_g, off_u, rb_g, qt_g, 0,
                             hf.data.ptr)
                    self._split((r1 - r0, 1), 256, s, hf.data.ptr + 4 * r0 * F, 0, F, hh.data.ptr + 2 * r0 * F,
                                hl.data.ptr + 2 * r0 * F, hi.data.ptr + 4 * r0)
                    mm((-(-H // _N_DOWN), t_hi - t_lo), 128, s, d_base, d_row + 4 * t_lo, d_n + 4 * t_lo,
                             d_g + 4 * t_lo, hh.data.ptr, hl.data.ptr, hi.data.ptr, F, H, off_d, 0, rb_d, qt_d, 1,
                             y.data.ptr)
                for e in gpu_experts[g0:g1]:
                    if e in promo:
                        _rt.memcpyAsync(gx._slot_ptr(layer, promo[e]), stage_of[e], lx.expert_bytes, _D2D, s)
                        slot_of[(layer, e)] = promo[e]
                if ri:
                    _rt.eventRecord(self._free[(ri - 1) % 2].ptr, s)
            self.rounds += len(rounds)
        else:
            for v in d.retired:
                slot_of.pop(v, None)
        with gx.compute:
            out = cp.empty((T, H), cp.float32)
        if job is not None:
            res = eng._cpu_result(job, layer)
            gx.put_rows(y[: n_pairs * H].reshape(n_pairs, H), n_gpu, res)
        gx._k_combine((T, 1), 256, s, y.data.ptr, d_pair, d_w, out.data.ptr, k, H)
        gx.mark_read()
        for e, slot in zip(d.uploads, d.slots):
            slot_of[(layer, e)] = slot
        st = eng.stats
        st.steps += 1
        st.gpu_pairs += n_gpu
        st.cpu_pairs += n_pairs - n_gpu
        st.uploads += len(d.uploads)
        st.streams += len(d.streams)
        st.host_queue_s += time.perf_counter() - t0
        return eng.hand_back(out)

    def _bases(self, d: Decision, layer: int, misses: tuple, slot_of) -> tuple[list[int], dict[int, int]]:
        """Device address of each GPU expert in decision order (hits: their slots; uploads: their
        new slots; streams: a staging buffer of their round's half), and the streams' buffers."""
        gx = self.gx
        slots = [slot_of.get((layer, e)) for e in d.hits]
        if None in slots:
            e = d.hits[slots.index(None)]
            raise ExecutorError(f"layer {layer}: hit on expert {e}, which this engine never loaded")
        table = gx.slot_tables[layer]  # (arena address, slot bytes, slots) of the layer's pool
        arr = np.array(slots, np.int64)
        if table is not None and (not len(arr) or (arr.min() >= 0 and arr.max() < table[2])):
            bases = (table[0] + arr * table[1]).tolist()  # as source_ptr, without a call per expert
        else:
            bases = [gx.source_ptr(layer, s) for s in slots]
        up = dict(zip(d.uploads, d.slots))
        stage_of: dict[int, int] = {}
        base = self._staging() if d.streams else 0
        B = self.batch_experts
        for i, e in enumerate(misses):
            if e in up:
                bases.append(gx.source_ptr(layer, up[e]))
            else:
                ptr = base + (((i // B) % 2) * B + i % B) * self._stage_bytes
                stage_of[e] = ptr
                bases.append(ptr)
        return bases, stage_of
