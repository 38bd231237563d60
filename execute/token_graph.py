"""One decode token as one CUDA graph: every block's dense path and experts without the host.

A token's blocks (``gpu_dense`` launches) and, after each block's router, its experts
(``moe1r_gate_up`` / ``moe1r_down_combine``: the pairs read from the router's output and the
engine's slot table on the device) are captured once as one graph, with the head after the last
block; the graph ends with one copy of every block's ids and weights and of ``halt`` into pinned
memory. Per token the host writes the blocks' decode records (position, key range), copies the
slot table up when residency changed, launches the graph and waits once.

Residency is checked on the device: a block whose routed experts are not all in the slot table
sets ``halt`` to its index and runs no expert; no later block runs an expert either (their dense
launches still run, on stale inputs, into buffers of the graph's own). The host then has the
routes of blocks ``0 .. halt`` and the residual stream after block ``halt - 1``; the model yields
the steps of the blocks the graph completed (their decisions are settled, not run: see
``ExpertEngine.settle_layer``) and runs the rest block by block from ``halt``. Under ``gpu``
every expert is resident and the graph always completes. For a policy whose cache holds part of
the model, an incomplete token costs the wasted dense launches, so after an incomplete token the
graph is tried again only after a back-off (1, 2, 4 .. 64 tokens; 0 again after a complete one).

Numerics: the same kernels on the same values as the block-by-block path (router weights as the
router kernel wrote them), so logits are bit-identical.
"""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

__all__ = ["TokenGraph", "token_graph_env"]

_rt = cp.cuda.runtime
_MAX_SKIP = 64
_HALT_NONE = 0x7F7F7F7F  # halt's value before a token (memset of 0x7f bytes): no block missed


def token_graph_env() -> bool:
    """The ``MOELAB_TOKEN_GRAPH`` environment variable: ``1`` (the default) runs a decode token as
    one graph when it can, ``0`` runs it block by block."""
    import os

    from .experts import ExecutorError

    v = os.environ.get("MOELAB_TOKEN_GRAPH", "1").strip()
    if v not in ("0", "1"):
        raise ExecutorError(f"environment variable MOELAB_TOKEN_GRAPH: {v!r}, expected 0 or 1")
    return v == "1"


