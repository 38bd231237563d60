"""Background fills and swaps on the engine, and its variants (how they are waited for, where the
hand-off's input copy runs): the order on the device, and outputs that do not depend on the variant."""
from __future__ import annotations

import numpy as np
import pytest

from execute.bench_layers import engine_variant
from execute.engine import ExpertEngine, _Residency
from scheduler.core import Capacity, Decision, Geometry, Move, Step, Token
from scheduler.drive import RunLayer
from scheduler.policies import make_policy

from .conftest import cupy_or_skip, spin
from .test_engine import EXPERTS, HIDDEN, LAYERS, TOP_K, _replay_early, check, scenario


def test_a_slot_is_fresh_until_it_holds_an_expert():
    table = np.zeros((2, 4), np.uint64)
    res = _Residency(table, [(1000, 10, 3), None])
    assert res.fresh(0, 0) and res.fresh(0, 2)
    res[(0, 3)] = 2
    assert not res.fresh(0, 2) and res.fresh(0, 1) and table[0, 3] == 1020
    res.pop((0, 3))
    assert not res.fresh(0, 2) and table[0, 3] == 0  # emptied, but a queued kernel may still read it
    assert not res.fresh(1, 0)  # no pool: nothing to fill
    assert not _Residency().fresh(0, 0)  # no GPU


def test_engine_variants_are_checked():
    assert engine_variant("device:early") == {"background_wait": "device", "handoff_put": "early"}
    for bad in ("device", "disk:early", "host:late", "host:early:copy"):
        with pytest.raises(ValueError, match="WAIT:PUT"):
            engine_variant(bad)
    geo = Geometry.uniform(1, 4, 1, 1024)
    with pytest.raises(ValueError, match="background_wait: 'never'"):
        ExpertEngine([None], Capacity.per_layer(geo, 1), threads=1, use_gpu=False, background_wait="never")
    with pytest.raises(ValueError, match="handoff_put: 'late'"):
        ExpertEngine([None], Capacity.per_layer(geo, 1), threads=1, use_gpu=False, handoff_put="late")


def _one(layer: int, ids: list[int], hits: tuple) -> RunLayer:
    step = Step(layer, tuple(ids))
    return RunLayer(Token(0, 0, 0, "decode", (step,)), step, Decision(step, hits))


@pytest.mark.gpu
def test_a_late_fill_is_waited_for_on_the_device(rng, reference):
    """A fill into a fresh slot, its copy held back on the background stream: with the device
    wait the host does not block, and the kernels that read the filled expert wait for it."""
    cp = cupy_or_skip()
    layers, _, _ = scenario(rng, num_tokens=1)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    engine = ExpertEngine(layers, Capacity.per_layer(geo, 3), threads=1, use_gpu=True)
    try:
        gx = engine.gpu
        moves = (Move(0, 4, 1), Move(2, 6, 0))
        spin(cp, 50.0, gx.background)  # the copies below land 50 ms after they are queued
        engine.start_background(moves)
        engine.await_background(moves)
        assert engine.stats.background_wait_s == 0.0 and engine.slot_of[(0, 4)] == 1
        ids, w = np.array([[4]]), np.array([[1.0]], np.float32)
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        out = engine.run_layer(_one(0, [4], (4,)), cp.asarray(x), ids, w)
        engine.synchronize()
        check([(0, ids, w, x, out)], layers, reference)
    finally:
        engine.close()


@pytest.mark.gpu
def test_a_swap_waits_for_the_reads_of_its_victim(rng, reference):
    """A swap into the slot of an expert whose kernels are still queued (the compute stream held
    back): its copy waits for them, so they read the victim, and later kernels the new expert."""
    cp = cupy_or_skip()
    layers, _, _ = scenario(rng, num_tokens=1)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    engine = ExpertEngine(layers, Capacity.per_layer(geo, 3), threads=1, use_gpu=True)
    try:
        engine.load_residents({(0, 5): 0})
        gx = engine.gpu
        w = np.array([[1.0]], np.float32)
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        xd = cp.asarray(x)
        spin(cp, 50.0, gx.compute)
        first = engine.run_layer(_one(0, [5], (5,)), xd, np.array([[5]]), w)
        moves = (Move(0, 2, 0, (0, 5)),)
        engine.start_background(moves)
        engine.await_background(moves)
        second = engine.run_layer(_one(0, [2], (2,)), xd, np.array([[2]]), w)
        engine.synchronize()
        check([(0, np.array([[5]]), w, x, first), (0, np.array([[2]]), w, x, second)], layers, reference)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["host:compute", "device:compute", "host:early"])
def test_engine_variants_give_the_same_decisions_and_outputs(variant, rng, reference, monkeypatch):
    """hybrid with CPU pairs handed off, fills and swaps, early starts: each variant gives the
    defaults' decisions and bitwise their outputs, within the float64 reference."""
    cp = cupy_or_skip()
    monkeypatch.setenv("MOELAB_HANDOFF", "1")
    layers, routing, tokens = scenario(rng, num_tokens=16, batch=(1,))
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1}
    runs = []
    for v in ("device:early", variant):
        pol = make_policy("hybrid", geo, Capacity.per_layer(geo, 3), **options)
        engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2, **engine_variant(v))
        try:
            engine.load_residents(pol.cache.slot)
            d, r = _replay_early(engine, pol, routing, tokens, True, cp)
            runs.append((d, [(a, b, c, e, o.get()) for a, b, c, e, o in r], engine.stats.handoff_calls))
        finally:
            engine.close()
    (d0, r0, h0), (d1, r1, h1) = runs
    assert d0 == d1 and h0 == h1 > 0
    assert any(x.cpu for x in d0)
    check(r1, layers, reference)
    for a, b in zip(r0, r1):
        assert np.array_equal(a[4], b[4])
