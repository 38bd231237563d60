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
from collections import deque
from typing import Sequence

import numba
import numpy as np
from numba import njit

from .cpu_experts import (J_FFN, J_HIDDEN, J_N, J_NG, J_T0, J_T1, JOB_FIELDS, _bad_experts, _check_call, _fill, _layer_fields,
                          _Scratch, run_phase, tensor_views)
from .cpu_simd import atomic_add, atomic_load, atomic_store, futex_wait, futex_wake, now_ns, pause, yield_cpu
from .experts import ExecutorError, LayerExperts

__all__ = ["CpuExpertPool", "CpuJob"]


# The pool's thread team. ctrl (int64) holds the team's counters, each on its own cache line
# (a GPU hand-off places ctrl in host-mapped memory: the GPU writes _C_GATE and reads _C_DONE
# and _C_BROKEN, see execute.handoff):
# (_C_FIN: workers out of calls so far; _C_HOLD: nonzero holds the next call, for tests; _C_SLEEP:
# workers asleep on _C_GEN; with a lead (see _team_worker) worker 0 sleeps on _C_LEAD instead,
# counted in _C_LSLEEP)
(_C_GEN, _C_DONE, _C_FIN, _C_LEAD, _C_SLEEP, _C_WAIT, _C_HOLD, _C_LSLEEP, _C_BROKEN,
 _C_GATE) = (8 * k for k in range(10))
CTRL_WORDS = _CTRL = 8 * 10
# pool-only job fields after the kernels' (cpu_experts.JOB_FIELDS): the gate value a gated call
# waits for in ctrl[_C_GATE] (0: none), how many hands have passed it, and the first one's stamp;
# the hands that may take part (see _phase_chunks); per phase, chunks claimed and chunks finished; waiters asleep on a
# phase's finished count
J_GATE, J_GSEEN, J_TG, J_HANDS = JOB_FIELDS, JOB_FIELDS + 1, JOB_FIELDS + 2, JOB_FIELDS + 3
_PHASES = 5  # group the pairs (one chunk), quantize x, gate+up, quantize h, down
J_CLAIM = JOB_FIELDS + 4
J_PFIN = J_CLAIM + _PHASES
J_PSLEEP = J_PFIN + _PHASES
_RING_FIELDS = J_PSLEEP + 1
_PER_PART = 16  # compute chunks per hand at most: a hand that is done waits a short chunk's time for the rest
_MIN_ROWS = 16  # and rows per compute chunk at least (a claim is an atomic add on a shared line)
_QUANT_BLOCKS = 16  # and 32-value blocks per quantize chunk at least (~1 us)
_GATE_NAP_NS = 20_000  # a worker that has spun past spin_ns re-checks the gate this often
_RING = 16  # job slots: calls submitted but not yet finished, at most
_STOP = -1  # _C_GEN value that ends the workers
_FOREVER = 1 << 62  # a worker's deadline
_WAIT_SPIN_NS = 1_000_000  # result()'s spin when the caller has a core (see CpuExpertPool)
_DEAD_CHECK_S = 0.05  # a result() wait looks for a dead worker this often
_ABANDONED: list = []  # arrays of calls a stalled team may still read (see CpuExpertPool._break)


@njit(inline="always")
def _spin(spins):
    """One step of a spin-wait: a pause, every 64th a sched_yield (cpu_simd.yield_cpu). A thread
    that spins on a core its waker is queued on would otherwise hold that core for its whole spin
    (a loaded 2-core host: a woken worker preempted the submitting thread, then spun 100 us
    waiting for the call the submitter could not publish)."""
    if spins & 63:
        pause()
    else:
        yield_cpu()


