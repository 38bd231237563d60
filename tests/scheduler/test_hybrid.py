"""hybrid: the miss split, adaptive fill, swap rounds, and asynchronous completion."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from scheduler import Capacity, Decision, Geometry, Profile, Step, Token, drive, make_policy, replay
from scheduler.drive import EndToken, RunLayer, StartBackground


def tok(i, *layers):
    return Token(i, 0, i, "decode", tuple(Step(l, tuple(es)) for l, es in enumerate(layers)))


@pytest.mark.parametrize("n_miss, frac, n_pcie", [(8, 44, 1), (4, 44, 1), (2, 44, 0), (3, 44, 1),
                                                   (8, 0, 0), (8, 256, 8), (5, 128, 3), (1, 128, 1)])
def test_miss_fraction_rounds_half_up(n_miss, frac, n_pcie):
    g = Geometry.uniform(1, 16, 8, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 0), miss_frac_256=frac)
    d = policy.plan(Step(0, tuple(range(n_miss))))
    assert len(d.streams) == n_pcie and len(d.cpu) == n_miss - n_pcie and not d.uploads


def test_pcie_misses_are_the_most_used_then_router_rank():
    g = Geometry.uniform(1, 8, 4, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 0), miss_frac_256=128, adaptive=False, swap_every=0)
    replay(policy, [tok(0, [5, 6, 1, 2]), tok(1, [6, 7, 1, 3])])
    d = policy.plan(Step(0, (0, 1, 6, 4)))  # usage: 6 -> 2, 1 -> 2, others <= 1
    assert d.streams == (1, 6) and d.cpu == (0, 4)  # ties by router rank: 1 before 6
    d = policy.plan(Step(0, (0, 3, 4, 5), (1, 4, 1, 1)))  # token counts come first
    assert d.streams[0] == 3


def test_adaptive_fill_uses_free_slots_only_and_ranks_by_usage():
    g = Geometry.uniform(2, 8, 2, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 1), miss_frac_256=0, swap_every=0)
    items = list(drive(policy, [tok(0, [1, 2], [3, 4])], lag_tokens=0))
    bg = [i for i in items if type(i) is StartBackground][0]
    assert [(m.layer, m.expert, m.victim) for m in bg.moves] == [(0, 1, None), (1, 3, None)]
    assert policy.residents() == [(0, 1), (1, 3)]
    # cache full: no more fills, whatever misses
    items = list(drive(policy, [tok(1, [5, 6], [5, 6])], lag_tokens=0))
    assert not [i for i in items if type(i) is StartBackground]


def test_swap_round_gate_margin_and_decay():
    g = Geometry.uniform(1, 4, 1, 10)
    profile = Profile(1, 4, ((0, 0),), 1)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 1), profile, miss_frac_256=0, swap_every=4)
    # expert 1 routed 4 times: usage 4 >= gate 2 and >= 0 + 1.5 -> swapped in at the 4th token
    items = list(drive(policy, [tok(i, [1]) for i in range(4)], lag_tokens=0))
    moves = [m for i in items if type(i) is StartBackground for m in i.moves]
    assert [(m.expert, m.victim, m.gain) for m in moves] == [(1, (0, 0), 4.0)]
    assert policy.residents() == [(0, 1)]
    assert policy.usage[0, 1] == pytest.approx(4 * 0.7)


def test_swap_needs_margin_over_victim():
    g = Geometry.uniform(1, 4, 1, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 1), Profile(1, 4, ((0, 0),), 1),
                         miss_frac_256=0, swap_every=4)
    # round 1 (after token 3): u0 = 2, u1 = 2: no swap, 2 < 2 + 1.5; then both decay to 1.4.
    # round 2 (after token 7): u1 = 1.4 + 4 = 5.4 >= u0 1.4 + 1.5: swap with gain 4.0.
    seq = [0, 0, 1, 1, 1, 1, 1, 1]
    items = list(drive(policy, [tok(i, [e]) for i, e in enumerate(seq)], lag_tokens=0))
    moves = [(i.token.index, m.expert, round(m.gain, 6)) for i in items if type(i) is StartBackground for m in i.moves]
    assert moves == [(7, 1, 4.0)]


def test_in_flight_fill_is_not_a_hit_and_goes_to_cpu():
    g = Geometry.uniform(1, 4, 1, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 2), miss_frac_256=256, swap_every=0)
    tokens = [tok(0, [1]), tok(1, [2]), tok(2, [2]), tok(3, [2])]
    decisions = [i.decision for i in drive(policy, tokens, lag_tokens=1) if type(i) is RunLayer]
    # token 0: expert 1 over PCIe into a free slot (admitted). token 1: expert 2 uploaded too.
    assert decisions[0].uploads == (1,) and decisions[1].uploads == (2,)
    assert decisions[2].hits == (2,)


def test_background_completes_after_lag_tokens():
    g = Geometry.uniform(1, 4, 1, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 2), miss_frac_256=0, swap_every=0)
    tokens = [tok(0, [1]), tok(1, [1]), tok(2, [1]), tok(3, [1])]
    items = list(drive(policy, tokens, lag_tokens=2))
    kinds = [type(i).__name__ for i in items]
    # fill of expert 1 starts after token 0 and is awaited before token 3 (0 + 1 + lag 2)
    assert kinds.index("AwaitBackground") == 7
    runs = [i.decision for i in items if type(i) is RunLayer]
    assert [len(d.hits) for d in runs] == [0, 0, 0, 1]
    assert [d.cpu for d in runs[:3]] == [(1,), (1,), (1,)]


def costs(layers=1, upload=1.0, gpu=0.1, gpu_tok=0.0, cpu=0.2, cpu_tok=0.8, task=0.0):
    from scheduler import CostModel

    return CostModel((gpu,) * layers, (gpu_tok,) * layers, (upload,) * layers, (cpu,) * layers,
                     (cpu_tok,) * layers, task)


def test_cost_model_sends_many_token_experts_over_pcie_and_single_tokens_to_cpu():
    g = Geometry.uniform(1, 8, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=costs())
    # expert 3: 6 tokens -> CPU 5.0 s vs upload 1.0 s; experts 1, 5: 1 token -> CPU 1.0 s each
    d = policy.plan(Step(0, (1, 3, 5), (1, 6, 1)))
    assert d.streams == (3,) and d.cpu == (1, 5)


def test_cost_model_balances_a_decode_layer():
    g = Geometry.uniform(1, 16, 8, 10)
    # upload 1.0, CPU 1.0 per expert: 8 misses split 4 / 4 (ties go to the CPU)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=costs(cpu=1.0, cpu_tok=0.0))
    d = policy.plan(Step(0, tuple(range(8))))
    assert len(d.streams) == 4 and len(d.cpu) == 4


def test_cost_model_needs_its_model():
    g = Geometry.uniform(1, 8, 2, 10)
    with pytest.raises(ValueError, match="cost_model"):
        make_policy("hybrid-cost", g, Capacity.per_layer(g, 0))
    with pytest.raises(ValueError, match="CostModel.gpu_expert_s: 1 entries, expected 2"):
        from scheduler import CostModel
        CostModel((1.0,), (1.0,), (1.0, 2.0), (1.0,), (1.0,))


def test_full_pool_admits_an_upload_over_a_colder_resident():
    g = Geometry.uniform(1, 8, 2, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 2), Profile(1, 8, ((0, 0), (0, 1)), 2),
                         miss_frac_256=256, adaptive=False, swap_every=0)
    replay(policy, [tok(0, [0, 1])])  # usage 0 -> 1, 1 -> 1
    d = policy.plan(Step(0, (0, 5)))  # 5 (usage 0) is colder than resident 1: streamed
    assert d.hits == (0,) and d.streams == (5,) and not d.evictions
    policy.commit(d)  # usage 5 -> 1
    d = policy.plan(Step(0, (0, 5)))  # now as used as 1, which the step does not use: replaces it
    assert d.uploads == (5,) and d.evictions == ((0, 1),) and d.slots == (policy.cache.slot[(0, 1)],)
    policy.commit(d)
    policy.complete(0, 5)
    assert policy.residents() == [(0, 0), (0, 5)]
    off = make_policy("hybrid", g, Capacity.per_layer(g, 2), Profile(1, 8, ((0, 0), (0, 1)), 2),
                      miss_frac_256=256, adaptive=False, swap_every=0, admit_uploads=False)
    assert off.plan(Step(0, (0, 5))).streams == (5,)


def test_layer_then_key_order_is_lexsort():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from scheduler.policies import _by_layer_then

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 5), st.integers(1, 30), st.data())
    def check(num_layers, num_experts, data):
        flat = sorted(data.draw(st.sets(st.integers(0, num_layers * num_experts - 1))))
        idx = np.array(flat, dtype=np.int64)
        layers, experts = idx // num_experts, idx % num_experts
        keys = np.array(data.draw(st.lists(st.sampled_from([0.0, 0.7, 1.0, 1.4, 2.0]), min_size=len(idx),
                                           max_size=len(idx))))
        for k in (keys, -keys):
            assert (_by_layer_then(layers, k) == np.lexsort((experts, k, layers))).all()

    check()


def test_cost_model_roofline():
    from scheduler import CostModel

    linear = CostModel((1.0,), (0.5,), (2.0,), (0.1,), (0.3,))
    roof = CostModel((1.0,), (0.5,), (2.0,), (0.1,), (0.3,), gpu_read_s=(4.0,), cpu_read_s=(0.9,))
    assert (linear.gpu_s(0, 4), linear.cpu_s(0, 4)) == (3.0, 0.1 + 1.2)
    assert (roof.gpu_s(0, 4), roof.gpu_s(0, 10)) == (5.0, 6.0)  # read-bound, then compute-bound
    assert (roof.cpu_s(0, 1), roof.cpu_s(0, 4)) == (0.1 + 0.9, 0.1 + 1.2)


def predicted_s(policy, tokens):
    """Sum of the cost model's layer times over ``tokens`` (no background work in these tests)."""
    total = 0.0
    for t in tokens:
        for step in t.steps:
            d = policy.plan(step)
            policy.commit(d)
            total += policy.committed_s
            for e in d.uploads:
                policy.complete(step.layer, e)
        policy.commit_background(policy.plan_background())
    return total


