"""The Numba CPU expert kernels and pool against gguf's dequantizer and a float64 matmul."""
from __future__ import annotations

import dataclasses
import functools
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execute import cpu_pool
from execute import quant as Q
from execute.cpu_experts import run_experts
from execute.cpu_pool import CpuExpertPool
from execute.experts import ACTIVATIONS, ExecutorError, random_layer

from .conftest import biased, biased_reference

ALL = sorted(Q.QTYPES)
FLOATS = (Q.F32, Q.F16, Q.BF16)
# relative error bound (norm of the error / norm of the reference): float weights are dotted with
# float32 inputs (exact dequantization, float32 accumulation: ~1e-7); quantized weights with two
# int8 levels of the inputs (|error| <= scale / 512 per input: ~5e-5 measured on 8 experts, NMSE
# ~2e-9, well inside NMSE 1e-4; one expert's output, where the products cancel more, up to 3.2e-4:
# Q4_K, hidden 768, ffn 512, found by the property test below, the same before and after the
# kernels' staged dots)
REL_ERR = 1e-5
REL_ERR_INT8 = 5e-4


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def bound(*qtypes):
    return REL_ERR if all(t in FLOATS for t in qtypes) else REL_ERR_INT8


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_kernels_match_reference(qtype, rng, reference):
    layer = random_layer(rng, 3, num_experts=6, hidden=512, ffn=256, qtype=qtype)
    experts = [4, 1, 4, 0, 5, 4, 2]  # repeated experts: several tokens share one weight read
    x = rng.standard_normal((len(experts), 512)).astype(np.float32)
    y = run_experts(layer, experts, x, threads=2)
    assert y.shape == (7, 512) and y.dtype == np.float32
    assert rel_err(y, reference(layer, experts, x)) < bound(qtype)


# odd block counts (the kernels reshape rows into blocks and read x's 32-column sums), and float
# rows that are not a whole number of 32-column blocks
ODD_SHAPES = {Q.Q4_K: (768, 256), Q.Q6_K: (256, 768), Q.Q8_0: (96, 160), Q.Q4_0: (160, 96),
              Q.F32: (40, 24), Q.F16: (24, 40), Q.BF16: (40, 8),
              Q.MXFP4: (96, 160)}  # MXFP4: 3-block rows of 51 bytes, so odd rows start at odd addresses


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_odd_shapes_and_single_token_groups(qtype, rng, reference):
    hidden, ffn = ODD_SHAPES[qtype]
    layer = random_layer(rng, 4, num_experts=3, hidden=hidden, ffn=ffn, qtype=qtype)
    experts = [2, 0, 1]
    x = (rng.standard_normal((3, hidden)) * [[1.0], [1e-3], [30.0]]).astype(np.float32)  # scales differ per row
    assert rel_err(run_experts(layer, experts, x, threads=1), reference(layer, experts, x)) < bound(qtype)


@pytest.mark.parametrize("qtype, down", [(Q.Q4_K, Q.Q6_K), (Q.MXFP4, Q.MXFP4)], ids=("Q4_K+Q6_K", "MXFP4"))
def test_mixed_types_and_fast_random_blocks(qtype, down, rng, reference):
    layer = random_layer(rng, 0, num_experts=4, hidden=256, ffn=512, qtype=qtype, down_qtype=down, exact=False)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert rel_err(run_experts(layer, [3, 0, 2], x), reference(layer, [3, 0, 2], x)) < bound(qtype, down)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.MXFP4), ids=("Q8_0", "Q4_K", "MXFP4"))
def test_biases_and_activations_match_float64(activation, qtype, rng):
    layer = biased(random_layer(rng, 2, num_experts=5, hidden=256, ffn=256, qtype=qtype), rng, activation)
    experts = [3, 0, 3, 4, 1, 3]
    x = (rng.standard_normal((len(experts), 256)) * 6.0).astype(np.float32)  # gate/up often beyond +-7
    ref, cut = biased_reference(layer, experts, x)
    assert activation == "silu" or cut > 0.05  # the clamps are exercised
    y = run_experts(layer, experts, x, threads=2)
    assert rel_err(y, ref) < bound(qtype)
    plain = dataclasses.replace(layer, gate_bias=None, up_bias=None, down_bias=None, activation="silu")
    assert rel_err(run_experts(plain, experts, x, threads=1), ref) > 1e-2  # biases and activation matter


