"""The GPU <-> CPU pool hand-off through mapped memory (GPU only)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from execute import cpu_pool
from execute.experts import ExecutorError
from scheduler.core import Capacity, Decision, Geometry, Step, Token
from scheduler.drive import RunLayer

from .conftest import cupy_or_skip
from .test_engine import EXPERTS, HIDDEN, LAYERS, TOP_K, check, scenario


def _engine(rng, monkeypatch, slots=3, timeout_s=30.0):
    from execute.engine import ExpertEngine

    monkeypatch.setenv("MOELAB_HANDOFF", "1")
    layers, _, _ = scenario(rng, num_tokens=1)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    return layers, ExpertEngine(layers, Capacity.per_layer(geo, slots), threads=2, use_gpu=True, timeout_s=timeout_s)


@pytest.mark.gpu
def test_one_token_with_cpu_pairs_is_handed_off(rng, reference, monkeypatch):
    """Hits, an upload and CPU pairs in one token: the host does not wait, the output matches
    the reference, and both edges of the call are measured."""
    cp = cupy_or_skip()
    layers, engine = _engine(rng, monkeypatch)
    try:
        engine.load_residents({(0, 5): 0})
        ids, w = np.array([[5, 2, 6]]), np.array([[0.5, 0.3, 0.2]], np.float32)
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        step = Step(0, (5, 2, 6))
        tok = Token(0, 0, 0, "decode", (step,))
        outs = []
        for _ in range(4):
            d = Decision(step, (5,), uploads=(2,), slots=(1,), cpu=(6,)) if not outs else Decision(step, (5, 2), cpu=(6,))
            outs.append(engine.run_layer(RunLayer(tok, step, d), cp.asarray(x), ids, w))
        engine.synchronize()
        check([(0, ids, w, x, o) for o in outs], layers, reference)
        st = engine.stats
        assert st.cpu_pairs == 4 and st.handoff_calls == 4 and st.cpu_wait_s == 0.0
        assert np.isfinite(st.handoff_in_s) and np.isfinite(st.handoff_out_s)
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_stalled_worker_is_one_error_not_a_hang(rng, monkeypatch):
    """The team held before its next call: the GPU's wait gives up after 1 s, marks the pool
    broken, and the host gets one ExecutorError naming the layer; nothing hangs."""
    cp = cupy_or_skip()
    layers, engine = _engine(rng, monkeypatch, timeout_s=30.0)
    try:
        ids, w = np.array([[1, 3]]), np.array([[0.5, 0.5]], np.float32)
        step = Step(1, (1, 3))
        item = RunLayer(Token(0, 0, 0, "decode", (step,)), step, Decision(step, (), cpu=(1, 3)))
        x = cp.asarray(rng.standard_normal((1, HIDDEN)).astype(np.float32))
        engine.run_layer(item, x, ids, w)  # warms the team, pairs the clocks
        engine.synchronize()
        engine.pool.ctrl[cpu_pool._C_HOLD] = 1
        t0 = time.perf_counter()
        engine.run_layer(item, x, ids, w)
        with pytest.raises(ExecutorError, match=r"layer 1: CPU experts did not finish within 1 s"):
            engine.synchronize()
        assert time.perf_counter() - t0 < 20  # a bound against a hang, not a speed check
        with pytest.raises(ExecutorError, match="unusable"):
            engine.run_layer(item, x, ids, w)
    finally:
        engine.pool.ctrl[cpu_pool._C_HOLD] = 0
        engine.close()


@pytest.mark.gpu
def test_bench_edges_rows_arrive_intact():
    cupy_or_skip()
    from execute.handoff import bench_edges

    r = bench_edges(threads=2, rows=3, hidden=256, ffn=256, calls=12, busy_us=50)
    assert r["rows_equal"] and r["calls"] > 0 and r["round_trip_s"] > 0


@pytest.mark.gpu
def test_bench_edges_ahead_keeps_rows_and_stamps_the_wait():
    cupy_or_skip()
    from execute.handoff import bench_edges

    r = bench_edges(threads=2, rows=3, hidden=256, ffn=256, calls=24, busy_us=20, ahead=4)
    assert r["rows_equal"] and r["calls"] > 0
    assert len(r["wait_started_s"]) == r["calls"]  # block 0 stamps its first look at every call
