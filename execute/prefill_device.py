"""A prefill chunk whose experts start on the device: no host round trip inside the chunk.

When every expert of every MoE block is resident in the GPU's slots (``gpu``, or a cache that holds
the whole model), :class:`DeviceChunk` queues the chunk's blocks back to back on the caller's stream
and the host waits once, after the last block:

1. per block, the dense path as ``MoeModel`` runs it (``prefill_dense``: norms, projections, attention);
2. the router's top-k on the device (``ChunkDense.route_to``, ``pd_route``) into the block's row of
   chunk-wide buffers of ids (int32), weights (float64) and a non-finite flag;
3. ``pf_group`` (one block of 1024 threads): the block's (token, rank) pairs grouped by expert on
   the device, experts ascending and tokens ascending within one, the combine's pair table, the
   weights in float32 and tiles of up to 32 rows; the expert addresses are the engine's slot table
   on the device (``ExpertEngine.table_dev``);
4. the products as ``BatchedExperts`` runs a layer of hits (``pf_split``, ``pf_mm2`` or ``pf_mm``
   gate+up, ``pf_split``, down, ``moe_combine``) in launches of a fixed shape: ceil(T k / 32) +
   min(E, T k) tiles, the unused ones (``tile_n`` 0) returning at once.

After the last block one copy brings every block's ids, weights and flags to pinned memory, the head
is queued, the host waits, and the blocks' Steps are yielded settled (``model.step_done``): the
policy plans, commits and audits each as before; the backend's ``settle_layer`` carries out what a
decision still moves (as for the token graph, ``execute.token_graph``). ``last_input`` is None for
these steps (the blocks' normed inputs are not kept; nothing reads them for a settled step).

Numerics: the same kernels on the same values as the block-by-block path, and a pair's row of the
products does not depend on its tile or position (the combine sums a token's pairs in rank order),
so the logits are bit-identical to it. A block with a non-finite router logit (the host rule routes
those) is found after the chunk, which then runs again block by block (``chunk_steps``).

``MOELAB_PREFILL_DEVICE``: 1 takes this path where it applies, 0 keeps the chunk block by block
(unset: :data:`DEFAULT`); another value is an error.
"""
from __future__ import annotations

import os
import time

import cupy as cp
import numpy as np

from .batch_route import max_tiles, settle
from .experts import ExecutorError
from .gpu_host import Launch
from .prefill import _N_DOWN, _N_GATE, MIN_TOKENS, _kernel

__all__ = ["DEFAULT", "DeviceChunk", "device_env"]

DEFAULT = "1"  # MOELAB_PREFILL_DEVICE when unset

_rt = cp.cuda.runtime
_GROUP_E = 2048  # pf_group's shared arrays (GROUP_E in prefill_kernels.cu)
_GROUP_THREADS = 1024


def device_env() -> bool:
    """``MOELAB_PREFILL_DEVICE``: 1 -> True, 0 -> False, unset -> :data:`DEFAULT`; another value is an
    ExecutorError naming the variable."""
    v = os.environ.get("MOELAB_PREFILL_DEVICE", DEFAULT).strip()
    if v not in ("0", "1"):
        raise ExecutorError(f"environment variable MOELAB_PREFILL_DEVICE: {v!r}, expected 0 or 1")
    return v == "1"


