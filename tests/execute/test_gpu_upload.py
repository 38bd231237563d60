"""Start-up uploads on the device (execute.gpu_upload, MOELAB_FAST_LOAD): the background expert load
fills the arenas with the bytes of per-expert uploads and skips only what it filled; the staging
ring delivers every byte; staged dense matrices are the host path's bytes; and ``moelab run``
gives the same tokens and decisions with the fast load on and off."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import random_layer
from scheduler.core import Capacity, Geometry

from .conftest import biased, cupy_or_skip

pytestmark = pytest.mark.gpu


def _make(layers, slots, **kw):
    from execute.gpu_experts import GpuExperts

    geo = Geometry(tuple(l.num_experts if l else 0 for l in layers), 2,
                   tuple(l.expert_bytes if l else 0 for l in layers))
    return GpuExperts(layers, Capacity.per_layer(geo, slots), scratch_slots=2, **kw)


def _arenas(gx) -> list[bytes]:
    gx.compute.synchronize()
    return [a.get().tobytes() for a in gx.arenas]


def test_background_load_fills_the_slots_per_expert_uploads_fill(rng):
    cupy_or_skip()
    layers = [random_layer(rng, 0, 16, 512, 768, Q.Q8_0, exact=False), None,
              biased(random_layer(rng, 2, 16, 512, 256, Q.Q4_0, down_qtype=Q.Q8_0, exact=False), rng, "swiglu_oai")]
    placed = {**{(0, e): e for e in range(12)}, (0, 13): 12, (2, 3): 0, (2, 4): 1, (2, 5): 2, (2, 9): 7, (2, 0): 4}
    ref = _make(layers, [13, 0, 8])
    fast = _make(copy.deepcopy(layers), [13, 0, 8], defer_pin=True)  # own host arrays: CUDA registers a range once
    try:
        ref.begin_copies()
        for (l, e), s in placed.items():
            ref.upload(l, e, s)
        ref.wait(ref.copies_event())
        fast.start_load()  # registration starts, then the placement is given
        fast.start_load(placed)
        fast.settle()
        assert len(fast.registered) == len(ref.registered) == 7 and fast.staging is None
        assert _arenas(fast) == _arenas(ref) and fast.bytes_uploaded == ref.bytes_uploaded
        up0 = fast.bytes_uploaded
        fast.begin_copies()
        fast.upload(0, 5, 5)  # filled by the load: skipped
        assert fast.bytes_uploaded == up0
        for gx in (fast, ref):
            gx.begin_copies()
            gx.upload(2, 9, 0)  # another expert over a filled slot, then the first one back
            gx.upload(2, 3, 7)
            gx.wait(gx.copies_event())
        assert _arenas(fast) == _arenas(ref)
    finally:
        ref.close()
        fast.close()


def test_staging_ring_delivers_every_byte(rng):
    cp = cupy_or_skip()
    from execute.gpu_upload import Staged

    sizes = [0, 1, 255, 4096, 70_001, (3 << 20) + 7, 9 << 20, 12]
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    srcs.append(rng.standard_normal((301, 77)).astype(np.float32)[::3])  # not contiguous: C order
    dsts = [cp.zeros(s.nbytes, cp.uint8) for s in srcs]
    st = Staged(cp.cuda.get_current_stream().ptr, chunk_bytes=1 << 20, buffers=2, threads=3)
    for d, s in zip(dsts, srcs):
        st.put(d.data.ptr, s)
    st.close()
    for d, s in zip(dsts, srcs):
        assert d.get().tobytes() == np.ascontiguousarray(s).tobytes()


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.F16, Q.F32, Q.BF16])
def test_staged_matrices_are_the_host_path_bytes(rng, qt):
    cp = cupy_or_skip()
    from execute.gpu_dense import stack_matrices
    from execute.gpu_upload import Staged

    c = 256
    rb = Q.row_bytes(qt, c, "m")
    parts = [((rng.integers(0, 256, (rows, rb), dtype=np.uint8), qt), np.zeros((rows, c), np.float32), p)
             for rows, p in [(640, None), (128, rng.permutation(128)), (128, np.arange(128))]]
    host = stack_matrices(parts)
    st = Staged(cp.cuda.get_current_stream().ptr, chunk_bytes=1 << 18)
    dev = stack_matrices(parts, st)
    st.close()
    assert (dev.qt, dev.rows, dev.cols) == (host.qt, host.rows, host.cols)
    assert dev.w.dtype == host.w.dtype and dev.w.shape == host.w.shape
    assert dev.w.get().tobytes() == host.w.get().tobytes()
    assert (dev.d is None) == (host.d is None) == (qt != Q.Q8_0)
    if dev.d is not None:
        assert dev.d.dtype == host.d.dtype and dev.d.get().tobytes() == host.d.get().tobytes()


@pytest.mark.parametrize("policy", [["--policy", "gpu"], ["--policy", "lru", "--cache-slots", "3"]])
def test_run_gives_the_same_tokens_and_decisions_with_the_fast_load_off(models, capsys, monkeypatch, policy):
    """Same text, decisions and uploads; and no warning (a CUDA graph capture disturbed by the
    background load's driver calls would say so and fall back to plain launches)."""
    import json

    from execute.cli_run import run_main

    cupy_or_skip()
    out = {}
    for fast in ("0", "1"):
        monkeypatch.setenv("MOELAB_FAST_LOAD", fast)
        argv = [str(models()), "-p", "The cat sat on the mat and", "-n", "8", *policy, "--json", "--threads", "1"]
        assert run_main(argv) == 0
        res = capsys.readouterr()
        assert "warning" not in res.err, res.err
        text, _, fig = res.out.partition("\n{")
        fig = json.loads("{" + fig)
        out[fast] = (text, fig["digest"], fig["generated"], fig["uploads"], fig["upload_mib"])
    assert out["0"] == out["1"]
