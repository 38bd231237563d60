"""The expert engine under the scheduler's driver: numpy (policy cpu) and GPU (every policy)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execute import quant as Q
from execute.engine import ExpertEngine, _pair_arrays, _pair_lists, gather_pairs
from execute.experts import ExecutorError, random_layer
from scheduler.core import Capacity, Decision, Geometry, Step, Token
from scheduler.drive import AwaitBackground, RunLayer, StartBackground, drive
from scheduler.policies import make_policy
from scheduler.profile import Profile

from .conftest import cupy_or_skip, spin

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS = 256, 256, 8, 2, 3


def scenario(rng, num_tokens=12, batch=(1, 1, 3)):
    """Layers, and tokens whose steps carry routing: {(token, layer): (ids (T, k), weights (T, k))}."""
    layers = [random_layer(rng, l, EXPERTS, HIDDEN, FFN, qt) for l, qt in enumerate((Q.Q8_0, Q.Q4_K, Q.Q6_K))]
    routing, tokens = {}, []
    for i in range(num_tokens):
        t = int(batch[i % len(batch)])
        steps = []
        for l in range(LAYERS):
            p = np.array([8, 6, 4, 2, 1, 1, 1, 1], float) / 24
            ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False, p=p) for _ in range(t)])
            w = rng.dirichlet(np.ones(TOP_K), size=t).astype(np.float32)
            routing[(i, l)] = (ids, w)
            order = list(dict.fromkeys(ids.reshape(-1).tolist()))
            counts = tuple(int((ids == e).sum()) for e in order)
            steps.append(Step(l, tuple(order), counts if t > 1 else None))
        tokens.append(Token(i, 0, i, "decode" if t == 1 else "prefill", tuple(steps), t))
    return layers, routing, tokens


def expected(layers, reference, ids, w, x):
    out = np.zeros((len(x), HIDDEN))
    for t in range(len(x)):
        y = reference(layers, list(ids[t]), np.repeat(x[t:t + 1], len(ids[t]), axis=0))
        out[t] = w[t].astype(np.float64) @ y
    return out


def replay(engine, policy, layers, routing, tokens, rng, xp=np):
    """Drive the policy; run every item on the engine; return (outputs, inputs) per RunLayer."""
    results = []
    for item in drive(policy, tokens):
        if isinstance(item, RunLayer):
            ids, w = routing[(item.token.index, item.step.layer)]
            x = rng.standard_normal((len(ids), HIDDEN)).astype(np.float32)
            out = engine.run_layer(item, xp.asarray(x), ids, w)
            results.append((item.step.layer, ids, w, x, out))
        elif isinstance(item, StartBackground):
            engine.start_background(item.moves)
        elif isinstance(item, AwaitBackground):
            engine.await_background(item.moves)
    return results


def check(results, layers, reference, tol=1e-4):
    for layer, ids, w, x, out in results:
        out = out.get() if hasattr(out, "get") else out
        ref = expected(layers[layer], reference, ids, w, x)
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) <= tol * np.linalg.norm(ref), f"layer {layer}"


def test_gather_pairs_orders_by_destination():
    step = Step(0, (5, 1, 3, 7))
    d = Decision(step, hits=(3,), uploads=(7,), slots=(0,), cpu=(5, 1))
    ids = np.array([[5, 3], [1, 5], [7, 3]])
    experts, tok, pair_of, n_gpu, gpu = gather_pairs(d, ids)
    assert experts.tolist() == [3, 3, 7, 5, 5, 1] and tok.tolist() == [0, 2, 2, 0, 1, 1]
    assert n_gpu == 3 and gpu.tolist() == [3, 7]
    assert (experts[pair_of] == ids).all() and (tok[pair_of] == np.arange(3)[:, None]).all()
    with pytest.raises(ExecutorError, match=r"layer 0: routed experts \[9\] are not in the decision"):
        gather_pairs(d, np.array([[9, 3]]))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pair_lists_match_numpy_path(data):
    """The list path (small steps, the GPU hot path) and the numpy path order pairs identically."""
    n_exp = data.draw(st.integers(2, 40))
    k = data.draw(st.integers(1, min(8, n_exp)))
    t = data.draw(st.integers(1, 6))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(t)])
    used = list(dict.fromkeys(ids.reshape(-1).tolist()))
    dest = rng.integers(0, 4, len(used))  # hits, uploads, streams, cpu
    part = [tuple(e for e, d in zip(used, dest) if d == i) for i in range(4)]
    d = Decision(Step(0, tuple(used)), hits=part[0], uploads=part[1], slots=tuple(range(len(part[1]))),
                 streams=part[2], cpu=part[3])
    experts, tok, pair_of, n_gpu, gpu = _pair_lists(d, ids)
    ref = _pair_arrays(d, ids)
    assert experts == ref[0].tolist() and tok == ref[1].tolist() and pair_of == ref[2].reshape(-1).tolist()
    assert n_gpu == ref[3] and list(gpu) == ref[4].tolist()
    got = gather_pairs(d, ids)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3] + got[4:], ref[:3] + ref[4:])) and got[3] == ref[3]


def test_gather_pairs_large_step_uses_numpy_path_consistently():
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(64, 8, replace=False) for _ in range(100)])  # 800 pairs > the list-path limit
    used = list(dict.fromkeys(ids.reshape(-1).tolist()))
    d = Decision(Step(0, tuple(used)), hits=tuple(used[::2]), cpu=tuple(used[1::2]))
    experts, tok, pair_of, n_gpu, _ = gather_pairs(d, ids)
    assert (experts[pair_of] == ids).all() and (tok[pair_of] == np.arange(100)[:, None]).all()
    assert n_gpu == int(np.isin(ids, used[::2]).sum()) and set(experts[:n_gpu].tolist()) == set(used[::2])
    with pytest.raises(ExecutorError, match=r"routed experts \[99\] are not in the decision"):
        gather_pairs(d, np.concatenate([ids, [[99] + list(ids[0, 1:])]]))


def test_cpu_policy_without_gpu(rng, reference):
    layers, routing, tokens = scenario(rng, num_tokens=6)
    geo = Geometry.uniform(LAYERS, EXPERTS, TOP_K, layers[0].expert_bytes)
    cap = Capacity.per_layer(geo, 4)
    engine = ExpertEngine(layers, cap, threads=2, use_gpu=False)
    try:
        results = replay(engine, make_policy("cpu", geo, cap), layers, routing, tokens, rng)
        check(results, layers, reference)
        assert engine.stats.cpu_pairs == sum(len(ids) * TOP_K for _, ids, *_ in results)
    finally:
        engine.close()


def test_gpu_work_without_gpu_is_a_clear_error(rng):
    layers, routing, tokens = scenario(rng, num_tokens=2)
    geo = Geometry.uniform(LAYERS, EXPERTS, TOP_K, layers[0].expert_bytes)
    cap = Capacity.per_layer(geo, 4)
    engine = ExpertEngine(layers, cap, threads=1, use_gpu=False)
    item = next(i for i in drive(make_policy("lru", geo, cap), tokens) if isinstance(i, RunLayer))
    ids, w = routing[(0, 0)]
    engine.begin_layer(0, np.zeros((len(ids), HIDDEN), np.float32), ids)  # no GPU: nothing to start
    assert engine.stats.early_pairs == 0
    with pytest.raises(ExecutorError, match="need a GPU"):
        engine.run_layer(item, np.zeros((len(ids), HIDDEN), np.float32), ids, w)
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["gpu", "lru", "freq-lru", "static", "hybrid", "belady", "cpu"])
def test_every_policy_on_gpu_matches_reference(policy, rng, reference):
    cp = cupy_or_skip()
    layers, routing, tokens = scenario(rng, num_tokens=16)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    cap = Capacity.per_layer(geo, EXPERTS if policy == "gpu" else 3)
    profile = Profile.from_counts(np.array([[8, 6, 4, 2, 1, 1, 1, 1]] * LAYERS, float), slots=3) if policy == "static" else None
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
    future = [s for t in tokens for s in t.steps] if policy == "belady" else None
    pol = make_policy(policy, geo, cap, profile=profile, future=future, **options)
    engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
    try:
        engine.load_residents(pol.cache.slot)
        results = replay(engine, pol, layers, routing, tokens, rng, xp=cp)
        engine.synchronize()
        check(results, layers, reference)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["hybrid", "cpu"])
def test_cpu_pairs_awaited_by_the_host_match_reference(policy, rng, reference, monkeypatch):
    """MOELAB_HANDOFF=0: one token's CPU pairs fetched, submitted and awaited by the host (the
    synchronized path; the default hands them off through mapped memory)."""
    monkeypatch.setenv("MOELAB_HANDOFF", "0")
    test_every_policy_on_gpu_matches_reference(policy, rng, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cpu", "lru", "hybrid"])
def test_inputs_copied_late_on_the_callers_stream(policy, rng, reference):
    """The caller's stream is kept busy before it queues each layer's input copy, and it reads each
    output at once: the engine's reads of x (the CPU pool's fetch, the kernels) wait
    for that copy, and the read of the output waits for the experts. (With the compute stream not
    ordered after the caller's, the pool got a stale x: errors as large as the output itself.)"""
    cp = cupy_or_skip()
    layers, routing, tokens = scenario(rng, num_tokens=8)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
    pol = make_policy(policy, geo, Capacity.per_layer(geo, 3), **options)
    engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
    results = []
    try:
        engine.load_residents(pol.cache.slot)
        for item in drive(pol, tokens):
            if isinstance(item, RunLayer):
                ids, w = routing[(item.token.index, item.step.layer)]
                x = rng.standard_normal((len(ids), HIDDEN)).astype(np.float32)
                spin(cp, 5.0)  # the copy below lands 5 ms after it is queued
                xd = cp.asarray(x)
                results.append((item.step.layer, ids, w, x, engine.run_layer(item, xd, ids, w).get()))
                del xd  # its memory is reused by the next input, in the caller's stream's order
            elif isinstance(item, StartBackground):
                engine.start_background(item.moves)
            elif isinstance(item, AwaitBackground):
                engine.await_background(item.moves)
        engine.synchronize()
    finally:
        engine.close()
    assert engine.stats.cpu_pairs > 0 if policy != "lru" else engine.stats.gpu_pairs > 0
    check(results, layers, reference)


def _replay_early(engine, policy, routing, tokens, early: bool, cp):
    """As ``replay``, with the inputs made where a forward pass makes them (before the driver plans
    the step) and ``begin_layer`` called there when ``early``: (decisions, outputs, inputs)."""
    from dataclasses import replace

    xrng = np.random.default_rng(11)
    cur = {}

    def steps(tok):
        for step in tok.steps:
            ids, _ = routing[(tok.index, step.layer)]
            cur["x"] = cp.asarray(xrng.standard_normal((len(ids), HIDDEN)).astype(np.float32))
            if early:
                engine.begin_layer(step.layer, cur["x"], ids)
            yield step

    decisions, results = [], []
    for item in drive(policy, (replace(t, steps=steps(t)) for t in tokens)):
        if isinstance(item, RunLayer):
            ids, w = routing[(item.token.index, item.step.layer)]
            out = engine.run_layer(item, cur["x"], ids, w)
            decisions.append(item.decision)
            results.append((item.step.layer, ids, w, cur["x"].get(), out))
        elif isinstance(item, StartBackground):
            engine.start_background(item.moves)
        elif isinstance(item, AwaitBackground):
            engine.await_background(item.moves)
    engine.synchronize()
    return decisions, results


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["gpu", "lru", "hybrid"])
def test_early_start_changes_neither_decisions_nor_outputs(policy, rng, reference):
    """begin_layer before each step's plan (as ``run`` calls it): the same decisions and bitwise
    the same outputs as without it, within the float64 reference; resident experts started early."""
    cp = cupy_or_skip()
    layers, routing, tokens = scenario(rng, num_tokens=16)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    cap = Capacity.per_layer(geo, EXPERTS if policy == "gpu" else 3)
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
    runs = {}
    for early in (False, True):
        pol = make_policy(policy, geo, cap, **options)
        engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
        try:
            engine.load_residents(pol.cache.slot)
            runs[early] = (*_replay_early(engine, pol, routing, tokens, early, cp), engine.stats.early_pairs)
        finally:
            engine.close()
    (d0, r0, e0), (d1, r1, e1) = runs[False], runs[True]
    assert d0 == d1 and e0 == 0 and e1 > 0
    check(r1, layers, reference)
    for a, b in zip(r0, r1):
        assert np.array_equal(a[3], b[3]) and np.array_equal(a[4].get(), b[4].get())


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_late_start_changes_neither_decisions_nor_outputs(policy, rng, reference, monkeypatch):
    """The early gate/up covering a step's uploads once their copy lands (MOELAB_LATE_START=1) against
    MOELAB_LATE_START=0: the same decisions and bitwise the same outputs; lru ran pairs late."""
    cp = cupy_or_skip()
    layers, routing, tokens = scenario(rng, num_tokens=16)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
    runs = {}
    for late in ("0", "1"):
        monkeypatch.setenv("MOELAB_LATE_START", late)
        pol = make_policy(policy, geo, Capacity.per_layer(geo, 3), **options)
        engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
        try:
            engine.load_residents(pol.cache.slot)
            runs[late] = (*_replay_early(engine, pol, routing, tokens, True, cp), engine.stats.late_pairs)
        finally:
            engine.close()
    (d0, r0, n0), (d1, r1, n1) = runs["0"], runs["1"]
    assert d0 == d1 and n0 == 0 and (n1 > 0 or policy != "lru")
    check(r1, layers, reference)
    for a, b in zip(r0, r1):
        assert np.array_equal(a[4].get(), b[4].get())