def test_cost_model_sends_the_most_used_misses_of_a_count_over_pcie():
    g = Geometry.uniform(1, 8, 3, 10)
    cm = costs(cpu=1.0, cpu_tok=0.0)  # upload 1.0, CPU 1.0: of 3 misses, 1 goes over PCIe
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=cm, floors_256=(0,),
                         adaptive=False, swap_every=0)
    replay(policy, [tok(0, [4, 5, 6]), tok(1, [5, 6, 7]), tok(2, [6, 1, 2])])  # usage: 6 -> 3, 5 -> 2
    d = policy.plan(Step(0, (4, 5, 6)))
    assert d.streams == (6,) and d.cpu == (4, 5)
    d = policy.plan(Step(0, (4, 5, 6), (2, 1, 1)))  # ranked by count first: 4 (2 tokens) is the one sent
    assert d.streams == (4,) and d.cpu == (5, 6)
    cm = costs(cpu=0.5, cpu_tok=0.5)  # 1 token: CPU 1.0; 2 tokens: CPU 1.5 > upload 1.0
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=cm, floors_256=(0,))
    replay(policy, [tok(0, [4, 5, 6]), tok(1, [5, 6, 7]), tok(2, [6, 1, 2])])
    d = policy.plan(Step(0, (4, 5, 6), (2, 1, 1)))
    assert d.streams == (4,) and d.cpu == (5, 6)