def test_bias_fields_validated(rng):
    layer = random_layer(rng, 0, 2, 64, 32, Q.Q8_0)
    ok = np.zeros((2, 32), np.float32)
    with pytest.raises(ValueError, match="all given or all None"):
        dataclasses.replace(layer, gate_bias=ok)
    with pytest.raises(ValueError, match=r"down_bias must be C-contiguous float32 \(2, 64\)"):
        dataclasses.replace(layer, gate_bias=ok, up_bias=ok, down_bias=ok)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        dataclasses.replace(layer, activation="gelu")


def test_bad_input(rng):
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0)
    with pytest.raises(ValueError, match=r"layer 0: x has shape \(1, 128\), expected \(1, 256\)"):
        run_experts(layer, [0], np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="expert ids must be in 0..1"):
        run_experts(layer, [2], np.zeros((1, 256), np.float32))
    assert run_experts(layer, [], np.zeros((0, 256), np.float32)).shape == (0, 256)


def test_pool_runs_in_background(rng, reference):
    layer = random_layer(rng, 1, 4, 256, 256, Q.Q8_0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    with CpuExpertPool(threads=2, timeout_s=60) as pool:
        jobs = [pool.submit(layer, [i, 3 - i, 0, 1], x) for i in range(3)]
        for i, job in enumerate(jobs):
            assert rel_err(job.result(), reference(layer, [i, 3 - i, 0, 1], x)) < REL_ERR_INT8


def test_a_pool_compiles_the_row_kernels_of_its_layers_types_alone(rng, monkeypatch):
    """Each type's row kernel is compiled (or loaded from Numba's cache) on its own, when a layer of
    that type is first submitted: a Q8_0 + Q6_K layer asks for those two, not the whole family;
    warmup readies the types of the other layers it is given as well."""
    from execute import cpu_experts

    monkeypatch.setattr(cpu_experts, "_KERNELS", {})
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0, down_qtype=Q.Q6_K)
    with CpuExpertPool(threads=1, timeout_s=60) as pool:
        pool.submit(layer, [1], np.ones((1, 256), np.float32)).result()
        assert sorted(cpu_experts._KERNELS) == sorted((Q.Q8_0, Q.Q6_K))
        pool.warmup(layer, [random_layer(rng, 1, 2, 256, 256, Q.Q4_K)])
    assert sorted(cpu_experts._KERNELS) == sorted((Q.Q8_0, Q.Q6_K, Q.Q4_K))


def test_pool_failure_is_an_error_not_an_abort(rng):
    layer = random_layer(rng, 2, 2, 256, 256, Q.Q8_0)
    with CpuExpertPool(threads=1) as pool:
        job = pool.submit(layer, [0], np.zeros((1, 64), np.float32))
        with pytest.raises(ExecutorError, match="layer 2: CPU experts failed"):
            job.result()
        assert pool.submit(layer, [1], np.ones((1, 256), np.float32)).result().shape == (1, 256)


def test_pool_stall_times_out(rng):
    layer = random_layer(rng, 5, 2, 256, 256, Q.Q8_0)
    pool = CpuExpertPool(threads=1, timeout_s=0.2)
    pool._ctrl[cpu_pool._C_HOLD] = 1  # the team's leader waits before its next call: a stall
    job = pool.submit(layer, [0], np.ones((1, 256), np.float32))
    with pytest.raises(ExecutorError, match="layer 5: CPU experts did not finish within 0.2 s"):
        job.result()
    with pytest.raises(ExecutorError, match="CPU expert pool is unusable"):
        pool.submit(layer, [0], np.ones((1, 256), np.float32))
    pool._ctrl[cpu_pool._C_HOLD] = 0
    pool.close()


