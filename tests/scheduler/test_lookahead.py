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


@pytest.mark.parametrize("field,value", [("fills", "lru"), ("values", "belady")])
def test_value_choices_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        LookaheadConfig(**{field: value})


@pytest.mark.parametrize("values", ["recency", "frequency", "forecast", "adaptive"])
def test_the_split_is_never_predicted_slower_than_uploading_every_miss(values):
    """The chosen split's predicted layer time is at most the all-upload plan's (lru's), by the
    same cost model, hand-off terms included."""
    g, toks = _tokens(E=8, k=3)
    cm = CostModel(gpu_expert_s=(1e-6,) * 4, gpu_token_s=(0.0,) * 4, upload_s=(70e-6,) * 4, cpu_expert_s=(47e-6,) * 4,
                   cpu_token_s=(0.0,) * 4, cpu_task_s=20e-6, layer_s=(85e-6,) * 4, cpu_copy_s=22e-6,
                   cpu_combine_s=6e-6, gpu_batch_s=18e-6)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 3), cost_model=cm, values=values)
    checked = 0
    orig = pol.plan

    def plan(step):
        d = orig(step)
        if d.uploads or d.streams or d.cpu:
            n = len(d.uploads) + len(d.streams)
            assert pol.split_times[n] <= pol.split_times[-1] + 1e-15
            nonlocal checked
            checked += 1
        return d

    pol.plan = plan
    for _ in drive(pol, toks, 1):
        pass
    assert checked > 20


def test_the_hand_off_is_priced():
    """One miss: the pool's 67 us beats an upload's 89 us until the hidden state's copies (22 us)
    are charged; then the miss is uploaded."""
    from dataclasses import replace

    from scheduler import Step

    g = Geometry.uniform(1, 8, 1)
    cm = CostModel(gpu_expert_s=(1e-6,), gpu_token_s=(0.0,), upload_s=(70e-6,), cpu_expert_s=(47e-6,),
                   cpu_token_s=(0.0,), cpu_task_s=20e-6, layer_s=(85e-6,), gpu_batch_s=18e-6)
    for copy, where in ((0.0, "cpu"), (22e-6, "uploads")):
        pol = make_policy("lookahead", g, Capacity.per_layer(g, 2), cost_model=replace(cm, cpu_copy_s=copy),
                          reuse_weight=0.0)
        d = pol.plan(Step(0, (3,)))
        assert getattr(d, where) == (3,)


def test_the_audit_holds_back_swaps_that_lose_and_scores_them_still():
    from scheduler import Move, Step

    g = Geometry.uniform(2, 8, 1)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 2), cost_model=_cm(2))
    swap, fill = Move(1, 5, 0, (1, 3)), Move(1, 6, 1)
    assert pol._swaps_ok("prefetch", [swap, fill]) == [fill]  # no evidence yet: held back, on trial
    pol._trials["prefetch"].clear()
    pol._gain["prefetch"] = -0.5  # swaps lately lost routes
    assert pol._swaps_ok("prefetch", [swap, fill]) == [fill]
    pol.commit(pol.plan(Step(1, (5,))))  # the held-back swap would have been right
    assert pol._gain["prefetch"] > 0 and pol._swaps_ok("prefetch", [swap]) == [swap]
    pol._trials["prefetch"].clear()
    pol._gain["prefetch"] = 0.0
    pol._swaps_ok("prefetch", [swap])
    pol.commit(pol.plan(Step(1, (3,))))  # its victim was routed: a loss
    assert pol._gain["prefetch"] < 0


def test_adaptive_values_follow_the_shadow_that_hits():
    """A layer of 2 slots: one hot expert among one-offs favours frequency (recency loses it);
    then two experts in turn, long after, favour recency (frequency keeps the old hot one)."""
    from scheduler import Step

    g = Geometry.uniform(1, 64, 1)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 2), cost_model=_cm(1), values="adaptive")

    def feed(experts):
        for e in experts:
            d = pol.plan(Step(0, (e,)))
            pol.commit(d)
            for u in d.uploads:
                pol.complete(0, u)
            moves = pol.plan_background()
            pol.commit_background(moves)
            for m in moves:
                pol.complete(m.layer, m.expert)

    feed([x for i in range(30) for x in (0, 2 + 2 * i, 3 + 2 * i)])
    assert pol.mode() == "frequency"
    feed([62, 63] * 150)
    assert pol.mode() == "recency"


def test_fill_window_is_checked():
    with pytest.raises(ValueError, match="fill_window"):
        LookaheadConfig(fill_window="always")
    with pytest.raises(ValueError, match="fill_price"):
        LookaheadConfig(fill_price=-1.0)


def _replay_tokens(pol, toks, check):
    """Drive ``pol`` by hand (every copy completes at once); ``check(kind, moves)`` sees each
    background batch before it is committed."""
    for tok in toks:
        for st in tok.steps:
            d = pol.plan(st)
            pol.commit(d)
            for e in d.uploads:
                pol.complete(st.layer, e)
            early = pol.plan_prefetch(st)
            check("layer", early)
            pol.commit_background(early)
            for m in early:
                pol.complete(m.layer, m.expert)
        want = list(pol._want)
        moves = pol.plan_background()
        check(("end", want), moves)
        pol.commit_background(moves)
        for m in moves:
            pol.complete(m.layer, m.expert)


