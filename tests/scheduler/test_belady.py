"""belady keeps its future compactly (a few bytes per routed expert, the steps not held), and its
decisions are those it made when it held them as objects (digests recorded then)."""
import tracemalloc

import numpy as np
import pytest

import traces
from scheduler import Audit, Capacity, Geometry, Profile, Step, make_policy, replay
from scheduler.policies import route_counts

from .conftest import make_tokens


def digest(policy, toks):
    audit = Audit(policy.geometry, keep_log=True)
    replay(policy, toks, audit=audit)
    return audit.digest()


def _random(seed, batch, pools, profile):
    ne = (8, 0, 12, 12)
    g = Geometry(ne, 2, tuple(1000 if e else 0 for e in ne))
    toks = make_tokens(60, ne, 2, seed, skew=0.5 + seed % 4, max_batch=batch)
    cap = Capacity.shared(g, [g.moe_layers], [pools]) if pools >= 10 else Capacity.per_layer(g, pools)
    return g, cap, toks, Profile.from_counts(route_counts(toks, g)) if profile else None


# digests of the per-step implementation: random routing (seed, batch, slots per layer or a shared
# pool of 10, a profile's residents to start from) and the bundled granite trace
RECORDED = {
    (0, 4, 3, False): "06f9760bdf2617fe86d6b4eeae72e16179abfab48aad4e3113b7d3bd62595598",
    (0, 4, 6, True): "ddf66a4da1a7190a64ea539a0f11cc3f4f82a2cf95dad72121c84556332246c1",
    (0, 4, 10, False): "6f88ab7c2dd654a2a65339c557e21d170a0febe8c6a8035094da1498be7b9594",
    (0, 4, 10, True): "4367641b4d1b2bd780817490210f9f89f59101a02529dfa32cb04878281fffbf",
    (3, 4, 3, True): "d86664dbb035d8e58ddc5a4ecbfea6ceaa6c804eaf1599919eae3224a6b2d5e5",
    (3, 4, 10, False): "f036906f122a573cdcbe679dd0e119050e5d837c42bc5a80daaee062974d59f3",
}
GRANITE = {8: "70f57c4f6a14b801927dd2f7e62524d35ce033705a786e9f667affc4cbb53977",
           16: "10d078aea830b5657ca808dac4d0c5565347e3766d4325ad905bb3951afc4cb0",
           24: "b3f890bbb4743a3534b0b5cc31fcf85db68b0d4f3952b68a0711927e41d712f1"}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_decisions_are_the_recorded_ones(case):
    g, cap, toks, profile = _random(*case)
    assert digest(make_policy("belady", g, cap, profile, tokens=toks), toks) == RECORDED[case]


def test_decisions_on_the_granite_trace_are_the_recorded_ones():
    t = traces.load()
    g = Geometry(tuple(t.num_experts), t.top_k, tuple(1000 if e else 0 for e in t.num_experts))
    toks = list(t.tokens())
    for slots, want in GRANITE.items():
        assert digest(make_policy("belady", g, Capacity.per_layer(g, slots), tokens=toks), toks) == want


def _steps(num_tokens, layers, experts, k, seed=0):
    """A generator: each step made as it is read, so only what the policy keeps stays in memory."""
    rng = np.random.default_rng(seed)
    for _ in range(num_tokens):
        for layer in range(layers):
            yield Step(layer, tuple(int(e) for e in rng.choice(experts, k, replace=False)))


def test_the_future_costs_a_few_bytes_per_routed_expert():
    """4000 tokens x 8 layers x top-8 of 64: 256k routed experts; as objects (a Step and a tuple of
    next uses per step) they held over 40 bytes each, and more while being read."""
    T, L, E, k = 4000, 8, 64, 8
    g = Geometry.uniform(L, E, k)
    make_policy("belady", g, Capacity.per_layer(g, 16), future=_steps(2, L, E, k))  # first use's imports, not counted
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        policy = make_policy("belady", g, Capacity.per_layer(g, 16), future=_steps(T, L, E, k))
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    routed = T * L * k
    assert (held - before) / routed < 10, (held - before) / routed
    assert (peak - before) / routed < 32, (peak - before) / routed
    assert policy.plan(Step(0, tuple(policy._experts(0)))).step.layer == 0


def test_a_step_other_than_the_trace_s_is_refused():
    g = Geometry.uniform(2, 8, 2)
    policy = make_policy("belady", g, Capacity.per_layer(g, 2), future=[Step(0, (1, 2)), Step(1, (3, 4))])
    with pytest.raises(ValueError, match="step 0 differs"):
        policy.plan(Step(0, (2, 1)))
    with pytest.raises(ValueError, match="needs the whole trace"):
        make_policy("belady", g, Capacity.per_layer(g, 2), future=iter(()))
