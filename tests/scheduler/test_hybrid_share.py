"""hybrid's PCIe share from a cost model (``CostShare``): the split, the reuse charge, the wiring."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Capacity, CostModel, Geometry, RunLayer, Step, Token, drive, make_policy, replay
from scheduler.policies.hybrid import REUSE_SCALE, CostShare

from .conftest import scenarios
from .test_invariants import checked


def flat(layers, gpu=0.0, upload=1.0, cpu=1.0, task=0.0, delay=0.0, gpu_tok=0.0, cpu_tok=0.0, copy=0.0, comb=0.0,
         batch=0.0):
    n = layers
    return CostModel((gpu,) * n, (gpu_tok,) * n, (upload,) * n, (cpu,) * n, (cpu_tok,) * n, task,
                     cpu_delay_s=delay, cpu_copy_s=copy, cpu_combine_s=comb, gpu_batch_s=batch)


def reference_times(hits_s, n_hits, gpu, cpu, n_busy, busy_s, up, task, delay, copy, comb, batch):
    """The layer's time for every k, written out as the simulator charges it without a host lane:
    the hits as a batch, the link then the uploaded experts as a batch for k uploads; the pool, its
    copies and the combine for the rest; the GPU side ``delay`` late when the pool is used."""
    out = []
    for k in range(len(gpu) + 1):
        pool = (len(gpu) - k) + n_busy > 0
        d = delay if pool else 0.0
        hits_end = d + batch + hits_s if n_hits else d
        g = max(hits_end, d + k * up) + batch + sum(gpu[:k]) if k else hits_end
        out.append(max(g, copy + task + busy_s + sum(cpu[k:])) + comb if pool else g)
    return out


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.lists(st.floats(0, 2), min_size=0, max_size=8), st.integers(0, 2),
       st.floats(0.01, 3), st.floats(0, 2), st.floats(0, 1), st.floats(0, 3), st.tuples(*[st.floats(0, 0.5)] * 3))
def test_split_is_the_least_time_by_brute_force(n_hits, gpu, n_busy, up, task, delay, cpu_scale, handoff):
    cpu = [g * cpu_scale + 0.1 for g in gpu]
    copy, comb, batch = handoff
    hits_s = 0.4 * n_hits
    if not gpu and not n_hits and not n_busy:
        n_hits, hits_s = 1, 0.4
    share = CostShare(flat(1, upload=up, task=task, delay=delay, copy=copy, comb=comb, batch=batch), 1)  # no reuse yet
    busy_s = 0.3 * n_busy
    times = reference_times(hits_s, n_hits, gpu, cpu, n_busy, busy_s, up, task, delay, copy, comb, batch)
    want = max(k for k, t in enumerate(times) if t == min(times))  # least time; ties: more uploads
    k, t = share.best(0, hits_s, n_hits, gpu, cpu, n_busy, busy_s)
    assert k == want or times[k] == pytest.approx(times[want], rel=1e-12)  # equal up to rounding
    assert t == pytest.approx(times[k], rel=1e-12)  # the split's own time (no reuse charge yet)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(batches=True), st.floats(1e-6, 1e-3), st.floats(1e-6, 1e-3), st.floats(0, 1e-3),
       st.floats(1.01, 10), st.floats(0, 1e-3), st.booleans(), st.integers(0, 2))
def test_no_miss_goes_to_the_cpu_when_it_is_slower_for_every_split(scenario, gpu, up, cpu, factor, delay,
                                                                  adaptive, lag):
    """The pool's task alone outlasts uploading and running every expert of any step: then no
    miss goes to the CPU but one whose background copy is still in flight (nothing is copied twice)."""
    geometry, capacity, tokens = scenario
    n = geometry.num_layers
    most = max(len(s.experts) for t in tokens for s in t.steps)
    gpu_max = gpu + 3 * gpu  # at most 3 tokens per expert
    task = factor * most * (up + 2 * gpu_max)
    cm = CostModel((gpu,) * n, (gpu,) * n, (up,) * n, (cpu,) * n, (cpu,) * n, task, cpu_delay_s=delay)
    policy = make_policy("hybrid", geometry, capacity, cost_model=cm, adaptive=adaptive)
    assert policy.share is not None
    checked(policy, tokens, lag)  # the cache invariants hold
    policy = make_policy("hybrid", geometry, capacity, cost_model=cm, adaptive=adaptive)
    cache = policy.cache
    for item in drive(policy, tokens, lag):
        if type(item) is RunLayer:
            for e in item.decision.cpu:
                assert (item.step.layer, e) in cache.inflight, "a miss on the CPU that was not in flight"
    if not adaptive:  # nothing in flight: the pool is never used
        assert replay(make_policy("hybrid", geometry, capacity, cost_model=cm, adaptive=False), tokens,
                      lag_tokens=lag).totals["cpu"] == 0


def test_a_pool_faster_than_any_upload_takes_every_miss():
    g = Geometry.uniform(1, 16, 8, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 4), cost_model=flat(1, upload=1e3, cpu=1.0, task=0.5))
    d = policy.plan(Step(0, tuple(range(8))))
    assert d.cpu == tuple(range(8)) and not d.uploads and not d.streams


@pytest.mark.parametrize("n_miss, n_pcie", [(1, 1), (2, 1), (3, 2), (4, 2), (8, 4)])
def test_equal_link_and_pool_split_a_step_in_half_ties_to_the_link(n_miss, n_pcie):
    """upload 1, CPU 1 per expert, no task: time max(k, n - k); a tie (n odd) goes to the link."""
    g = Geometry.uniform(1, 16, 8, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 0), cost_model=flat(1))
    d = policy.plan(Step(0, tuple(range(n_miss))))
    assert len(d.streams) == n_pcie and len(d.cpu) == n_miss - n_pcie


def test_token_counts_price_each_expert():
    """With counts: an expert of many tokens is dear on the CPU (cpu_tok), cheap on the GPU."""
    g = Geometry.uniform(1, 8, 2, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 0), cost_model=flat(1, upload=1.0, cpu=0.0, cpu_tok=0.8))
    d = policy.plan(Step(0, (1, 3, 5), (1, 6, 1)))  # 3: 4.8 s on the CPU; 1 and 5: 0.8 s each
    assert d.streams == (3,) and d.cpu == (1, 5)


def tok(i, *layers):
    return Token(i, 0, i, "decode", tuple(Step(l, tuple(es)) for l, es in enumerate(layers)))


def test_a_layer_that_hits_charges_its_cpu_misses_their_lost_reuse():
    """upload 1.0 vs CPU 0.9: a lone miss goes to the CPU while the layer shows no reuse; once its
    steps hit (reuse near 1), leaving the miss uncached costs ~0.9 more, so it is uploaded."""
    g = Geometry.uniform(1, 16, 2, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 4), cost_model=flat(1, upload=1.0, cpu=0.9),
                         adaptive=False)
    assert policy.plan(Step(0, (7,))).cpu == (7,)
    replay(policy, [tok(0, [1, 2])] + [tok(i, [1, 2]) for i in range(1, 80)])
    assert policy.share.reuse[0] >= REUSE_SCALE * 3 // 4
    d = policy.plan(Step(0, (1, 7)))
    assert d.hits == (1,) and d.uploads == (7,) and not d.cpu


def test_wiring_fraction_or_cost_model():
    g = Geometry.uniform(2, 8, 2, 10)
    cap = Capacity.per_layer(g, 3)
    cm = flat(2)
    by_cost = make_policy("hybrid", g, cap, cost_model=cm)
    assert by_cost.share is not None and by_cost.admit == "recency" and by_cost.swap_every == 0
    fixed = make_policy("hybrid", g, cap, cost_model=cm, miss_fraction=0.5)
    assert fixed.share is None and fixed.admit == "usage" and fixed.swap_every == 4 and fixed.miss_frac_256 == 128
    plain = make_policy("hybrid", g, cap)
    assert plain.share is None and plain.miss_frac_256 == 44 and plain.admit == "usage"
    usage = make_policy("hybrid", g, cap, cost_model=cm, admit="usage")
    assert usage.admit == "usage" and usage.swap_every == 4
    with pytest.raises(ValueError, match="hybrid admit"):
        make_policy("hybrid", g, cap, admit="lfu")
    with pytest.raises(ValueError, match="cost_model has 1 layers, the model 2"):
        make_policy("hybrid", g, cap, cost_model=flat(1))


def test_recency_admission_evicts_the_least_recently_used_resident():
    g = Geometry.uniform(1, 8, 2, 10)
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 3), cost_model=flat(1, cpu=1e3), adaptive=False)
    replay(policy, [tok(0, [0, 1]), tok(1, [2, 0]), tok(2, [0, 1])], lag_tokens=0)  # 2 used longest ago
    d = policy.plan(Step(0, (4, 0)))
    assert d.uploads == (4,) and d.evictions == ((0, 2),)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(scenarios(batches=True), st.sampled_from(["hybrid", "hybrid-cost"]), st.integers(0, 2))
def test_dropping_absent_experts_from_the_recency_order_changes_no_decision(monkeypatch, scenario, name, lag):
    """Recency admission without swap rounds drops absent experts from its order as it scans it:
    the decisions are those of a scan over every expert."""
    from scheduler import Audit
    from scheduler.policies import hybrid

    geometry, capacity, tokens = scenario
    n = geometry.num_layers
    cm = CostModel((1e-5,) * n, (2e-6,) * n, (9e-5,) * n, (1e-5,) * n, (7e-5,) * n, 5e-6)
    digest = lambda: replay(make_policy(name, geometry, capacity, cost_model=cm), tokens, lag_tokens=lag,
                            audit=Audit(geometry, keep_log=True)).digest()
    fast = digest()
    with monkeypatch.context() as m:
        m.setattr(hybrid, "_recent_victims", hybrid._unused_residents)
        assert digest() == fast


def test_fills_are_capped_by_the_links_idle_time_and_held_after_a_prompt():
    """With a cost model, a token's fills are at most what the link could carry in its idle time
    (its steps' predicted time less its demand copies, over one upload's time), none after a step
    of several tokens; the fixed share fills up to ``max_fills``."""
    g = Geometry.uniform(1, 16, 2, 10)
    cm = flat(1, gpu=1.0, upload=1.0, cpu=0.5)  # a lone miss: CPU 0.5 < link 1 + GPU 1
    policy = make_policy("hybrid", g, Capacity.per_layer(g, 8), cost_model=cm)
    d = policy.plan(Step(0, (3, 4)))
    assert d.cpu == (3, 4)
    policy.commit(d)
    t = cm.step_s(0, 0.0, 0, 0.0, 0, cm.pool_s(1.0, 2))[0]  # the step's predicted time, no copies
    assert policy.fill_cap() == int(t / 1.0) and len(policy.plan_background()) == min(2, int(t))
    policy.commit_background(policy.plan_background())
    chunk = policy.plan(Step(0, (5, 6), (3, 1)))
    policy.commit(chunk)
    assert policy.fill_cap() == 0 and policy.plan_background() == ()
    fixed = make_policy("hybrid", g, Capacity.per_layer(g, 8), cost_model=cm, miss_fraction=0.0)
    fixed.commit(fixed.plan(Step(0, (5, 6), (3, 1))))
    assert fixed.fill_cap() == fixed.max_fills and len(fixed.plan_background()) == 2
