"""The token graph's rule (scheduler.graph): the back-off and which blocks the graph runs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from scheduler import AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from scheduler.graph import MAX_SKIP, MIN_RATE, GraphBackoff, resident_at_launch

L = 3


def token_items(index: int, miss: bool, fill_at: int | None = None) -> list:
    """One decode token's driver items over L blocks routed to experts (0, 1): with ``miss`` block 1
    uploads expert 1; ``fill_at``: a copy of (2, 0) awaited after that block (a prefetch)."""
    t = Token(index, 0, index, "decode", ())
    out = []
    for l in range(L):
        s = Step(l, (0, 1))
        d = Decision(s, (0,), uploads=(1,), slots=(3,)) if miss and l == 1 else Decision(s, (0, 1))
        out.append(RunLayer(t, s, d))
        if fill_at == l:
            out.append(AwaitBackground((Move(2, 0, 4),)))
    return out + [EndToken(t)]


def replay(gate: GraphBackoff, complete: list[bool]) -> list[int]:
    """The tokens that tried the graph, a backend's way: a token that tries is told its outcome; every
    token's driver items are then seen in order."""
    tried = []
    for i, c in enumerate(complete):
        if gate.want():
            tried.append(i)
            gate.done(c)
        for it in token_items(i, miss=not c):
            gate.see(it)
    return tried


def test_backoff_doubles_after_incomplete_tokens_and_resets_after_a_complete_one():
    g = GraphBackoff()
    pattern = []
    for _ in range(40):
        tried = g.want()
        pattern.append(tried)
        if tried:
            g.done(False)
    # tried, skip 1, tried, skip 2, tried, skip 4, tried, skip 8, tried, skip 16 ...
    tries = [i for i, t in enumerate(pattern) if t]
    assert tries[:6] == [0, 2, 5, 10, 19, 36]
    while not g.want():
        pass
    g.done(True)  # a complete token: the next one tries again, and an incomplete one after it skips 1
    assert g.want() and g.backoff == 1
    g.done(False)
    assert not g.want() and g.want()


def test_backoff_is_capped():
    g = GraphBackoff()
    for _ in range(20):
        g.done(False)
    assert g.skip == MAX_SKIP and g.backoff == MAX_SKIP


def test_a_block_runs_in_the_graph_only_when_every_routed_expert_was_resident_at_launch():
    s = Step(3, (1, 2))
    assert resident_at_launch(Decision(s, (1, 2)))
    assert not resident_at_launch(Decision(s, (1,), uploads=(2,), slots=(0,)))
    assert not resident_at_launch(Decision(s, (1,), cpu=(2,)))
    assert not resident_at_launch(Decision(s, (1, 2)), arrived={(3, 2)})  # a hit that arrived after the launch
    assert resident_at_launch(Decision(s, (1, 2)), arrived=[(4, 2)])


def test_the_executors_token_graph_uses_the_same_cap():
    """execute.token_graph keeps the back-off on the host; its cap must be this one (read from the
    source: importing it needs CuPy)."""
    src = Path(__file__).resolve().parents[2] / "execute" / "token_graph.py"
    tree = ast.parse(src.read_text())
    caps = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "_MAX_SKIP" for t in n.targets)]
    uses = "GraphBackoff" in src.read_text()
    assert uses or caps == [MAX_SKIP]


def test_tokens_that_turn_complete_while_backing_off_try_the_graph_again():
    """20 tokens with a miss back the graph off to 16 tokens (tried: 0, 2, 5, 10, 19); from token 20
    every token would complete. Tried tokens alone would skip up to 16 of them (the next try at 36);
    scoring the skipped ones, the rate passes MIN_RATE after two and token 22 tries again."""
    complete = [False] * 20 + [True] * 20
    gate = GraphBackoff()
    tried = replay(gate, complete)
    assert tried[:5] == [0, 2, 5, 10, 19]
    assert tried[5:] == list(range(22, 40))
    assert gate.skip == 0 and gate.backoff == 1


