"""hybrid-cost's prefetch (scheduler.policies.prefetch): moves only into the next layer's idle link
window, a wrong guess is the first victim, swaps wait for the audit, hot residents are never
evicted for a guess, the cache invariants hold and the decisions are deterministic."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import Audit, Capacity, CostModel, Geometry, RunLayer, StartBackground, Step, Token, drive, make_policy, replay
from scheduler.policies import HybridCostConfig
from scheduler.policies.prefetch import PREFETCH_GRID


def costs(n: int, upload: float = 1e-5, layer: float = 2.5e-5) -> CostModel:
    """Uploads cheaper than the CPU, a dense part of ``layer`` seconds per layer."""
    return CostModel((1e-6,) * n, (1e-6,) * n, (upload,) * n, (1e-6,) * n, (5e-5,) * n, 5e-6, layer_s=(layer,) * n)


def tokens(rng, n: int, L: int, E: int, k: int, follow: bool = True) -> list[Token]:
    """Routes where layer l's experts decide layer l+1's (``follow``: an exact cross-layer pattern),
    else random."""
    out = []
    for t in range(n):
        steps, first = [], int(rng.integers(E))
        for l in range(L):
            ex = ([(first + j) % E for j in range(k)] if follow
                  else [first] + [int(e) for e in rng.permutation(E) if e != first][:k - 1])
            steps.append(Step(l, tuple(ex)))
            first = (3 * first + 1) % E if follow else int(rng.integers(E))
        out.append(Token(t, 0, t, "decode", tuple(steps)))
    return out


def policy(g, slots, cm, **options):
    return make_policy("hybrid-cost", g, Capacity.per_layer(g, slots), cost_model=cm,
                       **{"prefetch": 4, "prefetch_confidence": 0.3, **options})


def test_the_default_is_off_with_a_grid_entrys_settings():
    cfg = HybridCostConfig()  # off: the executor measured it slower; its settings a grid entry's
    assert cfg.prefetch == 0 and {"prefetch": 4, "prefetch_fills": cfg.prefetch_fills,
                                  "prefetch_confidence": cfg.prefetch_confidence} in PREFETCH_GRID


@pytest.mark.parametrize("field,value", [("prefetch", -1), ("prefetch", 65), ("prefetch_confidence", 1.5),
                                         ("prefetch_margin", -0.1), ("prefetch_memory", 1.0)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HybridCostConfig(**{field: value})


def test_prefetches_fit_the_idle_window_and_land_before_their_step():
    g = Geometry.uniform(4, 8, 2)
    toks = tokens(np.random.default_rng(0), 60, 4, 8, 2)
    for layer_s, most in ((2.5e-5, 2), (1.5e-5, 1), (0.9e-5, 0)):  # windows of 2, 1, 0 uploads
        pol = policy(g, 4, costs(4, 1e-5, layer_s))
        plan, sizes = pol.plan_prefetch, []
        pol.plan_prefetch = lambda st: (sizes.append(len(m := plan(st))), m)[1]
        for item in drive(pol, toks):
            if type(item) is RunLayer:  # a prefetch completes before the next step is planned
                assert not any((item.step.layer, e) in pol.cache.inflight for e in item.decision.hits)
        assert max(sizes) == most and (most == 0 or pol.prefetcher.moved > 0)


def test_learnt_pattern_is_prefetched_and_used():
    g = Geometry.uniform(4, 8, 1)
    toks = tokens(np.random.default_rng(1), 80, 4, 8, 1)
    base = replay(make_policy("hybrid-cost", g, Capacity.per_layer(g, 3), cost_model=costs(4), prefetch=0), toks,
                  audit=Audit(g)).summary()
    pol = policy(g, 3, costs(4))
    got = replay(pol, toks, audit=Audit(g)).summary()
    pf = pol.prefetcher
    assert pf.moved > 20 and pf.used / pf.moved > 0.8  # the pattern is exact: guesses are right
    assert got["hits"] > base["hits"]


def test_a_wrong_guess_is_the_first_victim():
    g = Geometry.uniform(2, 8, 1)
    pol = policy(g, 3, costs(2))
    for e in range(3):  # fill layer 1's slots with 0, 1, 2 (0 least recent)
        pol.commit(d := pol.plan(Step(1, (e,))))
        for x in d.uploads:
            pol.complete(1, x)
    pf = pol.prefetcher
    pf.recur[1, 5] = 10.0 * pf.r_weight[1] / pf.rate  # expert 5 "recurs": forecast above every resident
    moves = pol.plan_prefetch(Step(0, (0,)))
    assert moves == ()  # a swap: held back until the audit finds swaps pay
    pf.gain = 1.0
    (m,) = pol.plan_prefetch(Step(0, (0,)))
    assert m.expert == 5 and m.victim == (1, 0)  # the least recently used resident
    pol.commit_background((m,))
    pol.complete(1, 5)
    assert next(iter(pol._lru[1])) == 5  # placed least recent until a step routes it
    d = pol.plan(Step(1, (6,)))  # the route proves it wrong: the next upload takes its slot
    assert d.uploads == (6,) and d.evictions == ((1, 5),)


def test_a_resident_as_likely_as_the_guess_is_not_evicted():
    g = Geometry.uniform(2, 8, 1)
    pol = policy(g, 2, costs(2), prefetch_margin=0.2)
    for e in range(2):
        pol.commit(d := pol.plan(Step(1, (e,))))
        for x in d.uploads:
            pol.complete(1, x)
    pf = pol.prefetcher
    pf.gain = 1.0
    scale = pf.r_weight[1] / pf.rate
    pf.recur[1, :] = 0.0
    pf.recur[1, 0], pf.recur[1, 5] = 0.5 * scale, 0.6 * scale  # the victim 0 is nearly as likely
    assert pol.plan_prefetch(Step(0, (3,))) == ()
    pf.recur[1, 5] = 0.8 * scale
    assert [m.expert for m in pol.plan_prefetch(Step(0, (3,)))] == [5]


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_invariants_and_same_decisions_twice(lag):
    rng = np.random.default_rng(lag)
    g = Geometry.uniform(5, 12, 2)
    toks = tokens(rng, 50, 5, 12, 2, follow=lag != 1)
    toks.insert(3, Token(3, 0, 3, "prefill", (Step(0, (1, 2, 3), (4, 1, 3)), Step(1, (0, 5), (2, 6))), 8))
    digests = []
    for _ in range(2):
        pol = policy(g, 4, costs(5), prefetch_fills=True, prefetch_confidence=0.2)
        pol.prefetcher.gain = pol.prefetcher.fill_gain = 1.0  # swaps from the start
        for item in drive(pol, toks, lag):
            pol.cache.check()
            if type(item) is RunLayer:
                d = item.decision
                assert sorted(d.hits + d.uploads + d.streams + d.cpu) == sorted(item.step.experts)
        assert not pol.cache.inflight and pol.prefetcher.moved > 0
        pol = policy(g, 4, costs(5), prefetch_fills=True, prefetch_confidence=0.2)
        digests.append(replay(pol, toks, lag_tokens=lag, audit=Audit(g, keep_log=True)).digest())
    assert digests[0] == digests[1]
