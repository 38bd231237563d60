"""GPU expert kernels, uploads, streams and promotions against gguf's dequantizer (needs CUDA)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import random_layer
from scheduler.core import Capacity, Geometry

pytestmark = pytest.mark.gpu

ALL = sorted(Q.QTYPES)
REL_ERR = 1e-5  # exact dequantization, float32 accumulation (same bound as the CPU kernels)


@pytest.fixture
def cp():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp


def make(layers, slots, scratch=2, pinned=True):
    from execute.gpu_experts import GpuExperts

    geo = Geometry(tuple(l.num_experts for l in layers), 2, tuple(l.expert_bytes for l in layers))
    return GpuExperts(layers, Capacity.per_layer(geo, slots), scratch_slots=scratch, pinned=pinned)


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_kernels_match_reference(qtype, cp, rng, reference):
    from execute.gpu_experts import scratch_source

    layer = random_layer(rng, 0, num_experts=6, hidden=512, ffn=768, qtype=qtype)
    gx = make([layer], slots=3)
    try:
        gx.begin_copies()
        for e, s in [(4, 0), (1, 2)]:
            gx.upload(0, e, s)
        k = gx.stream(0, 5)
        ev = gx.copies_event()
        # expert 4 gets 5 tokens (more than a kernel's chunk of 4), 1 one token, 5 two tokens
        experts = [4, 1, 4, 5, 4, 4, 5, 4]
        sources = [{4: 0, 1: 2, 5: scratch_source(k)}[e] for e in experts]
        x = rng.standard_normal((3, 512)).astype(np.float32)
        xrow = [0, 1, 2, 0, 1, 2, 2, 0]
        out = cp.full((len(experts), 512), cp.nan, cp.float32)  # poisoned: every row must be written
        y = gx.run(0, sources, cp.asarray(x), xrow, wait=[ev], out=out)
        ref = reference(layer, experts, x[xrow])
        assert rel_err(y.get(), ref) < REL_ERR
    finally:
        gx.close()


def test_mixed_types_promote_and_combine(cp, rng, reference):
    from execute.gpu_experts import scratch_source

    layer = random_layer(rng, 1, num_experts=4, hidden=256, ffn=512, qtype=Q.Q4_K, down_qtype=Q.Q6_K, exact=False)
    other = random_layer(rng, 0, num_experts=4, hidden=256, ffn=512, qtype=Q.Q4_K, down_qtype=Q.Q6_K, exact=False)
    gx = make([other, layer], slots=2, pinned=False)  # staging path
    try:
        gx.begin_copies()
        k = gx.stream(1, 3)
        ev = gx.copies_event()
        x = cp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
        y1 = gx.run(1, [scratch_source(k)], x, [1], wait=[ev])
        gx.promote(1, k, 1)
        y2 = gx.run(1, [1, 1], x, [1, 0])
        ref = reference(layer, [3, 3], x.get()[[1, 0]])
        assert rel_err(y1.get(), ref[:1]) < REL_ERR and rel_err(y2.get(), ref) < REL_ERR
        w = np.array([[0.25, 0.75], [1.0, 0.0]], np.float32)
        pair_of = np.array([[0, 1], [1, -1]])
        out = gx.combine(y2, pair_of, w).get()
        want = np.stack([0.25 * ref[0] + 0.75 * ref[1], ref[1]])
        assert rel_err(out, want) < REL_ERR
    finally:
        gx.close()


def test_arena_is_the_capacity_budget(cp, rng):
    layers = [random_layer(rng, l, 8, 256, 256, Q.Q8_0, exact=False) for l in range(2)]
    gx = make(layers, slots=3)
    try:
        slot = -(-layers[0].expert_bytes // 256) * 256
        assert [a.nbytes for a in gx.arenas] == [3 * slot, 3 * slot]
        assert len(gx.registered) == 6 and gx.staging is None
    finally:
        gx.close()
