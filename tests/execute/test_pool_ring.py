"""The pool's ring of job slots under a hand-off that runs far ahead (no GPU: a thread plays it)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from execute import cpu_pool as P
from execute.experts import random_layer


def test_a_slow_worker_never_sees_its_slot_reused(rng, monkeypatch):
    """More workers than cores, gated calls submitted up to the ring's depth ahead, a thread
    opening each gate and waiting for its call as the GPU does: a worker descheduled inside a
    finished call must not wake in its slot holding a later call (it would compute that call's
    chunks as the old one and move the done count backwards: the GPU then waits forever)."""
    monkeypatch.setattr(P.os, "cpu_count", lambda: 64)
    layer = random_layer(rng, 0, 8, 256, 256, 8)  # Q8_0
    ctrl = np.zeros(P.CTRL_WORDS, np.int64)
    pool = P.CpuExpertPool(4, 20.0, spin_us=50, ctrl=ctrl)
    xin, yout = np.zeros((8, 256), np.float32), np.zeros((8, 256), np.float32)
    jobs, problems = [], []

    def gpu():
        for i in range(600):
            while len(jobs) <= i:
                time.sleep(0)
            seq = jobs[i]._seq
            xin[:] = 1.0
            ctrl[P._C_GATE] = seq
            t0 = time.perf_counter()
            while ctrl[P._C_DONE] < seq:
                if time.perf_counter() - t0 > 5.0 or ctrl[P._C_BROKEN]:
                    problems.append(f"call {i}: done {ctrl[P._C_DONE]} < {seq}")
                    ctrl[P._C_BROKEN] = 1
                    return
                time.sleep(0)

    try:
        pool.warmup(layer)
        t = threading.Thread(target=gpu, daemon=True)
        t.start()
        for _ in range(600):
            if problems:
                break
            jobs.append(pool.submit(layer, [int(e) for e in rng.integers(0, 8, 8)], xin, out=yout, gated=True))
        t.join(60)
    finally:
        ctrl[P._C_BROKEN] = 1
        pool.close()
    assert not problems and not t.is_alive()


@pytest.mark.parametrize("wake", ["lead", "all"])
def test_a_sleeping_team_is_woken_for_every_call(rng, monkeypatch, wake):
    """A team that sleeps between calls (no spin) is woken for each: by the submitter itself
    (``wake="all"``) or through its lead, which wakes the rest; every call finishes, gated or not,
    with the same rows as the other setting's."""
    monkeypatch.setattr(P.os, "cpu_count", lambda: 64)
    layer = random_layer(rng, 0, 8, 256, 256, 8)  # Q8_0
    x = rng.standard_normal((3, 256)).astype(np.float32)
    outs = {}
    for w in (wake, "all" if wake == "lead" else "lead"):
        pool = P.CpuExpertPool(4, 20.0, spin_us=0, wake=w)
        try:
            assert pool.lead == (w == "lead")
            pool.warmup(layer)
            got = []
            for i in range(40):
                job = pool.submit(layer, [1, 5, 7], x, gated=bool(i % 2))
                if job.gated:
                    pool.ctrl[P._C_GATE] = job._seq
                got.append(job.result().copy())
                time.sleep(0.0005)  # the team goes back to sleep
            assert int(pool.ctrl[P._C_SLEEP]) + int(pool.ctrl[P._C_LSLEEP]) <= pool.workers
        finally:
            pool.close()
        assert all(np.array_equal(g, got[0]) for g in got)
        outs[w] = got[0]
    assert np.array_equal(outs["lead"], outs["all"])


def test_bench_submit_times_each_wake_setting(monkeypatch):
    monkeypatch.setattr(P.os, "cpu_count", lambda: 64)
    r = P.bench_submit(3, 2, 256, 256, 16, 0.0, 0.0)
    assert set(r) == {"lead", "all"}
    assert all(len(v["submit_s"]) == 16 and min(v["submit_s"]) > 0 for v in r.values())


def test_wake_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="wake"):
        P.CpuExpertPool(2, wake="some")
    monkeypatch.setenv("MOELAB_POOL_WAKE", "one")
    with pytest.raises(ValueError, match="MOELAB_POOL_WAKE"):
        P.CpuExpertPool(2)
    monkeypatch.setenv("MOELAB_POOL_WAKE", "all")
    assert P.CpuExpertPool(2).wake == "all" and P.CpuExpertPool(2, wake="lead").wake == "lead"
