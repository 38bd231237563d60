"""GPU expert kernels, uploads, streams and promotions against gguf's dequantizer (needs CUDA)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import ACTIVATIONS, random_layer
from scheduler.core import Capacity, Geometry

from .conftest import biased, biased_reference, cupy_or_skip, spin

pytestmark = pytest.mark.gpu

ALL = sorted(Q.QTYPES)
REL_ERR = 1e-5  # exact dequantization, float32 accumulation (same bound as the CPU kernels)


@pytest.fixture
def cp():
    cp = cupy_or_skip()
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


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("pinned", (True, False), ids=("pinned", "staged"))
def test_biased_experts_match_float64(activation, pinned, cp, rng):
    """gpt-oss experts: each expert's float32 biases travel with it (slot, scratch, promotion) and
    the kernels add them and apply the activation, clamps included."""
    from execute.gpu_experts import scratch_source

    layer = biased(random_layer(rng, 0, num_experts=5, hidden=256, ffn=512, qtype=Q.Q8_0), rng, activation)
    assert layer.expert_bytes == layer.bias_bytes + 3 * 256 * 512 // 32 * 34
    gx = make([layer], slots=2, pinned=pinned)
    try:
        gx.begin_copies()
        gx.upload(0, 3, 1)
        k = gx.stream(0, 0)
        ev = gx.copies_event()
        experts = [3, 0, 3, 3, 0]
        x = (rng.standard_normal((len(experts), 256)) * 6.0).astype(np.float32)  # gate/up often beyond +-7
        ref, cut = biased_reference(layer, experts, x)
        assert activation == "silu" or cut > 0.05  # the clamps are exercised
        src = {3: 1, 0: scratch_source(k)}
        y = gx.run(0, [src[e] for e in experts], cp.asarray(x), list(range(len(experts))), wait=[ev])
        assert rel_err(y.get(), ref) < REL_ERR
        gx.promote(0, k, 0)
        y2 = gx.run(0, [0, 1], cp.asarray(x[:2]), [1, 0])
        assert rel_err(y2.get(), ref[[1, 0]]) < REL_ERR
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


def test_run_waits_for_the_callers_stream_and_the_caller_for_it(cp, rng, reference):
    """x copied late on the caller's stream (busy 5 ms) is read only once there; an output the
    compute stream writes late (busy 20 ms) is read on the caller's stream only once written."""
    layer = random_layer(rng, 0, num_experts=3, hidden=256, ffn=512, qtype=Q.Q8_0)
    gx = make([layer], slots=3)
    try:
        gx.begin_copies()
        gx.upload(0, 2, 0)
        ev = gx.copies_event()
        for late in ("input", "output") * 2:
            x = rng.standard_normal((2, 256)).astype(np.float32)
            if late == "input":
                spin(cp, 5.0)
            xd = cp.asarray(x)
            if late == "output":
                spin(cp, 20.0, gx.compute)
            y = gx.run(0, [0, 0], xd, [0, 1], wait=[ev]).get()
            assert rel_err(y, reference(layer, [2, 2], x)) < REL_ERR, late
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


