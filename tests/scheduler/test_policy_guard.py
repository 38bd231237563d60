"""lookahead's guard: it prices decisions as lookahead's split does, follows hybrid's decisions on
lookahead's own cache (no prefetch) only while its shadow hybrid is predicted faster, then plans
again; its fields are checked."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import Capacity, Geometry, drive, make_policy
from scheduler.costmodel import CostModel
from scheduler.policies import LookaheadConfig
from scheduler.policies.guard import decision_time
from traces import synth


def _cm(n: int, up: float = 70e-6, cpu: float = 40e-6) -> CostModel:
    return CostModel(gpu_expert_s=(1e-6,) * n, gpu_token_s=(0.0,) * n, upload_s=(up,) * n, cpu_expert_s=(cpu,) * n,
                     cpu_token_s=(0.0,) * n, cpu_task_s=20e-6, layer_s=(150e-6,) * n, cpu_delay_s=3e-6,
                     cpu_copy_s=5e-6, cpu_combine_s=2e-6, gpu_batch_s=4e-6)


def _tokens(L=4, E=16, k=2, T=40, seed=0):
    t = synth.generate(L, E, k, T, synth.SynthParams(reuse_prob=0.5, cross_layer=0.5), np.random.default_rng(seed))
    return Geometry.uniform(L, E, k), list(t.tokens())


@pytest.mark.parametrize("field,value", [("guard_memory", 0.5), ("guard_margin", 1.0), ("guard_probe", 0)])
def test_guard_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        LookaheadConfig(**{field: value})


def test_decision_time_is_lookaheads_own_prediction():
    g, toks = _tokens()
    cm = _cm(g.num_layers)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=cm, guard_memory=0.0)
    assert pol.guard is None
    seen = 0
    plan = pol.plan

    def checked(step):
        queued = max(pol._queue - cm.layer_s[step.layer], 0.0)
        d = plan(step)
        t, left = decision_time(cm, d, queued)
        assert t == pytest.approx(pol._planned[1], rel=1e-12, abs=1e-15)
        assert left == pytest.approx(pol._planned[2], rel=1e-12, abs=1e-15)
        nonlocal seen
        seen += 1
        return d

    pol.plan = checked
    for _ in drive(pol, toks, 1):
        pass
    assert seen == sum(len(t.steps) for t in toks)


def test_while_following_the_decisions_are_hybrids_on_the_same_cache():
    g, toks = _tokens()
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=_cm(g.num_layers), guard_probe=3)
    guard = pol.guard
    assert guard.follow.cache is pol.cache and guard.shadow.cache is not pol.cache
    plan, followed = pol.plan, []

    def checked(step):
        d = plan(step)
        if guard.active:  # hybrid's plan on this cache (side-effect free), or the shadow's own once aligned
            want = guard.shadow.plan(step) if guard.aligned() else guard.follow.plan(step)
            assert d._replace(slots=()) == want._replace(slots=())
            followed.append(d)
        return d

    pol.plan = checked
    n = 0
    for item in drive(pol, toks, 1):
        if type(item).__name__ == "EndToken":
            n += 1
            if n == 10:
                guard.left = 3  # as if the shadow had been predicted faster
                guard.own, guard.other = 1.0, 1.0
        elif type(item).__name__ == "StartBackground" and guard.active and n < 13:
            assert all(m.victim is None for m in item.moves)  # hybrid's fills only, no prefetch
        pol.cache.check()
    assert guard.followed >= 3 and len(followed) >= 3 * g.num_layers


def test_the_guard_follows_only_when_the_shadow_is_predicted_faster():
    g, toks = _tokens()
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=_cm(g.num_layers), guard_memory=4.0,
                      guard_margin=0.1, guard_probe=5)
    guard = pol.guard
    for _ in range(4):
        guard.decide(1.0)  # the shadow's tokens: its own prediction of these (empty) tokens, 0 s
        assert guard.left == 0  # the first guard_memory tokens are measured only
    guard.decide(1.0)
    assert guard.left == 5 and guard.other < guard.own * 0.9
    for _ in range(5):
        guard.decide(0.0)
    assert guard.left == 0 and guard.followed == 5
    guard.own = guard.other = 0.0
    guard.decide(0.0)  # equal: plans on
    assert guard.left == 0


def test_with_a_slow_cpu_the_guard_never_follows():
    """With the CPU pool far slower than the link, hybrid and lookahead both upload every miss:
    the shadow is never predicted faster than lookahead by the margin, so it never follows."""
    g, toks = _tokens(T=24)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=_cm(g.num_layers, up=10e-6, cpu=1e-3),
                      guard_margin=0.05)
    for _ in drive(pol, toks, 1):
        pass
    assert pol.guard.followed == 0


def _record(pol, toks, follow_from=None):
    """Per token: its decisions and background moves, slots left out (a cache's own numbering),
    and what the cache holds (and has in flight) at its end; from token ``follow_from`` on, the
    guard follows to the end."""
    out, cur = [], []
    for item in drive(pol, toks, 1):
        kind = type(item).__name__
        if kind == "RunLayer":
            d = item.decision
            cur.append((d.step.layer, d.hits, d.uploads, d.streams, d.cpu, d.evictions))
        elif kind == "StartBackground":
            cur.append(tuple((m.layer, m.expert, m.victim) for m in item.moves))
        elif kind == "EndToken":
            out.append((tuple(cur), frozenset(pol.cache.slot), frozenset(pol.cache.inflight)))
            cur = []
            if follow_from is not None and len(out) == follow_from:
                pol.guard.left = 10 ** 6
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_following_brings_the_cache_to_hybrids_then_decides_exactly_as_hybrid(seed):
    """Forced to follow from token 10 on, lookahead's cache comes to hold what a hybrid run alone
    holds, and from the next token on every decision and background move is that hybrid's (so a
    backend charges both alike); while it is not there yet, each eviction takes a resident that
    hybrid's cache lacks whenever the step leaves one."""
    g, toks = _tokens(L=6, E=32, k=4, T=48, seed=seed)
    cm = _cm(g.num_layers)
    alone = _record(make_policy("hybrid", g, Capacity.per_layer(g, 8), cost_model=cm), toks)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 8), cost_model=cm)
    guard, plan, checked = pol.guard, pol.plan, []

    def evicts_the_shadows_misfits_first(step):
        d = plan(step)
        if guard.active and d.evictions and not guard.aligned():
            mine, its = pol.cache.state[step.layer], guard.shadow.cache.state[step.layer]
            misfits = {e for e in range(g.num_experts[step.layer]) if mine[e] == 2 and its[e] == 0} - set(step.experts)
            assert all(v[1] in misfits for v in d.evictions[:len(misfits)])
            checked.append(len(misfits))
        return d

    pol.plan = evicts_the_shadows_misfits_first
    mine = _record(pol, toks, follow_from=10)
    assert guard.followed >= 30 and any(checked)
    held = next(i for i in range(10, len(toks)) if mine[i][1:] == alone[i][1:])
    assert held < 40
    assert [m[0] for m in mine[held + 1:]] == [a[0] for a in alone[held + 1:]]


