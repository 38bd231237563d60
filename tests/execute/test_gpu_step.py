"""execute.gpu_step without a GPU (the stand-in cupy of test_gpu_experts_host): a step's copies
gathered into one batched driver call carry exactly the copies the one-call-per-part path makes,
in the same stream order; a batch the driver refuses falls back to them; the one-token pair table
and the per-layer launches carry the values the kernels expect."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import random_layer

from .test_gpu_experts_host import _make, fake_cupy  # noqa: F401  (the fixture)


def _layers(rng, n=2, experts=6):
    return [random_layer(rng, l, experts, 256, 128, Q.Q8_0) for l in range(n)]


def _copies(cp, stream_ptr):
    """(dst, src, bytes) of the cudaMemcpyAsync calls recorded on ``stream_ptr``, in order."""
    return [tuple(c.args[:3]) for c in cp.cuda.runtime.memcpyAsync.call_args_list if c.args[4] == stream_ptr]


class _Driver:
    """A stand-in for cuMemcpyBatchAsync: records each batch's (dst, src, size) triples."""

    def __init__(self, batch, err=0):
        self.batch, self.err, self.batches = batch, err, []

    def __call__(self, d, s, z, n, attrs, idx, num_attrs, stream):
        a = self.batch._a
        assert (d, s, z) == tuple(self.batch._addr) and num_attrs == 1
        assert attrs == self.batch._attrs.ctypes.data and self.batch._attrs[0] == 1  # every copy stream-ordered
        self.batches.append((stream, [tuple(int(v) for v in a[:, i]) for i in range(n)]))
        return self.err


@pytest.mark.parametrize("streams", [False, True])
def test_a_steps_copies_go_in_one_batch_equal_to_the_per_part_copies(fake_cupy, rng, streams):
    cp, G = fake_cupy
    layers = _layers(rng)
    ups, slots = [4, 1], [0, 2]
    st_e, st_k = ([5], [1]) if streams else ([], [])
    per_part = _make(G, layers, slots=3)
    batched = _make(G, layers, slots=3)
    try:
        rt = cp.cuda.runtime
        rt.memcpyAsync.reset_mock()
        per_part.copy_in(1, ups, slots, st_e, st_k)
        want = [(d - per_part._arena_ptr[0] if d < per_part.scratch.data.ptr else d - per_part.scratch.data.ptr, s, n)
                for d, s, n in _copies(cp, per_part.copy.ptr)]
        assert len(want) == 3 * (len(ups) + len(st_e))
        drv, calls = _Driver(batched._batch), []

        def fn(*a):
            calls.append(("batch", a[-1]))
            return drv(*a)

        batched._batch._fn, batched._batch._fail_idx = fn, False
        rt.memcpyAsync.reset_mock()
        rt.streamWaitEvent.side_effect = lambda *a: calls.append(("wait",) + a)
        rt.eventRecord.side_effect = lambda *a: calls.append(("record",) + a)
        batched.copy_in(1, ups, slots, st_e, st_k)
        assert not _copies(cp, batched.copy.ptr)
        assert len(drv.batches) == 1 and drv.batches[0][0] == batched.copy.ptr
        got = [(d - batched._arena_ptr[0] if d < batched.scratch.data.ptr else d - batched.scratch.data.ptr, s, n)
               for d, s, n in drv.batches[0][1]]
        assert got == want  # same sources, sizes and offsets in the slots / scratch buffers
        assert batched.bytes_uploaded == per_part.bytes_uploaded == sum(n for _, _, n in want)
        assert [c[0] for c in calls] == ["wait", "batch", "record", "wait"]
        assert calls[0][1:] == (batched.copy.ptr, batched.last_read.ptr)  # after the queued kernels
        assert calls[2][1] == calls[3][2] and calls[3][1] == batched.compute.ptr  # compute waits for them
    finally:
        rt.streamWaitEvent.side_effect = rt.eventRecord.side_effect = None
        per_part.close()
        batched.close()


