"""The CPU expert pool: a team of native threads running ``execute.cpu_experts``' kernels.

``CpuExpertPool`` runs calls on a team of native threads (Numba ``nogil`` functions that never
take the GIL) fed through a ring of job descriptions; ``submit`` returns at once, ``CpuJob.result``
waits at most ``timeout_s`` and raises ``ExecutorError`` on a stall or a failure (the pool is then
marked broken): never a hang, never an abort.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Sequence

import numba
import numpy as np
from numba import njit

from .cpu_experts import (J_FFN, J_H, J_HIDDEN, J_T0, J_T1, J_X, JOB_FIELDS, _bad_experts, _check_call, _chunk, _fill,
                          _group, _layer_fields, _quantize_input, _Scratch, tensor_views)
from .cpu_simd import atomic_add, atomic_load, atomic_store, futex_wait, futex_wake, now_ns, pause
from .experts import ExecutorError, LayerExperts

__all__ = ["CpuExpertPool", "CpuJob"]


# The pool's thread team. ctrl (int64) holds the team's counters, each on its own cache line
# (a GPU hand-off places ctrl in host-mapped memory: the GPU writes _C_GATE and reads _C_DONE
# and _C_BROKEN, see execute.handoff):
(_C_GEN, _C_DONE, _C_FIN, _C_BAR, _C_SLEEP, _C_WAIT, _C_HOLD, _C_BSLEEP, _C_BROKEN,
 _C_GATE) = (8 * k for k in range(10))
_BARRIER_SPINS = 4000  # pause instructions (tens of microseconds) before a barrier sleeps
CTRL_WORDS = _CTRL = 8 * 10
# pool-only job fields after the kernels' (cpu_experts.JOB_FIELDS): the gate value a gated call
# waits for in ctrl[_C_GATE] (0: none), how many workers have passed it, and the first one's stamp
J_GATE, J_GSEEN, J_TG = JOB_FIELDS, JOB_FIELDS + 1, JOB_FIELDS + 2
_RING_FIELDS = JOB_FIELDS + 3
_GATE_NAP_NS = 20_000  # a worker that has spun past spin_ns re-checks the gate this often
_RING = 16  # job slots: calls submitted but not yet finished, at most
_STOP = -1  # _C_GEN value that ends the workers
_WAIT_SPIN_NS = 1_000_000  # result()'s spin when threads < cores (see CpuExpertPool)
_DEAD_CHECK_S = 0.05  # a result() wait looks for a dead worker this often
_ABANDONED: list = []  # arrays of calls a stalled team may still read (see CpuExpertPool._break)


@njit(inline="always")
def _barrier(ctrl, team, nbar):
    """Wait until every worker has reached barrier ``nbar + 1`` (spinning, then on a futex: a
    descheduled worker must not cost the others their cores); the new count."""
    target = team * (nbar + 1)
    if atomic_add(ctrl, _C_BAR, 1) == target - 1:
        if atomic_load(ctrl, _C_BSLEEP):
            futex_wake(ctrl, _C_BAR)
        return nbar + 1
    spins = 0
    while True:
        v = atomic_load(ctrl, _C_BAR)
        if v >= target:
            return nbar + 1
        spins += 1
        if spins < _BARRIER_SPINS:
            pause()
            continue
        atomic_add(ctrl, _C_BSLEEP, 1)
        v = atomic_load(ctrl, _C_BAR)
        if v < target:
            futex_wait(ctrl, _C_BAR, v, 1_000_000)
        atomic_add(ctrl, _C_BSLEEP, -1)


@njit(nogil=True, cache=True)
def _team_worker(ctrl, ring, t, team, spin_ns):
    """Worker t of ``team``: runs every published call (slots of ``ring`` in order), spinning up to
    spin_ns for the next one, then sleeping on a futex. Once every worker has finished the previous
    call (its scratch is then free), worker 0 groups the pairs while all quantize a part of x; a
    barrier; gate+up; a barrier; all quantize a part of h; a barrier; down. The last worker to
    finish a call stamps and publishes it."""
    seq = 0
    nbar = 0
    while True:
        t0 = now_ns()
        spins = 0
        while atomic_load(ctrl, _C_GEN) == seq:
            spins += 1
            if spins & 63 or now_ns() - t0 < spin_ns:
                pause()
                continue
            atomic_add(ctrl, _C_SLEEP, 1)
            if atomic_load(ctrl, _C_GEN) == seq:
                futex_wait(ctrl, _C_GEN, seq, 100_000_000)
            atomic_add(ctrl, _C_SLEEP, -1)
        if atomic_load(ctrl, _C_GEN) == _STOP:
            return
        seq += 1
        job = ring[seq % _RING]
        while atomic_load(ctrl, _C_FIN) < team * (seq - 1) or (t == 0 and atomic_load(ctrl, _C_HOLD)):
            pause()  # the previous call's scratch is free once every worker has finished it
        if t == 0:
            job[J_T0] = now_ns()
            _group(job)
        if job[J_GATE]:
            _wait_gate(ctrl, job, spin_ns)
        _quantize_input(job, job[J_X], job[J_HIDDEN], 0, 1, t, team)
        nbar = _barrier(ctrl, team, nbar)
        _chunk(job, t, team, 0)
        nbar = _barrier(ctrl, team, nbar)
        _quantize_input(job, job[J_H], job[J_FFN], 2, 2, t, team)
        nbar = _barrier(ctrl, team, nbar)
        _chunk(job, t, team, 1)
        if atomic_add(ctrl, _C_FIN, 1) == team * seq - 1:
            job[J_T1] = now_ns()
            atomic_store(ctrl, _C_DONE, seq)
            if atomic_load(ctrl, _C_WAIT):
                futex_wake(ctrl, _C_DONE)


@njit(inline="always")
def _wait_gate(ctrl, job, spin_ns):
    """Wait until ctrl[_C_GATE] reaches the call's gate (written by the GPU once the call's inputs
    are in place) or the pool is marked broken: spin up to spin_ns, then nap _GATE_NAP_NS at a
    time (nobody can wake a futex from the GPU). The first worker through stamps J_TG."""
    gate = job[J_GATE]
    t0 = now_ns()
    spins = 0
    while True:
        v = atomic_load(ctrl, _C_GATE)
        if v >= gate or atomic_load(ctrl, _C_BROKEN):
            break
        spins += 1
        if spins & 63 or now_ns() - t0 < spin_ns:
            pause()
            continue
        futex_wait(ctrl, _C_GATE, v, _GATE_NAP_NS)
    if atomic_add(job, J_GSEEN, 1) == 0:
        job[J_TG] = now_ns()


@njit(nogil=True, cache=True)
def _publish(ctrl, seq):
    """Make call ``seq`` (or _STOP) visible to the team and wake sleeping workers."""
    atomic_store(ctrl, _C_GEN, seq)
    if atomic_load(ctrl, _C_SLEEP):
        futex_wake(ctrl, _C_GEN)


@njit(nogil=True, cache=True)
def _launch(ctrl, job, seq, e, x, y, num_experts, fixed, scratch, gate):
    """Fill ``job`` (see cpu_experts._fill) and publish it as call ``seq``, gated on ctrl[_C_GATE]
    >= ``gate`` (0: not gated); False, with nothing written or published, when an expert id is
    out of range."""
    if not _fill(job, e, x, y, num_experts, fixed, scratch):
        return False
    job[J_GATE] = gate
    job[J_GSEEN] = 0
    job[J_TG] = 0
    _publish(ctrl, seq)
    return True


@njit(nogil=True, cache=True)
def _wait_done(ctrl, seq, spin_ns, timeout_ns):
    """Wait until call ``seq`` has finished: spin up to spin_ns, then sleep on a futex; False after
    timeout_ns."""
    t0 = now_ns()
    while atomic_load(ctrl, _C_DONE) < seq:
        el = now_ns() - t0
        if el > timeout_ns:
            return False
        if el < spin_ns:
            pause()
            continue
        atomic_add(ctrl, _C_WAIT, 1)
        done = atomic_load(ctrl, _C_DONE)
        if done < seq:
            futex_wait(ctrl, _C_DONE, done, 1_000_000)
        atomic_add(ctrl, _C_WAIT, -1)
    return True


def _guarded_worker(ctrl, ring, t, team, spin_ns, pool_ref) -> None:
    """``_team_worker``; an exception in it is kept in the pool's ``_dead``, which ends a
    ``result()`` wait within ``_DEAD_CHECK_S`` instead of the timeout. ``pool_ref`` is a weak
    reference: the team must not keep its pool alive."""
    try:
        _team_worker(ctrl, ring, t, team, spin_ns)
    except BaseException as exc:
        pool = pool_ref()
        if pool is not None:
            pool._dead = f"CPU experts failed: worker {t} died: {exc!r}"


def _default_spin_us(spare_core: bool) -> float:
    """``MOELAB_POOL_SPIN_US`` (microseconds a worker spins before it sleeps), else 2000 when the
    team leaves the caller a core (the team stays hot across a decode step's GPU part between
    two CPU layers: on a 16-core H200 host, 15 threads, `moelab run --policy cpu` decoded 116 vs
    102 tokens/s and `hybrid` 147 vs 128 against a 100 us spin), else 100 (spinning workers would
    take the caller's core)."""
    raw = os.environ.get("MOELAB_POOL_SPIN_US", "2000" if spare_core else "100")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"MOELAB_POOL_SPIN_US={raw!r}: expected microseconds, a number 0..1e6") from None


