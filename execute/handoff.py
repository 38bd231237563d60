"""The GPU <-> CPU pool hand-off: flags in host-mapped memory, no stream synchronize.

The pool's counters (``cpu_pool.CTRL_WORDS`` int64 words) live in page-locked, device-mapped
host memory, beside the calls' input rows ``xin`` and output rows ``yout``. A layer's CPU pairs
go as follows (``handoff.cu``):

1. the host submits a *gated* call to the pool (``CpuExpertPool.submit(..., gated=True)``, call
   number ``seq``) and queues ``handoff_put``; it does not wait. The put runs on a stream of its
   own as soon as the layer's input is ready on the compute stream (``x_ready``, recorded before
   the early-started expert kernels), so the CPU starts beside those kernels, not after them;
2. ``handoff_put`` copies the pairs' input rows into ``xin``, then writes ``ctrl[_C_GATE] = seq``
   (after ``__threadfence_system``); the pool's workers, which picked the call up at once and
   grouped its pairs, spin on that word (then nap; a GPU cannot wake a futex) and compute;
3. the pool's last worker writes the rows into ``yout`` and then ``ctrl[_C_DONE] = seq``;
4. for one token, ``handoff_wait`` (one block) queued after the layer's GPU work waits for
   ``ctrl[_C_DONE] >= seq``, one copy moves the rows from ``yout`` to device memory, and
   ``handoff1_down_combine`` adds the GPU pairs' down projections and the rows, router-weighted
   in rank order as ``moe1_down_combine`` (read from mapped memory by each of its blocks, the rows
   would cost the link a round trip per two floats); ``handoff_get`` (the microbenchmark's) waits
   and reads the rows from ``yout`` itself, coalesced.

A wait gives up after ``wait_timeout_s`` (1 s at most) or when the pool is marked broken: it then
writes the call's number into a mapped error word and marks the pool broken itself (the pool's
gates open, later waits end at once), so a stalled or crashed worker costs one timeout, never a
hang; ``check`` turns the error word into one ``ExecutorError`` on the host, at the next layer.

Both edges of the hand-off are stamped: ``handoff_put`` stamps the GPU clock (``%globaltimer``)
when it writes the gate, the pool the first worker through the gate and its last output
(``CLOCK_MONOTONIC``), and the waiting kernel the GPU clock when it sees the call done. The two
clocks are paired once by a ping-pong through mapped memory (``clock_offset``).
"""
from __future__ import annotations

import time
from collections import deque

import cupy as cp
import numpy as np
from numba import njit

from . import cpu_pool as P
from .cpu_simd import atomic_load, atomic_store, now_ns, pause
from .experts import ExecutorError
from .gpu_experts import MAX_TOP_K, Launch
from .gpu_host import cuda_module
from .gpu_step import pack1

__all__ = ["Edges", "Handoff", "bench_edges"]


_rt = cp.cuda.runtime
_MAPPED_PORTABLE = 2 | 1  # cudaHostAllocMapped | cudaHostAllocPortable
# words after the pool's counters: the error word, the clock ping and pong, the stamp ring
_ERR, _PING, _PONG = P.CTRL_WORDS, P.CTRL_WORDS + 8, P.CTRL_WORDS + 16
_STAMPS = P.CTRL_WORDS + 24
_SLOTS = 64  # stamp triples (put, seen done, wait started) per call, by seq % _SLOTS
_CLOCK = _STAMPS + 3 * _SLOTS  # GPU stamps of the clock pairing
_ROUNDS = 64
_WORDS = _CLOCK + _ROUNDS
_RPB = 2  # output rows per block in handoff1_down_combine (as moe1_down_combine)


def _kernel(name: str):
    """A kernel of gpu_kernels.cu + handoff.cu (one module, compiled once per process)."""
    return cuda_module("gpu_kernels.cu", "handoff.cu").get_function(name)


