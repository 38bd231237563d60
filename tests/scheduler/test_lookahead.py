"""lookahead and oracle: config errors, planning without side effects, cache invariants, the
prefetch never longer than the link's idle window, wrong prefetches released first."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import Capacity, Geometry, drive, make_policy
from scheduler.costmodel import CostModel
from scheduler.policies import LookaheadConfig
from traces import synth


def _cm(n: int, up: float = 70e-6, layer: float = 150e-6) -> CostModel:
    return CostModel(gpu_expert_s=(1e-6,) * n, gpu_token_s=(0.0,) * n, upload_s=(up,) * n,
                     cpu_expert_s=(40e-6,) * n, cpu_token_s=(0.0,) * n, cpu_task_s=20e-6, layer_s=(layer,) * n)


def _tokens(L=4, E=16, k=2, T=40, seed=0):
    t = synth.generate(L, E, k, T, synth.SynthParams(reuse_prob=0.6, cross_layer=0.9), np.random.default_rng(seed))
    return Geometry.uniform(L, E, k), list(t.tokens())


@pytest.mark.parametrize("field,value", [("confidence", 1.5), ("margin", -1), ("max_prefetch", -1),
                                         ("fill_share", 2), ("slack", -0.1), ("memory", 1.0), ("reuse_weight", -1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LookaheadConfig(**{field: value})


def test_needs_a_cost_model():
    g = Geometry.uniform(2, 8, 1)
    with pytest.raises(ValueError, match="cost_model"):
        make_policy("lookahead", g, Capacity.per_layer(g, 2))
    with pytest.raises(ValueError, match="future"):
        make_policy("oracle", g, Capacity.per_layer(g, 2), cost_model=_cm(2))


@pytest.mark.parametrize("name", ["lookahead", "oracle"])
def test_replay_keeps_the_cache_sound_and_plans_without_side_effects(name):
    g, toks = _tokens()
    pol = make_policy(name, g, Capacity.per_layer(g, 4), tokens=toks, cost_model=_cm(g.num_layers))
    n = 0
    for item in drive(pol, toks, 1):
        kind = type(item).__name__
        if kind == "RunLayer":
            d = item.decision
            assert sorted(d.hits + d.uploads + d.streams + d.cpu) == sorted(item.step.experts)
            n += 1
        pol.cache.check()
    assert n == sum(len(t.steps) for t in toks)
    # planning twice gives the same decision and changes nothing
    pol2 = make_policy(name, g, Capacity.per_layer(g, 4), tokens=toks, cost_model=_cm(g.num_layers))
    step = toks[0].steps[0]
    before = bytes(pol2.cache._buf)
    assert pol2.plan(step) == pol2.plan(step)
    assert bytes(pol2.cache._buf) == before


def test_prefetch_fits_the_idle_window():
    g, toks = _tokens()
    cm = _cm(g.num_layers, up=70e-6, layer=150e-6)  # two copies fit a layer's dense part
    pol = make_policy("oracle", g, Capacity.per_layer(g, 6), tokens=toks, cost_model=cm)
    sizes, plan = [], pol.plan_prefetch
    pol.plan_prefetch = lambda st: sizes.append(len(plan(st))) or plan(st)
    for _ in drive(pol, toks, 1):
        pass
    assert sizes and max(sizes) <= 2 and sum(sizes) > 0
    slow = make_policy("lookahead", g, Capacity.per_layer(g, 6), cost_model=_cm(g.num_layers, up=400e-6))
    for tok in toks:
        for st in tok.steps:
            d = slow.plan(st)
            slow.commit(d)
            for e in d.uploads:
                slow.complete(st.layer, e)
            assert slow.plan_prefetch(st) == ()  # a copy longer than the window: never prefetched
        slow.commit_background(slow.plan_background())


def test_a_wrong_prefetch_is_evicted_first():
    g = Geometry.uniform(2, 8, 1)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 2), cost_model=_cm(2))
    from scheduler import Move, Step

    pol.commit_background((Move(1, 5, 0), Move(1, 6, 1)))  # a prefetch into layer 1
    for m in (5, 6):
        pol.complete(1, m)
    pol.commit(pol.plan(Step(1, (6,))))  # routes 6: 5 was wrong
    assert (1, 5) in pol._wrong and (1, 6) not in pol._wrong
    ranked = pol._ranked(1, np.ones(8))
    assert ranked[0][1] == (1, 5) and ranked[0][0] < 0