def test_pool_matches_run_experts_and_writes_in_place(rng):
    """The team and the OpenMP path run the same phases; ``out`` is the result, not a copy; the
    job's clock stamps are ordered; bad expert ids are reported by result()."""
    layer = random_layer(rng, 0, 6, 96, 256, Q.Q8_0, down_qtype=Q.Q6_K)
    experts = [5, 0, 5]
    x = rng.standard_normal((3, 96)).astype(np.float32)
    want = run_experts(layer, experts, x, threads=3)
    with CpuExpertPool(threads=2, timeout_s=60) as pool:  # x's 9 blocks quantized in shares of 4 and 5
        out = np.full((3, 96), np.nan, np.float32)
        job = pool.submit(layer, experts, x, out=out)
        assert job.result() is out
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert job.submitted_s <= job.started_s <= job.finished_s <= job.collected_s
        assert job.compute_s == job.finished_s - job.started_s > 0
        bad = pool.submit(layer, [6], x[:1])
        with pytest.raises(ExecutorError, match="expert ids must be in 0..5"):
            bad.result()
        assert pool.submit(layer, [], x[:0]).result().shape == (0, 96)


def test_pool_queues_more_calls_than_its_ring(rng, reference):
    layer = random_layer(rng, 1, 4, 256, 256, Q.Q8_0)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    with CpuExpertPool(threads=2, timeout_s=60, spin_us=0) as pool:
        jobs = [pool.submit(layer, [k % 4, (k + 1) % 4], x) for k in range(2 * cpu_pool._RING + 3)]
        for k, job in enumerate(jobs):
            assert rel_err(job.result(), reference(layer, [k % 4, (k + 1) % 4], x)) < REL_ERR_INT8



def test_the_caller_takes_a_share_and_the_workers_need_no_caller(rng, reference, monkeypatch):
    """A team that would take every core leaves the caller one; result() takes part in the call
    (here the only hand: the workers exit at once), and a call nobody collects still runs."""
    import os
    import time

    cores = os.cpu_count() or 1
    assert CpuExpertPool(threads=cores).workers == max(cores - 1, 1)
    assert cores == 1 or CpuExpertPool(threads=cores - 1).workers == cores - 1
    layer = random_layer(rng, 4, 4, 256, 256, Q.Q8_0)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    ids = [3, 1, 1, 0, 2, 3, 3, 1]
    def leaves(*args):
        return None

    leaves.compile = cpu_pool._team_worker.compile  # the pool compiles the team's loop before starting it
    monkeypatch.setattr(cpu_pool, "_team_worker", leaves)
    with CpuExpertPool(threads=2, timeout_s=60, spin_us=0) as pool:
        jobs = [pool.submit(layer, ids[k:] + ids[:k], x) for k in range(3)]
        assert all(w.join(10) or not w.is_alive() for w in pool._workers)
        assert not jobs[0].done()  # no worker left: nothing ran
        for k in (2, 0, 1):  # collecting the last one runs the earlier ones first
            assert rel_err(jobs[k].result(), reference(layer, ids[k:] + ids[:k], x)) < REL_ERR_INT8
    monkeypatch.undo()
    with CpuExpertPool(threads=2, timeout_s=60, spin_us=0) as pool:
        jobs = [pool.submit(layer, ids[k:] + ids[:k], x, track=True) for k in range(3)]
        t0 = time.perf_counter()
        while not all(j.poll() for j in jobs) and time.perf_counter() - t0 < 30:
            time.sleep(0.001)
        assert all(j.done() and j.started_s <= j.finished_s for j in jobs)
        for k, job in enumerate(jobs):
            assert rel_err(job.result(), reference(layer, ids[k:] + ids[:k], x)) < REL_ERR_INT8


# Shapes for the property test: (hidden, ffn) multiples of each type's block
BLOCK = {t: (256 if t in (Q.Q4_K, Q.Q6_K) else 32 if t not in FLOATS else 8) for t in ALL}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(qtype=st.sampled_from(ALL), down=st.sampled_from(ALL), hb=st.integers(1, 3), fb=st.integers(1, 3),
       experts=st.lists(st.integers(0, 3), min_size=0, max_size=9), chunks=st.integers(1, 7),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), seed=st.integers(0, 2**16))
