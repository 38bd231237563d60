"""A rule-based state machine: steps, token ends and copy completions in any order."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler import MAX_FILLS_PER_TOKEN, Capacity, Geometry, Step, make_policy


class CacheMachine(RuleBasedStateMachine):
    @initialize(name=st.sampled_from(["hybrid", "lru", "freq-lru"]), num_experts=st.integers(3, 10),
                top_k=st.integers(1, 3), extra=st.integers(0, 6), shared=st.booleans(),
                frac=st.integers(0, 256))
    def setup(self, name, num_experts, top_k, extra, shared, frac):
        self.g = Geometry.uniform(3, num_experts, top_k, 10)
        slots = min(num_experts, top_k + extra)
        cap = (Capacity.shared(self.g, [[0, 1, 2]], [3 * slots]) if shared else Capacity.per_layer(self.g, slots))
        opts = {"miss_frac_256": frac, "swap_every": 2} if name == "hybrid" else {}
        self.policy = make_policy(name, self.g, cap, **opts)
        self.pending = []

    @rule(layer=st.integers(0, 2), data=st.data())
    def step(self, layer, data):
        n = self.g.num_experts[layer]
        experts = tuple(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=self.g.top_k, unique=True)))
        cache = self.policy.cache
        before_resident = {e for e in experts if cache.is_resident((layer, e))}
        d = self.policy.plan(Step(layer, experts))
        assert self.policy.plan(Step(layer, experts)) == d, "planning has no side effects"
        assert set(d.hits) == before_resident
        assert sorted(d.hits + d.uploads + d.streams + d.cpu) == sorted(experts)
        assert not {v for v in d.evictions if v[0] == layer and v[1] in experts}
        self.policy.commit(d)
        for e in d.uploads:
            self.policy.complete(layer, e)

    @rule()
    def end_token(self):
        moves = self.policy.plan_background()
        assert sum(1 for m in moves if m.victim is None) <= MAX_FILLS_PER_TOKEN
        free = {p: set(f) for p, f in enumerate(self.policy.cache.free)}
        for m in moves:
            if m.victim is None:
                assert m.slot in free[self.policy.cache.pool_of[m.layer]], "fills only into free slots"
        self.policy.commit_background(moves)
        self.pending.extend((m.layer, m.expert) for m in moves)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def complete_one(self, data):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        self.policy.complete(*self.pending.pop(i))

    @invariant()
    def cache_is_consistent(self):
        if hasattr(self, "policy"):
            cache = self.policy.cache
            cache.check()
            assert cache.inflight == set(self.pending)
            for p, (_, size) in enumerate(self.policy.capacity.pools):
                assert sum(k is not None for k in cache.owner[p]) <= size


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
