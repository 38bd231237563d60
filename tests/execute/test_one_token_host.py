"""The one-token step's pair table from what ``begin_layer`` found (``engine._early_bases``), on
the host: where it answers, it gives the addresses and pairs the full loop over the routed
experts gives; a decision that does not keep the early start (other hits, an early expert
uploaded anew or evicted, a slot out of range) gets None, and the full loop decides."""
from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execute.engine import _early_bases, _Early

from .test_gpu_experts_host import fake_cupy  # noqa: F401  (the fixture)
from scheduler.core import Decision, Step

PTR, STRIDE, SLOTS, LAYER = 1 << 20, 4096, 6, 3


def _begin(ids: list, slot_of: dict) -> _Early:
    """``begin_layer``'s record for ``ids`` with residency ``slot_of`` (expert -> slot)."""
    bases, pick, got, rest = [0] * len(ids), [], [], []
    for j, e in enumerate(ids):
        if e in slot_of:
            bases[j] = PTR + slot_of[e] * STRIDE
            pick.append(j)
            got.append(e)
        else:
            rest.append(j)
    return _Early(LAYER, None, None, ids, pick, bases, tuple(got), rest)


def _loop(ids: list, slot_of: dict, d: Decision, picked: list) -> tuple[list, list]:
    """``_run_one``'s loop over the routed experts (the reference)."""
    up = dict(zip(d.uploads, d.slots))
    bases, rest = [], []
    for j, e in enumerate(ids):
        if e in up:
            s = up[e]
            rest.append(j)
        else:
            s = slot_of[e]
            assert e in d.hits
            if j not in picked:
                rest.append(j)
        bases.append(PTR + s * STRIDE)
    return bases, rest


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_early_table_equals_the_full_loop(data):
    """A decision as lru and hybrid make them (hits in routed order, the others uploaded into free
    slots or evicted residents' slots): the same bases and pairs as the loop."""
    k = data.draw(st.integers(1, 6))
    ids = data.draw(st.lists(st.integers(0, 15), min_size=k, max_size=k, unique=True))
    resident = data.draw(st.lists(st.sampled_from(ids), unique=True))
    others = [e for e in range(16) if e not in ids]
    held = data.draw(st.lists(st.sampled_from(others), unique=True, max_size=SLOTS - len(resident)))
    slot_of = dict(zip(resident + held, np.random.default_rng(k).permutation(SLOTS).tolist()))
    early = _begin(ids, slot_of)
    misses = [e for e in ids if e not in resident]
    free = [s for s in range(SLOTS) if s not in slot_of.values()]
    n_free = min(len(free), len(misses))
    victims = held[:len(misses) - n_free]
    if len(victims) < len(misses) - n_free:
        return  # no room for this step's uploads: not a decision lru makes
    slots = free[:n_free] + [slot_of[v] for v in victims]
    d = Decision(Step(LAYER, tuple(ids)), tuple(early.got), tuple(misses), tuple(slots),
                 evictions=tuple((LAYER, v) for v in victims))
    up = dict(zip(d.uploads, d.slots)) or None
    for v in victims:
        del slot_of[v]
    got = _early_bases(early, d, up, PTR, STRIDE, SLOTS)
    assert got is not None
    assert (list(got[0]), list(got[1])) == _loop(ids, slot_of, d, early.pick)


def test_a_decision_that_breaks_the_early_start_goes_to_the_full_loop():
    ids = [5, 2, 7]
    early = _begin(ids, {5: 0, 7: 1})
    step = Step(LAYER, tuple(ids))

    def fast(d):
        return _early_bases(early, d, dict(zip(d.uploads, d.slots)) or None, PTR, STRIDE, SLOTS)

    assert fast(Decision(step, (5, 7), (2,), (4,))) == ([PTR, PTR + 4 * STRIDE, PTR + STRIDE], [1])
    assert fast(Decision(step, (7, 5), (2,), (4,))) is None  # hits in another order
    assert fast(Decision(step, (7,), (5, 2), (3, 4))) is None  # an early expert uploaded anew
    assert fast(Decision(step, (5, 7), (2,), (SLOTS,))) is None  # a slot out of range
    assert fast(Decision(step, (5, 7), (2,), (1,), evictions=((LAYER, 7),))) is None  # a hit evicted
    assert fast(Decision(step, (5, 7))) is None  # a routed expert neither resident nor uploaded
    all_hits = _begin(ids, {5: 0, 2: 2, 7: 1})
    d = Decision(step, tuple(ids))
    assert _early_bases(all_hits, d, None, PTR, STRIDE, SLOTS) == (all_hits.bases, ())