def test_a_refused_first_batch_goes_one_copy_per_part_from_then_on(fake_cupy, rng, monkeypatch):
    cp, G = fake_cupy
    import execute.gpu_step as S

    monkeypatch.setattr(S.CopyBatch, "refused", None)
    gx = _make(G, _layers(rng), slots=3)
    try:
        drv = gx._batch._fn = _Driver(gx._batch, err=1)
        gx._batch._fail_idx = False
        cp.cuda.runtime.memcpyAsync.reset_mock()
        gx.copy_in(0, [3], [1])
        assert S.CopyBatch.refused == 1 and not gx._batch.batched
        assert [(s, n) for _, s, n in _copies(cp, gx.copy.ptr)] == [(s, n) for _, s, n in drv.batches[0][1]]
        gx.copy_in(0, [2], [0])
        assert len(drv.batches) == 1 and len(_copies(cp, gx.copy.ptr)) == 6
        with pytest.raises(G.ExecutorError, match="out of range"):
            gx.copy_in(0, [2, 6], [0, 1])  # nothing of a refused step is left to copy later
        with pytest.raises(G.ExecutorError, match="out of range"):
            gx.copy_in(0, [2], [3])
        assert not gx._batch.dst and len(_copies(cp, gx.copy.ptr)) == 6
    finally:
        gx.close()


def test_pack1_writes_the_pair_table_the_kernels_read(fake_cupy):
    _, G = fake_cupy
    from execute.gpu_step import pack1

    ex = np.full(16 * G.MAX_TOP_K, 0xAB, np.uint8)
    bases, weights, pick = [11, 22, 33], [0.5, 0.25, 0.125], [2, 0]
    pack1(ex, bases, weights, pick)
    m = G.MAX_TOP_K
    assert ex[:24].view(np.uint64).tolist() == bases and not ex[24:8 * m].any()
    assert ex[8 * m:8 * m + 12].view(np.float32).tolist() == weights and not ex[8 * m + 12:12 * m].any()
    assert ex[12 * m:12 * m + 8].view(np.int32).tolist() == pick and (ex[12 * m + 8:] == 0xAB).all()
    pack1(ex, bases, (), [1])  # an early start: no weights
    assert ex[:24].view(np.uint64).tolist() == bases and ex[12 * m:12 * m + 4].view(np.int32).tolist() == [1]


def test_one_token_launches_carry_the_layer_constants_and_h1(fake_cupy, rng):
    cp, G = fake_cupy
    layers = _layers(rng)
    gx = _make(G, layers, slots=3)
    try:
        x = cp.empty((1, 256))
        launch = cp.cuda.driver.launchKernel
        launch.reset_mock()
        gx.pack1([1, 2], [0.5, 0.5], [0, 1])
        gx.gate_up1(1, x, 2, 2)
        out = gx.down_combine1(1, 2)
        gu, dc = gx._one(1)
        hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = gx._consts[1]
        assert gu.vals.tolist() == [x.data.ptr, gx.h1, ffn, hidden, 2, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias]
        assert dc.vals.tolist() == [gx.h1, out.data.ptr, 2, ffn, hidden, 2, off_d, qt_d, rb_d, bias]
        (a1,), (a2,) = [c.args for c in launch.call_args_list[:1]], [c.args for c in launch.call_args_list[1:2]]
        assert a1[:5] == (int(gx._kl[1][2].func), -(-ffn // 8), 2, 1, 128) and a1[8:10] == (gx.compute.ptr, gu.ptr)
        assert a2[:5] == (int(gx._kl[1][3].func), -(-hidden // 2), 1, 1, 64) and a2[8:10] == (gx.compute.ptr, dc.ptr)
        params = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 3).from_address(gu.ptr))
        assert params[0] == gx._ex.ctypes.data and params[1] == gu.vals.ctypes.data  # the table by value first
        assert struct.calcsize("<13Q") == gu.vals.nbytes
    finally:
        gx.close()



def test_a_launch_writes_its_arguments_into_the_block_the_driver_reads(fake_cupy):
    """gpu_host.Launch: each argument in its own 64-bit slot of the block whose slot addresses the
    driver gets (a negative int in two's complement: an int parameter reads it right); a wrong
    argument count is refused before anything is launched."""
    cp, _ = fake_cupy
    from execute.gpu_host import Launch

    kernel = cp.RawKernel()
    launch = Launch(kernel, 4)
    driver = cp.cuda.driver.launchKernel
    driver.reset_mock()
    launch((3, 2), 64, 77, 0x7F00_0000_1000, 5, -1, Launch.f32(0.5))
    (args,) = [c.args for c in driver.call_args_list]
    assert args[:9] == (launch.func, 3, 2, 1, 64, 1, 1, 0, 77)
    slots = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 4).from_address(args[9]))
    vals = [int(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint64 * 1).from_address(int(a)))[0]) for a in slots]
    assert vals == [0x7F00_0000_1000, 5, 2**64 - 1, int(np.float32(0.5).view(np.uint32))]
    assert np.int32(np.uint64(vals[2]).astype(np.uint32).view(np.int32)) == -1
    with pytest.raises(ValueError, match="3 arguments, expected 4"):
        launch((1, 1), 32, 0, 1, 2, 3)
    assert driver.call_count == 1