def test_background_copies_queued_on_the_link_delay_uploads_until_layers_drain_them():
    from scheduler import CostModel

    g = Geometry.uniform(1, 8, 2, 10)
    for layer_s, want_streams in ((None, 0), ((5.0,), 1)):
        cm = CostModel((0.1,), (0.0,), (1.0,), (1.0,), (0.0,), layer_s=layer_s)
        policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 1), cost_model=cm, floors_256=(0,),
                             swap_every=0)
        replay(policy, [tok(0, [0])], lag_tokens=1)  # expert 0 on the CPU, then filled: 1.0 s queued
        d = policy.plan(Step(0, (2, 3)))
        # queued copy ahead: an upload would end at 2.0 s, as late as both on the CPU (a tie: CPU)
        assert len(d.uploads) + len(d.streams) == want_streams and len(d.cpu) == 2 - want_streams


def test_floor_tuner_moves_to_the_floor_the_cost_model_favours():
    g = Geometry.uniform(1, 16, 2, 10)
    cm = costs(upload=1.5, cpu=1.0, cpu_tok=0.0)
    fixed = lambda f, slots: make_policy("hybrid-cost", g, Capacity.per_layer(g, slots), cost_model=cm,
                                         floors_256=(f,), adaptive=False, swap_every=0)
    # the same two experts every token: floor 0 uploads one (2 misses: CPU 2.0 > PCIe 1.5) and
    # keeps the other on the CPU (1.0 < 1.5); floor 128 uploads the last miss too, then all hit
    reuse = [tok(i, [3, 9]) for i in range(24)]
    # one new expert every token and no cache: an upload (1.5) never pays back the CPU's 1.0
    fresh = [tok(i, [i % 16]) for i in range(24)]
    for tokens, slots, start, want in ((reuse, 2, 0, 128), (fresh, 0, 128, 0)):
        assert predicted_s(fixed(want, slots), tokens) < predicted_s(fixed(start, slots), tokens)
        policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, slots), cost_model=cm,
                             floors_256=(start, want), tune_every=4, adaptive=False, swap_every=0)
        replay(policy, tokens)
        assert policy.floor_256 == want and policy.tuner.history[-1] == want
        routes = sum(len(s.experts) for t in tokens for s in t.steps)
        assert len(policy.tuner.history) == routes // (4 * 2)  # a window: 4 tokens of top-2 routes
        policy.cache.check()
        for sh in policy.tuner.shadows:
            sh.cache.check()