def _engine(G, rng, batch_fn=None):
    """Two Q8_0 layers of 8 experts (256 x 128) with 4 slots each, a GpuExperts over the stand-in
    cupy (``batch_fn``: its batched-copy call, which then never fails) and a one-thread engine on
    it: -> (layers, capacity, gx, engine)."""
    import dataclasses

    from execute import quant as Q
    from execute.engine import ExpertEngine
    from execute.experts import random_layer
    from scheduler.core import Capacity, Geometry

    base = random_layer(rng, 0, 8, 256, 128, Q.Q8_0)
    layers = [dataclasses.replace(base, layer=l) for l in range(2)]
    cap = Capacity.per_layer(Geometry((8, 8), 2, tuple(l.expert_bytes for l in layers)), 4)
    gx = G.GpuExperts(layers, cap, scratch_slots=2)
    if batch_fn is not None:
        gx._batch._fn, gx._batch._fail_idx = batch_fn, False
    return layers, cap, gx, ExpertEngine(layers, cap, threads=1, use_gpu=True, gpu=gx)


def _calls(cp, batch_calls: list) -> dict:
    rt = cp.cuda.runtime
    return {"record": rt.eventRecord.call_count, "wait": rt.streamWaitEvent.call_count,
            "launch": cp.cuda.driver.launchKernel.call_count, "memcpy": rt.memcpyAsync.call_count,
            "batch": len(batch_calls)}


@pytest.mark.parametrize("late", [True, False])
def test_driver_calls_of_a_one_token_step(fake_cupy, rng, monkeypatch, late):
    """The driver calls a one-token step makes, early start included (a stand-in cupy counts
    them): all hits: the caller's event and the compute stream's wait, two launches, one event
    and the caller's wait; with an upload, besides: the copy stream's wait, one batched copy and
    the copy of the step's late entries (the early gate/up covers the uploaded pair: no third
    launch, no event between the streams); MOELAB_LATE_START=0: the copies' event and the compute
    stream's wait, and the uploaded pair's gate/up launch."""
    monkeypatch.setenv("MOELAB_LATE_START", "1" if late else "0")
    from scheduler.drive import RunLayer

    from .test_gpu_experts_host import _Dev

    cp, G = fake_cupy
    batches: list = []
    layers, cap, gx, engine = _engine(G, rng, lambda *a: batches.append(a) or 0)
    try:
        engine.load_residents({(1, 3): 0, (1, 5): 1})
        x, w = _Dev((1, 256)), np.array([[0.6, 0.4]], np.float32)
        cp.cuda.runtime.reset_mock()
        cp.cuda.driver.launchKernel.reset_mock()

        def step(ids, d):
            a = np.array([ids])
            before = _calls(cp, batches)
            engine.begin_layer(1, x, a)
            engine.run_layer(RunLayer(None, d.step, d), x, a, w)
            return {k: v - before[k] for k, v in _calls(cp, batches).items()}

        s = Step(1, (3, 5))
        assert step([3, 5], Decision(s, (3, 5))) == {"record": 2, "wait": 2, "launch": 2, "memcpy": 0, "batch": 0}
        s = Step(1, (3, 6))
        up = {"record": 2, "wait": 3, "launch": 2, "memcpy": 1, "batch": 1} if late else \
            {"record": 3, "wait": 4, "launch": 3, "memcpy": 0, "batch": 1}
        assert step([3, 6], Decision(s, (3,), (6,), (2,))) == up
        assert engine.slot_of[(1, 6)] == 2 and engine.stats.early_pairs == 3
        assert engine.stats.late_pairs == (1 if late else 0)
    finally:
        engine.close()
        gx.close()


