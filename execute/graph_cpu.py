"""Misses inside a token's graph: the CPU pool computes them, the graph waits on the device.

With ``moelab run --graph-cpu`` or ``MOELAB_GRAPH_CPU=1`` (off by default) a ``TokenGraph``
(``execute.token_graph``) is captured with this module's launches per block in place of the
resident-only expert kernels, so a decode token runs as one graph whatever the cache holds: no
block halts it, and the host does nothing between blocks. Per block ``l`` of a token
(``handoff.cu``, ``graphcpu_*``):

1. before the launch the host writes the number of the pool's last call, ``base``, into the graph's
   input; after the launch it submits one gated call per block (``k`` pairs: the block's rows of
   ``ids``, ``xin`` and ``yout``, all in host-mapped memory), call ``base + 1 + l`` for block
   ``l``. The pool's ring of 16 calls makes the host wait for a call to finish before it submits
   the one 16 blocks later; the GPU reaches a block long after its call was published;
2. the put reads the block's routes and slot table row on the device: the routed experts without
   a slot are the block's misses. It waits until the host has published the call, writes their ids
   and their count (into the call's job, which the pool's team reads only after the gate) and the
   block's input row, then the gate;
3. the resident pairs' gate/up and down rows run while the team computes the misses;
4. the combine waits for the call when the block has a miss (``handoff.cu``'s ``ho_wait``) and adds
   the rows, router-weighted in rank order as ``handoff1_down_combine``: the bits of the
   block-by-block hand-off of the same decision.

These are four launches a block (``handoff.cu``): ``graphcpu_put``, ``graphcpu_gate_up``,
``graphcpu_down``, ``graphcpu_combine`` (v1's rows). (Two launches a block on the v4 kernels, the
put beside the gate/up rows and the wait and sum in the down launch, ran a 4 GiB ``hybrid`` decode
at 43 tokens/s against these four's 90 on the H200, and were dropped.)

The graph's split is its slot table at the launch; the decisions must say the same, which
``scheduler.graph.CpuMisses`` makes them do (every miss of such a token on the CPU, its upload
deferred to a background fill after the token). ``GraphCpuGate`` checks each settled step's CPU
experts against the graph's and raises ``ExecutorError`` on a difference. Uploads never overwrite a
slot the running graph reads: fills start after the graph's ``mark_read`` and enter the table only
once complete (``TokenGraph``'s staging rule); the graph launches no token ahead in this mode (a
token launched ahead would not see the fills awaited at its start, which the decisions count).

Settling while the graph runs (``MOELAB_GRAPH_CPU_STREAM=1``): the put also copies the block's
route and miss count into mapped memory and raises a flag; ``TokenGraph`` then yields block
``l``'s step as soon as its flag is up, so the host plans and settles it while the GPU and the pool
run the blocks after it (the decisions are the same: they depend on the routes and the policy,
and the graph's split on the table at the launch). The host submits the first ``_AHEAD`` calls
after the launch and call ``l + _AHEAD`` once block ``l`` is seen (its ring slot is then free).
"""
from __future__ import annotations

import sys
import time
import weakref

import cupy as cp
import numpy as np

from scheduler.graph import GRAPH_CPU_AHEAD

from . import cpu_pool as P
from .cpu_experts import J_N
from .experts import ExecutorError
from .gpu_experts import Launch
from .handoff import _ERR, _SLOTS, _STAMPS, _Mapped, _kernel

__all__ = ["GraphCpu"]

_rt = cp.cuda.runtime
_RPW, _RPB, _WARPS = 2, 2, 4  # as gpu_experts' one-token launches (moe1_gate_up, moe1_down_combine)
_REGISTER_MAPPED = 2  # cudaHostRegisterMapped
_PAGE = 4096
_AHEAD = min(GRAPH_CPU_AHEAD, P._RING - 1)  # calls submitted ahead of the block being settled


def graph_cpu_stream_env() -> bool:
    """``MOELAB_GRAPH_CPU_STREAM``: ``1`` settles a CPU graph's blocks while it runs, each as soon as
    its put has written its route (``GraphCpu.seen_block``); ``0`` (the default) after the graph."""
    from .xp import env_switch

    return env_switch("MOELAB_GRAPH_CPU_STREAM", "0")