class DeviceChunk:
    """Prefill chunks of ``model`` with ``engine``'s resident experts on ``batched``'s kernels
    (module docstring). Build with :meth:`build` (None where the path cannot apply)."""

    def __init__(self, model, engine, batched):
        self.model, self.engine, self.batched, self.gx = model, engine, batched, engine.gpu
        self._group = Launch(_kernel("pf_group"), 12)
        info = model.info
        self.moe = [l for l, w in enumerate(model.layers) if w["router"] is not None]
        self._index = {l: j for j, l in enumerate(self.moe)}  # a MoE block's row in the chunk's buffers
        width = engine.table_dev.shape[1]
        self._need = np.zeros(engine.table_dev.shape, bool)  # the slot-table entries every chunk reads
        for l in self.moe:
            self._need[l, : engine.layers[l].num_experts] = True
        self._table_row = {l: int(engine.table_dev.data.ptr) + 8 * width * l for l in self.moe}
        self.k = int(info.top_k)
        self._bufs: dict[str, cp.ndarray] = {}
        self._pinned, self._pinned_size = None, 0
        self._done = cp.cuda.Event(disable_timing=True)
        self._t0, self._t1 = cp.cuda.Event(), cp.cuda.Event()
        self.chunks = self.reruns = 0  # chunks run here; of those, run again block by block
        self.queue_s = self.wait_s = self.gpu_s = 0.0  # last chunk: host queueing, host wait, device time

    @classmethod
    def build(cls, model, engine, batched) -> "DeviceChunk | None":
        """A DeviceChunk when the path can apply to ``model``: a GPU engine with a device slot table,
        the chunk dense path, every MoE block on ``batched``'s kernels and routed by ``pd_route``
        (softmax or softmax_topk gating, no groups or selection bias), at most 2048 experts a block."""
        if engine.gpu is None or engine.table_dev is None or getattr(model, "pd", None) is None:
            return None
        if getattr(engine.gpu, "generic_layers", None):
            return None
        info = model.info
        for l, w in enumerate(model.layers):
            if w["router"] is None:
                continue
            lx = engine.layers[l]
            if (lx is None or not batched._ok.get(l, False) or lx.num_experts > _GROUP_E
                    or lx.hidden != info.hidden or not model.pd.routes(info, w["exp_probs_b"])):
                return None
        return cls(model, engine, batched)

    def takes(self, t: int, routes) -> bool:
        """Whether a chunk of ``t`` tokens runs here: t >= MIN_TOKENS, no forced routes, no router
        predictor, the chunk dense path still on, no background copy in flight, and every expert of
        every MoE block resident."""
        eng = self.engine
        if (t < MIN_TOKENS or routes is not None or self.model.router_predictor is not None or self.model.pd is None
                or getattr(eng, "_pending", None)):  # background moves still in flight
            return False
        return bool(np.all(eng.slot_of.table[self._need] != 0))

    def _buf(self, name: str, n: int, dtype) -> cp.ndarray:
        a = self._bufs.get(name)
        if a is None or a.size < n:
            a = self._bufs[name] = cp.empty(max(n, 2 * (0 if a is None else a.size)), dtype)
        return a

    def steps(self, x, all_logits: bool, rows):
        """Run the chunk ``x`` ``(T, hidden)`` (the embedded tokens) at ``model.pos`` through every
        block and the head, then yield each MoE block's settled Step; -> True, or False (nothing
        yielded, nothing kept) when a router logit was not finite."""
        model, info, gx, eng, b = self.model, self.model.info, self.gx, self.engine, self.batched
        t0 = time.perf_counter()
        T, k, H = int(x.shape[0]), self.k, int(info.hidden)
        L, P = len(self.moe), T * k
        rs = np.float32(info.residual_scale)
        s = cp.cuda.get_current_stream()
        sp = s.ptr
        gx.to_caller()  # after the expert work and the copies the compute stream has queued so far
        eng.sync_table(sp)
        wb, ib = 8 * L * P, 4 * L * P
        nbytes = wb + ib + 4 * L
        back = self._buf("back", nbytes, cp.uint8)
        bp = int(back.data.ptr)
        _rt.memsetAsync(bp + wb + ib, 0, 4 * L, sp)
        F = max(eng.layers[l].ffn for l in self.moe)
        ntile = max(max_tiles(P, eng.layers[l].num_experts) for l in self.moe)
        tok, pair = self._buf("tok", P, cp.int32), self._buf("pair", P, cp.int32)
        w32 = self._buf("w32", P, cp.float32)
        tiles = self._buf("tiles", 3 * ntile, cp.int32)
        trow, tn, tg = (int(tiles.data.ptr) + 4 * ntile * i for i in range(3))
        ah, al = self._buf("xh", P * H, cp.uint16), self._buf("xl", P * H, cp.uint16)
        ai, hi = self._buf("xi", P, cp.float32), self._buf("hi", P, cp.float32)
        hf = self._buf("hf", P * F, cp.float32)
        hh, hl = self._buf("hh", P * F, cp.uint16), self._buf("hl", P * F, cp.uint16)
        y = self._buf("y", P * H, cp.float32)
        _rt.eventRecord(self._t0.ptr, sp)
        for l in range(info.num_layers):
            w = model.layers[l]
            h = model._rms(x, w["attn_norm"])
            a = model._attention_mla(l, h) if model.mla else model._attention(l, h)
            x = x + a if rs == 1 else x + a * rs
            hn = model._rms(x, w["ffn_norm"])
            if w["router"] is None:
                f = model._ffn(w["dense_ffn"], hn)
                x = x + f if rs == 1 else x + f * rs
                continue
            j = self._index[l]
            ids_p, wts_p = bp + wb + 4 * P * j, bp + 8 * P * j
            if not model.pd.route_to(model._proj(hn, w["router"]), w["router_bias_dev"], info, ids_p, wts_p,
                                     bp + wb + ib + 4 * j):
                raise AssertionError("pd_route declined a model DeviceChunk.build accepted")
            lx = eng.layers[l]
            E, Fl, nt = lx.num_experts, lx.ffn, max_tiles(P, lx.num_experts)
            if hn.dtype != cp.float32 or not hn.flags.c_contiguous:
                hn = cp.ascontiguousarray(hn, cp.float32)
            self._group((1, 1), _GROUP_THREADS, sp, ids_p, wts_p, P, k, E, nt, int(tok.data.ptr), int(pair.data.ptr),
                        int(w32.data.ptr), trow, tn, tg)
            _, _, off_g, qt_g, rb_g, off_u, _, _, off_d, qt_d, rb_d, _, _ = gx._consts[l]
            mm = b._mm2 if b._use_mm2[l] else b._mm
            base = self._table_row[l]
            b._split((P, 1), 256, sp, int(hn.data.ptr), int(tok.data.ptr), H, int(ah.data.ptr), int(al.data.ptr),
                     int(ai.data.ptr))
            mm((-(-Fl // _N_GATE), nt), 128, sp, base, trow, tn, tg, int(ah.data.ptr), int(al.data.ptr),
               int(ai.data.ptr), H, Fl, off_g, off_u, rb_g, qt_g, 0, int(hf.data.ptr))
            b._split((P, 1), 256, sp, int(hf.data.ptr), 0, Fl, int(hh.data.ptr), int(hl.data.ptr), int(hi.data.ptr))
            mm((-(-H // _N_DOWN), nt), 128, sp, base, trow, tn, tg, int(hh.data.ptr), int(hl.data.ptr),
               int(hi.data.ptr), Fl, H, off_d, 0, rb_d, qt_d, 1, int(y.data.ptr))
            out = cp.empty((T, H), cp.float32)
            gx._k_combine((T, 1), 256, sp, int(y.data.ptr), int(pair.data.ptr), int(w32.data.ptr), int(out.data.ptr),
                          k, H)
            if w["shared"] is not None:
                out = out + model._shared(l, hn)
            x = x + out if rs == 1 else x + out * rs
        _rt.eventRecord(self._t1.ptr, sp)
        if self._pinned_size < nbytes:
            self._pinned_size = max(nbytes, 1 << 16)
            self._pinned = cp.cuda.alloc_pinned_memory(self._pinned_size)
        _rt.memcpyAsync(self._pinned.ptr, bp, nbytes, _rt.memcpyDeviceToHost, sp)
        self._done.record(s)
        gx.after_caller()
        gx.mark_read()  # copies into slots wait for the chunk's reads
        model._head(x, all_logits)
        t1 = time.perf_counter()
        self._done.synchronize()
        self.queue_s, self.wait_s = t1 - t0, time.perf_counter() - t1
        self.gpu_s = 1e-3 * cp.cuda.get_elapsed_time(self._t0, self._t1)
        host = np.frombuffer(self._pinned, np.uint8, nbytes)
        if host[wb + ib:].view(np.int32).any():
            self.reruns += 1
            model.chunk_logits = model.logits = None
            return False
        self.chunks += 1
        wts = host[:wb].view(np.float64).reshape(L, T, k)
        ids = host[wb:wb + ib].view(np.int32).reshape(L, T, k).astype(np.int64)
        model._route_len = [k] * T
        yield from settle(model, ((l, ids[j], wts[j].copy()) for j, l in enumerate(self.moe)), rows)
        return True