def test_floor_tuner_shadows_complete_background_copies_at_the_live_lag():
    g = Geometry.uniform(2, 8, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 3), cost_model=costs(layers=2),
                         floors_256=(0, 64), tune_every=2)
    tokens = [tok(i, [i % 8, (i + 3) % 8], [(i + 1) % 8, (5 * i) % 8]) for i in range(12)]
    replay(policy, tokens, lag_tokens=2)
    assert policy.lag_tokens == 2
    for sh in policy.tuner.shadows:
        sh.cache.check()
        assert len(sh.background) <= 2 * 3  # copies of at most the last lag + 1 tokens in flight
    again = make_policy("hybrid-cost", g, Capacity.per_layer(g, 3), cost_model=costs(layers=2),
                        floors_256=(0, 64), tune_every=2)
    replay(again, tokens, lag_tokens=2)
    assert again.tuner.history == policy.tuner.history  # deterministic


@pytest.mark.parametrize("options, field", [(dict(floors_256=()), "floors_256"), (dict(floors_256=(0, 300)), "floors_256"),
                                            (dict(floors_256=(64, 64)), "floors_256"), (dict(tune_every=0), "tune_every"),
                                            (dict(hysteresis=1.0), "hysteresis"), (dict(shadow_layers=0), "shadow_layers"),
                                            (dict(tune_duty=0.0), "tune_duty"), (dict(tune_warmup=-1), "tune_warmup"),
                                            (dict(admit="lfu"), "admit")])
def test_hybrid_cost_options_are_checked(options, field):
    g = Geometry.uniform(1, 8, 2, 10)
    with pytest.raises(ValueError, match=field):
        make_policy("hybrid-cost", g, Capacity.per_layer(g, 2), cost_model=costs(), **options)


def test_cost_model_of_layers_picks_and_renumbers():
    from scheduler import CostModel

    cm = CostModel((1.0, 2.0, 3.0), (0.1, 0.2, 0.3), (4.0, 5.0, 6.0), (7.0, 8.0, 9.0), (0.0, 0.5, 1.0), 0.25,
                   layer_s=(0.01, 0.02, 0.03))
    sub = cm.of_layers((2, 0))
    assert sub.upload_s == (6.0, 4.0) and sub.layer_s == (0.03, 0.01) and sub.gpu_read_s is None
    assert sub.cpu_task_s == 0.25 and sub.gpu_s(0, 2) == cm.gpu_s(2, 2) and sub.cpu_s(1, 3) == cm.cpu_s(0, 3)


def test_floor_tuner_shadows_replay_a_spread_of_layers_only():
    g = Geometry.uniform(8, 16, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 4), cost_model=costs(layers=8),
                         floors_256=(0, 128), tune_every=2, shadow_layers=2, max_moves=8, decay=1.0,
                         tune_duty=1.0)
    rng = np.random.default_rng(3)
    tokens = [tok(i, *[rng.choice(16, 2, replace=False).tolist() for _ in range(8)]) for i in range(40)]
    replay(policy, tokens)
    tuner = policy.tuner
    assert sorted(tuner.index) == [2, 6]  # the middle of layers 0-3 and of 4-7
    assert len(tuner.history) == 40 * 8 * 2 // (2 * 2 * 8)  # windows count every layer's routes
    for sh in tuner.shadows:
        assert sh.geometry.num_layers == 2 and sh.max_moves == 2 and sh.costs.upload_s == (1.0, 1.0)
        sh.cache.check()
        routed = [sum(len(t.steps[l].experts) for t in tokens) for l in (2, 6)]
        assert sh.usage.sum(axis=1).tolist() == routed  # the routes of layers 2 and 6, no others


@pytest.mark.parametrize("layers, floors, picked", [(4, (0, 32, 64, 96, 128), [2]), (8, (0, 128), [1, 3, 5, 7]),
                                                     (48, (0, 32, 64, 96, 128), [6, 18, 30, 42])])
def test_floor_tuner_shadows_plan_no_more_layers_than_the_live_policy(layers, floors, picked):
    """At most one sampled layer per len(floors) MoE layers (at least one), up to shadow_layers."""
    g = Geometry.uniform(layers, 16, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 4), cost_model=costs(layers=layers),
                         floors_256=floors)
    assert sorted(policy.tuner.index) == picked


def test_floor_tuner_samples_whole_shared_pools():
    g = Geometry.uniform(6, 8, 2, 10)
    cap = Capacity.shared(g, [(0, 1), (2, 3), (4, 5)], [4, 4, 4])
    policy = make_policy("hybrid-cost", g, cap, cost_model=costs(layers=6), floors_256=(0, 64), shadow_layers=1)
    assert sorted(policy.tuner.index) == [2, 3]  # layer 3 picked; layer 2 shares its pool
    assert policy.tuner.shadows[0].capacity.pools == (((0, 1), 4),)
    tokens = [tok(i, *[[(i + l) % 8, (3 * i + l + 1) % 8] for l in range(6)]) for i in range(12)]
    replay(policy, tokens)
    for sh in policy.tuner.shadows:
        sh.cache.check()