class GraphCpu:
    """Buffers, launches and calls of the misses of ``L`` blocks of ``k`` pairs (see the module
    docstring); None-safe construction is the caller's: ``create`` returns None (and prints why)
    when the engine has no hand-off or the pool's ring cannot be mapped."""

    def __init__(self, engine, L: int, k: int, hidden: int):
        ho, pool = engine.handoff, engine.pool
        self.engine, self.ho, self.pool, self.L, self.k, self.hidden = engine, ho, pool, L, k, hidden
        self._ids = _Mapped(8 * L * k)
        self.ids = self._ids.host.view(np.int64).reshape(L, k)  # zeros: valid ids at every submit
        self._io = _Mapped(2 * 4 * L * k * hidden)
        f = self._io.host.view(np.float32)
        n = L * k * hidden
        self.xin = f[:n].reshape(L, k, hidden)
        self.yout = f[n:2 * n].reshape(L, k, hidden)
        self._yout_dev = self._io.dev + 4 * n
        self._seen = _Mapped(4 * L * (2 * k + 2) + 8 * L)  # per block: its route and miss count, then a flag
        self.seen = self._seen.host[:4 * L * (2 * k + 2)].view(np.float32).reshape(L, 2 * k + 2)
        self.seen_flag = self._seen.host[4 * L * (2 * k + 2):4 * L * (2 * k + 2) + 8 * L].view(np.int64)
        with engine.gpu.compute:
            self.pick = cp.zeros((L, k + 1), cp.int32)  # per block: each pair's CPU row (-1: GPU), the count
            self.ys = cp.zeros((k, hidden), cp.float32)  # the GPU pairs' rows of the block being combined
            self.seq_dev = cp.zeros(1, cp.int64)
            self.relay = cp.zeros(1, cp.int64)
        self._seq_mem = cp.cuda.alloc_pinned_memory(8)
        self.seq_host = np.frombuffer(self._seq_mem, np.int64, 1)
        self._pick_mem = cp.cuda.alloc_pinned_memory(self.pick.nbytes)
        self.pick_host = np.frombuffer(self._pick_mem, np.int32, L * (k + 1)).reshape(L, k + 1)
        ring = pool._ring  # the team's job slots: the GPU writes each call's pair count there
        lo = ring.ctypes.data // _PAGE * _PAGE  # whole pages (older drivers want them)
        hi = -(-(ring.ctypes.data + ring.nbytes) // _PAGE) * _PAGE
        _rt.hostRegister(lo, hi - lo, _REGISTER_MAPPED)
        self.close = weakref.finalize(self, _unregister, lo, ring)  # the ring kept until then
        self._ring_dev = int(_rt.pointerGetAttributes(lo).devicePointer) + ring.ctypes.data - lo
        self.stream = graph_cpu_stream_env()
        self._put = Launch(_kernel("graphcpu_put"), 24)
        self._gate_up = Launch(_kernel("graphcpu_gate_up"), 16)
        self._down = Launch(_kernel("graphcpu_down"), 12)
        self._combine = Launch(_kernel("graphcpu_combine"), 17)
        self.timeout_ns = ho.wait_timeout_ns
        self._base = 0  # the pool's last call before the running token's
        self._submitted = 0  # the running token's calls submitted
        self.calls = 0  # calls submitted
        self.cpu_pairs = 0  # pairs the graphs handed to the pool

    @classmethod
    def create(cls, engine, L: int, k: int, hidden: int):
        if engine.handoff is None:
            print("moelab: warning: MOELAB_GRAPH_CPU needs the GPU hand-off; misses halt the token graph",
                  file=sys.stderr)
            return None
        try:
            return cls(engine, L, k, hidden)
        except _rt.CUDARuntimeError as exc:
            print(f"moelab: warning: the CPU pool's ring cannot be mapped ({exc}); misses halt the token graph",
                  file=sys.stderr)
            return None

    # capture ---------------------------------------------------------------------------------
    def prologue(self) -> list:
        """Launches before the first block: the token's call base into device memory."""
        d, h = int(self.seq_dev.data.ptr), self._seq_mem.ptr
        return [lambda s: _rt.memcpyAsync(d, h, 8, _rt.memcpyHostToDevice, s)]

    def block(self, l: int, route: int, table: int, x: int, h: int, out: int) -> list:
        """Block ``l``'s four launches (device addresses: the router's output, the
        block's slot table row, the normed input, a (k, ffn) work buffer, the (hidden,) output)."""
        gx = self.engine.gpu
        hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = gx._consts[l]
        k, ho = self.k, self.ho
        ctrl, seq0 = ho._dev, int(self.seq_dev.data.ptr)
        pick = int(self.pick.data.ptr) + 4 * (k + 1) * l
        ids = self._ids.dev + 8 * k * l
        xin = self._io.dev + 4 * k * hidden * l
        yout = self._yout_dev + 4 * k * hidden * l
        err, stamps = ctrl + 8 * _ERR, ctrl + 8 * _STAMPS
        a0 = (route, table, k, x, hidden, ids, xin, pick, ctrl, P._C_GEN, P._C_GATE, P._C_BROKEN, seq0, l,
              self._ring_dev, P._RING, P._RING_FIELDS, J_N, self.timeout_ns, err, stamps, _SLOTS)
        # streamed: the put copies the block's route and miss count for the host (else null pointers)
        a0 += ((self._seen.dev + 4 * (2 * k + 2) * l, self._seen.dev + 4 * (2 * k + 2) * self.L + 8 * l)
               if self.stream else (0, 0))
        relay = int(self.relay.data.ptr)
        a1 = (route, table, k, x, h, ffn, hidden, _RPW, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias)
        ys = int(self.ys.data.ptr)
        a2 = (route, table, h, ys, k, ffn, hidden, _RPB, off_d, qt_d, rb_d, bias)
        a3 = (route, pick, k, hidden, ys, yout, out, ctrl, P._C_DONE, P._C_BROKEN, seq0, l, self.timeout_ns, relay, err,
              stamps, _SLOTS)
        g1, g2, g3 = (-(-ffn // (_WARPS * _RPW)), k), (-(-hidden // _RPB), 1), (-(-hidden // 256), 1)
        return [lambda s: self._put((1, 1), 256, s, *a0), lambda s: self._gate_up(g1, 32 * _WARPS, s, *a1),
                lambda s: self._down(g2, 32 * k, s, *a2), lambda s: self._combine(g3, 256, s, *a3)]

    def epilogue(self) -> list:
        """Launches after the head: the blocks' picks back to the host."""
        d, h, n = int(self.pick.data.ptr), self._pick_mem.ptr, self.pick.nbytes
        return [lambda s: _rt.memcpyAsync(h, d, n, _rt.memcpyDeviceToHost, s)]

    # run -------------------------------------------------------------------------------------
    def before_launch(self) -> None:
        """Write the call base the graph reads (the pool's last call), warming the pool and pairing
        the hand-off's clocks on the first token."""
        ho = self.ho
        if not ho._started:
            ho._started = True
            lx = next(l for l in self.engine.layers if l is not None)
            self.pool.warmup(lx)
            ho.clock_offset(strict=False)
        ho.check(self.pool)
        self.seq_host[0] = self.pool._seq

    def after_launch(self) -> None:
        """Submit the token's calls, one per block, in block order (the launched graph waits for
        each before its block's put); with ``stream`` the first ``_AHEAD`` only (``seen_block``
        submits the others)."""
        self._base, self._submitted = int(self.seq_host[0]), 0
        for _ in range(min(_AHEAD, self.L) if self.stream else self.L):
            self._submit()

    def _submit(self) -> None:
        l, ho = self._submitted, self.ho
        seq = self._base + 1 + l
        stamp = ho._slot(seq)  # zeroed before the GPU can stamp it (it waits for the call)
        job = self.pool.submit(self.engine.layers[l], self.ids[l], self.xin[l], out=self.yout[l], gated=True,
                               track=True)
        if job._seq != seq:
            raise ExecutorError(f"block {l}: the CPU pool numbered the graph's call {job._seq}, expected {seq}")
        ho._pending.append([job, stamp, False])
        self._submitted += 1
        self.calls += 1

    def seen_block(self, l: int, done) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """Wait until block ``l``'s put has written its route (the graph runs on), then submit the
        call ``_AHEAD`` blocks later (its ring slot is block ``l - 1``'s, whose call the graph has
        waited for unless it had no pair): -> the block's ids ``(k,)`` int64, weights ``(k,)``
        float32 and CPU experts (rank order). ``done``: the graph's event (a graph that ended
        without the flag, or a wait past the hand-off's timeout, is an ``ExecutorError``)."""
        want, flag = self._base + 1 + l, self.seen_flag
        if flag[l] != want:
            t0, n = time.perf_counter(), 0
            while flag[l] != want:
                n += 1
                if n & 1023 == 0:
                    if done.done and flag[l] != want:
                        raise ExecutorError(f"block {l}: the token graph ended without handing over its route")
                    if time.perf_counter() - t0 > 2e-9 * self.timeout_ns + 1.0:
                        raise ExecutorError(f"block {l}: the token graph did not reach the block's put within "
                                            f"{2e-9 * self.timeout_ns + 1.0:.1f} s")
        k, row = self.k, self.seen[l]
        n = int(row[2 * k:2 * k + 1].view(np.int32)[0])
        ids, wts = row[:k].view(np.int32).astype(np.int64), row[k:2 * k].copy()
        cpu = tuple(int(e) for e in self.ids[l, :n])
        self.cpu_pairs += n
        if self._submitted < self.L and self._submitted <= l + _AHEAD:
            self._submit()
        return ids, wts, cpu

    def submit_rest(self) -> None:
        """Submit the running token's calls not submitted yet (before a wait for the whole graph)."""
        while self._submitted < self.L:
            self._submit()

    def finish_stream(self) -> None:
        """After a streamed graph: raise a failed call's error, collect the hand-off's edges."""
        self.ho.check(self.pool)
        self.ho.collect(self.engine.stats)

    def finish(self) -> list[tuple[int, ...]]:
        """After the graph: raise a failed call's error; -> per block, the experts it handed to the
        CPU (rank order)."""
        eng = self.engine
        self.ho.check(self.pool)
        self.ho.collect(eng.stats)
        p = self.pick_host
        k = self.k
        out = []
        for l in range(self.L):
            n = int(p[l, k])
            out.append(tuple(int(e) for e in self.ids[l, :n]))
            self.cpu_pairs += n
        return out


def _unregister(ptr: int, ring: np.ndarray) -> None:
    try:
        _rt.hostUnregister(ptr)
    except _rt.CUDARuntimeError:  # a context already gone
        pass
