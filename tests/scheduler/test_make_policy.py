"""make_policy: configs checked by field, the construction glue (tokens, miss_fraction), commit -> None."""
import numpy as np
import pytest

from scheduler import MISS_FRAC_256, Audit, Capacity, CostModel, Geometry, Profile, Step, Token, make_policy, replay
from scheduler.policies import CONFIGS, POLICIES, FreqLruConfig, HybridConfig, HybridCostConfig, route_counts


def tokens(seed=3, n=40, L=3, E=8, k=2):
    rng = np.random.default_rng(seed)
    return [Token(i, 0, i, "decode", tuple(Step(l, tuple(int(e) for e in rng.choice(E, k, replace=False)))
                                           for l in range(L)), 1) for i in range(n)]


def digest(policy, toks):
    audit = Audit(policy.geometry, keep_log=True)
    replay(policy, toks, audit=audit)
    return audit.digest()


@pytest.mark.parametrize("config, bad, field", [
    (HybridConfig, {"miss_frac_256": 257}, "hybrid miss_frac_256"),
    (HybridConfig, {"swap_every": -1}, "hybrid swap_every"),
    (HybridConfig, {"max_moves": -1}, "hybrid max_moves"), (HybridConfig, {"max_fills": 513}, "hybrid max_fills"),
    (HybridConfig, {"decay": 0.0}, "hybrid decay"), (HybridCostConfig, {"decay": 1.5}, "hybrid-cost decay"),
    (HybridCostConfig, {"rounding": "carry"}, "hybrid-cost rounding"),
    (FreqLruConfig, {"halve_every": 0}, "halve_every")])
def test_config_errors_name_the_field(config, bad, field):
    with pytest.raises(ValueError, match=field):
        config(**bad)


def test_configs_are_frozen_and_hold_the_defaults():
    assert HybridConfig().miss_frac_256 == MISS_FRAC_256 == 44
    assert HybridCostConfig().swap_every == 0 and HybridCostConfig(admit="usage").swap_every == 4
    assert HybridCostConfig(floors_256=[0, 64]).floors_256 == (0, 64)
    with pytest.raises(AttributeError):
        HybridConfig().decay = 0.5
    assert set(CONFIGS) <= set(POLICIES)


def test_unknown_options_are_refused_by_name():
    g = Geometry.uniform(2, 8, 2)
    with pytest.raises(ValueError, match="'hybrid': unknown option swap_evry; expected some of"):
        make_policy("hybrid", g, Capacity.per_layer(g, 2), swap_evry=2)
    with pytest.raises(ValueError, match="'lru': unknown option decay; it takes none"):
        make_policy("lru", g, Capacity.per_layer(g, 2), decay=0.5)


def test_tokens_give_static_its_oracle_profile_and_belady_its_future():
    toks = tokens()
    g = Geometry.uniform(3, 8, 2)
    cap = Capacity.per_layer(g, 3)
    profile = Profile.from_counts(route_counts(toks, g))
    oracle = make_policy("static", g, cap, tokens=toks)
    assert digest(oracle, toks) == digest(make_policy("static", g, cap, profile), toks)
    future = [s for t in toks for s in t.steps]
    given = make_policy("belady", g, cap, future=future)
    assert digest(make_policy("belady", g, cap, tokens=toks), toks) == digest(given, toks)
    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("static", g, cap)
    lru = make_policy("lru", g, cap, tokens=toks)  # ignored by a policy that does not use it
    assert lru.residents() == []


def test_miss_fraction_sets_hybrids_share_and_is_checked():
    g = Geometry.uniform(3, 8, 2)
    cap = Capacity.per_layer(g, 2)
    assert make_policy("hybrid", g, cap, miss_fraction=0.5).miss_frac_256 == 128
    assert make_policy("hybrid", g, cap).miss_frac_256 == MISS_FRAC_256
    with pytest.raises(ValueError, match="miss_fraction: 1.5"):
        make_policy("hybrid", g, cap, miss_fraction=1.5)


def test_commit_returns_none_for_every_policy():
    toks = tokens()
    g = Geometry.uniform(3, 8, 2)
    cm = CostModel((0.05,) * 3, (0.02,) * 3, (0.3,) * 3, (0.0,) * 3, (0.2,) * 3, 0.1)
    for name in POLICIES:
        cap = Capacity.per_layer(g, 8 if name == "gpu" else 3)
        pol = make_policy(name, g, cap, tokens=toks, cost_model=cm)
        step = toks[0].steps[0]
        assert pol.commit(pol.plan(step)) is None, name
