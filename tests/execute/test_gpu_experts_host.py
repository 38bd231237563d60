"""GpuExperts' host side without a GPU: a stand-in ``cupy`` module records the driver calls, so
the order of the stream waits, the host registrations' lifetime and the per-layer constants of
every layout are checked on any machine (the GPU tests check the numbers)."""
from __future__ import annotations

import dataclasses
import gc
import importlib
import sys
from itertools import count
from unittest import mock

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import random_layer
from scheduler.core import Capacity, Geometry
from scheduler.policies import make_policy

_MODULES = ("cupy", "execute.gpu_experts", "execute.gpu_host", "execute.gpu_quant")
_ptrs = count(0x1000, 0x1000)


class _Pinned(bytearray):
    """cupy.cuda.alloc_pinned_memory's stand-in: a host buffer with ``ptr`` and ``size()``."""

    @property
    def ptr(self) -> int:
        return np.frombuffer(self, np.uint8).ctypes.data

    def size(self) -> int:
        return len(self)


class _Dev:
    """A device array's stand-in: shape, dtype, flags and a distinct address, no data."""

    def __init__(self, shape, dtype=np.float32, memptr=None, **_):
        self.shape = tuple(np.atleast_1d(shape).tolist()) if not isinstance(shape, tuple) else shape
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.flags = mock.Mock(c_contiguous=True)
        self.data = mock.Mock(ptr=next(_ptrs))

    def __getitem__(self, _):
        return self

    def reshape(self, *shape):
        return _Dev(shape[0] if len(shape) == 1 else shape, self.dtype)

    def set(self, _):
        pass


class _Handle:
    """A stream or event: a distinct address; a stream is a context manager (``with stream``)."""

    def __init__(self, *_, **__):
        self.ptr = next(_ptrs)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return None

    record = synchronize = wait_event = lambda self, *a: None


@pytest.fixture
def fake_cupy(monkeypatch):
    """``execute.gpu_experts`` imported over a recording stand-in for cupy. Every module that holds
    the real cupy (or is imported during the test) is set aside and put back afterwards, with the
    package's attributes, so no later test sees the stand-in. The stand-in maps no host memory:
    engines built over it take the synchronized CPU path (MOELAB_HANDOFF=0)."""
    import execute

    monkeypatch.setenv("MOELAB_HANDOFF", "0")

    real = sys.modules.get("cupy")
    before = dict(sys.modules)
    held = {k for k, m in before.items() if k.startswith("execute.") and real is not None and m is not None
            and any(v is real for v in vars(m).values())}
    saved = {k: before[k] for k in held | set(_MODULES) if k in before}
    cp = mock.MagicMock(name="cupy")
    cp.float32, cp.int32, cp.uint8, cp.uint16, cp.uint64 = np.float32, np.int32, np.uint8, np.uint16, np.uint64
    cp.ndarray = _Dev
    cp.empty = cp.full = lambda shape, dtype=np.float32, *a, **k: _Dev(shape, dtype)
    cp.arange = lambda n, dtype=np.int32: _Dev(n, dtype)
    cp.cuda.Stream = cp.cuda.Event = _Handle
    cp.cuda.alloc_pinned_memory = _Pinned
    null = _Handle()
    null.ptr = 0
    cp.cuda.get_current_stream = lambda: null
    cp.cuda.runtime.CUDARuntimeError = RuntimeError
    cp.cuda.runtime.eventQuery.return_value = 0
    for k in saved:
        sys.modules.pop(k, None)
    sys.modules["cupy"] = cp
    try:
        yield cp, importlib.import_module("execute.gpu_experts")
    finally:
        for k in list(sys.modules):
            if k == "cupy" or k in saved or (k.startswith("execute.") and k not in before):
                m = sys.modules.pop(k)
                name = k.partition(".")[2]
                if k.startswith("execute.") and "." not in name and getattr(execute, name, None) is m:
                    delattr(execute, name)
        for k, m in saved.items():
            sys.modules[k] = m
            if k.startswith("execute.") and "." not in k.partition(".")[2]:
                setattr(execute, k.partition(".")[2], m)