def test_decode_and_one_token_counts_plan_alike():
    """The decode path (no counts) and the token-count path agree when every count is 1 (costs
    exact in binary, so the sums cannot differ by rounding)."""
    g = Geometry.uniform(2, 16, 4, 10)
    cm = costs(layers=2, upload=1.0, gpu=0.125, cpu=0.5, cpu_tok=0.25, task=0.0625)
    rng = np.random.default_rng(7)
    tokens = [tok(i, *[rng.choice(16, 4, replace=False).tolist() for _ in range(2)]) for i in range(30)]
    for floor in (0, 64, 256):
        policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 6), cost_model=cm, floors_256=(floor,))
        for t in tokens:
            for step in t.steps:
                ones = Step(step.layer, step.experts, (1,) * len(step.experts))
                d1 = policy.plan(ones)
                t1 = policy.layer_time_s(d1)
                d = policy.plan(step)
                assert d[1:] == d1[1:] and policy.layer_time_s(d) == t1
                policy.commit(d)
                for e in d.uploads:
                    policy.complete(step.layer, e)
            policy.commit_background(policy.plan_background())
            for m in policy.background.copy():
                policy.complete(*m)


def test_floor_tuner_rests_between_windows_after_its_warmup():
    g = Geometry.uniform(2, 16, 2, 10)
    rng = np.random.default_rng(5)
    tokens = [tok(i, *[rng.choice(16, 2, replace=False).tolist() for _ in range(2)]) for i in range(60)]
    make = lambda: make_policy("hybrid-cost", g, Capacity.per_layer(g, 4), cost_model=costs(layers=2),
                               floors_256=(0, 64, 128), tune_every=2, tune_duty=0.5, tune_warmup=2)
    policy = make()
    rests = []  # whether the shadows were resting at each token's end
    for item in drive(policy, tokens):
        if type(item) is EndToken:
            rests.append(not policy.tuner.shadows)
    # windows of 2 tokens (8 routes), closing at a token's last step; after the 2 windows of
    # warm-up a rest of 8 routes follows each, and fresh shadows start when a token ends
    assert rests[:3] == [False] * 3 and rests[3:11] == [True, True, False, False] * 2
    assert len(policy.tuner.history) == 2 + (60 - 4) // 4
    again = make()
    replay(again, tokens)
    assert again.tuner.history == policy.tuner.history  # deterministic


def test_fresh_shadows_start_from_the_live_cache_usage_and_copies_in_flight():
    from dataclasses import replace

    g = Geometry.uniform(4, 16, 2, 10)
    cm = replace(costs(layers=4), layer_s=(5.0,) * 4)  # dense parts long enough for a token's fills
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 8), cost_model=cm,
                         floors_256=(0, 128), shadow_layers=2, tune_every=1, tune_duty=0.5, tune_warmup=0)
    rng = np.random.default_rng(2)
    tokens = [tok(i, *[rng.choice(16, 2, replace=False).tolist() for _ in range(4)]) for i in range(9)]
    for item in drive(policy, tokens, lag_tokens=2):
        if type(item) is EndToken and item.token.index == 3:
            break
    tuner, live = policy.tuner, policy
    assert live.cache.inflight  # background copies of the last tokens still on their way
    sh = tuner.make(0, None)
    tuner._seed(sh, live, 3, live.lag_tokens)
    sh.cache.check()
    for j, l in enumerate(tuner.layers):
        assert {e: s for (k, e), s in sh.cache.slot.items() if k == j} == \
            {e: s for (k, e), s in live.cache.slot.items() if k == l}
        assert {e for k, e in sh.cache.inflight if k == j} == {e for k, e in live.cache.inflight if k == l}
        assert sh.usage[j].tolist() == live.usage[l].tolist()
        assert list(sh._lru[j]) == list(live._lru[l])
        assert sh._hit_avg[j] == live._hit_avg[l]  # the reuse charge's hit share
    assert sh.tokens == live.tokens
    due = {(m.layer, m.expert): t for t, s, ms in tuner.pending if s is sh for m in ms}
    assert set(due) == {(j, e) for j, l in enumerate(tuner.layers) for k, e in live.cache.inflight if k == l}
    assert all(due[j, e] == live._bg_token[l, e] + 1 + 2 for j, l in enumerate(tuner.layers)
               for k, e in live.cache.inflight if k == l)  # complete when the live copies do


