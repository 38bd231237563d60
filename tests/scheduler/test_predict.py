"""``predict``: cache invariants, side-effect-free planning, no look-ahead, and its forecast
against a tiny reference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scheduler import Audit, Capacity, CapacityError, Geometry, Step, Token, make_policy, replay

from .conftest import make_tokens, scenarios
from .test_invariants import checked

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPTIONS = st.fixed_dictionaries({"bypass": st.booleans(), "max_prefetch": st.integers(0, 4),
                                 "prefetch_margin": st.sampled_from([0.05, 0.25, 1.0]),
                                 "admit_margin": st.sampled_from([0.0, 0.2]),
                                 "misses": st.sampled_from(["gpu", "cpu"])})


def build(geometry, capacity, **options):
    try:
        return make_policy("predict", geometry, capacity, **options)
    except CapacityError:
        assume(False)


@settings(max_examples=80, **SETTINGS)
@given(scenarios(batches=True), OPTIONS, st.integers(0, 2))
def test_invariants_hold_with_any_options(scenario, options, lag):
    geometry, capacity, tokens = scenario
    checked(build(geometry, capacity, **options), tokens, lag)


@settings(max_examples=40, **SETTINGS)
@given(scenarios(), OPTIONS)
def test_planning_has_no_side_effects(scenario, options):
    """Planning a step or a prefetch twice, at every point of a replay, gives the same answer and
    leaves residency and statistics alone."""
    geometry, capacity, tokens = scenario
    policy = build(geometry, capacity, **options)
    def snapshot():
        arrays = (policy.freq_stored, policy.trans, policy.seen, policy.cross, policy.cseen)
        return policy.residents(), list(policy.scale), [a.copy() for a in arrays]

    def same(a, b):
        return a[:2] == b[:2] and all(np.array_equal(x, y) for x, y in zip(a[2], b[2]))

    for tok in tokens:
        for step in tok.steps:
            before = snapshot()
            d = policy.plan(step)
            assert policy.plan(step) == d
            assert same(snapshot(), before)
            policy.commit(d)
            for e in d.uploads:
                policy.complete(step.layer, e)
            before = snapshot()
            moves = policy.plan_prefetch(step)
            assert policy.plan_prefetch(step) == moves
            assert same(snapshot(), before)
            policy.commit_background(moves)
            for m in moves:
                policy.complete(m.layer, m.expert)
        policy.commit_background(policy.plan_background())


@settings(max_examples=40, **SETTINGS)
@given(scenarios(), st.integers(1, 39))
def test_decisions_never_depend_on_later_steps(scenario, cut):
    """The decision log of the first ``cut`` tokens is the same whatever follows them."""
    geometry, capacity, tokens = scenario
    assume(cut < len(tokens))
    logs = []
    for part in (tokens[:cut], tokens):
        audit = replay(build(geometry, capacity), part, audit=Audit(geometry, keep_log=True))
        logs.append(audit.log)
    n = len(logs[0])
    assert logs[1][:n] == logs[0]


def test_forecast_matches_a_reference():
    """Counts, decay, the prior and persistence by hand on a 1-layer, 4-expert, top-2 trace."""
    g = Geometry.uniform(1, 4, 2)
    policy = make_policy("predict", g, Capacity.per_layer(g, 4), memory=4.0, prior=0.5, persist=3.0,
                         max_prefetch=0)
    seq = [(0, 1), (1, 2), (0, 1), (2, 3)]
    keep = 0.75
    freq, trans, seen, prev = np.zeros(4), np.zeros((4, 4)), np.zeros(4), None
    for ex in seq:
        d = policy.plan(Step(0, ex))
        policy.commit(d)
        for e in d.uploads:
            policy.complete(0, e)
        policy.commit_background(())  # the token's end: the step is learnt
        freq = freq * keep
        freq[list(ex)] += 0.25
        if prev is not None:
            trans, seen = trans * keep, seen * keep
            for a in prev:
                seen[a] += 1
                for b in ex:
                    trans[a, b] += 1
        prev = ex
    want = np.mean([(trans[a] + 0.5 * (freq + 3.0 * (np.arange(4) == a))) / (seen[a] + 0.5) for a in (2, 3)],
                   axis=0)
    np.testing.assert_allclose(policy.forecast(0, policy.prev[0]), want)
    np.testing.assert_allclose(policy.forecast(0, (2, 3)), want)
    np.testing.assert_allclose(policy.frequency(0), freq)


def test_statistics_survive_rescaling():
    """Thousands of steps: the stored statistics are rescaled before they overflow, and the
    forecast stays the decayed one (a one-expert layer always routes expert 0: freq -> 1)."""
    g = Geometry.uniform(1, 2, 1)
    policy = make_policy("predict", g, Capacity.per_layer(g, 1), memory=2.0, persist=0.0, max_prefetch=0)
    for _ in range(3000):
        d = policy.plan(Step(0, (0,)))
        policy.commit(d)
        for e in d.uploads:
            policy.complete(0, e)
        policy.commit_background(())
    assert 1e-200 <= policy.scale[0] <= 1.0
    np.testing.assert_allclose(policy.frequency(0), [1.0, 0.0])
    np.testing.assert_allclose(policy.forecast(0, (0,)), [1.0, 0.0])


def test_prefetch_brings_the_next_layers_expert_in():
    """Layer 1 routes expert e+1 when layer 0 routes e, and the next token's layer 0 follows a fixed
    cycle: once learnt, every step hits, each after one prefetch into the layer's single slot."""
    g = Geometry.uniform(2, 6, 1)
    routes = [0, 3, 1, 4, 2, 5] * 6
    toks = [Token(i, 0, i, "decode", (Step(0, (e,)), Step(1, ((e + 1) % 6,)))) for i, e in enumerate(routes)]
    policy = make_policy("predict", g, Capacity.per_layer(g, 1), max_prefetch=1, prefetch_margin=0.25)
    audit = replay(policy, toks, audit=Audit(g, keep_records=True))
    late = [r for r in audit.records if r["token"] >= 18]
    assert [r["hits"] for r in late] == [2] * len(late)
    assert [r["swaps"] for r in late] == [2] * len(late)
    assert sum(r["uploads"] + r["streams"] for r in late) == 0