def _make(G, layers, slots=2, **kw):
    geo = Geometry(tuple(l.num_experts for l in layers), 2, tuple(l.expert_bytes for l in layers))
    return G.GpuExperts(layers, Capacity.per_layer(geo, slots), scratch_slots=2, **kw)


def _layer(rng, qt, n=3, hidden=256, ffn=256, layer=0, down=None):
    from execute.experts import ExpertTensor, LayerExperts

    def t(rows, cols, q, name):
        return ExpertTensor(Q.random_blocks(rng, q, n * rows, cols, 0.1).reshape(n, -1), q, rows, cols, name=name)

    d = qt if down is None else down
    return LayerExperts(layer, t(ffn, hidden, qt, "gate"), t(ffn, hidden, qt, "up"), t(hidden, ffn, d, "down"))


GENERIC = sorted(set(Q.LAYOUTS) - set(Q.QTYPES))


@pytest.mark.parametrize("qt", GENERIC, ids=[Q.LAYOUTS[t].name for t in GENERIC])
def test_every_layout_makes_a_gpu_experts_with_its_row_sizes(fake_cupy, rng, qt):
    """A layer of a type the arena's kernels do not read builds (the gpu run refused them all with
    'quant type ... is not supported here' from the per-layer constants), is a generic layer,
    and its kernels get the stored row sizes."""
    cp, G = fake_cupy
    layers = [_layer(rng, qt), _layer(rng, Q.Q8_0, layer=1, down=Q.Q6_K)]
    gx = _make(G, layers)
    try:
        assert gx.generic_layers == {0}
        for l in layers:
            c = gx._consts[l.layer]
            assert (c[4], c[7], c[10]) == tuple(Q.row_bytes(t.qtype, t.cols, "t", Q.LAYOUTS)
                                                 for t in (l.gate, l.up, l.down))
            assert (c[3], c[6], c[9]) == (l.gate.qtype, l.up.qtype, l.down.qtype)
        assert gx._kl[0] != gx._kl[1]  # gpu_quant's launches for the generic layer
        with pytest.raises(G.ExecutorError, match="token graph"):
            gx.routed_layer(0, 0, 0, 0, 0, 0, 0, 2)
    finally:
        gx.close()


def _registered(cp) -> list[int]:
    return [c.args[0] for c in cp.cuda.runtime.hostRegister.call_args_list]


def _unregistered(cp) -> list[int]:
    return [c.args[0] for c in cp.cuda.runtime.hostUnregister.call_args_list]


def test_a_failed_construction_unregisters_what_it_registered(fake_cupy, rng, monkeypatch):
    """A GpuExperts whose construction fails after pinning the host weights unregisters them (they
    were left registered and then freed: later copies from new memory at those addresses failed
    with 'invalid argument' or read stale pages)."""
    cp, G = fake_cupy
    monkeypatch.setattr(G, "_kernel", mock.Mock(side_effect=RuntimeError("compile failed")))
    with pytest.raises(RuntimeError, match="compile failed"):
        _make(G, [random_layer(rng, 0, 3, 256, 256, Q.Q8_0)])
    assert len(_registered(cp)) == 3 and sorted(_unregistered(cp)) == sorted(_registered(cp))


def test_a_bad_layer_is_refused_before_anything_is_registered(fake_cupy, rng):
    cp, G = fake_cupy
    layer = random_layer(rng, 0, 3, 256, 256, Q.Q8_0)
    layer = dataclasses.replace(layer, down=dataclasses.replace(layer.down, cols=250))
    with pytest.raises(ValueError, match="250"):
        _make(G, [layer])
    assert not _registered(cp)


