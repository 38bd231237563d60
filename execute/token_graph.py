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
graph is tried again only after a back-off (``scheduler.graph.GraphBackoff``, the simulator's
rule too: 1, 2, 4 .. 64 tokens, 0 again after a complete one, and none while the smoothed share of
tokens that would have completed stays at or above its ``MIN_RATE``).

Pipelining. When a token's graph completes, its logits are final before the host has planned,
settled or audited any of its steps. ``steps`` then asks ``ahead`` (set by the run loop,
``execute.driver``) for the next input; when that is the same sequence's next token, its graph is
launched at once and the host's work on the finished token's steps overlaps it. Nothing the
scheduler decides depends on it (decisions come from the routes, which are the same), and the
numerics do not change: the early graph reads the slot table as it stood at its launch, copied to a
staging buffer (the host table may change while it runs); every expert in that table is in its
slot by then (uploads and promotions are ordered before the graph on the device, background fills
enter the table only once complete), and every copy queued after the launch waits for the graph's
reads (``mark_read``), so no slot it reads is overwritten while it runs. An expert that the early
graph does not find (a background fill completed after its launch) halts it, as any miss does.

Numerics: the same kernels on the same values as the block-by-block path (router weights as the
router kernel wrote them), so logits are bit-identical.

Misses on the CPU (``moelab run --graph-cpu`` or ``MOELAB_GRAPH_CPU=1``, off by default;
``execute.graph_cpu``): each block hands its non-resident experts to the CPU pool through mapped
memory inside the graph, so no block halts; the policy must be wrapped in
``scheduler.graph.CpuMisses`` (its decisions then say the same, which ``GraphCpuGate`` checks), and
no token is launched ahead; with ``MOELAB_GRAPH_CPU_STREAM=1`` the host settles each block's step
while the graph runs on.
"""
from __future__ import annotations

import sys

import time

import cupy as cp
import numpy as np

from scheduler.graph import GraphBackoff

from .driver import settled_steps
from .gpu_experts import copy_to_device

__all__ = ["TokenGraph", "token_graph_env"]

_rt = cp.cuda.runtime
_HALT_NONE = 0x7F7F7F7F  # halt's value before a token (memset of 0x7f bytes): no block missed
_DENSE = ("qkv", "qk_rope", "attention", "attn_merge", "wo", "router")  # gpu_dense's launches of a block
_EXPERTS = {False: ("gate_up", "down_combine"), True: ("put", "gate_up", "down", "wait+combine")}  # by CPU graph


def token_graph_env() -> bool:
    """The ``MOELAB_TOKEN_GRAPH`` environment variable: ``1`` (the default) runs a decode token as
    one graph when it can, ``0`` runs it block by block."""
    from .xp import env_switch

    return env_switch("MOELAB_TOKEN_GRAPH")


class TokenGraph:
    """The token graph of ``model`` (a ``MoeModel`` on the fused path) with ``engine``'s experts.
    ``pipeline`` False launches no token ahead (for side-by-side timing). ``graph_cpu``: misses on
    the CPU pool inside the graph (``execute.graph_cpu``; None: ``MOELAB_GRAPH_CPU``)."""

    pipeline = True

    def __init__(self, model, engine, graph_cpu: bool | None = None):
        info, gd = model.info, model.gd
        self.model, self.engine, self.gx = model, engine, engine.gpu
        self.L, self.k, hidden = info.num_layers, info.top_k, info.hidden
        L, k = self.L, self.k
        self.cur = cp.zeros((L, hidden), cp.float32)  # each block's residual stream after attention
        self.hn = cp.zeros((L, hidden), cp.float32)  # each block's normed MoE input
        self.hn_rows = [self.hn[l:l + 1] for l in range(L)]  # (1, hidden) views, made once
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
        self._win = np.array(self.swa, np.int64)  # per block: its sliding window (0: none)
        self._has_win = self._win > 0
        self.done = cp.cuda.Event(disable_timing=True)
        self.after_experts = cp.cuda.Event(disable_timing=True)
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._exec = 0
        self._graph = None
        self._cache = None  # the KV cache the graph was captured for
        self.gate = GraphBackoff()  # whether the next token tries the graph (scheduler.graph's rule)
        self.failed = False  # a capture failed: never again for this model
        self.tokens = self.complete = 0
        self._gd = gd
        # the slot table as the last launch read it (the host's may change while a graph runs)
        self._stage_mem = cp.cuda.alloc_pinned_memory(engine.table_dev.nbytes)
        self._stage = np.frombuffer(self._stage_mem, np.uint64, engine.table_dev.size).reshape(engine.table_dev.shape)
        self._emb_mem = cp.cuda.alloc_pinned_memory(4 * hidden)  # the embedding of a token launched ahead
        self._emb = np.frombuffer(self._emb_mem, np.float32, hidden)
        self.ahead = None  # the run loop's: ahead(pos) -> the token id to launch at pos next, or None
        self._pending = None  # (pos, token id or None) of the launched graph not yet read back
        self.launched_ahead = 0  # tokens launched before the previous token's steps were settled
        self.wait_s = 0.0  # host time blocked on the graphs (in result)
        self.gpu_s = 0.0  # device time of the graphs (CUDA events around each launch)
        self._t0, self._t1 = cp.cuda.Event(), cp.cuda.Event()
        self.cpu = None  # execute.graph_cpu.GraphCpu: misses go to the CPU pool inside the graph
        from .graph_gate import GraphCpuGate, graph_cpu_wanted

        if graph_cpu_wanted(graph_cpu):
            from .graph_cpu import GraphCpu

            self.cpu = GraphCpu.create(engine, L, k, hidden)
            if self.cpu is not None:
                self.gate, self.pipeline = GraphCpuGate(), False

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
        cpu = self.cpu
        if cpu is not None:
            out += cpu.prologue()
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
            if cpu is not None:
                out.extend(cpu.block(l, route, table + 8 * width * l, int(self.hn[l].data.ptr), int(self.h.data.ptr),
                                     int(self.out[l].data.ptr)))
            else:
                out.extend(gx.routed_layer(l, route, table + 8 * width * l, halt, int(self.hn[l].data.ptr),
                                           int(self.h.data.ptr), int(self.out[l].data.ptr), k))
            x = self.cur[l]
        head = gd.decode_head(x, model.output, model.output_norm, eps, rs, float(info.logit_scale))
        head.vals[6], head.vals[15] = int(self.out[L - 1].data.ptr), int(self.logits.data.ptr)
        back_h, nback = self._back_mem.ptr, self.back_dev.nbytes
        out += [head, lambda s: _rt.memcpyAsync(back_h, back, nback, _rt.memcpyDeviceToHost, s)]
        if cpu is not None:
            out += cpu.epilogue()
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

    def prepare(self) -> bool:
        """Capture the graph now, before a run's clock starts, rather than at the first launch; False
        when it cannot be built (a warning was printed, decode runs block by block)."""
        if self.failed:
            return False
        if self._exec and self._cache is self.model.k_cache[0]:
            return True
        return self._build()

    # run -----------------------------------------------------------------------------------------
    def want(self) -> bool:
        """Whether the next token should try the graph (see the module docstring)."""
        if self.failed:
            return False
        return self.gate.want()

    def launch(self, pos: int) -> bool:
        """Launch the token at ``pos`` (its embedding already queued into ``gd.emb`` on the current
        stream) without waiting; False when the graph cannot be built. ``result`` reads it back."""
        if self._exec == 0 or self._cache is not self.model.k_cache[0]:
            if not self._build():
                return False
        gx = self.gx
        s = self._stage_token(pos)
        _rt.eventRecord(self._t0.ptr, s)
        _rt.graphLaunch(self._exec, s)
        _rt.eventRecord(self._t1.ptr, s)
        _rt.eventRecord(self.done.ptr, s)
        _rt.streamWaitEvent(gx.compute.ptr, self.done.ptr)
        gx.mark_read()  # copies into slots wait for the graph's reads
        if self.cpu is not None:  # the graph waits for each block's call on the device
            self.cpu.after_launch()
        self._pending = (pos, None)
        return True

    def _stage_token(self, pos: int) -> int:
        """``launch``'s staging (also ``time_launches``'s): the decode records of the token at ``pos``, the
        slot table staged (and the CPU graph's call base written) on the current stream after the
        expert work queued before: -> the stream."""
        rec, n = self.rec, pos + 1
        lo = np.where(self._has_win, np.maximum(n - self._win, 0), 0)  # each block's first key
        rec[:, 0] = pos
        rec[:, 1] = lo
        rec[:, 2] = n - lo
        s = cp.cuda.get_current_stream().ptr
        _rt.eventRecord(self.after_experts.ptr, self.gx.compute.ptr)  # expert work queued before this token
        _rt.streamWaitEvent(s, self.after_experts.ptr)
        res = self.engine.slot_of
        if res.dirty:  # the graph reads a staged copy: the host table may change while it runs
            np.copyto(self._stage, res.table)
            copy_to_device(self.engine.table_dev, self._stage, s)
            res.dirty = False
        if self.cpu is not None:
            self.cpu.before_launch()
        return s

    def time_launches(self, pos: int) -> list[tuple[str, float]]:
        """The token at ``pos`` (its embedding queued) as plain launches instead of the graph, a CUDA
        event after each, waited for: -> (name, milliseconds) per launch in order (per-kernel
        timing: each launch ends before the next starts, so programmatic overlap is lost)."""
        launches = self._launches()
        cpu = self.cpu
        names = (["record", "halt"] + ["seq"] * (cpu is not None)
                 + [*_DENSE, *_EXPERTS[cpu is not None]] * self.L + ["head", "read back"]
                 + ["picks"] * (cpu is not None))
        if len(names) != len(launches):  # another block shape: numbered
            names = [f"launch{i}" for i in range(len(launches))]
        events = [cp.cuda.Event() for _ in range(len(launches) + 1)]
        s = self._stage_token(pos)
        _rt.eventRecord(events[0].ptr, s)
        for f, e in zip(launches, events[1:]):
            f(s)
            _rt.eventRecord(e.ptr, s)
        if self.cpu is not None:
            self.cpu.after_launch()
            self.cpu.submit_rest()
        events[-1].synchronize()
        if self.cpu is not None:
            self.cpu.finish()
        return [(n, cp.cuda.get_elapsed_time(a, b)) for n, a, b in zip(names, events, events[1:])]

    def result(self) -> tuple[int, np.ndarray, np.ndarray]:
        """Wait for the launched graph: -> the number of blocks it completed (``halt``), ids ``(L, k)``
        int64 and weights ``(L, k)`` float32 of blocks ``0 .. halt`` (rows past it are not meaningful)."""
        L, k = self.L, self.k
        if self.cpu is not None:
            self.cpu.submit_rest()  # (streaming submits them block by block)
        t0 = time.perf_counter()
        self.done.synchronize()
        self.wait_s += time.perf_counter() - t0
        self.gpu_s += 1e-3 * cp.cuda.get_elapsed_time(self._t0, self._t1)
        self._pending = None
        back = self.back
        halt = int(back[L * 2 * k:].view(np.int32)[0])
        m = L if halt >= L else halt
        r = back[: L * 2 * k].reshape(L, 2 * k)
        ids = r[:, :k].view(np.int32).astype(np.int64)
        wts = r[:, k:].copy()
        self.tokens += 1
        self.complete += m == L
        self.gate.done(m == L)
        if self.cpu is not None:
            self.gate.expect(self.cpu.finish())
        return m, ids, wts

    def run(self, pos: int) -> tuple[int, np.ndarray, np.ndarray]:
        """``launch`` then ``result`` (0 blocks when the graph cannot be built)."""
        if not self.launch(pos):
            return 0, np.zeros((self.L, self.k), np.int64), np.zeros((self.L, self.k), np.float32)
        return self.result()

    def launched(self, pos: int, token_id: int) -> bool:
        """Whether token ``token_id`` at ``pos`` was launched ahead (``steps`` then reads it back)."""
        return self._pending == (pos, token_id)

    def drop(self) -> None:
        """Forget a graph launched ahead and not read back (a run that ended early), after it ran."""
        if self._pending is not None:
            self.done.synchronize()
            self._pending = None

    def _launch_ahead(self, pos: int, token_id: int) -> None:
        """Launch the next token of the sequence now, if the graph would be tried for it."""
        model = self.model
        if (pos + 1 > model.k_cache[0].shape[1] or self._cache is not model.k_cache[0]
                or model.router_predictor is not None or not self.want()):
            return
        np.copyto(self._emb, np.ascontiguousarray(model.token_embd[token_id] * np.float32(model.info.embedding_scale),
                                                  np.float32))
        copy_to_device(self._gd.emb, self._emb, cp.cuda.get_current_stream().ptr)
        if self.launch(pos):
            self._pending = (pos, token_id)
            self.launched_ahead += 1

    def steps(self, model, pos: int, rows: list | None, ahead: bool = False):
        """The token at ``pos`` through the graph (``model._token_fast``'s decode token: its embedding
        queued, or with ``ahead`` the graph ``launched`` ahead for it): yields the Steps of the blocks
        it completed, each with ``model.step_done`` set (the run loop settles them), and returns how
        many. ``rows``: the model's route log of the token, extended by those blocks' routes. A token
        the graph completed leaves the model after the token (logits, position, route log) before
        its first step is yielded, and the next token may be launched then (see Pipelining above);
        the steps' ``last_input`` rows are then not this token's (nothing reads them for a settled
        step)."""
        if self.cpu is not None and self.cpu.stream:
            return (yield from self._stream_steps(model, pos, rows))
        if not ahead:
            self.drop()
            if not self.launch(pos):
                return 0
        m, g_ids, g_wts = self.result()
        if m == self.L:  # the device idles from here to the next launch: nothing else before it
            model.chunk_logits = self.logits.copy()
            model.logits = model.chunk_logits[-1]
            model.pos = pos + 1
            take = self.ahead
            if take is not None and self.pipeline:
                nxt = take(pos + 1)
                if nxt is not None:
                    self._launch_ahead(pos + 1, nxt)
        ids_rows = g_ids[:m].tolist()
        w_rows = g_wts[:m].astype(np.float64).tolist()
        if rows is not None:
            rows.extend((l, ids_rows[l], w_rows[l]) for l in range(m))
            if m == self.L:
                model.route_log.append((pos, rows))
        yield from settled_steps(model, g_ids[:m], g_wts[:m], ids_rows, w_rows, self.hn_rows)
        return m

    def _stream_steps(self, model, pos: int, rows: list | None):
        """``steps`` of a CPU graph (``execute.graph_cpu``) settled while it runs: block ``l``'s step
        is yielded as soon as the graph's put has handed over its route, so the host plans and
        settles it while the GPU and the pool run the blocks after it; the decisions are the same
        (the graph's split is its slot table at the launch, every block completes). The token's
        logits, position and route log are set after its last step, once the graph has ended."""
        from scheduler import Step

        self.drop()
        if not self.launch(pos):
            return 0
        cpu, L = self.cpu, self.L
        expect: list = []
        self.gate.done(True)
        self.gate.expect(expect)  # filled block by block, before each step is yielded
        model._route_len = [self.k]
        for l in range(L):
            t0 = time.perf_counter()
            ids, wts, misses = cpu.seen_block(l, self.done)
            self.wait_s += time.perf_counter() - t0
            expect.append(misses)
            id_row, w_row = ids.tolist(), wts.astype(np.float64).tolist()
            if rows is not None:
                rows.append((l, id_row, w_row))
            model.last_input, model.last_ids, model.last_weights = self.hn_rows[l], ids[None], wts[None]
            model.step_done = True
            try:
                yield Step(l, tuple(id_row), None, tuple(w_row))
            finally:
                model.step_done = False
        t0 = time.perf_counter()
        self.done.synchronize()
        self.wait_s += time.perf_counter() - t0
        self.gpu_s += 1e-3 * cp.cuda.get_elapsed_time(self._t0, self._t1)
        self._pending = None
        self.tokens += 1
        self.complete += 1
        cpu.finish_stream()
        model.chunk_logits = self.logits.copy()
        model.logits = model.chunk_logits[-1]
        model.pos = pos + 1
        if rows is not None:
            model.route_log.append((pos, rows))
        return L