@pytest.mark.parametrize("window", ["demand", "priced"])
def test_layer_batches_fit_the_next_layers_window(window):
    """A batch after a step (prefetches and held-over fills) is copied within the next layer's
    dense part, less the link's queue, so it never delays that layer by the cost model."""
    g, toks = _tokens(E=16, k=2, T=30)
    cm = _cm(g.num_layers, up=70e-6, layer=150e-6)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 6), cost_model=cm, fill_window=window)
    seen = {"fills": 0}

    def check(kind, moves):
        if kind == "layer":
            assert len(moves) * 70e-6 <= 150e-6 + 1e-12
            seen["fills"] += len(pol._spare_keys)

    _replay_tokens(pol, toks, check)
    assert seen["fills"] > 0 or window == "priced"  # demand: held-over fills did go in layer windows


def test_demand_window_fills_land_before_the_first_wanted_upload():
    g, toks = _tokens(E=16, k=2, T=30)
    cm = _cm(g.num_layers, up=70e-6, layer=150e-6)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 6), cost_model=cm, fill_window="demand")
    n = {"checked": 0}

    def check(kind, moves):
        if kind != "layer":
            first = min((t for t, w, _, _ in kind[1] if w > 0), default=None)
            if first is not None:
                assert len(moves) * 70e-6 <= first + 1e-12
                n["checked"] += 1
                n["held"] = n.get("held", 0) + len(pol._spare)

    _replay_tokens(pol, toks, check)
    assert n["checked"] > 0 and n["held"] > 0  # some fills were held over for the layer windows


def test_priced_fills_cost_the_last_token_no_more_than_their_worth():
    """Replayed on the token just ended, the fills sent at its end delay it by at most their
    worth (fill_price x the share of fills routed x one CPU expert each); none when priced at 0."""
    from scheduler.policies.lookahead import _replay

    g, toks = _tokens(E=16, k=2, T=30)
    cm = _cm(g.num_layers, up=300e-6, layer=100e-6)  # a slow link: fills compete with uploads
    for price in (0.0, 1.0):
        pol = make_policy("lookahead", g, Capacity.per_layer(g, 6), cost_model=cm, fill_price=price)
        sent = []

        def check(kind, moves):
            if kind != "layer" and moves:
                want = kind[1]
                cost = _replay(want, pol._queue + 300e-6 * len(moves)) - _replay(want, pol._queue)
                assert cost <= price * pol._hit * 40e-6 * len(moves) + 1e-12
                sent.append(len(moves))

        _replay_tokens(pol, toks, check)
        assert sum(sent) > 0  # free-slot fills into an idle link cost nothing, even at price 0


def test_the_guard_follows_longer_each_time_it_is_called_back_soon():
    """guard_backoff: following that starts again within guard_memory tokens of the last ending lasts
    backoff times the last; after guard_memory tokens of its own planning, guard_probe again."""
    g, _ = _tokens()
    with pytest.raises(ValueError, match="guard_backoff"):
        LookaheadConfig(guard_backoff=0.5)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=_cm(g.num_layers), guard_memory=4.0,
                      guard_margin=0.1, guard_probe=3, guard_backoff=2.0)
    guard, spans = pol.guard, []
    for _ in range(40):
        was = guard.left
        guard.decide(1.0)  # the shadow predicts 0 s a token: always faster
        if guard.left and not was:
            spans.append(guard.left)
    assert spans[:3] == [3, 6, 12]
    guard.own = guard.other = 0.0
    while guard.left:
        guard.decide(0.0)
    for _ in range(5):  # longer than guard_memory planning its own, not slower
        guard.decide(0.0)
        assert guard.left == 0
    guard.decide(1.0)
    assert guard.left == 3


def test_misses_of_equal_value_go_over_pcie_by_their_routes_so_far():
    """Recency values tie two misses just routed; the split uploads one of them, and it is the one
    routed more so far (as hybrid ranks its misses), not the router's first."""
    from scheduler import Step

    g = Geometry.uniform(1, 8, 2)
    cm = CostModel(gpu_expert_s=(1e-6,), gpu_token_s=(0.0,), upload_s=(70e-6,), cpu_expert_s=(47e-6,),
                   cpu_token_s=(0.0,), cpu_task_s=20e-6, layer_s=(85e-6,), gpu_batch_s=18e-6, cpu_copy_s=22e-6)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 2), cost_model=cm, values="recency", guard_memory=0.0,
                      max_prefetch=0, fill_share=0.0)
    for experts in [(5, 6)] * 3 + [(1, 2)] * 3:  # 5 routed three times, then evicted
        d = pol.plan(Step(0, experts))
        pol.commit(d)
        for e in d.uploads:
            pol.complete(0, e)
    d = pol.plan(Step(0, (3, 5)))
    assert (d.uploads, d.cpu) == ((5,), (3,)) and pol.uses[0, 5] == 3 and pol.uses[0, 3] == 0
