"""The start-up uploads (execute.gpu_upload) without a GPU: over the stand-in cupy of
test_gpu_experts_host, with device arrays in host memory and the copy calls carried out at once
(``cudaMemcpy2DAsync`` with its pitches), the background expert load fills the slots with the bytes
per-expert uploads write, skips what it filled, falls back to the staging ring where registration
fails; the staging ring delivers every byte and refills a buffer only after waiting for its event;
the dense matrices come out identical through it. The GPU tests (test_gpu_upload) check the same
on the device, with the real asynchrony."""
from __future__ import annotations

import ctypes
import importlib
import threading
import time
import types

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import random_layer
from scheduler.core import Capacity, Geometry

from .test_gpu_experts_host import _Handle, fake_cupy  # noqa: F401  (the fixture)


class _DevArr(np.ndarray):
    """A device array's stand-in holding its bytes in host memory (``data.ptr`` is their address)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _dev(a) -> _DevArr:
    return np.ascontiguousarray(a).view(_DevArr)


class _Event(_Handle):
    """An event that logs its records and waits: ('record', ptr) / ('sync', ptr)."""

    log: list = []
    done = False  # never seen done without a wait: the load's queue is throttled by its waits

    def record(self, stream=None):
        _Event.log.append(("record", self.ptr))

    def synchronize(self):
        _Event.log.append(("sync", self.ptr))


@pytest.fixture
def mem_cupy(fake_cupy):
    """The stand-in cupy with memory-backed arrays, copies done at once, events logged."""
    cp, G = fake_cupy
    rt = cp.cuda.runtime
    cp.empty = lambda shape, dtype=np.float32, *a, **k: np.zeros(shape, dtype).view(_DevArr)
    cp.zeros = cp.empty
    cp.asarray = _dev
    cp.ascontiguousarray = _dev
    cp.cuda.Event = _Event
    _Event.log = []
    copies = []

    def memcpy(dst, src, n, kind, stream):
        copies.append(("1d", n))
        ctypes.memmove(dst, src, n)

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        assert width <= dpitch and width <= spitch
        copies.append(("2d", width * height))
        for h in range(height):
            ctypes.memmove(dst + h * dpitch, src + h * spitch, width)

    rt.memcpyAsync.side_effect = memcpy
    rt.memcpy2DAsync.side_effect = memcpy2d
    rt.eventRecord.side_effect = lambda ev, stream: _Event.log.append(("record", ev))
    return cp, G, copies


def _make(G, layers, slots, **kw):
    geo = Geometry(tuple(l.num_experts if l else 0 for l in layers), 2, tuple(l.expert_bytes if l else 0 for l in layers))
    return G.GpuExperts(layers, Capacity.per_layer(geo, slots), scratch_slots=2, **kw)


def _arenas(gx) -> list[bytes]:
    return [bytes(a) for a in gx.arenas]


def _layers(rng):
    return [random_layer(rng, 0, 8, 256, 256, Q.Q8_0, exact=False), None,
            random_layer(rng, 2, 8, 256, 512, Q.Q4_0, down_qtype=Q.Q8_0, exact=False)]


# identity, a run into shifted slots, single experts, gaps; layer 1 is dense
PLACED = {**{(0, e): e for e in range(6)}, (2, 1): 3, (2, 2): 4, (2, 7): 0, (2, 0): 6}


def test_background_load_writes_what_per_expert_uploads_write(mem_cupy, rng):
    cp, G, copies = mem_cupy
    layers = _layers(rng)
    ref = _make(G, layers, slots=[6, 0, 7])
    fast = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    try:
        assert cp.cuda.runtime.hostRegister.call_count == 6 and not fast.registered  # only ref's registered
        ref.begin_copies()
        for (l, e), s in PLACED.items():
            ref.upload(l, e, s)
        n_ref = len(copies)
        fast.start_load(PLACED)
        fast.settle()
        assert fast.staging is None and len(fast.registered) == 6
        assert _arenas(fast) == _arenas(ref) and fast.bytes_uploaded == ref.bytes_uploaded
        assert len(copies) - n_ref < n_ref  # runs: one strided copy per projection
        assert fast.filled == {(l, s): e for (l, e), s in PLACED.items()}
        before = len(copies)
        fast.upload(0, 3, 3)  # what the load put there: skipped
        assert len(copies) == before and (0, 3) not in fast.filled
        fast.upload(2, 5, 3)  # another expert: copied
        ref.upload(2, 5, 3)
        assert len(copies) > before and _arenas(fast) == _arenas(ref)
        fast.upload(2, 1, 3)  # the slot was overwritten: expert 1 goes up again
        ref.upload(2, 1, 3)
        assert _arenas(fast) == _arenas(ref)
    finally:
        ref.close()
        fast.close()


def test_a_layer_the_driver_refuses_to_register_goes_through_the_staging_ring(mem_cupy, rng):
    cp, G, copies = mem_cupy
    layers = _layers(rng)
    refused = layers[2].up.data.ctypes.data
    ref = _make(G, layers, slots=[6, 0, 7], pinned=False)
    cp.cuda.runtime.hostRegister.side_effect = lambda ptr, n, flags: (_ for _ in ()).throw(RuntimeError("no"))\
        if ptr == refused else None
    fast = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    try:
        ref.begin_copies()
        for (l, e), s in PLACED.items():
            ref.upload(l, e, s)
        fast.start_load(PLACED)
        fast.settle()
        assert fast.staging is not None and len(fast.registered) == 5
        assert _arenas(fast) == _arenas(ref)
    finally:
        ref.close()
        fast.close()


def test_the_first_copy_settles_a_deferred_registration_and_close_waits_for_a_load(mem_cupy, rng):
    cp, G, copies = mem_cupy
    layers = _layers(rng)
    gx = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    gx.begin_copies()
    gx.upload(2, 1, 0)  # no start_load: registered now, then copied
    assert len(gx.registered) == 6 and bytes(gx.arenas[gx.pool_of[2]][:16]) != bytes(16)
    with pytest.raises(G.ExecutorError, match="registered already"):
        gx.start_load({})
    gx.close()
    rt = cp.cuda.runtime
    rt.hostUnregister.reset_mock()
    rt.hostRegister.reset_mock()
    started = threading.Event()

    def slow_register(*args):  # the thread is inside a layer's registration when close() comes
        started.set()
        time.sleep(0.01)

    rt.hostRegister.side_effect = slow_register
    gx = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    with pytest.raises(G.ExecutorError, match="experts 7..8 of layer 0"):
        gx.start_load({(0, 7): 0, (0, 8): 1})
    gx.start_load(PLACED)
    with pytest.raises(G.ExecutorError, match="given already"):
        gx.start_load(PLACED)
    assert started.wait(10)
    gx.close()  # joins the thread (it stops after the layer it is in) before unregistering
    registered = [c.args[0] for c in rt.hostRegister.call_args_list]
    assert len(registered) >= 3 and len(registered) % 3 == 0  # whole layers: gate, up, down
    assert sorted(c.args[0] for c in rt.hostUnregister.call_args_list) == sorted(registered)
    assert set(registered) <= {a.ctypes.data for l in layers if l is not None for a in (l.gate.data, l.up.data, l.down.data)}


def test_staging_ring_delivers_every_byte_and_waits_before_reuse(mem_cupy):
    cp, G, copies = mem_cupy
    U = importlib.import_module("execute.gpu_upload")
    rng = np.random.default_rng(1)
    sizes = [0, 1, 300, 4096, 9000, 70_000, 5, 20_000]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    srcs.append(rng.standard_normal((33, 7)).astype(np.float32)[::2])  # not contiguous: copied in C order
    dsts = [cp.empty(s.nbytes, cp.uint8) for s in srcs]
    st = U.Staged(0, chunk_bytes=4096, buffers=2, threads=3)
    monkey_min = U._THREAD_MIN
    U._THREAD_MIN = 1024  # the threaded fill on small pieces
    try:
        for d, s in zip(dsts, srcs):
            st.put(d.data.ptr, s)
        st.close()
    finally:
        U._THREAD_MIN = monkey_min
    for d, s in zip(dsts, srcs):
        assert bytes(d) == np.ascontiguousarray(s).tobytes()
    assert st.nbytes == sum(s.nbytes for s in srcs)
    # every buffer's event: recorded, then waited for before that buffer is filled again
    evs = {e.ptr for e in st._events}
    log = [x for x in _Event.log if x[1] in evs]
    pending: set = set()
    for kind, ev in log:
        if kind == "record":
            assert ev not in pending  # a buffer is refilled only after its wait
            pending.add(ev)
        else:
            pending.discard(ev)
    assert not pending  # close() waited for all


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.F16, Q.F32])
def test_staged_matrices_are_the_host_path_bytes(mem_cupy, qt):
    cp, G, copies = mem_cupy
    D = importlib.import_module("execute.gpu_dense")
    U = importlib.import_module("execute.gpu_upload")
    rng = np.random.default_rng(qt)
    c = 128
    rb = Q.row_bytes(qt, c, "m")
    parts = []
    for rows, perm in [(64, None), (32, rng.permutation(32)), (16, np.arange(16))]:
        raw = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
        parts.append(((raw, qt), np.zeros((rows, c), np.float32), perm))
    host = D.stack_matrices(parts)
    st = U.Staged(0, chunk_bytes=4096, buffers=3, threads=2)
    dev = D.stack_matrices(parts, st)
    st.close()
    assert (dev.qt, dev.rows, dev.cols) == (host.qt, host.rows, host.cols) == (qt, 112, c)
    assert dev.w.dtype == host.w.dtype and dev.w.shape == host.w.shape and bytes(dev.w) == bytes(host.w)
    if qt == Q.Q8_0:
        assert dev.d.dtype == host.d.dtype == np.uint16 and dev.d.shape == host.d.shape
        assert bytes(dev.d) == bytes(host.d)
    else:
        assert dev.d is None and host.d is None


def test_registration_starts_before_the_placement_and_survives_a_new_capacity(mem_cupy, rng):
    """The engine's construction re-sizes the arenas (set_capacity) while the load registers: no
    copy has been made yet, so nothing waits; the placement given afterwards lands in the new
    arenas. Settled without a placement, the load only registers; closed, it does not hang."""
    cp, G, copies = mem_cupy
    layers = _layers(rng)
    geo = Geometry((8, 0, 8), 2, (layers[0].expert_bytes, 0, layers[2].expert_bytes))
    ref = _make(G, layers, slots=[6, 0, 7])
    fast = _make(G, layers, slots=[2, 0, 2], defer_pin=True)
    try:
        fast.start_load()
        fast.set_capacity(Capacity.per_layer(geo, [6, 0, 7]))
        assert fast._load is not None  # not settled by the new capacity
        fast.start_load(PLACED)
        fast.settle()
        ref.begin_copies()
        for (l, e), s in PLACED.items():
            ref.upload(l, e, s)
        assert _arenas(fast) == _arenas(ref) and len(fast.registered) == 6
    finally:
        ref.close()
        fast.close()
    gx = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    gx.start_load()
    n = len(copies)
    gx.settle()
    assert len(gx.registered) == 6 and len(copies) == n and not gx.filled
    gx.close()
    gx = _make(G, layers, slots=[6, 0, 7], defer_pin=True)
    gx.start_load()
    gx.close()


def test_engine_backend_ends_prepared_alike_with_the_fast_load_on_and_off(mem_cupy, rng, monkeypatch):
    """EngineExperts: registration from construction, the policy's placement from start_prepare,
    prepare waits; the arenas, the residency and the bytes counted are those of the serial path."""
    import types

    cp, G, copies = mem_cupy
    B = importlib.import_module("execute.backends")
    layers = _layers(rng)
    geo = Geometry((8, 0, 8), 2, (layers[0].expert_bytes, 0, layers[2].expert_bytes))
    cap = Capacity.per_layer(geo, [8, 0, 8])
    weights = types.SimpleNamespace(experts=layers, info=types.SimpleNamespace(expert_bias=False, path="m"))
    monkeypatch.setenv("MOELAB_PREFILL", "0")
    from scheduler.policies import make_policy

    out = {}
    for fast in "01":
        monkeypatch.setenv("MOELAB_FAST_LOAD", fast)
        b = B.EngineExperts(weights, cap, 1, True)
        assert (b.engine.gpu._load is not None) == (fast == "1")
        policy = make_policy("gpu", geo, cap)
        b.start_prepare(policy)
        b.prepare(policy)
        out[fast] = (_arenas(b.engine.gpu), dict(b.engine.slot_of), b.engine.gpu.bytes_uploaded)
        assert not b.engine.gpu.filled and b.engine.slot_of == dict(policy.cache.slot)
        b.close()
    assert out["0"] == out["1"]


def test_a_placement_of_every_expert_is_registered_and_copied(mem_cupy, rng, monkeypatch):
    """Every expert placed (policy gpu): the host stacks are registered and the placement copied
    from them in strided runs; the arenas are those of per-expert uploads."""
    cp, G, copies = mem_cupy
    U = importlib.import_module("execute.gpu_upload")
    monkeypatch.setattr(U, "_THREAD_MIN", 1024)
    layers = _layers(rng)
    every = {(0, e): (e + 3) % 8 for e in range(8)}
    every.update({(2, e): 7 - e for e in range(8)})
    ref = _make(G, layers, slots=[8, 0, 8])
    try:
        ref.begin_copies()
        for (l, e), s in every.items():
            ref.upload(l, e, s)
        reg = cp.cuda.runtime.hostRegister.call_count
        fast = _make(G, layers, slots=[8, 0, 8], defer_pin=True)
        try:
            fast.start_load()
            fast.start_load(every)
            load = fast._load
            fast.settle()
            assert "registered" in load.stamps and cp.cuda.runtime.hostRegister.call_count > reg
            assert fast.staging is None and len(fast.registered) == 6
            assert _arenas(fast) == _arenas(ref) and fast.bytes_uploaded == ref.bytes_uploaded
            assert fast.filled == {(l, s): e for (l, e), s in every.items()}
        finally:
            fast.close()
    finally:
        ref.close()