def test_any_shape_pairs_and_chunking_match_float64(qtype, down, hb, fb, experts, chunks, scale, seed, reference):
    """Any block-multiple shape, pair list (repeats, empty), input scale and chunk count (rows
    that do not divide it): within the error bound of the types involved."""
    block = max(BLOCK[qtype], BLOCK[down])
    hidden, ffn = hb * block, fb * block
    r = np.random.default_rng(seed)
    layer = random_layer(r, 0, num_experts=4, hidden=hidden, ffn=ffn, qtype=qtype, down_qtype=down, exact=False)
    x = (r.standard_normal((len(experts), hidden)) * scale).astype(np.float32)
    y = run_experts(layer, experts, x, threads=chunks)
    assert y.shape == (len(experts), hidden)
    if experts:
        assert rel_err(y, reference(layer, experts, x)) < bound(qtype, down)


@functools.cache
def _phase_chunks():
    from numba import njit

    return njit(lambda job, phase: cpu_pool._phase_chunks(job, phase))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 70), groups=st.integers(1, 8), hidden=st.sampled_from([32, 256, 2048]),
       ffn=st.sampled_from([32, 96, 768]), hands=st.integers(1, 16))
def test_every_call_has_a_chunk_that_publishes_it(n, groups, hidden, ffn, hands):
    """A pool call's chunks per phase: one grouping chunk; a quantize or gate+up phase none exactly
    when it has no work (a call without pairs crosses one barrier); the last phase (down) at least
    one, since the hand that finishes its last chunk publishes the call (none: it would never
    finish); no phase more than a hand's share of chunks allows."""
    chunks = _phase_chunks()
    job = np.zeros(cpu_pool._RING_FIELDS, np.int64)
    ng = min(groups, n)
    job[cpu_pool.J_N], job[cpu_pool.J_HIDDEN], job[cpu_pool.J_FFN] = n, hidden, ffn
    job[cpu_pool.J_NG], job[cpu_pool.J_HANDS] = ng, hands
    c = [chunks(job, phase) for phase in range(cpu_pool._PHASES)]
    assert c[0] == 1 and c[4] >= 1
    assert (c[1] > 0, c[2] > 0, c[3] > 0) == (n > 0, ng > 0, n > 0)
    assert max(c[1], c[3]) <= hands and max(c[2], c[4]) <= 16 * hands


def test_pool_config_validated():
    with pytest.raises(ValueError, match="threads: 0"):
        CpuExpertPool(threads=0)
    with pytest.raises(ValueError, match="timeout_s"):
        CpuExpertPool(threads=1, timeout_s=0)


def test_device_offsets_and_misaligned_layouts(rng):
    """GPU slots hold [biases] | gate | up | down: offsets, and a clear error where a projection
    after an odd-sized MXFP4 one would break the kernels' 16-bit loads."""
    ok = random_layer(rng, 0, num_experts=2, hidden=32, ffn=33, qtype=Q.MXFP4, down_qtype=Q.F16)
    g = ok.gate.expert_bytes  # 33 rows of one 17-byte block: odd
    assert g == 561 and ok.device_offsets() == (0, g, 2 * g)
    lb = biased(random_layer(rng, 0, num_experts=2, hidden=64, ffn=32, qtype=Q.Q8_0), rng, "swiglu_oai")
    assert lb.device_offsets()[0] == lb.bias_bytes == 4 * (2 * 32 + 64)
    bad = random_layer(rng, 0, num_experts=2, hidden=32, ffn=33, qtype=Q.MXFP4, down_qtype=Q.F32)
    with pytest.raises(ValueError, match=r"F32 would start at byte 1122 .*not 4-byte aligned"):
        bad.device_offsets()