def _token_end_fills(pol, toks, starts=()):
    """{token: the background moves started at its end}; the guard follows 3 tokens from each
    token end in ``starts`` (decided there, before the fills)."""
    guard, decide = pol.guard, pol.guard.decide

    def forced(own_s):
        decide(own_s)
        if guard.tokens - 1 in starts:
            guard.left = 3

    guard.decide = forced
    out, n, last = {}, 0, None
    for item in drive(pol, toks, 1):
        kind = type(item).__name__
        if kind == "EndToken":
            if last is not None:
                out[n] = last.moves
            n += 1
        last = item if kind == "StartBackground" else None
    return out


def test_the_token_where_following_starts_ends_with_hybrids_fills():
    """The guard decides before a token's fills: where it starts to follow, the fills are hybrid's
    (into free slots only: none here), not the swaps lookahead plans there when it plans on (every
    fill priced at the token's end: none held over for the next token's windows)."""
    g, toks = _tokens(L=6, E=32, k=4, T=40, seed=1)
    make = lambda: make_policy("lookahead", g, Capacity.per_layer(g, 8), cost_model=_cm(g.num_layers),
                               fill_window="priced")
    own = _token_end_fills(make(), toks)
    starts = [n for n in sorted(own) if n > 8 and any(m.victim is not None for m in own[n])][:2]
    assert len(starts) == 2  # lookahead's own swaps at those token ends
    followed = _token_end_fills(make(), toks, starts)
    assert all(m.victim is None for n in starts for m in followed.get(n, ()))
