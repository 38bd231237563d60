"""``hybrid`` with ``rounding="carry"``: the PCIe share of misses holds on average for small miss
counts; the default rounding's decisions are unchanged."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Audit, Capacity, Geometry, Step, Token, make_policy, replay

from .conftest import scenarios
from .test_invariants import checked

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tokens_of(steps):
    return [Token(i, 0, i, "decode", (Step(0, ex),)) for i, ex in enumerate(steps)]


@settings(max_examples=60, **SETTINGS)
@given(st.integers(0, 256), st.lists(st.integers(1, 4), min_size=1, max_size=80))
def test_sent_over_pcie_is_the_fraction_rounded_down_over_the_run(frac, sizes):
    """No slots (every miss is new, none in flight): after the run, the misses sent over PCIe are
    floor(total misses * frac / 256), whatever the step sizes; nearest rounding may send none."""
    g = Geometry.uniform(1, 8, 4)
    steps = [tuple(range(n)) for n in sizes]
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 0), miss_frac_256=frac, rounding="carry")
    s = replay(policy, tokens_of(steps)).summary()
    assert s["streams"] == sum(sizes) * frac // 256
    assert s["streams"] + s["cpu"] == sum(sizes)
    assert 0 <= policy._carry[0] < 256


def test_top2_sends_its_share_where_nearest_sends_none():
    g = Geometry.uniform(1, 8, 2)
    steps = [(2 * i % 8, (2 * i + 1) % 8) for i in range(64)]
    sent = {}
    for rounding in ("nearest", "carry"):
        p = make_policy("hybrid", g, Capacity.per_layer(g, 0), rounding=rounding)
        sent[rounding] = replay(p, tokens_of(steps)).summary()["streams"]
    assert sent == {"nearest": 0, "carry": 128 * 44 // 256}


@settings(max_examples=60, **SETTINGS)
@given(scenarios(batches=True), st.integers(0, 256), st.integers(0, 2))
def test_invariants_hold_with_carry(scenario, frac, lag):
    geometry, capacity, tokens = scenario
    checked(make_policy("hybrid", geometry, capacity, miss_frac_256=frac, rounding="carry"), tokens, lag)


@settings(max_examples=30, **SETTINGS)
@given(scenarios())
def test_planning_with_carry_has_no_side_effects(scenario):
    geometry, capacity, tokens = scenario
    policy = make_policy("hybrid", geometry, capacity, miss_frac_256=100, rounding="carry")
    for tok in tokens:
        for step in tok.steps:
            carry = list(policy._carry)
            d = policy.plan(step)
            assert policy.plan(step) == d and policy._carry == carry
            policy.commit(d)
            for e in d.uploads:
                policy.complete(step.layer, e)
        policy.commit_background(policy.plan_background())


def test_default_rounding_is_nearest_and_options_are_checked():
    g = Geometry.uniform(1, 8, 2)
    a = replay(make_policy("hybrid", g, Capacity.per_layer(g, 2)), tokens_of([(0, 1), (2, 3)] * 4),
               audit=Audit(g, keep_log=True)).digest()
    b = replay(make_policy("hybrid", g, Capacity.per_layer(g, 2), rounding="nearest"),
               tokens_of([(0, 1), (2, 3)] * 4), audit=Audit(g, keep_log=True)).digest()
    assert a == b
    with pytest.raises(ValueError, match="hybrid rounding"):
        make_policy("hybrid", g, Capacity.per_layer(g, 2), rounding="up")