class _Mapped:
    """Page-locked host memory mapped into the device: (host array, device address)."""

    def __init__(self, nbytes: int):
        n = max(nbytes, 64)
        self.mem = cp.cuda.PinnedMemory(n, _MAPPED_PORTABLE)
        self.host = np.frombuffer(cp.cuda.PinnedMemoryPointer(self.mem, 0), np.uint8, n)
        self.host[:] = 0
        self.dev = int(cp.cuda.runtime.pointerGetAttributes(self.mem.ptr).devicePointer)


@njit(nogil=True, cache=True)
def _ping(words, ping, pong, rounds, sent, got, timeout_ns):
    """The host side of the clock pairing (see handoff_clock): rounds completed."""
    t0 = now_ns()
    for r in range(1, rounds + 1):
        sent[r - 1] = now_ns()
        atomic_store(words, ping, r)
        while atomic_load(words, pong) < r:
            if now_ns() - t0 > timeout_ns:
                return r - 1
            pause()
        got[r - 1] = now_ns()
    return rounds


class Edges:
    """Sums of the two hand-off edges over the calls measured (seconds), and the last calls'."""

    def __init__(self):
        self.calls = 0
        self.in_s = 0.0  # gate written (GPU) -> first worker through it (CPU)
        self.out_s = 0.0  # last output written (CPU) -> a waiting kernel sees the call done (GPU)
        self.last: deque = deque(maxlen=4096)  # (in_s, out_s) per call
        # per call, host-clock seconds (perf_counter): (layer, seq, submitted, gate written by the
        # GPU, first worker through the gate, team started, last output, call seen done by the GPU,
        # the GPU's waiting kernel started: its block 0's first look; 0.0 if not stamped)
        self.timeline: deque = deque(maxlen=4096)