def test_a_window_before_a_rest_spans_its_whole_batch():
    """Batches of many tokens reach a window's routes at their first layer; before a rest the
    window stays open through the batch's other layers and closes when the batch ends."""
    g = Geometry.uniform(4, 16, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 4), cost_model=costs(layers=4),
                         floors_256=(0, 128), shadow_layers=2, tune_every=1, tune_duty=0.5, tune_warmup=0)
    batch = lambda i: Token(i, 0, i, "prefill", tuple(Step(l, ((i + l) % 16, (i + l + 5) % 16), (4, 4))
                                                       for l in range(4)))
    seen = []  # (layer, windows closed) after each layer of the first batch
    for item in drive(policy, [batch(0), batch(1)]):
        if type(item) is RunLayer and item.token.index == 0:
            seen.append((item.step.layer, len(policy.tuner.history)))
        if type(item) is EndToken and item.token.index == 0:
            assert len(policy.tuner.history) == 1 and not policy.tuner.shadows  # closed, resting
    assert seen == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_hybrid_cost_admits_a_pcie_miss_over_the_least_recently_used_resident():
    """admit="recency": a full pool's PCIe miss takes the slot of the resident used longest ago
    (not the least used), never one the step uses; no swap rounds unless asked for."""
    g = Geometry.uniform(1, 8, 2, 10)
    cm = costs(cpu=100.0)  # the CPU is never worth it: every miss goes over PCIe
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 3), cost_model=cm, floors_256=(0,))
    assert policy.swap_every == 0
    # fills the 3 slots with 1, 2, 3; then 1 and 2 are used often and 3 once, long ago
    replay(policy, [tok(0, [1, 2]), tok(1, [3, 1]), tok(2, [1, 2]), tok(3, [2, 1]), tok(4, [1, 2])], lag_tokens=0)
    assert sorted(e for _, e in policy.residents()) == [1, 2, 3]
    d = policy.plan(Step(0, (2, 5)))
    assert d.hits == (2,) and d.uploads == (5,) and d.evictions == ((0, 3),)  # 3: last used at token 1
    policy.commit(d)
    replay(policy, [tok(5, [2, 5])], lag_tokens=0)
    d = policy.plan(Step(0, (5, 6)))
    assert d.evictions == ((0, 1),)  # 1, the most used, but last used at token 4
    usage = make_policy("hybrid-cost", g, Capacity.per_layer(g, 3), cost_model=cm, floors_256=(0,), admit="usage")
    assert usage.swap_every == 4
    replay(usage, [tok(0, [1, 2]), tok(1, [3, 1]), tok(2, [1, 2]), tok(3, [2, 1]), tok(4, [1, 2])], lag_tokens=0)
    d = usage.plan(Step(0, (2, 5)))
    assert d.uploads == () and d.streams == (5,)  # usage-gated: 5 (never used) is not kept


def test_cpu_delay_keeps_a_layer_off_the_pool_when_queueing_late_costs_more():
    """With ``cpu_delay_s`` (an executor queues a layer's GPU work and copies after submitting its
    CPU job) every split that uses the pool starts its GPU side that late."""
    from dataclasses import replace

    g = Geometry.uniform(1, 16, 8, 10)
    cm = costs(gpu=0.125, cpu=1.0, cpu_tok=0.0)  # upload 1.0 or CPU 1.0 per expert
    split = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=cm, floors_256=(0,))
    d = split.plan(Step(0, tuple(range(8))))  # k uploads: the link k, then their GPU k/8; the pool 8 - k
    assert len(d.streams) == 4 and len(d.cpu) == 4 and split.layer_time_s(d) == (4.5, 0.0)
    late = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=replace(cm, cpu_delay_s=10.0),
                       floors_256=(0,))
    d = late.plan(Step(0, tuple(range(8))))
    assert len(d.streams) == 8 and not d.cpu  # 8 uploads (9.0) beat every split, GPU side 10.0 late
    assert late.layer_time_s(d) == (9.0, 0.0)
    with pytest.raises(ValueError, match="cpu_delay_s"):
        replace(cm, cpu_delay_s=-1.0)


def brute_split(cm, layer, hits_s, n_hits, gpu, cpu, n_busy, busy_s, n_floor, one):
    """Every subset of the misses sent over PCIe (at least ``n_floor``), priced by ``step_s``: the
    least time (written out, no ranking assumed)."""
    from itertools import combinations

    m = len(gpu)
    best = None
    for k in range(n_floor, m + 1):
        for up in combinations(range(m), k):
            rest = [i for i in range(m) if i not in up]
            pool = cm.pool_s(busy_s + sum(cpu[i] for i in rest), len(rest) + n_busy)
            t = cm.step_s(layer, hits_s, n_hits, sum(gpu[i] for i in up), k, pool, 0.0, one)[0]
            best = t if best is None else min(best, t)
    return best