@pytest.mark.gpu
def test_one_token_path_checks_the_decision(rng, reference):
    """An early-started expert the decision uploads instead (a broken hits invariant) is run again
    from its new slot; a routed expert missing from the decision, or a hit never loaded, is an error."""
    cp = cupy_or_skip()
    layers, _, _ = scenario(rng, num_tokens=1)
    geo = Geometry((EXPERTS,) * LAYERS, TOP_K, tuple(l.expert_bytes for l in layers))
    engine = ExpertEngine(layers, Capacity.per_layer(geo, 3), threads=1, use_gpu=True)
    try:
        engine.load_residents({(0, 5): 0})
        ids, w = np.array([[5, 2]]), np.array([[0.75, 0.25]], np.float32)
        x = rng.standard_normal((1, HIDDEN)).astype(np.float32)
        xd = cp.asarray(x)
        step = Step(0, (5, 2))
        tok = Token(0, 0, 0, "decode", (step,))
        engine.begin_layer(0, xd, ids)
        assert engine.stats.early_pairs == 1
        out = engine.run_layer(RunLayer(tok, step, Decision(step, (), uploads=(5, 2), slots=(1, 2))), xd, ids, w)
        assert engine.slot_of[(0, 5)] == 1 and engine.slot_of[(0, 2)] == 2
        check([(0, ids, w, x, out)], layers, reference)
        with pytest.raises(ExecutorError, match=r"layer 0: routed experts \[2\] are not in the decision"):
            engine.run_layer(RunLayer(tok, step, Decision(step, (5,))), xd, ids, w)
        with pytest.raises(ExecutorError, match="hit on expert 7, which this engine never loaded"):
            engine.run_layer(RunLayer(tok, Step(0, (5, 7)), Decision(Step(0, (5, 7)), (5, 7))), xd,
                             np.array([[5, 7]]), w)
    finally:
        engine.close()


