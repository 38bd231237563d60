"""The pool's ring of job slots under a hand-off that runs far ahead (no GPU: a thread plays it)."""
from __future__ import annotations

import threading
import time

import numpy as np

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