def test_begin_layer_starts_the_resident_experts_at_their_slot_addresses(fake_cupy, rng):
    """The engine's own early record (``begin_layer``, read from the residency's table): each
    resident routed expert at its slot's address, in routed order, the others left for run_layer;
    nothing started for an id outside the table, a negative id or no resident expert."""

    from .test_gpu_experts_host import _Dev

    cp, G = fake_cupy
    layers, cap, gx, engine = _engine(G, rng)
    try:
        engine.load_residents({(1, 3): 2, (1, 5): 0, (0, 6): 1})
        ptr, stride, _ = gx.slot_tables[1]
        x = _Dev((1, 256))
        engine.begin_layer(1, x, np.array([[6, 5, 3]]))
        e = engine._early
        assert (e.layer, e.ids, e.pick, e.got, e.rest) == (1, [6, 5, 3], [1, 2], (5, 3), [0])
        assert e.bases == [0, ptr, ptr + 2 * stride] and e.x is x
        for ids in ([[6, 7]], [[5, 8]], [[-1, 5]]):  # none resident; 8 past the table; a negative id
            engine.begin_layer(1, x, np.array(ids))
            assert engine._early is None
        marks = []  # x_ready for a hand-off: recorded by begin_layer once a step's CPU pairs were handed off
        engine.handoff = types.SimpleNamespace(mark_input=lambda: marks.append(1))
        engine.begin_layer(1, x, np.array([[5]]))
        assert not marks and engine._early is not None
        engine._cpu_seen = True
        engine.begin_layer(1, x, np.array([[5]]))
        assert marks == [1]
        engine.handoff = None
    finally:
        engine.close()
        gx.close()


def test_late_pairs_are_resolved_once_by_their_uploads_or_a_release(fake_cupy, rng, monkeypatch):
    """begin_layer launches the late gate/up over every routed pair (resident first) with a new
    step number; a decision that uploads the rest copies their entries (number, slot address)
    after the uploads; one that does not keep the early start, a second begin_layer, a device-side
    background wait or a synchronize release the pending step (entries with address 0), behind
    last_read, and the step then runs its pairs as without the late start."""
    monkeypatch.setenv("MOELAB_LATE_START", "1")
    from scheduler.core import Move
    from scheduler.drive import RunLayer

    from .test_gpu_experts_host import _Dev

    cp, G = fake_cupy
    layers, cap, gx, engine = _engine(G, rng, lambda *a: 0)
    late = engine._late
    try:
        engine.load_residents({(1, 3): 0})
        ptr, stride, _ = gx.slot_tables[1]
        x, w, rt = _Dev((1, 256)), np.array([[0.6, 0.4]], np.float32), cp.cuda.runtime

        def entries(n):  # the last copy's source: (tag, address) per pair, one word each
            dst, src, size, kind, stream = rt.memcpyAsync.call_args.args
            assert dst == late._dev and kind == rt.memcpyHostToDevice and size == 8 * n
            words = np.frombuffer(late._mem, np.uint64, n, src - late._src_ptr).tolist()
            return [[w & 0xFF, w & ~0xFF] for w in words], stream

        engine.begin_layer(1, x, np.array([[3, 6]]))
        assert engine._early.late == 1 and list(gx._ex[12 * 32:12 * 32 + 8].view(np.int32)) == [0, 1]
        s = Step(1, (3, 6))
        engine.run_layer(RunLayer(None, s, Decision(s, (3,), (6,), (2,))), x, np.array([[3, 6]]), w)
        assert entries(2) == ([[2, ptr], [2, ptr + 2 * stride]], gx.copy.ptr)  # step 1's tag: 1 % 255 + 1
        assert engine.stats.late_pairs == 1
        for cut, e in (("decision", 7), ("begin", 4), ("await", 5), ("sync", 2)):
            rt.reset_mock()
            engine.begin_layer(1, x, np.array([[3, e]]))
            seq = engine._early.late
            if cut == "decision":  # the early expert uploaded anew: the step runs both pairs itself
                s = Step(1, (3, 7))
                engine.run_layer(RunLayer(None, s, Decision(s, (), (3, 7), (1, 3))), x, np.array([[3, 7]]), w)
            elif cut == "begin":
                engine.begin_layer(1, x, np.array([[3]]))
            elif cut == "await":
                moves = (Move(0, 1, 3),)
                engine.start_background(moves)
                engine.await_background(moves)
                assert engine._early.late == 0
            else:
                engine.synchronize()
            calls = [(c[0], c.args[:2]) for c in rt.mock_calls]
            put = next(i for i, c in enumerate(calls) if c == ("memcpyAsync", (late._dev, c[1][1])))
            assert ("streamWaitEvent", (gx.copy.ptr, gx.last_read.ptr)) in calls[:put], cut
            if cut != "decision":
                assert entries(2) == ([[seq % 255 + 1, 0]] * 2, gx.copy.ptr), cut
                # the release moves last_read past the released kernel: the next entries wait for it
                assert calls[put + 1:put + 2] == [("eventRecord", (gx.last_read.ptr, gx.compute.ptr))], cut
            else:  # released, then both pairs uploaded and run by the step's own launch
                assert rt.memcpyAsync.call_count == 1 and engine.stats.late_pairs == 1
            engine._early = None
        seq = late.seq  # as if its pair 1 had timed out, having seen the step before's word
        late._err[:] = seq, 0x300 | ((seq - 1) % 255 + 1), 1
        with pytest.raises(Exception, match=rf"pair 1 of one-token step {seq} \(layer 1\).*entries were queued .*"
                                            rf"tag {(seq - 1) % 255 + 1} \(its own: {seq % 255 + 1}\)"):
            engine.synchronize()
        with pytest.raises(Exception, match=f"step {seq} "):  # and at the next step begun
            late.begin(1, x, [ptr, 0], [0, 1], 2)
        assert late.seq == seq
        late._err[:] = 0
    finally:
        engine.close()
        gx.close()