def test_run_begins_each_block_before_its_plan_and_keeps_the_decisions(tiny_weights):
    """``run`` hands each block's routing to a backend's ``begin_layer`` before the driver plans
    the step; the decision log is the same as with a backend that has none."""
    from execute import model as M
    from scheduler.audit import Audit

    weights = tiny_weights("Q8_0")
    geo = weights.info.geometry()
    events = []

    class Any(M.NumpyExperts):  # computes every expert on the host, whatever the decision
        def run_layer(self, item, x, ids, w):
            return self.compute(item.step, x, ids, w)

    class Early(Any):
        def begin_layer(self, layer, x, ids):
            assert x is model.last_input and ids is model.last_ids
            events.append(("begin", layer, tuple(ids[0].tolist())))

    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate([3, 17, 5, 29, 11])]
    digests = []
    for backend in (Any(weights), Early(weights)):
        events.clear()
        pol = make_policy("lru", geo, Capacity.per_layer(geo, geo.top_k))
        plan = pol.plan
        pol.plan = lambda step, plan=plan: (events.append(("plan", step.layer, step.experts)), plan(step))[1]
        model = M.MoeModel(weights)
        audit = Audit(geo, keep_log=True)
        M.run(model, backend, pol, inputs, audit=audit)
        digests.append(audit.digest())
    assert digests[0] == digests[1]
    moe = [l for l in range(geo.num_layers) if geo.num_experts[l]]
    assert [e[:2] for e in events] == [(kind, l) for _ in inputs for l in moe for kind in ("begin", "plan")]
    for begin, plan in zip(events[::2], events[1::2]):
        assert set(begin[2]) == set(plan[2])  # the routing begun is the step planned