class Handoff:
    """Mapped memory, kernels and bookkeeping of the hand-off for one engine (see the module
    docstring); ``ctrl`` is the array to build the engine's ``CpuExpertPool`` over."""

    def __init__(self, compute: cp.cuda.Stream, timeout_s: float, early_put: bool = True):
        self.compute = compute
        # early_put: handoff_put runs on its own stream as soon as the layer's input is ready on the
        # compute stream (x_ready), beside the early-started expert kernels queued after it
        self._side = cp.cuda.Stream(non_blocking=True) if early_put else None
        self.x_ready = cp.cuda.Event(disable_timing=True)
        self._put_done = cp.cuda.Event(disable_timing=True)
        self.wait_timeout_ns = int(min(timeout_s, 1.0) * 1e9)
        self._words = _Mapped(8 * _WORDS)
        self.words = self._words.host.view(np.int64)
        self.words[:] = 0
        self.ctrl = self.words[:P.CTRL_WORDS]
        self._dev = self._words.dev
        self._io: list[_Mapped] = []  # grown xin | yout buffers, kept until close
        self._io_rows = self._io_width = 0
        self._views: dict[tuple[int, int], tuple] = {}  # buffers() by (rows, hidden), for the newest buffer
        self._host_ptr: dict[int, int] = {}  # id of a yout view there -> its host address
        self._relay = cp.zeros(1, cp.int64)
        self._counter = cp.zeros(1, cp.uint32)
        self._k_put = Launch(_kernel("handoff_put"), 10)
        self._k_get = Launch(_kernel("handoff_get"), 11)
        self._blob = np.zeros(16 * MAX_TOP_K, np.uint8)  # Experts1: base, weight, pick (the CPU row)
        self._k_down1 = Launch(_kernel("handoff1_down_combine"), 19, self._blob)
        self._k_wait = Launch(_kernel("handoff_wait"), 8)
        self._ydev = cp.empty(0, cp.float32)  # the CPU rows of a one-token call, copied from yout
        self.offset_ns: int | None = None  # GPU clock - host clock
        self._started = False  # the first one-token call has warmed the pool and paired the clocks
        self.edges = Edges()
        self._pending: deque = deque()  # [job, stamp index, CPU times counted] whose edges are not read yet
        self._counted = 0  # of those, how many (the oldest) have their CPU times counted
        self._reported = False

    # buffers ---------------------------------------------------------------------------------
    def buffers(self, rows: int, hidden: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(xin, yout) host views (rows, hidden) float32 and their device addresses. Growing
        keeps the old buffers (calls in flight may still use them)."""
        v = self._views.get((rows, hidden))
        if v is not None:
            return v
        if rows > self._io_rows or hidden > self._io_width:
            self._io_rows, self._io_width = max(rows, 2 * self._io_rows, 8), max(hidden, self._io_width)
            self._io.append(_Mapped(8 * self._io_rows * self._io_width))
            self._views.clear()
            self._host_ptr.clear()
        m = self._io[-1]
        n = rows * hidden
        half = 4 * self._io_rows * self._io_width
        f = m.host.view(np.float32)
        v = self._views[(rows, hidden)] = (f[:n].reshape(rows, hidden), f[half // 4:half // 4 + n].reshape(rows, hidden),
                                           m.dev, m.dev + half)
        self._host_ptr[id(v[1])] = v[1].ctypes.data
        return v

    # the kernels -----------------------------------------------------------------------------
    def _slot(self, seq: int) -> int:
        s = seq % _SLOTS
        self.words[_STAMPS + 3 * s:_STAMPS + 3 * s + 3] = 0
        return _STAMPS + 3 * s

    def mark_input(self) -> None:
        """Record ``x_ready`` after the work queued on the compute stream so far: the next
        ``put`` (with ``put`` "early") waits for it alone, not for work queued after it."""
        _rt.eventRecord(self.x_ready.ptr, self.compute.ptr)

    def put(self, x_ptr: int, rows_ptr: int, n: int, hidden: int, xin_dev: int, job) -> None:
        """Queue ``handoff_put``: ``xin[i] = x[rows[i]]`` (``rows_ptr`` 0: row 0) for the gated
        ``job``'s n rows, then its gate; on the compute stream, or (``early_put``) on its own stream
        after ``x_ready``, the compute stream waiting for it before its next work.
        ``x_ready`` comes after every earlier call's wait for its CPU rows, so ``xin`` is free."""
        stamp = self._slot(job._seq)
        grid = min(-(-n * hidden // 256), 128)
        s = self.compute.ptr
        if self._side is not None:
            s = self._side.ptr
            _rt.streamWaitEvent(s, self.x_ready.ptr)
        self._k_put((grid, 1), 256, s, x_ptr, rows_ptr, n, hidden, xin_dev, self._dev, P._C_GATE,
                    job._seq, self._counter.data.ptr, self._dev + 8 * stamp)
        if self._side is not None:
            _rt.eventRecord(self._put_done.ptr, s)
        self._pending.append([job, stamp, False])

    def down_combine1(self, bases: list, weights: list, cpu_row: list, h: int, out: int, consts: tuple,
                      yout: np.ndarray, job) -> None:
        """Queue, for one token's k pairs, ``handoff_wait``, a copy of the call's rows ``yout``
        (mapped) to device memory, and ``handoff1_down_combine``: ``bases[j]`` 0 marks a CPU pair,
        whose output is row ``cpu_row[j]`` of ``yout``; ``consts``: GpuExperts' layer constants.
        The rows go by one copy: read by the combine's blocks from mapped memory, two floats per
        block and pair, they cost the link thousands of round trips."""
        hidden, ffn, _, _, _, _, _, _, off_d, qt_d, rb_d, _, bias = consts
        k = len(bases)
        stamp = _STAMPS + 3 * (job._seq % _SLOTS)
        wait = (self._dev, P._C_DONE, P._C_BROKEN, job._seq, self.wait_timeout_ns, self._relay.data.ptr,
                self._dev + 8 * _ERR, self._dev + 8 * stamp)
        if self._side is not None:  # x is read and the gate written before anything after this
            _rt.streamWaitEvent(self.compute.ptr, self._put_done.ptr)
        if self._ydev.size < yout.size:
            with self.compute:
                self._ydev = cp.empty(max(yout.size, 2 * self._ydev.size), cp.float32)
        self._k_wait((1, 1), 32, self.compute.ptr, *wait)
        src = self._host_ptr.get(id(yout)) or yout.ctypes.data
        _rt.memcpyAsync(self._ydev.data.ptr, src, yout.nbytes, _rt.memcpyHostToDevice, self.compute.ptr)
        pack1(self._blob, bases, weights, cpu_row)
        self._k_down1((-(-hidden // _RPB), 1), 32 * k, self.compute.ptr, h, out, k, ffn, hidden, _RPB, off_d, qt_d,
                      rb_d, bias, *wait, self._ydev.data.ptr)

    def get(self, y_ptr: int, yout_dev: int, n: int, hidden: int, job) -> None:
        """Queue ``handoff_get``: ``y[i] = yout[i]`` for the job's n rows once it is done."""
        stamp = _STAMPS + 3 * (job._seq % _SLOTS)
        grid = min(-(-n * hidden // 256), 64)
        self._k_get((grid, 1), 256, self.compute.ptr, self._dev, P._C_DONE, P._C_BROKEN, job._seq,
                    self.wait_timeout_ns, self._relay.data.ptr, self._dev + 8 * _ERR, self._dev + 8 * stamp,
                    yout_dev, y_ptr, n * hidden)

    # errors and edges ------------------------------------------------------------------------
    def failed_seq(self) -> int:
        """The number of a call a GPU wait gave up on (0: none)."""
        return int(self.words[_ERR])

    def harvest(self, final: bool = False) -> list:
        """The calls that have finished since the last harvest. The edges of a finished call
        are added to ``edges`` once both its GPU stamps are written; a call stays pending until
        then unless ``final`` or more than ``_SLOTS / 2`` calls old (dropped unmeasured), and so
        do the calls after it."""
        pend, done = self._pending, []
        if not pend:
            return done
        # calls finish in order: the uncounted ones follow the counted ones, and a harvest looks
        # only at the calls done since the last one and at the oldest ones
        i = self._counted
        while i < len(pend) and pend[i][0].poll():
            pend[i][2] = True
            done.append(pend[i][0])
            i += 1
        newest = pend[-1][0]._seq
        e, w = self.edges, self.words
        while pend:
            job, stamp, counted = pend[0]
            if counted and w[stamp] and w[stamp + 1] and self.offset_ns is not None:
                a = (job.gate_s * 1e9 - (int(w[stamp]) - self.offset_ns)) * 1e-9
                b = ((int(w[stamp + 1]) - self.offset_ns) - job.finished_s * 1e9) * 1e-9
                e.calls += 1
                e.in_s += a
                e.out_s += b
                e.last.append((a, b))
                e.timeline.append((job.layer, job._seq, job.submitted_s, (int(w[stamp]) - self.offset_ns) * 1e-9,
                                   job.gate_s, job.started_s, job.finished_s,
                                   (int(w[stamp + 1]) - self.offset_ns) * 1e-9,
                                   (int(w[stamp + 2]) - self.offset_ns) * 1e-9 if w[stamp + 2] else 0.0))
            elif not final and newest - job._seq < _SLOTS // 2:
                break
            pend.popleft()
            i = max(i - 1, 0)
        self._counted = i
        return done

    def clock_offset(self, rounds: int = _ROUNDS, strict: bool = True) -> int | None:
        """Pair the GPU clock with the host's: GPU minus host nanoseconds, from the round trip
        through mapped memory with the shortest time (error at most half of it). A GPU that does
        not answer within 2 s (busy with other processes' work) raises, or with ``strict`` False
        leaves the edges unmeasured (None): the pairing only times them."""
        w = self.words
        w[_PING] = w[_PONG] = 0
        stream = cp.cuda.Stream(non_blocking=True)
        k = Launch(_kernel("handoff_clock"), 6)
        k((1, 1), 1, stream.ptr, self._dev, _PING, _PONG, min(rounds, _ROUNDS), self._dev + 8 * _CLOCK, 2_000_000_000)
        sent, got = np.zeros(_ROUNDS, np.int64), np.zeros(_ROUNDS, np.int64)
        done = _ping(w, _PING, _PONG, min(rounds, _ROUNDS), sent, got, 2_000_000_000)
        stream.synchronize()
        if done < 1:
            if not strict:
                return None
            raise ExecutorError("hand-off clock pairing: the GPU did not answer within 2 s")
        rtt = got[:done] - sent[:done]
        i = int(np.argmin(rtt))
        self.offset_ns = int(w[_CLOCK + i]) - int((sent[i] + got[i]) // 2)
        self.round_trip_ns = int(rtt[i])
        return self.offset_ns

    # the engine's one-token step with CPU pairs ---------------------------------------------
    def check(self, pool) -> None:
        """Raise the ExecutorError of a call a GPU wait gave up on (marking ``pool`` broken)."""
        seq = self.failed_seq()
        if seq and not self._reported:  # once: the pool then refuses calls as unusable
            self._reported = True
            layer = next((j.layer for j, _, _ in self._pending if j._seq == seq), None)
            where = f"layer {layer}" if layer is not None else f"CPU call {seq}"
            raise pool.fail(f"{where}: CPU experts did not finish within {self.wait_timeout_ns * 1e-9:g} s "
                            f"(the GPU stopped waiting for them)")

    def run_one(self, engine, d, lx, x, topk_ids: np.ndarray, topk_weights, early, t0: float):
        """One token whose decision has CPU pairs (and any hits, uploads, streams, promotions):
        the CPU call is posted gated on its input, ``handoff_put`` writes the input and the
        gate, the GPU pairs' gate/up run as ``ExpertEngine._run_one``'s (early-started ones are
        kept), and ``handoff1_down_combine`` adds the GPU pairs' down projections and the CPU
        rows in rank order. The host waits for nothing; residency follows as in ``_gpu_rounds``."""
        gx, pool, st = engine.gpu, engine.pool, engine.stats
        layer = d.layer
        self.check(pool)
        slot_of = engine.slot_of
        ids, weights, (ptr, stride, n_slots) = engine.one_token_start(d, topk_ids, topk_weights)
        up = dict(zip(d.uploads, d.slots))
        cpu = {e: i for i, e in enumerate(d.cpu)}
        streams = {e: gx.reserve_scratch() for e in d.streams}
        if early is not None and (early.layer != layer or early.x is not x or early.ids != ids):
            early = None
        picked = early.pick if early is not None else ()
        bases, rest, rows = [], [], []
        for j, e in enumerate(ids):
            r = cpu.get(e)
            rows.append(0 if r is None else r)
            if r is not None:
                bases.append(0)
            elif e in up:
                s = up[e]
                if not 0 <= s < n_slots:
                    raise ExecutorError(f"layer {layer}: slot {s} out of range for pool of {n_slots} slots")
                bases.append(ptr + s * stride)
                rest.append(j)
            elif e in streams:
                bases.append(gx.source_ptr(layer, -1 - streams[e]))
                rest.append(j)
            else:
                s = slot_of.get((layer, e))
                if s is None or e not in d.hits:
                    engine._not_on_gpu(layer, ids, d.hits, {**up, **cpu, **streams})
                bases.append(ptr + s * stride)
                if j not in picked:
                    rest.append(j)
        if len(cpu) != bases.count(0):
            raise ExecutorError(f"layer {layer}: CPU experts {sorted(set(cpu) - set(ids))} are not routed")
        if early is not None:
            xd = early.xd  # x_ready was recorded before its kernels (ExpertEngine.begin_layer)
        else:
            xd = gx.as_input(x)
            self.mark_input()
        if not self._started:  # first call: the team started and warm, the clocks paired (or the edges unmeasured)
            self._started = True
            pool.warmup(lx)
            self.clock_offset(strict=False)
        xin, yout, xin_dev, yout_dev = self.buffers(len(cpu), lx.hidden)
        ts = time.perf_counter()
        job = pool.submit(lx, d.cpu, xin, out=yout, gated=True, track=True)
        st.host_submit_s += time.perf_counter() - ts
        self.put(xd.data.ptr, 0, len(cpu), lx.hidden, xin_dev, job)
        st.steps += 1
        st.gpu_pairs += len(ids) - len(cpu)
        st.cpu_pairs += len(cpu)
        t1 = time.perf_counter()
        st.host_plan_s += t1 - t0
        if up or streams:
            gx.copy_in(layer, d.uploads, d.slots, list(streams), list(streams.values()))
            st.uploads += len(up)
            st.streams += len(streams)
        if rest:
            gx.pack1(bases, weights, rest)
            gx.gate_up1(layer, xd, len(ids), len(rest))
        out = gx._output(1, lx.hidden)
        self.down_combine1(bases, weights, rows, gx.h1, out.data.ptr, gx._consts[layer], yout, job)
        for v in d.retired:
            slot_of.pop(v, None)
        for e, s in zip(d.promotions, d.promotion_slots):
            gx.promote(layer, streams[e], s)
            slot_of[(layer, e)] = s
        for e, s in up.items():
            slot_of[(layer, e)] = s
        self.collect(st)
        st.host_queue_s += time.perf_counter() - t1
        return out

    def collect(self, st, final: bool = False) -> None:
        """Add the finished calls' CPU times and hand-off edges to the engine's ``st``."""
        calls, e_in, e_out = self.edges.calls, self.edges.in_s, self.edges.out_s
        for job in self.harvest(final):
            st.cpu_compute_s += job.compute_s
            st.per_layer_cpu_s[job.layer] = st.per_layer_cpu_s.get(job.layer, 0.0) + job.compute_s
        st.handoff_calls += self.edges.calls - calls
        st.handoff_in_s += self.edges.in_s - e_in
        st.handoff_out_s += self.edges.out_s - e_out


def bench_edges(threads: int, rows: int, hidden: int, ffn: int, calls: int, busy_us: float, seed: int = 0,
                ahead: int = 0) -> dict:
    """Both edges of the hand-off, per call, on a random Q8_0 layer: each call is posted gated,
    then ``handoff_put`` (after ``busy_us`` of GPU work, so the team is waiting before its gate
    opens) and ``handoff_get``; the host then waits until at most ``ahead`` calls are in flight
    (0: a stream synchronize after every call; an engine decoding runs ahead of the GPU).
    Returns the clock pairing's round trip and offset, the per-call edges (seconds) and, per
    call, when the GPU's waiting kernel started relative to the last output (negative: it was
    waiting before the pool finished)."""
    from .experts import random_layer

    rng = np.random.default_rng(seed)
    layer = random_layer(rng, 0, 8, hidden, ffn, 8)  # Q8_0
    stream = cp.cuda.Stream(non_blocking=True)
    ho = Handoff(stream, 10.0, early_put=False)  # each put after its busy kernel
    pool = P.CpuExpertPool(threads, 10.0, ctrl=ho.ctrl)
    flight: deque = deque()
    try:
        pool.warmup(layer)
        ho.clock_offset()
        with stream:
            x = cp.asarray(rng.standard_normal((1, hidden)).astype(np.float32))
            y = cp.zeros((rows, hidden), cp.float32)
        spin = Launch(_kernel("handoff_busy"), 1)
        experts = [int(e) for e in rng.integers(0, 8, rows)]
        for _ in range(calls):
            xin, yout, xin_dev, yout_dev = ho.buffers(rows, hidden)
            job = pool.submit(layer, experts, xin, out=yout, gated=True, track=True)
            if busy_us > 0:
                spin((1, 1), 32, stream.ptr, int(busy_us * 1e3))
            ho.put(x.data.ptr, 0, rows, hidden, xin_dev, job)
            ho.get(y.data.ptr, yout_dev, rows, hidden, job)
            flight.append(stream.record())
            while len(flight) > ahead:
                flight.popleft().synchronize()
            ho.check(pool)
            ho.harvest()
        stream.synchronize()
        ho.harvest(final=True)
        want = np.asarray(job.result())
        got = y.get()
    finally:
        pool.close()
    e = np.array(ho.edges.last)
    started = [t[8] - t[6] for t in ho.edges.timeline if t[8]]
    return {"round_trip_s": ho.round_trip_ns * 1e-9, "offset_ns": ho.offset_ns, "calls": len(e),
            "in_s": e[:, 0].tolist() if len(e) else [], "out_s": e[:, 1].tolist() if len(e) else [],
            "wait_started_s": started, "rows_equal": bool(np.array_equal(want, got))}