def test_dropped_without_close_unregisters_while_its_arrays_live(fake_cupy, rng):
    """Dropped without close(): unregistered when collected, the host arrays kept alive until then."""
    cp, G = fake_cupy
    layer = random_layer(rng, 0, 3, 256, 256, Q.Q8_0)
    gx = _make(G, [layer])
    ptrs = list(gx.registered)
    assert ptrs == [a.ctypes.data for a in (layer.gate.data, layer.up.data, layer.down.data)]
    del gx, layer
    gc.collect()
    assert sorted(_unregistered(cp)) == sorted(ptrs)
    gx = _make(G, [random_layer(rng, 0, 3, 256, 256, Q.Q8_0)])
    gx.close()
    gx.close()  # once only
    assert len(_unregistered(cp)) == 6 and not gx.registered


def test_run_orders_the_compute_stream_after_the_callers_stream_and_back(fake_cupy, rng):
    """gx.run: the compute stream waits for the caller's stream before reading x (its input's copy
    may still be queued there), and the caller's stream waits for the compute stream after the
    kernels (the caller reads the output, or frees x and reuses its memory, in its own order)."""
    cp, G = fake_cupy
    gx = _make(G, [random_layer(rng, 0, 3, 256, 256, Q.Q8_0)])
    calls = mock.Mock()
    calls.attach_mock(cp.cuda.runtime.eventRecord, "record")
    calls.attach_mock(cp.cuda.runtime.streamWaitEvent, "wait")
    calls.attach_mock(cp.cuda.driver.launchKernel, "launch")
    calls.reset_mock()
    gx.run(0, [0, 1], _Dev((2, 256)), [0, 1])
    seq = [(c[0], c.args) for c in calls.mock_calls]
    launches = [i for i, (n, _) in enumerate(seq) if n == "launch"]
    comp = gx.compute.ptr
    assert len(launches) == 2
    assert seq.index(("record", (gx._caller_ev.ptr, 0))) < seq.index(("wait", (comp, gx._caller_ev.ptr))) < launches[0]
    assert launches[-1] < seq.index(("record", (gx._back_ev.ptr, comp))) < seq.index(("wait", (0, gx._back_ev.ptr)))
    calls.reset_mock()
    with gx.compute:  # a caller on the compute stream itself: no wait
        cp.cuda.get_current_stream = lambda: gx.compute
        gx.after_caller()
        gx.to_caller()
    assert not calls.mock_calls
    gx.close()


@pytest.mark.parametrize("policy", ["cpu", "lru"])
def test_engine_layers_order_the_compute_stream_after_the_callers_and_back(fake_cupy, rng, policy):
    """ExpertEngine.run_layer (the CPU pool's input fetch, the kernels, the one-token path): the
    compute stream waits for the caller's stream before the first read of x, and the caller's
    stream waits for the compute stream after the layer's last launch or copy."""
    cp, G = fake_cupy
    cp.zeros = cp.empty
    from execute.engine import ExpertEngine
    from scheduler.drive import RunLayer, drive

    from .test_engine import scenario

    layers, routing, tokens = scenario(rng, num_tokens=3, batch=(1, 3))
    geo = Geometry((8,) * 3, 2, tuple(l.expert_bytes for l in layers))
    pol = make_policy(policy, geo, Capacity.per_layer(geo, 8 if policy == "lru" else 3))
    engine = ExpertEngine(layers, pol.capacity, threads=1, use_gpu=True, scratch_slots=2)
    gx = engine.gpu
    calls = mock.Mock()
    rt = cp.cuda.runtime
    for name, m in (("record", rt.eventRecord), ("wait", rt.streamWaitEvent), ("copy", rt.memcpyAsync),
                    ("launch", cp.cuda.driver.launchKernel)):
        calls.attach_mock(m, name)
    comp, runs = gx.compute.ptr, 0
    try:
        engine.load_residents(pol.cache.slot)
        for item in drive(pol, tokens):
            if not isinstance(item, RunLayer):
                continue
            ids, w = routing[(item.token.index, item.step.layer)]
            x = _Dev((len(ids), 256))
            calls.reset_mock()
            engine.run_layer(item, x, ids, w)
            seq = [(c[0], c.args) for c in calls.mock_calls]
            first = next(i for i, (n, a) in enumerate(seq) if n == "launch" or (n == "copy" and x.data.ptr in a[:2]))
            assert seq.index(("wait", (comp, gx._caller_ev.ptr))) < first
            last = max(i for i, (n, a) in enumerate(seq) if n in ("launch", "copy") and a[-1 if n == "copy" else 8] == comp)
            # the caller waits on the event recorded after the layer's work: _back_ev, or last_read
            # (one token: end_step marks the reads and hands back by one event)
            ev = gx._back_ev.ptr if ("record", (gx._back_ev.ptr, comp)) in seq else gx.last_read.ptr
            assert last < seq.index(("record", (ev, comp))) < seq.index(("wait", (0, ev)))
            calls.reset_mock()
            engine.dense_after_experts()  # the backend's wait: already done by run_layer
            assert not calls.mock_calls
            engine.dense_after_experts()  # not right after a layer: waits
            assert [c[0] for c in calls.mock_calls] == ["record", "wait"]
            runs += 1
        assert runs == 9 and (engine.stats.cpu_pairs > 0) == (policy == "cpu")
    finally:
        engine.close()