@settings(max_examples=150, deadline=None)
@given(m=st.integers(0, 6), n_hits=st.integers(0, 3), n_busy=st.integers(0, 2), upload=st.floats(0.01, 2.0),
       cpu=st.floats(0.01, 2.0), task=st.floats(0.0, 3.0), delay=st.floats(0.0, 1.0), batch=st.floats(0.0, 0.3),
       floor=st.integers(0, 256), lane=st.booleans(), handoff=st.booleans())
def test_exact_split_equals_brute_force(m, n_hits, n_busy, upload, cpu, task, delay, batch, floor, lane, handoff):
    """Decode steps (all misses cost alike): the chosen ``k`` is as fast as the best of every subset
    of at least the floor's misses, with and without the executor's host lane."""
    from dataclasses import replace

    from scheduler import CostModel
    from scheduler.costmodel import LaneCosts

    cm = CostModel((0.05,), (0.0,), (upload,), (cpu,), (0.0,), task, cpu_delay_s=delay, gpu_batch_s=batch,
                   cpu_call_factor=((2, 1.25),))
    if lane:
        cm = replace(cm, lane=LaneCosts(pool_task_s=task, submit_s=0.1, start_s=0.05, handoff_s=delay,
                                        return_s=0.2, combine_s=0.1, cpu_queue_s=0.03, expert_queue_s=0.01,
                                        copy_s=0.02, plan_copy_s=0.01, batch_s=batch, gpu_combine_s=0.02,
                                        handoff=handoff, handoff_in_s=0.07, handoff_out_s=0.09))
    E = m + n_hits + n_busy + 1
    g = Geometry.uniform(1, E, max(m + n_hits + n_busy, 1), 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=cm, floors_256=(floor,),
                         reuse_charge=False)
    n_floor = (m * floor + 128) >> 8
    k, t, _ = policy._split(0, n_hits * 0.05, n_hits, [0.05] * m, [cpu] * m, n_busy, n_busy * cpu, n_floor, 0.0,
                            True)
    assert n_floor <= k <= m
    want = brute_split(cm, 0, n_hits * 0.05, n_hits, [0.05] * m, [cpu] * m, n_busy, n_busy * cpu, n_floor, True)
    assert t == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_a_pool_cheaper_than_the_link_takes_the_misses():
    """The CPU pool is cheaper than uploading (the old greedy, pricing one miss at a time with the
    pool's fixed costs, sent them all over PCIe): the exact split keeps most on the CPU."""
    from scheduler import CostModel
    from scheduler.costmodel import LaneCosts

    # the calibrated H200's shape: upload 100 us, pool 62 us per expert, fixed hand-off costs on the host
    lane = LaneCosts(pool_task_s=28e-6, submit_s=51e-6, start_s=16e-6, handoff_s=124e-6, return_s=82e-6,
                     combine_s=44e-6, cpu_queue_s=16e-6, expert_queue_s=3e-6, copy_s=12e-6, plan_copy_s=3e-6,
                     batch_s=30e-6, gpu_combine_s=8e-6)
    cm = CostModel((0.0,), (0.0,), (100e-6,), (62e-6,), (0.0,), gpu_read_s=(7.7e-6,), lane=lane)
    g = Geometry.uniform(1, 128, 8, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 0), cost_model=cm, floors_256=(0,))
    d = policy.plan(Step(0, tuple(range(8))))
    assert 0 < len(d.streams) < 4 and len(d.cpu) == 8 - len(d.streams)
    every = policy.layer_time_s(Decision(d.step, (), (), (), tuple(range(8))))[0]
    assert policy.layer_time_s(d)[0] < 0.75 * every  # all over PCIe: 800 us of link, then the batch
    one = policy.plan(Step(0, (5,)))  # a lone miss: the pool's fixed costs outweigh one upload
    assert one.streams == (5,) and not one.cpu