def test_refuses_too_few_slots_and_bad_options():
    g = Geometry.uniform(2, 8, 2)
    with pytest.raises(CapacityError, match="top_k=2"):
        make_policy("predict", g, Capacity.per_layer(g, 1))
    make_policy("predict", g, Capacity.per_layer(g, 1), misses="cpu")  # nothing uploaded on demand
    for bad in ({"memory": 1.0}, {"prior": 0.0}, {"admit_margin": -1.0}, {"max_prefetch": 513},
                {"prefetch_margin": 0.0}, {"misses": "disk"}, {"persist": -1.0}):
        with pytest.raises(ValueError, match=f"predict {next(iter(bad))}"):
            make_policy("predict", g, Capacity.per_layer(g, 2), **bad)


def test_cpu_misses_change_the_cache_only_by_prefetch():
    g = Geometry.uniform(3, 12, 2)
    toks = make_tokens(60, g.num_experts, 2, seed=5, skew=0.3)
    s = replay(make_policy("predict", g, Capacity.per_layer(g, 3), misses="cpu"), toks).summary()
    assert s["uploads"] == s["streams"] == 0 and s["cpu"] > 0 and s["fills"] + s["swaps"] > 0 and s["hits"] > 0


def test_closes_more_of_the_gap_than_lru_on_random_traces():
    """Skewed random routing with cross-layer structure: more hits than lru at equal slots."""
    g = Geometry.uniform(3, 12, 2)
    toks = make_tokens(200, g.num_experts, 2, seed=3, skew=0.3)
    rate = lambda name: replay(make_policy(name, g, Capacity.per_layer(g, 4)), toks, lag_tokens=0).summary()["hit_rate"]
    assert rate("predict") > rate("lru")
