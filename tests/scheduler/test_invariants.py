"""Every policy, on random geometries, capacities and traces, keeps the cache invariants."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (MAX_FILLS_PER_TOKEN, Audit, CapacityError, Profile, RunLayer, StartBackground,
                       drive, make_policy, replay)

from .conftest import scenarios

ONLINE = ("cpu", "lru", "freq-lru", "static", "hybrid", "hybrid-cost")


def build(name, geometry, capacity, tokens, warm=False, **options):
    """``warm``: pre-populate from the oracle profile (as ``static`` always is)."""
    import numpy as np

    counts = np.zeros((geometry.num_layers, geometry.max_experts))
    for t in tokens:
        for s in t.steps:
            for e in s.experts:
                counts[s.layer, e] += 1
    profile = Profile.from_counts(counts) if (name == "static" or warm) and counts.any() else None
    if name == "static" and profile is None:
        profile = Profile(geometry.num_layers, geometry.max_experts, (), 0)
    future = [s for t in tokens for s in t.steps] if name == "belady" else None
    if name == "hybrid-cost":
        from scheduler import CostModel

        n = geometry.num_layers
        options["cost_model"] = CostModel((1e-5,) * n, (2e-6,) * n, (9e-5,) * n, (1e-5,) * n, (7e-5,) * n, 5e-6)
    return make_policy(name, geometry, capacity, profile=profile, future=future, **options)


def checked(policy, tokens, lag_tokens=1):
    """Drive ``policy`` and assert the invariants at every item; returns the hit count."""
    cache = policy.cache
    hits = 0
    for item in drive(policy, tokens, lag_tokens):
        cache.check()
        if type(item) is RunLayer:
            d, step = item.decision, item.step
            served = d.hits + d.uploads + d.streams + d.cpu
            assert sorted(served) == sorted(step.experts), "every routed expert served exactly once"
            assert len(d.uploads) == len(d.slots) and len(set(d.slots)) == len(d.slots)
            assert set(d.promotions) <= set(d.streams)
            for e in d.hits:  # hits were resident when the step started (uploads not yet complete)
                assert (step.layer, e) not in cache.inflight
            for e in d.uploads:  # uploaded now: in flight, so neither resident nor uploaded twice
                assert (step.layer, e) in cache.inflight
            for v in d.evictions:
                assert not (v[0] == step.layer and v[1] in step.experts), "evicted an expert the step uses"
                assert v not in cache.slot or cache.slot[v] != -1
            hits += len(d.hits)
        elif type(item) is StartBackground:
            fills = [m for m in item.moves if m.victim is None]
            assert len(fills) <= MAX_FILLS_PER_TOKEN
            for m in item.moves:
                assert (m.layer, m.expert) in cache.inflight
        for p, (layers, size) in enumerate(policy.capacity.pools):
            assert sum(1 for k in cache.owner[p] if k is not None) <= size
    cache.check()
    assert not cache.inflight, "every copy completed by the end"
    return hits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(batches=True), st.sampled_from(ONLINE + ("belady", "predict")), st.integers(0, 2))
def test_invariants_hold(scenario, name, lag):
    geometry, capacity, tokens = scenario
    try:
        policy = build(name, geometry, capacity, tokens)
    except CapacityError:
        assert name in ("lru", "freq-lru", "predict")
        return
    checked(policy, tokens, lag)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_belady_is_the_ceiling(scenario):
    geometry, capacity, tokens = scenario
    for warm in (False, True):  # static always starts warm: compare it with a warm Belady
        best = checked(build("belady", geometry, capacity, tokens, warm=warm), tokens, 0)
        for name in ONLINE:
            if (name == "static") != warm and name != "cpu":
                continue
            try:
                policy = build(name, geometry, capacity, tokens, warm=warm)
            except CapacityError:
                continue
            assert checked(policy, tokens, 0) <= best, (name, warm)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(batches=True), st.sampled_from(ONLINE + ("belady", "predict")))
def test_same_inputs_same_decision_log(scenario, name):
    geometry, capacity, tokens = scenario
    digests = []
    for _ in range(2):
        try:
            policy = build(name, geometry, capacity, tokens)
        except CapacityError:
            return
        digests.append(replay(policy, tokens, audit=Audit(geometry, keep_log=True)).digest())
    assert digests[0] == digests[1]


def test_gpu_policy_is_all_hits():
    from scheduler import Capacity, Geometry

    from .conftest import make_tokens

    g = Geometry.uniform(2, 6, 2, 10)
    tokens = make_tokens(20, g.num_experts, 2, 0)
    s = replay(make_policy("gpu", g, Capacity.per_layer(g, 6)), tokens).summary()
    assert s["hit_rate"] == 1.0 and s["upload_bytes"] == 0
    with pytest.raises(CapacityError):
        make_policy("gpu", g, Capacity.per_layer(g, 5))