class _NoMemo(dict):
    """A memo that keeps nothing: every decode split is computed afresh."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.parametrize("name", ["hybrid", "hybrid-cost"])
def test_decode_memos_change_no_decision(name):
    """Layers of equal costs share their decode answers, but not layers whose host lead differs
    (the last layer's is the head's): the decisions equal those computed afresh at every step."""
    from scheduler import CostModel
    from scheduler.audit import Audit
    from scheduler.costmodel import LaneCosts

    L, E = 4, 16
    g = Geometry.uniform(L, E, 4, 10)
    lane = LaneCosts(pool_task_s=0.3, submit_s=0.5, start_s=0.1, handoff_s=0.2, return_s=0.4, combine_s=0.3,
                     copy_s=0.05, batch_s=0.2, gpu_combine_s=0.05, lead_s=(0.1, 0.1, 0.1, 3.0))
    cm = CostModel((0.0,) * L, (0.0,) * L, (1.0,) * L, (0.6,) * L, (0.0,) * L, gpu_read_s=(0.1,) * L, lane=lane)
    rng = np.random.default_rng(3)
    tokens = [Token(i, 0, i, "decode", tuple(Step(l, tuple(int(e) for e in rng.choice(E, 4, replace=False)))
                                             for l in range(L))) for i in range(40)]

    def log(fresh):
        policy = make_policy(name, g, Capacity.per_layer(g, 5), cost_model=cm)
        holder = policy.share if name == "hybrid" else policy
        if fresh:
            holder._memo = [_NoMemo() for _ in range(L)]
        audit = Audit(g, keep_log=True)
        replay(policy, tokens, audit=audit)
        return audit.digest(), audit.totals["cpu"]

    got, want = log(False), log(True)
    assert got == want and want[1] > 0  # and the pool is used


def test_floor_tuner_runs_with_usage_admission():
    """admit="usage" keeps no recency order: fresh shadows start without one (they used to fail)."""
    g = Geometry.uniform(4, 16, 2, 10)
    policy = make_policy("hybrid-cost", g, Capacity.per_layer(g, 4), cost_model=costs(layers=4), admit="usage",
                         floors_256=(0, 128), shadow_layers=2, tune_every=1, tune_duty=0.5, tune_warmup=0)
    rng = np.random.default_rng(4)
    tokens = [tok(i, *[rng.choice(16, 2, replace=False).tolist() for _ in range(4)]) for i in range(16)]
    replay(policy, tokens)
    assert policy._lru is None and len(policy.tuner.history) > 2
    policy.cache.check()


def test_hybrid_cost_fills_only_what_the_link_could_carry_in_a_decode_token():
    """Fills after a one-token token: at most the link's idle time in it over an upload's; after
    a prompt chunk (a step of several tokens): none (they would delay the first decode tokens)."""
    from scheduler import CostModel

    g = Geometry.uniform(1, 16, 2, 10)

    def policy(layer_s, **options):  # the CPU (0.2 s an expert) beats the link (1.0 s): misses go there
        cm = CostModel((0.1,), (0.0,), (1.0,), (0.2,), (0.0,), layer_s=(layer_s,))
        return make_policy("hybrid-cost", g, Capacity.per_layer(g, 8), cost_model=cm, **options)

    def after(p, step):
        d = p.plan(step)
        assert d.cpu == step.experts
        p.commit(d)
        return p.plan_background()

    assert after(policy(0.0), Step(0, (1, 2))) == ()  # idle link time 0.4 s: no upload fits
    assert sorted(m.expert for m in after(policy(3.0), Step(0, (1, 2)))) == [1, 2]  # 3.4 s: both fit
    assert len(after(policy(1.0), Step(0, (1, 2)))) == 1  # 1.4 s: one fits
    assert after(policy(3.0, prompt_fill=False), Step(0, (1, 2), (3, 1))) == ()  # a prompt chunk: none


@pytest.mark.parametrize("name", ["hybrid", "hybrid-cost"])
def test_a_prompt_chunk_fills_the_layers_room_with_its_most_used_misses(name):
    """With a cost model whose CPU beats the link, a decode step sends its misses to the CPU; a
    prompt chunk (more routes than top_k) still uploads its misses with the most tokens into the
    free room (its layer's share of a shared pool), leaving the cache holding what the prompt used most."""
    from scheduler import CostModel
    from scheduler.policies.hybrid import prompt_room

    g = Geometry.uniform(2, 16, 2, 10)
    cm = CostModel((0.1,) * 2, (0.0,) * 2, (1.0,) * 2, (0.2,) * 2, (0.0,) * 2)
    cap = Capacity.shared(g, [(0, 1)], [6])  # 3 slots a layer
    p = make_policy(name, g, cap, cost_model=cm)
    assert p.plan(Step(0, (1, 2))).cpu == (1, 2)  # decode: the CPU
    d = p.plan(Step(0, (1, 2, 3, 4, 5), (1, 4, 2, 6, 3)))
    assert sorted(d.uploads) == [2, 4, 5] and sorted(d.cpu) == [1, 3] and not d.streams
    p.commit(d)
    assert prompt_room(p.cache, cap, 0) == 0 and prompt_room(p.cache, cap, 1) == 3
    d = p.plan(Step(1, (7, 8), (3, 1)))
    assert sorted(d.uploads) == [7, 8]
    off = make_policy(name, g, cap, cost_model=cm, prompt_fill=False)
    assert off.plan(Step(0, (1, 2, 3, 4, 5), (1, 4, 2, 6, 3))).uploads == ()
