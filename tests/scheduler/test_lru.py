"""lru against a ten-line reference, and the published granite hit rates."""
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import Audit, Capacity, Geometry, make_policy, replay

from .conftest import make_tokens


def reference_lru_hits(tokens, slots):
    """Per layer: hits = experts cached at step start; then the step's experts become most
    recent, in router-rank order, and the least recent others are evicted."""
    caches, hits = {}, []
    for tok in tokens:
        for step in tok.steps:
            cache = caches.setdefault(step.layer, OrderedDict())
            hits.append(tuple(e for e in step.experts if e in cache))
            for e in step.experts:
                cache.pop(e, None)
                cache[e] = None
            while len(cache) > slots:
                cache.popitem(last=False)
    return hits


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(4, 16), st.integers(0, 2**31), st.integers(0, 12), st.sampled_from([0.2, 1, 5]))
def test_lru_matches_reference(top_k, num_experts, seed, extra, skew):
    g = Geometry.uniform(3, num_experts, top_k, 100)
    slots = min(num_experts, top_k + extra)
    tokens = make_tokens(60, g.num_experts, top_k, seed, skew)
    audit = Audit(g, keep_log=True)
    replay(make_policy("lru", g, Capacity.per_layer(g, slots)), tokens, audit=audit)
    got = [rec[2] for rec in audit.log]
    assert got == reference_lru_hits(tokens, slots)


GRANITE = {  # published hit rates: decode steps in order, caches carried across the three prompts
    8: {"lru": 0.422, "static": 0.454, "belady": 0.620},
    16: {"lru": 0.725, "static": 0.740, "belady": 0.859},
    24: {"lru": 0.904, "static": 0.919, "belady": 0.953},
}


@pytest.mark.parametrize("slots", sorted(GRANITE))
def test_granite_hit_rates_match_anchors(slots):
    import traces
    from scheduler import Profile

    trace = traces.load()
    tokens = list(trace.tokens(phase="decode"))
    g = trace.geometry(1000)
    cap = Capacity.per_layer(g, slots)
    steps = [s for t in tokens for s in t.steps]
    for name, want in GRANITE[slots].items():
        profile = Profile.from_counts(trace.routing_counts(phase="decode")) if name == "static" else None
        policy = make_policy(name, g, cap, profile=profile, future=steps)
        assert round(replay(policy, tokens, lag_tokens=0).summary()["hit_rate"], 3) == want, name