def test_on_compute_takes_the_events_between_streams_out_of_a_step(fake_cupy, rng, monkeypatch):
    """Inside ``engine.on_compute()`` the caller's current stream is the compute stream: a one-token
    step of hits makes its two launches and one event (``last_read``), no stream wait. On entry the
    compute stream waits for the caller's stream; on exit the caller's stream for the compute one."""
    monkeypatch.setenv("MOELAB_LATE_START", "0")
    from scheduler.drive import RunLayer

    from .test_gpu_experts_host import _Dev

    cp, G = fake_cupy
    layers, cap, gx, engine = _engine(G, rng)
    current = [cp.cuda.get_current_stream()]

    class Stream:  # a stream whose ``with`` makes it the current one, as cupy's
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            current.append(self)

        def __exit__(self, *_):
            current.pop()

        def synchronize(self):
            pass

    caller, gx.compute = current[0].ptr, Stream(gx.compute.ptr)
    monkeypatch.setattr(cp.cuda, "get_current_stream", lambda: current[-1])
    rt = cp.cuda.runtime
    try:
        engine.load_residents({(1, 3): 0, (1, 5): 1})
        x, w, ids = _Dev((1, 256)), np.array([[0.6, 0.4]], np.float32), np.array([[3, 5]])
        d = Decision(Step(1, (3, 5)), (3, 5))
        rt.reset_mock()
        cp.cuda.driver.launchKernel.reset_mock()
        with engine.on_compute():
            assert current[-1] is gx.compute
            entry = [(c[0], c.args) for c in rt.mock_calls]
            engine.begin_layer(1, x, ids)
            engine.run_layer(RunLayer(None, d.step, d), x, ids, w)
            assert [(c[0], c.args) for c in rt.mock_calls[len(entry):]] == \
                [("eventRecord", (gx.last_read.ptr, gx.compute.ptr))]
            assert cp.cuda.driver.launchKernel.call_count == 2
        assert current == [current[0]]
        assert entry == [("eventRecord", (gx._caller_ev.ptr, caller)),
                         ("streamWaitEvent", (gx.compute.ptr, gx._caller_ev.ptr))]
        assert [(c[0], c.args) for c in rt.mock_calls[-2:]] == [("eventRecord", (gx._back_ev.ptr, gx.compute.ptr)),
                                                                ("streamWaitEvent", (caller, gx._back_ev.ptr))]
    finally:
        engine.close()
        gx.close()