@njit(inline="always")
def _phase_chunks(job, phase):
    """Chunks of ``phase`` (compute phases: known once the pairs are grouped): none for a phase
    without work but the last (its last chunk publishes the call), so a small call crosses fewer
    barriers (a call without pairs one: the grouping's)."""
    if phase == 0:
        return 1
    hands = job[J_HANDS]
    if phase & 1:
        blocks = job[J_N] * (job[J_HIDDEN] if phase == 1 else job[J_FFN]) // 32
        return min(-(-blocks // _QUANT_BLOCKS), hands)
    work = job[J_NG] * (job[J_FFN] if phase == 2 else job[J_HIDDEN])
    if work == 0:
        return 0 if phase < _PHASES - 1 else 1
    return min(max(work // _MIN_ROWS, hands), hands * _PER_PART)


@njit(inline="always")
def _wait_phase(job, phase, chunks, spin_ns, deadline):
    """Wait until every chunk of ``phase`` has finished (spinning up to spin_ns, then on a futex: a
    descheduled hand must not cost the others their cores); False at ``deadline`` (ns)."""
    t0 = now_ns()
    spins = 0
    while True:
        v = atomic_load(job, J_PFIN + phase)
        if v >= chunks:
            return True
        spins += 1
        if spins & 63 or now_ns() - t0 < spin_ns:
            _spin(spins)
            continue
        left = deadline - now_ns()
        if left <= 0:
            return False
        atomic_add(job, J_PSLEEP, 1)
        if atomic_load(job, J_PFIN + phase) == v:
            futex_wait(job, J_PFIN + phase, v, min(left, 1_000_000))
        atomic_add(job, J_PSLEEP, -1)


@njit(nogil=True, cache=True)
def _take_part(ctrl, job, seq, spin_ns, deadline):
    """Take part in call ``seq``: once the previous call has finished (its scratch is then free),
    claim chunks of each phase in turn until none is left, then wait for the phase's last one (but
    the last phase's: whoever waits for the call waits for _C_DONE). The participant that finishes
    the last chunk stamps and publishes the call. True once its part is done, False at
    ``deadline`` (ns; a worker's is _FOREVER)."""
    spins = 0
    while atomic_load(ctrl, _C_DONE) < seq - 1 or atomic_load(ctrl, _C_HOLD):
        if now_ns() > deadline:
            return False
        spins += 1
        _spin(spins)
    if job[J_GATE] and not _wait_gate(ctrl, job, spin_ns, deadline):
        return False
    for phase in range(_PHASES):
        chunks = _phase_chunks(job, phase)
        c = atomic_add(job, J_CLAIM + phase, 1) if chunks else 0
        while c < chunks:
            if phase == 0:
                job[J_T0] = now_ns()
            run_phase(job, phase, c, chunks)
            if atomic_add(job, J_PFIN + phase, 1) == chunks - 1:
                if phase == _PHASES - 1:
                    job[J_T1] = now_ns()
                    atomic_store(ctrl, _C_DONE, seq)
                    if atomic_load(ctrl, _C_WAIT):
                        futex_wake(ctrl, _C_DONE)
                if atomic_load(job, J_PSLEEP):
                    futex_wake(job, J_PFIN + phase)
            c = atomic_add(job, J_CLAIM + phase, 1)
        if phase < _PHASES - 1 and not _wait_phase(job, phase, chunks, spin_ns, deadline):
            return False
    return True


@njit(nogil=True, cache=True)
def _team_worker(ctrl, ring, t, team, spin_ns, lead):
    """Worker t of ``team`` worker threads: takes part in every published call (slots of ``ring``
    in order), spinning up to spin_ns for the next one, then sleeping on a futex; counts itself out
    of each call in ctrl[_C_FIN] and in its own row of ``ring`` past the job slots,
    ring[_RING + t, 0] (a ring slot is reused only once every worker has left it: a worker
    descheduled inside a finished call may be far behind the others).

    ``lead`` (worker 0 of a team of several): worker 0 sleeps on its own word, _C_LEAD, and on
    seeing a call wakes the workers asleep on _C_GEN; the submitter then wakes one thread, not the
    team (a futex wake of every sleeper costs the submitting thread about a microsecond or more per
    thread woken, while the team's wake-up overlaps the call's gate and the lead's share)."""
    seq = 0
    is_lead = lead and t == 0
    while True:
        t0 = now_ns()
        spins = 0
        while atomic_load(ctrl, _C_GEN) == seq:
            spins += 1
            if spins & 63 or now_ns() - t0 < spin_ns:
                _spin(spins)
                continue
            if is_lead:
                atomic_add(ctrl, _C_LSLEEP, 1)
                v = atomic_load(ctrl, _C_LEAD)
                if atomic_load(ctrl, _C_GEN) == seq:
                    futex_wait(ctrl, _C_LEAD, v, 100_000_000)
                atomic_add(ctrl, _C_LSLEEP, -1)
            else:
                atomic_add(ctrl, _C_SLEEP, 1)
                if atomic_load(ctrl, _C_GEN) == seq:
                    futex_wait(ctrl, _C_GEN, seq, 100_000_000)
                atomic_add(ctrl, _C_SLEEP, -1)
        if is_lead and atomic_load(ctrl, _C_SLEEP):
            futex_wake(ctrl, _C_GEN)
        if atomic_load(ctrl, _C_GEN) == _STOP:
            return
        seq += 1
        _take_part(ctrl, ring[seq % _RING], seq, spin_ns, np.int64(_FOREVER))  # not a constant: see run_phase
        atomic_store(ring[_RING + t], 0, seq)
        atomic_add(ctrl, _C_FIN, 1)


@njit(nogil=True, cache=True)
def _help(ctrl, ring, seq, spin_ns, timeout_ns):
    """The caller's share while it waits for call ``seq``: takes part in the unfinished calls up to
    ``seq``, in order; False after timeout_ns."""
    deadline = now_ns() + timeout_ns
    k = atomic_load(ctrl, _C_DONE) + 1
    while k <= seq:
        if not _take_part(ctrl, ring[k % _RING], k, spin_ns, deadline):
            return False
        k = max(k + 1, atomic_load(ctrl, _C_DONE) + 1)
    return True


@njit(inline="always")
def _wait_gate(ctrl, job, spin_ns, deadline):
    """Wait until ctrl[_C_GATE] reaches the call's gate (written by the GPU once the call's inputs
    are in place) or the pool is marked broken: spin up to spin_ns, then nap _GATE_NAP_NS at a
    time (nobody can wake a futex from the GPU); False at ``deadline``. The first participant
    through stamps J_TG."""
    gate = job[J_GATE]
    t0 = now_ns()
    spins = 0
    while True:
        v = atomic_load(ctrl, _C_GATE)
        if v >= gate or atomic_load(ctrl, _C_BROKEN):
            break
        spins += 1
        if spins & 63 or now_ns() - t0 < spin_ns:
            _spin(spins)
            continue
        if now_ns() > deadline:
            return False
        futex_wait(ctrl, _C_GATE, v, _GATE_NAP_NS)
    if atomic_add(job, J_GSEEN, 1) == 0:
        job[J_TG] = now_ns()
    return True


@njit(nogil=True, cache=True)
def _publish(ctrl, seq):
    """Make call ``seq`` (or _STOP) visible to the team and wake sleeping workers: a sleeping lead
    (which wakes the rest, see _team_worker), else those asleep on _C_GEN (a team without a lead,
    or _STOP)."""
    atomic_store(ctrl, _C_GEN, seq)
    if atomic_load(ctrl, _C_LSLEEP):
        atomic_add(ctrl, _C_LEAD, 1)
        futex_wake(ctrl, _C_LEAD)
        if seq != _STOP:
            return
    if atomic_load(ctrl, _C_SLEEP):
        futex_wake(ctrl, _C_GEN)


@njit(nogil=True, cache=True)
def _launch(ctrl, ring, seq, e, x, y, num_experts, fixed, scratch, gate, hands, workers, spin_ns, timeout_ns):
    """Wait until call ``seq``'s ring slot is free (the call ``_RING`` before it done and left by
    every worker), fill the slot (see cpu_experts._fill) and publish it as call ``seq`` for
    ``hands`` hands (see _phase_chunks), gated on ctrl[_C_GATE] >= ``gate`` (0: not gated).
    Returns 0, or with nothing written or published: 1 when an expert id is out of range, 2 when
    the queue did not drain and 3 when the team did not leave the old call within timeout_ns (waits:
spinning up to spin_ns, see _wait_done)."""
    old = seq - _RING
    if old > 0:
        if atomic_load(ctrl, _C_DONE) < old and not _wait_done(ctrl, old, spin_ns, timeout_ns):
            return 2
        if not _wait_left(ring, old, workers, timeout_ns):
            return 3
    job = ring[seq % _RING]
    if not _fill(job, e, x, y, num_experts, fixed, scratch):
        return 1
    job[J_GATE] = gate
    job[J_GSEEN] = 0
    job[J_TG] = 0
    job[J_HANDS] = hands
    job[J_CLAIM:_RING_FIELDS] = 0
    _publish(ctrl, seq)
    return 0


@njit(nogil=True, cache=True)
def _wait_done(ctrl, seq, spin_ns, timeout_ns):
    """Wait until call ``seq`` has finished: spin up to spin_ns, then sleep on a futex; False after
    timeout_ns."""
    t0 = now_ns()
    spins = 0
    while atomic_load(ctrl, _C_DONE) < seq:
        el = now_ns() - t0
        if el > timeout_ns:
            return False
        if el < spin_ns:
            spins += 1
            _spin(spins)
            continue
        atomic_add(ctrl, _C_WAIT, 1)
        done = atomic_load(ctrl, _C_DONE)
        if done < seq:
            futex_wait(ctrl, _C_DONE, done, 1_000_000)
        atomic_add(ctrl, _C_WAIT, -1)
    return True


@njit(nogil=True, cache=True)
def _wait_left(ring, seq, workers, timeout_ns):
    """Wait until every worker has left call ``seq`` (its ring slot is then free): each one's own
    count, not the team's sum (a fast worker may have left later calls while a slow one is still
    inside ``seq``); False after timeout_ns."""
    t0 = now_ns()
    spins = 0
    for t in range(workers):
        while atomic_load(ring[_RING + t], 0) < seq:
            if now_ns() - t0 > timeout_ns:
                return False
            spins += 1
            _spin(spins)
    return True


def _guarded_worker(ctrl, ring, t, team, spin_ns, lead, pool_ref) -> None:
    """``_team_worker``; an exception in it is kept in the pool's ``_dead``, which ends a
    ``result()`` wait within ``_DEAD_CHECK_S`` instead of the timeout. ``pool_ref`` is a weak
    reference: the team must not keep its pool alive."""
    try:
        _team_worker(ctrl, ring, t, team, spin_ns, lead)
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
        self.gated = False  # submitted gated: nobody waits for it on the host (see CpuExpertPool.submit)

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
                if pool._dead:
                    pool._break(f"layer {self.layer}: {pool._dead}")
                if (_help(pool._ctrl, pool._ring, self._seq, pool._wait_spin_ns, wait_ns)
                        and _wait_done(pool._ctrl, self._seq, pool._wait_spin_ns, wait_ns)):
                    break
                if pool._dead or left <= _DEAD_CHECK_S:
                    pool._break(f"layer {self.layer}: " + (pool._dead or f"CPU experts did not finish within "
                                                                        f"{pool.timeout_s} s"))
            self._stamp()
        return self._out

    def _stamp(self) -> None:
        slot = self._pool._ring[self._seq % _RING]
        t0, t1, tg = int(slot[J_T0]), int(slot[J_T1]), int(slot[J_TG])  # Python ints: a numpy scalar's product took ~3 us
        self.started_s, self.finished_s, self.gate_s = t0 * 1e-9, t1 * 1e-9, tg * 1e-9
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
    """``threads`` hands running the expert kernels: native worker threads and the caller.

    The workers are Numba ``nogil`` functions on daemon threads: they never take the GIL. A call is
    written into a slot of a ring of job descriptions and published through an atomic counter; its
    five phases (group the pairs, quantize x, gate+up, quantize h, down) are cut into chunks that
    whoever takes part claims one at a time, so no hand waits for another to arrive. ``result()``
    takes part too (the caller would otherwise only wait), which lets a team that would take every
    core leave the caller one: ``threads`` - 1 workers when ``threads`` >= the host's cores, else
    ``threads`` workers (``workers``). Workers spin up to ``spin_us`` after each call for the next
    one (a hot team starts a call in about a microsecond; every wait yields its core now and then,
    see _spin), then sleep on a futex (waking costs a
    system call and the scheduler's latency). ``result()``, its share done, spins as long (1 ms
    when ``threads`` leaves a core free), then sleeps. ``spin_us`` defaults to the environment's
    ``MOELAB_POOL_SPIN_US``, else 2000 us when ``threads`` leaves a core free and 100 us otherwise
    (``_default_spin_us``): a decode step's GPU part between two CPU layers is longer than 100 us,
    and a team woken from its futex costs the layer a wake-up of every worker, while a team on
    every core that spins long takes the cores of whatever else runs between two calls.
    ``wake``: "lead" (the default, else the environment's ``MOELAB_POOL_WAKE``): a submit wakes at
    most one sleeping worker, which wakes the others (see ``_team_worker``); "all": the submit wakes
    every sleeping worker itself.
    A call the caller never collects still runs (the workers need no one else). Inputs and outputs
    are read and written in place (``out=`` e.g. page-locked memory): no copies. Calls are
    submitted from one thread at a time (the engine's); results may be collected in any order.
    """

    def __init__(self, threads: int, timeout_s: float = 30.0, spin_us: float | None = None,
                 ctrl: np.ndarray | None = None, wake: str | None = None):
        cores = os.cpu_count() or 1
        source = "CpuExpertPool wake" if wake is not None else "MOELAB_POOL_WAKE"
        wake = os.environ.get("MOELAB_POOL_WAKE", "lead") if wake is None else wake
        if wake not in ("lead", "all"):
            raise ValueError(f"{source}: {wake!r}, expected 'lead' or 'all'")
        self.wake = wake
        # the caller takes a share of the work in result(): a team that would take every core
        # leaves it one (threads - 1 workers), and a team of fewer gets one more hand
        self.workers = int(threads) - 1 if 1 < threads >= cores else int(threads)
        if spin_us is None:
            spin_us = _default_spin_us(threads < cores)
        if threads < 1 or threads > max(cores, numba.config.NUMBA_NUM_THREADS):
            raise ValueError(f"CpuExpertPool threads: {threads}, expected 1..{max(cores, numba.config.NUMBA_NUM_THREADS)}")
        if not timeout_s > 0:
            raise ValueError(f"CpuExpertPool timeout_s: {timeout_s}, expected > 0")
        if not 0 <= spin_us <= 1e6:
            raise ValueError(f"CpuExpertPool spin_us: {spin_us}, expected 0..1e6")
        self.threads = int(threads)
        self.lead = wake == "lead" and self.workers > 1
        self.timeout_s = float(timeout_s)
        self._spin_ns = int(spin_us * 1e3)
        # result() spins longer when the caller has a core of its own: a futex wake-up would be on
        # the layer's critical path (the CPU job is usually its longest part)
        self._wait_spin_ns = max(self._spin_ns, _WAIT_SPIN_NS) if self.threads < cores and spin_us else self._spin_ns
        if ctrl is not None and (ctrl.dtype != np.int64 or ctrl.shape != (_CTRL,) or not ctrl.flags.c_contiguous):
            raise ValueError(f"CpuExpertPool ctrl: expected C-contiguous int64 ({_CTRL},), got {ctrl.dtype} {ctrl.shape}")
        self._ctrl = np.zeros(_CTRL, np.int64) if ctrl is None else ctrl
        self._ctrl[:] = 0
        self._ring = np.zeros((_RING + self.workers, _RING_FIELDS), np.int64)  # job slots, then a row per worker
        self._tracked: deque[CpuJob] = deque()  # calls submitted with track=True, not yet polled done (in order)
        self._seq = 0
        self._views: dict[int, tuple] = {}
        self._scratch = _Scratch()
        self._broken: str | None = None
        self._dead: str | None = None  # a team worker's exception (see _guarded_worker)
        self._workers: list[threading.Thread] = []
        self._inflight: deque[tuple[int, tuple]] = deque()  # (seq, arrays the team reads) until seq is done
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
        # the team's loop is compiled here, on the caller's thread and outside any wait (a cold Numba
        # cache: seconds on a 2-core host; a cache hit loads it), and each type's row kernel when a
        # layer of that type is first submitted (_fixed): time a result() timeout must not count
        _team_worker.compile(tuple(numba.typeof(a) for a in (self._ctrl, self._ring, 0, self.workers,
                                                                self._spin_ns, True)))
        _help.compile(tuple(numba.typeof(a) for a in (self._ctrl, self._ring, 0, self._spin_ns, 0)))
        # and what stopping the team calls from Python: a pool dropped without close() is stopped by
        # a finalizer, which may run inside an import (the garbage collector's moment), where a
        # first compile failed (a circular numba import) and left the team running
        i64, ctrl = numba.typeof(0), numba.typeof(self._ctrl)
        _publish.compile((ctrl, i64))
        _wait_done.compile((ctrl, i64, i64, i64))
        for t in range(self.workers):
            w = threading.Thread(target=_guarded_worker, name=f"moelab-cpu-experts-{t}", daemon=True,
                                 args=(self._ctrl, self._ring, t, self.workers, self._spin_ns, self.lead,
                                       weakref.ref(self)))
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
        tracked = self._tracked  # the stamps of the tracked call whose ring slot this one takes, read first
        while tracked and tracked[0]._seq <= seq - _RING:
            if not tracked[0].poll() and not _wait_done(self._ctrl, tracked[0]._seq, self._spin_ns,
                                                         int(self.timeout_s * 1e9)):
                self._break(f"layer {layer.layer}: the CPU expert queue did not drain within {self.timeout_s} s")
            tracked.popleft().poll()
        arrays, scratch = self._scratch.fields(len(e), layer.hidden, layer.ffn)
        try:
            status = _launch(self._ctrl, self._ring, seq, e, x, y, layer.num_experts, fixed, scratch,
                             seq if gated else 0, self.workers + 1, self.workers, self._spin_ns,
                             int(self.timeout_s * 1e9))
        except Exception as exc:  # reported by result(), like a bad argument
            job._error = exc
            return self._failed(job, gated)
        if status == 2:
            self._break(f"layer {layer.layer}: the CPU expert queue did not drain within {self.timeout_s} s")
        if status == 3:
            self._break(f"layer {layer.layer}: the CPU expert team did not leave call {seq - _RING} within "
                        f"{self.timeout_s} s")
        if status:
            job._error = _bad_experts(layer)
            return self._failed(job, gated)
        done, inflight = int(self._ctrl[_C_DONE]), self._inflight
        while inflight and inflight[0][0] <= done:
            inflight.popleft()
        inflight.append((seq, (e, x, y, arrays, layer, views)))
        job._seq, job._out, job.gated = seq, y, gated
        self._seq = seq
        if track:
            tracked.append(job)
        return job

    @staticmethod
    def _failed(job: CpuJob, gated: bool) -> CpuJob:
        if gated:
            job.result()  # raises the job's error
        return job

    def warmup(self, layer: LayerExperts, others: Sequence[LayerExperts] = ()) -> None:
        """Run one call of ``layer`` (its types' kernels compiled, or loaded from Numba's cache), and
        make ready what a first call of each of ``others`` would (their tensors checked, their types'
        kernels compiled or loaded): a model whose layers mix types pays no compile mid-run."""
        for lx in others:
            self._fixed(lx)
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


def bench_submit(threads: int, rows: int, hidden: int, ffn: int, calls: int, gap_us: float, spin_us: float | None,
                 wakes: Sequence[str] = ("lead", "all"), seed: int = 0) -> dict:
    """The host's cost of ``CpuExpertPool.submit`` for gated calls, per ``wake`` setting side by side
    (the pools take turns, ``calls`` // 8 calls at a time): each call is submitted gated, then the
    caller opens its gate and waits for it, standing in for the GPU; then it works ``gap_us`` in
    Python (the team falls asleep when that is longer than ``spin_us``).
    Returns per setting the submit times (seconds) and the gaps' measured lengths."""
    rng = np.random.default_rng(seed)
    from .experts import random_layer

    layer = random_layer(rng, 0, 8, hidden, ffn, 8)  # Q8_0
    x, experts = rng.standard_normal((rows, hidden)).astype(np.float32), [int(e) for e in rng.integers(0, 8, rows)]
    pools = {w: CpuExpertPool(threads, 20.0, spin_us=spin_us, wake=w) for w in wakes}
    out = {w: {"submit_s": [], "gap_s": []} for w in wakes}
    try:
        for pool in pools.values():
            pool.warmup(layer)
        for _ in range(8):
            for w, pool in pools.items():
                xin, yout, ctrl = x.copy(), np.zeros((rows, hidden), np.float32), pool.ctrl
                for _ in range(max(calls // 8, 1)):
                    t0 = time.perf_counter()
                    job = pool.submit(layer, experts, xin, out=yout, gated=True)
                    t1 = time.perf_counter()
                    ctrl[_C_GATE] = job._seq  # the GPU's part: the gate, then a wait for the done word
                    if not _wait_done(ctrl, job._seq, pool._spin_ns, int(pool.timeout_s * 1e9)):
                        raise ExecutorError("bench_submit: a call did not finish")
                    g0 = time.perf_counter()
                    while time.perf_counter() - g0 < gap_us * 1e-6:
                        pass
                    out[w]["submit_s"].append(t1 - t0)
                    out[w]["gap_s"].append(time.perf_counter() - g0)
    finally:
        for pool in pools.values():
            pool.close()
    return out