def test_batched_prefill_orders_the_compute_stream_after_the_callers_and_back(fake_cupy, rng):
    """BatchedExperts.run_layer, hybrid (CPU pairs fetched, GPU rounds): the same two waits."""
    cp, G = fake_cupy
    cp.zeros = cp.empty
    cp.cuda.Device.return_value.compute_capability = "90"
    from execute.engine import ExpertEngine
    from execute.prefill import BatchedExperts
    from scheduler.drive import RunLayer, drive

    from .test_prefill import E, _scenario

    layers = [random_layer(rng, l, E, 256, 128, Q.Q8_0) for l in range(2)]
    routing, tokens = _scenario(rng, layers, (40, 24))
    geo = Geometry((E,) * 2, 4, tuple(l.expert_bytes for l in layers))
    pol = make_policy("hybrid", geo, Capacity.per_layer(geo, 4), miss_frac_256=128, swap_every=2, gate=0.5, margin=0.1)
    engine = ExpertEngine(layers, pol.capacity, threads=1, use_gpu=True, scratch_slots=2)
    gx, rt = engine.gpu, cp.cuda.runtime
    batched = BatchedExperts(engine, batch_experts=2)
    calls = mock.Mock()
    for name, m in (("record", rt.eventRecord), ("wait", rt.streamWaitEvent), ("copy", rt.memcpyAsync),
                    ("launch", cp.cuda.driver.launchKernel)):
        calls.attach_mock(m, name)
    comp, runs = gx.compute.ptr, 0
    try:
        engine.load_residents(pol.cache.slot)
        for item in drive(pol, tokens):
            if isinstance(item, RunLayer):
                ids, w = routing[(item.token.index, item.step.layer)]
                x = _Dev((len(ids), 256))
                assert batched.takes(item.decision, ids)
                calls.reset_mock()
                batched.run_layer(item.decision, x, ids, w)
                seq = [(c[0], c.args) for c in calls.mock_calls]
                first = next(i for i, (n, a) in enumerate(seq)
                             if (n == "launch" and x.data.ptr in a) or (n == "copy" and x.data.ptr in a[:2]))
                assert seq.index(("wait", (comp, gx._caller_ev.ptr))) < first
                last = max(i for i, (n, a) in enumerate(seq) if n in ("launch", "copy") and a[-1 if n == "copy" else 8] == comp)
                # the caller waits on the event recorded after the layer's work: _back_ev, or last_read
                # (one token: end_step marks the reads and hands back by one event)
                ev = gx._back_ev.ptr if ("record", (gx._back_ev.ptr, comp)) in seq else gx.last_read.ptr
                assert last < seq.index(("record", (ev, comp))) < seq.index(("wait", (0, ev)))
                runs += 1
        assert runs == 4 and engine.stats.cpu_pairs > 0
    finally:
        engine.close()