def test_a_dropped_pool_stops_its_team(rng):
    """A pool garbage-collected without close(): its team finishes the published call and exits."""
    import gc

    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0)
    pool = CpuExpertPool(threads=2, timeout_s=60, spin_us=0)
    pool.submit(layer, [0, 1], np.ones((2, 256), np.float32))  # result never collected
    workers = list(pool._workers)
    del pool
    gc.collect()
    for w in workers:
        w.join(10)
    assert not any(w.is_alive() for w in workers)


def test_pool_spin_default_follows_the_environment(monkeypatch):
    """MOELAB_POOL_SPIN_US sets the workers' spin; unset, a team that leaves the caller a core
    spins 2 ms, else 100 us; a value that is no number is an error naming the variable."""
    from execute.cpu_pool import _default_spin_us

    monkeypatch.delenv("MOELAB_POOL_SPIN_US", raising=False)
    assert _default_spin_us(True) == 2000.0 and _default_spin_us(False) == 100.0
    monkeypatch.setenv("MOELAB_POOL_SPIN_US", "350")
    assert _default_spin_us(True) == _default_spin_us(False) == 350.0
    monkeypatch.setenv("MOELAB_POOL_SPIN_US", "fast")
    with pytest.raises(ValueError, match="MOELAB_POOL_SPIN_US"):
        _default_spin_us(True)


def test_gated_call_waits_for_its_gate(rng, reference):
    """A gated call reads its input only once ctrl[_C_GATE] reaches its number (a GPU kernel
    writes it in the hand-off; here the test does); the first worker through stamps gate_s."""
    import time

    layer = random_layer(rng, 3, 4, 256, 256, Q.Q8_0)
    x = np.zeros((2, 256), np.float32)
    want_x = rng.standard_normal((2, 256)).astype(np.float32)
    with CpuExpertPool(threads=2, timeout_s=60, spin_us=50) as pool:
        pool.warmup(layer)
        job = pool.submit(layer, [1, 2], x, gated=True, track=True)
        time.sleep(0.05)  # the team holds the call (spins, then naps) until the gate
        assert not job.done() and not job.poll()
        x[:] = want_x  # the input is written, then the gate, as handoff_put does
        pool.ctrl[cpu_pool._C_GATE] = job._seq
        assert rel_err(job.result(), reference(layer, [1, 2], want_x)) < REL_ERR_INT8
        assert job.submitted_s < job.gate_s <= job.finished_s and job.poll()
        with pytest.raises(ExecutorError, match="expert ids must be in 0..3"):
            pool.submit(layer, [4], x[:1], gated=True)  # a gated call that cannot run raises at once


def test_broken_pool_opens_its_gates(rng):
    """A pool marked broken (``fail``, as a GPU wait that gave up does) releases calls waiting
    for a gate that will never come, so close() does not wait for them."""
    layer = random_layer(rng, 3, 2, 256, 256, Q.Q8_0)
    pool = CpuExpertPool(threads=2, timeout_s=60, spin_us=0)
    job = pool.submit(layer, [0], np.ones((1, 256), np.float32), gated=True)
    err = pool.fail("layer 3: the GPU stopped waiting")
    assert isinstance(err, ExecutorError) and "layer 3" in str(err)
    job.result()  # the call ran (on whatever its input held) and finished
    with pytest.raises(ExecutorError, match="CPU expert pool is unusable: layer 3"):
        pool.submit(layer, [0], np.ones((1, 256), np.float32))
    pool.close()


def test_pool_over_external_counters(rng, reference):
    """The counters may be given (the hand-off's mapped memory): checked, zeroed, used in place."""
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0)
    with pytest.raises(ValueError, match="ctrl"):
        CpuExpertPool(threads=1, ctrl=np.zeros(8, np.int64))
    ctrl = np.full(cpu_pool.CTRL_WORDS, 7, np.int64)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    with CpuExpertPool(threads=1, ctrl=ctrl) as pool:
        assert pool.ctrl is ctrl
        assert rel_err(pool.submit(layer, [1], x).result(), reference(layer, [1], x)) < REL_ERR_INT8
        assert ctrl[cpu_pool._C_DONE] == 1