class TokenGraph:
    """The token graph of ``model`` (a ``MoeModel`` on the fused path) with ``engine``'s experts."""

    def __init__(self, model, engine):
        info, gd = model.info, model.gd
        self.model, self.engine, self.gx = model, engine, engine.gpu
        self.L, self.k, hidden = info.num_layers, info.top_k, info.hidden
        L, k = self.L, self.k
        self.cur = cp.zeros((L, hidden), cp.float32)  # each block's residual stream after attention
        self.hn = cp.zeros((L, hidden), cp.float32)  # each block's normed MoE input
        self.out = cp.zeros((L, hidden), cp.float32)  # each block's expert output
        self.logits = cp.zeros((1, info.vocab), cp.float32)
        ffn = max(l.ffn for l in engine.layers if l is not None)
        self.h = cp.zeros(k * ffn, cp.float32)  # the experts' gate/up output, (k, ffn) per block
        self.back_dev = cp.zeros(L * 2 * k + 1, cp.float32)  # routes (L, 2k), then halt (int32)
        self._back_mem = cp.cuda.alloc_pinned_memory(self.back_dev.nbytes)
        self.back = np.frombuffer(self._back_mem, np.float32, self.back_dev.size)
        self._rec_mem = cp.cuda.alloc_pinned_memory(8 * 4 * L)
        self.rec = np.frombuffer(self._rec_mem, np.int64, 4 * L).reshape(L, 4)
        self.rec_dev = cp.zeros((L, 4), cp.int64)
        self.rec[:, 3] = [0] + [int(self.out[l].data.ptr) for l in range(L - 1)]
        self.swa = [info.sliding_window if info.is_swa(l) else 0 for l in range(L)]
        self.done = cp.cuda.Event(disable_timing=True)
        self.after_experts = cp.cuda.Event(disable_timing=True)
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._exec = 0
        self._graph = None
        self._cache = None  # the KV cache the graph was captured for
        self.skip = 0  # tokens to run block by block before the next try
        self._backoff = 1
        self.failed = False  # a capture failed: never again for this model
        self.tokens = self.complete = 0
        self._gd = gd

    # build ---------------------------------------------------------------------------------------
    def _launches(self) -> list:
        """The token's work as callables of a stream address, made before the capture (making them
        allocates; a capture may not)."""
        model, gd, gx, eng = self.model, self._gd, self.gx, self.engine
        info, L, k = model.info, self.L, self.k
        rs, eps = float(info.residual_scale), float(info.rms_eps)
        gating = 0 if info.gating == "softmax" else 1
        mode = {"none": 0, "head": 1, "full": 2}[model.spec.qk_norm]
        back = int(self.back_dev.data.ptr)
        halt = back + 4 * L * 2 * k
        rec_h, rec_d, nrec = self._rec_mem.ptr, int(self.rec_dev.data.ptr), self.rec.nbytes
        out = [lambda s: _rt.memcpyAsync(rec_d, rec_h, nrec, _rt.memcpyHostToDevice, s),
               lambda s: _rt.memsetAsync(halt, 0x7F, 4, s)]
        x = gd.emb
        table = int(eng.table_dev.data.ptr)
        width = eng.table_dev.shape[1]
        self._blocks = []
        for l, w in enumerate(model.layers):
            b = gd.decode_block(
                x, self.cur[l], self.hn[l], w["wqkv"], w["attn_norm"], w["bqkv"], w.get("qk_weight"), mode, eps,
                model.rope_cos, model.rope_sin, model.k_cache[l], model.v_cache[l], model.kq_scale, w["sinks"],
                w["wo"], w["bo"], rs, w["router"], w["ffn_norm"], w["router_bias_dev"], gating, info.norm_topk,
                float(info.expert_weights_scale or 1.0), self.swa[l])
            self._blocks.append(b)
            route = back + 4 * l * 2 * k
            out.extend(b.launches(rec_d + 32 * l, route))
            out.extend(gx.routed_layer(l, route, table + 8 * width * l, halt, int(self.hn[l].data.ptr),
                                       int(self.h.data.ptr), int(self.out[l].data.ptr), k))
            x = self.cur[l]
        head = gd.decode_head(x, model.output, model.output_norm, eps, rs, float(info.logit_scale))
        head.vals[6], head.vals[15] = int(self.out[L - 1].data.ptr), int(self.logits.data.ptr)
        back_h, nback = self._back_mem.ptr, self.back_dev.nbytes
        out += [head, lambda s: _rt.memcpyAsync(back_h, back, nback, _rt.memcpyDeviceToHost, s)]
        return out

    def _build(self) -> bool:
        cs = self._stream
        try:
            launches = self._launches()
            with cs:
                cs.begin_capture()
                try:
                    for launch in launches:
                        launch(cs.ptr)
                except BaseException:
                    try:
                        cs.end_capture()
                    except Exception:  # noqa: BLE001 - the capture's own error is the one raised
                        pass
                    raise
                graph = cs.end_capture()
            ge = int(getattr(graph, "graphExec", 0) or 0)
            if ge == 0:
                raise RuntimeError("this CuPy's Graph does not expose graphExec")
        except Exception as exc:  # noqa: BLE001 - any failure leaves the block-by-block path
            self.failed = True
            msg = " ".join(f"{type(exc).__name__}: {exc}".split())
            print(f"moelab: warning: token graph capture failed ({msg}); decode runs block by block",
                  file=sys.stderr)
            return False
        self._graph, self._exec, self._cache = graph, ge, self.model.k_cache[0]
        return True

    # run -----------------------------------------------------------------------------------------
    def want(self) -> bool:
        """Whether the next token should try the graph (see the module docstring)."""
        if self.failed:
            return False
        if self.skip:
            self.skip -= 1
            return False
        return True

    def run(self, pos: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Run the token at ``pos`` (its embedding already in ``gd.emb``): -> the number of blocks
        the graph completed (``halt``), ids ``(L, k)`` int64 and weights ``(L, k)`` float32 of
        blocks ``0 .. halt`` (rows past it are not meaningful)."""
        if self._exec == 0 or self._cache is not self.model.k_cache[0]:
            if not self._build():
                return 0, np.zeros((self.L, self.k), np.int64), np.zeros((self.L, self.k), np.float32)
        L, k, gx = self.L, self.k, self.gx
        rec = self.rec
        n = pos + 1
        for l, win in enumerate(self.swa):
            lo = max(0, n - win) if win else 0
            rec[l, 0], rec[l, 1], rec[l, 2] = pos, lo, n - lo
        s = cp.cuda.get_current_stream().ptr
        _rt.eventRecord(self.after_experts.ptr, gx.compute.ptr)  # expert work queued before this token
        _rt.streamWaitEvent(s, self.after_experts.ptr)
        self.engine.sync_table(s)
        _rt.graphLaunch(self._exec, s)
        _rt.eventRecord(self.done.ptr, s)
        _rt.streamWaitEvent(gx.compute.ptr, self.done.ptr)
        gx.mark_read()  # copies into slots wait for the graph's reads
        self.done.synchronize()
        back = self.back
        halt = int(back[L * 2 * k:].view(np.int32)[0])
        m = L if halt >= L else halt
        r = back[: L * 2 * k].reshape(L, 2 * k)
        ids = r[:, :k].view(np.int32).astype(np.int64)
        wts = r[:, k:].copy()
        self.tokens += 1
        if m == L:
            self.complete += 1
            self._backoff = 1
        else:
            self.skip = self._backoff
            self._backoff = min(2 * self._backoff, _MAX_SKIP)
        return m, ids, wts