def test_while_tokens_keep_missing_the_back_off_is_unchanged():
    """A rate below MIN_RATE leaves the doubling back-off as it was: one token in forty completes."""
    complete = [i % 40 == 39 for i in range(200)]
    ours, old = GraphBackoff(), GraphBackoff(min_rate=1.0)  # min_rate 1: the back-off alone
    assert replay(ours, complete) == replay(old, complete)
    assert ours.rate < MIN_RATE


def test_the_rate_is_a_smoothed_share_of_tokens_tried_or_skipped():
    gate = GraphBackoff(smoothing=0.5)
    assert replay(gate, [False, True, True]) == [0, 2]  # token 1 skipped, scored complete
    assert gate.rate == pytest.approx(0.75)


def test_a_skipped_token_is_scored_like_the_graph_would_run_it():
    """A copy awaited after the first block and hit later would have halted the graph; copies awaited
    before the token's first block, items of a token that tried and other tokens' items do not count."""
    def score(items, tried=False):
        gate = GraphBackoff(smoothing=1.0)
        gate.done(False)
        gate.rate = 0.0
        if tried:
            gate.skip = 0
        gate.want()
        for it in items:
            gate.see(it)
        return gate.rate

    fill = AwaitBackground((Move(2, 0, 4),))
    assert score(token_items(1, False)) == 1.0
    assert score(token_items(1, True)) == 0.0
    assert score(token_items(1, False, fill_at=1)) == 0.0  # (2, 0) arrived after the launch
    assert score([fill] + token_items(1, False)) == 1.0  # awaited at the token's start: before the launch
    assert score(token_items(1, False), tried=True) == 0.0  # a tried token is scored by done() only
    t = Token(0, 0, 0, "decode", ())
    assert score([StartBackground(t, ()), EndToken(t)] + token_items(1, True)) == 1.0  # the next token: no watch


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="min_rate"):
        GraphBackoff(min_rate=1.5)
    with pytest.raises(ValueError, match="smoothing"):
        GraphBackoff(smoothing=0.0)


# CpuMisses: every miss of a one-token step on the CPU, the policy's uploads as fills after the token

def _graph_cpu_run(policy_name: str, capacity_slots: int, tokens, lag: int):
    from scheduler import Audit, Capacity, Geometry, drive, make_policy
    from scheduler.graph import CpuMisses

    g = Geometry.uniform(3, 8, 2)
    inner = make_policy(policy_name, g, Capacity.per_layer(g, capacity_slots))
    pol = CpuMisses(inner)
    audit = Audit(g, keep_log=True, keep_records=False)
    items = []
    for it in drive(pol, tokens, lag):
        audit.observe(it)
        items.append(it)
        inner.cache.check()
    return pol, inner, items, audit


def _tokens(n: int, seed: int, batch_every: int = 0):
    from .conftest import make_tokens

    toks = make_tokens(n, (8, 8, 8), 2, seed)
    if batch_every:  # some prefill chunks of 3 tokens among them
        many = make_tokens(n, (8, 8, 8), 2, seed + 1, max_batch=3)
        toks = [many[i] if i % batch_every == 0 and many[i].num_tokens > 1 else t for i, t in enumerate(toks)]
    return toks


@pytest.mark.parametrize("policy", ["lru", "hybrid", "freq-lru", "cpu"])
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_one_token_steps_upload_nothing_and_their_uploads_fill_the_policys_slots_after_the_token(policy, lag):
    toks = _tokens(30, 7, batch_every=4)
    pol, inner, items, _ = _graph_cpu_run(policy, 3, toks, lag)
    for it in items:
        if type(it) is RunLayer:
            d = it.decision
            assert sorted(d.hits + d.uploads + d.streams + d.cpu) == sorted(d.step.experts)
            if d.step.counts is None:
                assert not (d.uploads or d.streams or d.promotions)



def test_every_slot_the_policy_took_at_a_step_is_filled_after_the_token():
    """At each StartBackground every fill is in flight in the slot the policy holds for it; at each
    token's end every expert in flight travels in a batch started and not yet awaited."""
    from scheduler import Audit, Capacity, Geometry, drive, make_policy
    from scheduler.graph import CpuMisses

    g = Geometry.uniform(3, 8, 2)
    inner = make_policy("lru", g, Capacity.per_layer(g, 3))
    moving: dict = {}
    for it in drive(CpuMisses(inner), _tokens(40, 11), 1):
        k = type(it)
        if k is StartBackground:
            for m in it.moves:
                assert inner.cache.slot[(m.layer, m.expert)] == m.slot and (m.layer, m.expert) in inner.cache.inflight
                moving[(m.layer, m.expert)] = m.slot
        elif k is AwaitBackground:
            for m in it.moves:
                moving.pop((m.layer, m.expert))
        elif k is EndToken:
            assert inner.cache.inflight == set(moving)