def _stop_team(ctrl: np.ndarray, inflight: list, timeout_s: float) -> None:
    """Stop a team whose pool is gone, after its last published call (arrays kept if it stalls)."""
    seq = int(ctrl[_C_GEN])
    if seq > 0 and not ctrl[_C_BROKEN] and not _wait_done(ctrl, seq, 0, int(timeout_s * 1e9)):
        _ABANDONED.extend(inflight)
    _publish(ctrl, _STOP)


class CpuJob:
    """A submitted layer's CPU experts; ``result()`` waits for them at most the pool's timeout."""

    def __init__(self, pool: "CpuExpertPool", layer: int, n: int, seq: int = 0):
        self._pool = pool
        self.layer = layer
        self.num_pairs = n
        self._seq = seq
        self._out: np.ndarray | None = None
        self._error: BaseException | None = None
        self.submitted_s = time.perf_counter()
        self.compute_s = 0.0
        # perf_counter stamps (0.0 until set): the team starts and ends the call (CLOCK_MONOTONIC,
        # perf_counter's clock); the caller's first successful result() returns (moelab calibrate
        # splits the hand-offs by them)
        self.started_s = 0.0
        self.finished_s = 0.0
        self.collected_s = 0.0
        self.gate_s = 0.0  # a gated call: when its first worker passed the gate

    def done(self) -> bool:
        return self._error is not None or self._pool._ctrl[_C_DONE] >= self._seq

    def result(self) -> np.ndarray:
        """(n, hidden) float32 unweighted outputs; ExecutorError on failure or timeout."""
        if self._error is not None:
            raise ExecutorError(f"layer {self.layer}: CPU experts failed: {self._error!r}") from self._error
        pool = self._pool
        if not self.collected_s:
            while True:  # in slices: a worker that died ends the wait within one
                left = pool.timeout_s - (time.perf_counter() - self.submitted_s)
                wait_ns = int(max(min(left, _DEAD_CHECK_S), 0.0) * 1e9)
                if _wait_done(pool._ctrl, self._seq, pool._wait_spin_ns, wait_ns):
                    break
                if pool._dead or left <= _DEAD_CHECK_S:
                    pool._break(f"layer {self.layer}: " + (pool._dead or f"CPU experts did not finish within "
                                                                        f"{pool.timeout_s} s"))
            self._stamp()
        return self._out

    def _stamp(self) -> None:
        slot = self._pool._ring[self._seq % _RING]
        self.started_s, self.finished_s, self.gate_s = slot[J_T0] * 1e-9, slot[J_T1] * 1e-9, slot[J_TG] * 1e-9
        self.compute_s = self.finished_s - max(self.started_s, self.gate_s)
        self.collected_s = time.perf_counter()

    def poll(self) -> bool:
        """True (and the clock stamps set) once the call has finished; never waits. The
        stamps must be read before the ring slot is reused: ``CpuExpertPool.submit`` does so for
        the calls it tracks (``track=True``)."""
        if self.collected_s:
            return True
        if self._error is not None or self._pool._ctrl[_C_DONE] < self._seq:
            return False
        self._stamp()
        return True