@pytest.mark.gpu
def test_gpu_a_steps_copies_fill_the_slots_and_scratch_with_the_experts_bytes(rng):
    """On the device: copy_in (one batched call where the driver has it, else one per part) puts
    each expert's parts, in device order, into its slot and scratch buffer; again with the batch
    turned off."""
    from scheduler.core import Capacity, Geometry

    from .conftest import cupy_or_skip

    cupy_or_skip()
    from execute.gpu_experts import GpuExperts

    layers = _layers(rng, experts=8)
    geo = Geometry((8, 8), 2, tuple(l.expert_bytes for l in layers))
    gx = GpuExperts(layers, Capacity.per_layer(geo, 3), scratch_slots=2)
    try:
        def want(e):
            return np.concatenate([p[e].reshape(-1).view(np.uint8) for p in gx._host_parts(layers[1])])

        sb, eb = gx.slot_bytes[gx.pool_of[1]], layers[1].expert_bytes
        for batched, (ups, slots, st) in ((True, ([4, 1], [0, 2], 5)), (False, ([7, 2], [2, 1], 6))):
            if not batched:
                gx._batch._fn = None
            gx.copy_in(1, ups, slots, [st], [1])
            gx.wait(gx.all_done_event())
            arena, scratch = gx.arenas[gx.pool_of[1]].get(), gx.scratch.get()
            for e, s in zip(ups, slots):
                assert np.array_equal(arena[s * sb:s * sb + eb], want(e)), (batched, e)
            assert np.array_equal(scratch[gx.scratch_bytes:gx.scratch_bytes + eb], want(st))
        assert gx._batch.batches <= 1 and gx._batch.copies == 18
    finally:
        gx.close()


def test_copy_in_skips_what_the_background_load_put_in_a_slot(fake_cupy, rng):
    """As ``upload``: an expert the start-up load put in a slot nothing has written since is not
    copied again; the slots a step writes leave ``filled``."""
    cp, G = fake_cupy
    gx = _make(G, _layers(rng), slots=3)
    try:
        gx.filled.update({(0, 1): 3, (0, 0): 5, (1, 2): 4})
        cp.cuda.runtime.memcpyAsync.reset_mock()
        gx.copy_in(0, [3, 2], [1, 0])  # 3 is in slot 1 already; slot 0 held 5, now 2
        srcs = [s for _, s, _ in _copies(cp, gx.copy.ptr)]
        rows = gx._host_rows(0)
        assert srcs == [base + 2 * stride for base, stride, _ in rows]
        assert gx.filled == {(1, 2): 4}
    finally:
        gx.close()