def test_layer_meta_groups_rounds_and_cpu_rows(cp, rng, reference):
    """The engine's per-layer path: one metadata copy, kernels over groups in two launches (as in
    two rounds), CPU rows put through the pinned staging, then the combine."""
    from execute.gpu_experts import scratch_source

    layer = random_layer(rng, 0, num_experts=6, hidden=256, ffn=512, qtype=Q.Q4_0, down_qtype=Q.Q8_0)
    gx = make([layer], slots=3)
    try:
        gx.begin_copies()
        for e, s in [(2, 0), (0, 1)]:
            gx.upload(0, e, s)
        k = gx.stream(0, 5)
        gx.compute_after_copies()
        # tokens 0, 1, 2 with top-2: pairs grouped by expert (2: t0 t2 | 0: t1 | 5: t0 t1 | cpu 3: t2)
        experts, xrow = [2, 2, 0, 5, 5, 3], [0, 2, 1, 0, 1, 2]
        ids = np.array([[2, 5], [0, 5], [3, 2]])
        pair_of = np.array([[0, 3], [2, 4], [5, 1]])
        w = rng.dirichlet(np.ones(2), size=3).astype(np.float32)
        bases = [gx.source_ptr(0, s) for s in (0, 1, scratch_source(k))]
        meta = gx.layer_meta(bases, [0, 2, 3, 5], xrow[:5], pair_of.reshape(-1).tolist(), w.reshape(-1).tolist(), 2)
        y = gx.pair_outputs(0, 6)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        with gx.compute:  # the compute stream does not wait for the legacy default stream
            y[...] = cp.nan  # poisoned: every row must be written
            dx = gx.as_input(cp.asarray(x))
        gx.run_groups(0, meta, 0, 2, dx, 6)
        gx.run_groups(0, meta, 2, 3, dx, 6)
        xin, cpu_out = gx.cpu_buffers(1, 256)
        cpu_out[:] = reference(layer, [3], x[[2]])
        gx.put_rows(y, 5, cpu_out)
        out = gx.combine_meta(meta, y)
        gx.to_caller()  # the low-level calls leave the caller's stream to the caller
        out = out.get()
        ref_pairs = reference(layer, experts, x[xrow])
        assert rel_err(y.get(), ref_pairs) < REL_ERR
        want = np.einsum("tk,tkh->th", w.astype(np.float64), ref_pairs[pair_of])
        assert rel_err(out, want) < REL_ERR
        assert (np.array(experts)[pair_of] == ids).all()
    finally:
        gx.close()


def test_launch_checks_argument_count(cp, rng):
    from execute.gpu_experts import Launch, _kernel

    with pytest.raises(ValueError, match="3 arguments, expected 6"):
        Launch(_kernel("moe_combine"), 6)((1, 1), 32, 0, 1, 2, 3)


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_one_token_kernels_match_reference(qtype, cp, rng, reference):
    """moe1_gate_up over two picks (hits first, then an upload), moe1_down_combine summing the
    router-weighted pairs; a repeated expert (a padded route) counts once per pair."""
    layer = random_layer(rng, 0, num_experts=6, hidden=512, ffn=768, qtype=qtype)
    gx = make([layer], slots=4)
    try:
        gx.begin_copies()
        for e, s in [(4, 0), (1, 2), (5, 3)]:
            gx.upload(0, e, s)
        gx.compute_after_copies()
        experts, slots = [1, 4, 5, 1], [2, 0, 3, 2]
        w = np.array([0.5, 0.25, 0.125, 0.0], np.float32)
        x = rng.standard_normal((1, 512)).astype(np.float32)
        bases = [gx.source_ptr(0, s) for s in slots]
        xd = cp.asarray(x)
        gx.after_caller()  # gate_up1 reads x on the compute stream
        gx.pack1(bases, [], [0, 1, 3])
        gx.gate_up1(0, xd, 4, 3)
        gx.pack1(bases, w.tolist(), [2])
        gx.gate_up1(0, xd, 4, 1)
        out = gx.down_combine1(0, 4)
        gx.to_caller()
        ref = w.astype(np.float64) @ reference(layer, experts, np.repeat(x, 4, axis=0))
        assert out.shape == (1, 512) and rel_err(out.get()[0], ref) < REL_ERR
    finally:
        gx.close()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_one_token_kernels_add_biases(activation, cp, rng):
    layer = biased(random_layer(rng, 0, num_experts=5, hidden=256, ffn=512, qtype=Q.Q8_0), rng, activation)
    gx = make([layer], slots=2)
    try:
        gx.begin_copies()
        gx.upload(0, 3, 1)
        gx.upload(0, 0, 0)
        gx.compute_after_copies()
        x = (rng.standard_normal((1, 256)) * 6.0).astype(np.float32)
        ref, _ = biased_reference(layer, [0, 3], np.repeat(x, 2, axis=0))
        w = np.array([0.75, 0.25], np.float32)
        gx.pack1([gx.source_ptr(0, 0), gx.source_ptr(0, 1)], w.tolist(), [0, 1])
        xd = cp.asarray(x)
        gx.after_caller()
        gx.gate_up1(0, xd, 2, 2)
        out = gx.down_combine1(0, 2)
        gx.to_caller()
        assert rel_err(out.get()[0], w.astype(np.float64) @ ref) < REL_ERR
    finally:
        gx.close()