class CpuExpertPool:
    """A team of ``threads`` native worker threads running the expert kernels.

    The workers are Numba ``nogil`` functions on daemon threads: they never take the GIL. A call is
    written into a slot of a ring of job descriptions and published through an atomic counter;
    workers spin up to ``spin_us`` after each call for the next one (a hot team starts a call in
    about a microsecond), then sleep on a futex (waking costs a system call and the scheduler's
    latency). ``result()`` spins the same time (1 ms when ``threads`` leaves the caller a core),
    then sleeps. ``spin_us`` defaults to the environment's ``MOELAB_POOL_SPIN_US``, else 2000 us
    when ``threads`` leaves the caller a core and 100 us otherwise (``_default_spin_us``): a
    decode step's GPU part between two CPU layers is longer than 100 us, and a team woken from
    its futex costs the layer a wake-up of every worker. Inputs and outputs are read and
    written in place (``out=`` e.g. page-locked memory): no copies. Calls are submitted from one
    thread at a time (the engine's); results may be collected in any order.
    """

    def __init__(self, threads: int, timeout_s: float = 30.0, spin_us: float | None = None,
                 ctrl: np.ndarray | None = None):
        cores = os.cpu_count() or 1
        if spin_us is None:
            spin_us = _default_spin_us(threads < cores)
        if threads < 1 or threads > max(cores, numba.config.NUMBA_NUM_THREADS):
            raise ValueError(f"CpuExpertPool threads: {threads}, expected 1..{max(cores, numba.config.NUMBA_NUM_THREADS)}")
        if not timeout_s > 0:
            raise ValueError(f"CpuExpertPool timeout_s: {timeout_s}, expected > 0")
        if not 0 <= spin_us <= 1e6:
            raise ValueError(f"CpuExpertPool spin_us: {spin_us}, expected 0..1e6")
        self.threads = int(threads)
        self.timeout_s = float(timeout_s)
        self._spin_ns = int(spin_us * 1e3)
        # result() spins longer when the caller has a core of its own: a futex wake-up would be on
        # the layer's critical path (the CPU job is usually its longest part)
        self._wait_spin_ns = max(self._spin_ns, _WAIT_SPIN_NS) if self.threads < cores and spin_us else self._spin_ns
        if ctrl is not None and (ctrl.dtype != np.int64 or ctrl.shape != (_CTRL,) or not ctrl.flags.c_contiguous):
            raise ValueError(f"CpuExpertPool ctrl: expected C-contiguous int64 ({_CTRL},), got {ctrl.dtype} {ctrl.shape}")
        self._ctrl = np.zeros(_CTRL, np.int64) if ctrl is None else ctrl
        self._ctrl[:] = 0
        self._ring = np.zeros((_RING, _RING_FIELDS), np.int64)
        self._tracked: list[CpuJob] = []  # calls submitted with track=True, not yet polled done
        self._seq = 0
        self._views: dict[int, tuple] = {}
        self._scratch = _Scratch()
        self._broken: str | None = None
        self._dead: str | None = None  # a team worker's exception (see _guarded_worker)
        self._workers: list[threading.Thread] = []
        self._inflight: list[tuple[int, tuple]] = []  # (seq, arrays the team reads) until seq is done
        # a pool dropped without close(): its team finishes the calls, then stops
        weakref.finalize(self, _stop_team, self._ctrl, self._inflight, self.timeout_s)

    def _break(self, why: str) -> None:
        """Mark the pool unusable and raise (see ``fail``)."""
        raise self.fail(why)

    def fail(self, why: str) -> ExecutorError:
        """Mark the pool unusable (gated calls stop waiting for their gates, a GPU waiting for
        the team stops waiting) and return the error to raise; a stalled team may still read its
        calls' arrays later, so those are kept for the life of the process."""
        if self._broken is None:
            self._broken = why
            self._ctrl[_C_BROKEN] = 1
            _ABANDONED.extend(self._inflight)
        return ExecutorError(why)

    @property
    def ctrl(self) -> np.ndarray:
        """The team's counters (int64, ``CTRL_WORDS``): where a GPU hand-off writes the gate."""
        return self._ctrl

    def _fixed(self, layer: LayerExperts) -> tuple:
        v = self._views.get(id(layer))
        if v is None or v[0] is not layer:
            views = (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down))
            v = (layer, views, _layer_fields(layer, views))
            self._views[id(layer)] = v
        return v[1:]

    def _start(self) -> None:
        # the team's loop is compiled here, on the caller's thread and outside any wait: with a cold
        # Numba cache it compiles every kernel type (over a minute on a loaded 2-core host), time a
        # result() timeout would otherwise count against the first call (a cache hit loads it)
        _team_worker.compile(tuple(numba.typeof(a) for a in (self._ctrl, self._ring, 0, self.threads,
                                                                self._spin_ns)))
        # and what stopping the team calls from Python: a pool dropped without close() is stopped by
        # a finalizer, which may run inside an import (the garbage collector's moment), where a
        # first compile failed (a circular numba import) and left the team running
        i64, ctrl = numba.typeof(0), numba.typeof(self._ctrl)
        _publish.compile((ctrl, i64))
        _wait_done.compile((ctrl, i64, i64, i64))
        for t in range(self.threads):
            w = threading.Thread(target=_guarded_worker, name=f"moelab-cpu-experts-{t}", daemon=True,
                                 args=(self._ctrl, self._ring, t, self.threads, self._spin_ns, weakref.ref(self)))
            w.start()
            self._workers.append(w)

    def submit(self, layer: LayerExperts, experts: Sequence[int], x: np.ndarray,
               out: np.ndarray | None = None, gated: bool = False, track: bool = False) -> CpuJob:
        """Start computing ``experts[i]`` on ``x[i]`` for every i in the background (results
        into ``out`` when given; neither ``x`` nor ``out`` may be touched until ``result()``
        returns). A bad argument is reported by ``result()``.

        ``gated``: the team reads ``x`` only once ctrl[_C_GATE] >= the job's ``seq`` (written by
        whoever fills ``x``, e.g. a GPU kernel; see ``execute.handoff``); a bad argument then
        raises here, since nobody may wait for a call that never runs. ``track``: the pool
        stamps the job (``poll``) before its ring slot is reused, so a caller that never calls
        ``result()`` still gets its times."""
        if self._broken:
            raise ExecutorError(f"CPU expert pool is unusable: {self._broken}")
        job = CpuJob(self, layer.layer, len(experts))
        try:
            e, x, y = _check_call(layer, experts, x, out)
            views, fixed = self._fixed(layer)
        except (ValueError, TypeError) as exc:
            job._error = exc
            return self._failed(job, gated)
        if not self._workers:
            self._start()
        seq = self._seq + 1
        if seq - int(self._ctrl[_C_DONE]) > _RING and not _wait_done(self._ctrl, seq - _RING, self._spin_ns,
                                                                      int(self.timeout_s * 1e9)):
            self._break(f"layer {layer.layer}: the CPU expert queue did not drain within {self.timeout_s} s")
        if self._tracked:
            self._tracked = [j for j in self._tracked if not j.poll()]
        arrays, scratch = self._scratch.fields(len(e), layer.hidden, layer.ffn)
        try:
            launched = _launch(self._ctrl, self._ring[seq % _RING], seq, e, x, y, layer.num_experts, fixed, scratch,
                               seq if gated else 0)
        except Exception as exc:  # reported by result(), like a bad argument
            job._error = exc
            return self._failed(job, gated)
        if not launched:
            job._error = _bad_experts(layer)
            return self._failed(job, gated)
        done = int(self._ctrl[_C_DONE])
        self._inflight[:] = [k for k in self._inflight if k[0] > done] + [(seq, (e, x, y, arrays, layer, views))]
        job._seq, job._out = seq, y
        self._seq = seq
        if track:
            self._tracked.append(job)
        return job

    @staticmethod
    def _failed(job: CpuJob, gated: bool) -> CpuJob:
        if gated:
            job.result()  # raises the job's error
        return job

    def warmup(self, layer: LayerExperts) -> None:
        """Run one call (the kernels are compiled on first import, or loaded from Numba's cache)."""
        self.submit(layer, [0], np.zeros((1, layer.hidden), np.float32)).result()

    def close(self) -> None:
        """Stop the workers after the submitted calls (a stalled team is left behind, daemonic)."""
        if self._workers:
            if not self._broken and not _wait_done(self._ctrl, self._seq, 0, int(self.timeout_s * 1e9)):
                self._broken = f"the CPU expert team did not finish within {self.timeout_s} s of close()"
                self._ctrl[_C_BROKEN] = 1
                _ABANDONED.extend(self._inflight)
            _publish(self._ctrl, _STOP)
            if not self._broken:
                for w in self._workers:
                    w.join(self.timeout_s)
            self._workers = []
            if not self._broken:
                self._inflight.clear()

    def __enter__(self) -> "CpuExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