def test_a_miss_fills_after_its_token_and_is_a_hit_once_the_fill_completes():
    """lru on 2 slots, lag 0: token 0 misses (0, 1) at every block, both on the CPU and both filled after
    it; token 1 routed the same finds them resident."""
    from scheduler import Token

    toks = [Token(i, 0, i, "decode", tuple(Step(l, (0, 1)) for l in range(3))) for i in range(2)]
    pol, inner, items, audit = _graph_cpu_run("lru", 2, toks, 0)
    runs = [it.decision for it in items if type(it) is RunLayer]
    assert all(d.cpu == (0, 1) and not d.hits for d in runs[:3])
    assert all(d.hits == (0, 1) and not d.cpu for d in runs[3:])
    fills = [m for it in items if type(it) is StartBackground for m in it.moves]
    assert sorted((m.layer, m.expert) for m in fills) == [(l, e) for l in range(3) for e in (0, 1)]
    assert audit.summary()["uploads"] == 0 and audit.summary()["fills"] == 6


def test_an_expert_still_in_flight_is_computed_on_the_cpu():
    """lag 1: token 0's fills land before token 2, so token 1 routed the same runs them on the CPU
    (lru would otherwise upload an expert already holding a slot)."""
    from scheduler import Token

    toks = [Token(i, 0, i, "decode", (Step(0, (0, 1)),)) for i in range(3)]
    pol, inner, items, _ = _graph_cpu_run("lru", 2, toks, 1)
    runs = [it.decision for it in items if type(it) is RunLayer]
    assert runs[1].cpu == (0, 1) and runs[2].hits == (0, 1)


def test_multi_token_steps_keep_the_policys_decision_and_planning_has_no_side_effects():
    from scheduler import Capacity, Geometry, make_policy
    from scheduler.graph import CpuMisses

    g = Geometry.uniform(1, 8, 2)
    pol = CpuMisses(make_policy("lru", g, Capacity.per_layer(g, 3)))
    chunk = Step(0, (1, 2, 3), (2, 1, 1))
    assert pol.plan(chunk) == pol.plan(chunk) == pol.policy.plan(chunk)
    one = Step(0, (4, 5))
    a, b = pol.plan(one), pol.plan(one)
    assert a == b and a.cpu == (4, 5) and not a.uploads
    with pytest.raises(ValueError, match="commit the decision"):
        pol.commit(a)  # not the decision the last plan returned
    pol.commit(b)
    assert [m.expert for m in pol.plan_background()] == [4, 5]


def test_a_fill_budget_keeps_the_first_uploads_of_a_token_and_drops_the_rest():
    from scheduler import Capacity, Geometry, Token, drive, make_policy
    from scheduler.graph import CpuMisses

    g = Geometry.uniform(3, 8, 2)
    inner = make_policy("lru", g, Capacity.per_layer(g, 2))
    toks = [Token(i, 0, i, "decode", tuple(Step(l, (2 * i, 2 * i + 1)) for l in range(3))) for i in range(3)]
    items = list(drive(CpuMisses(inner, max_fills=3), toks, 0))
    fills = [[(m.layer, m.expert) for m in it.moves] for it in items if type(it) is StartBackground]
    assert fills == [[(0, 0), (0, 1), (1, 0)], [(0, 2), (0, 3), (1, 2)], [(0, 4), (0, 5), (1, 4)]]
    assert all(len(it.decision.evictions) <= 2 for it in items if type(it) is RunLayer)
    inner.cache.check()
    assert sorted(inner.residents()) == [(0, 4), (0, 5), (1, 2), (1, 4)]
    with pytest.raises(ValueError, match="max_fills"):
        CpuMisses(inner, max_fills=-1)
