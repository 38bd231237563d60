"""``lookahead``'s guard: hybrid's decisions wherever its own extra moves do not pay.

The guard runs a *shadow* ``hybrid`` (its own cache, the same cost model) on the routes the policy
sees and prices both, token by token, with the policy's own timing model (``decision_time``, the
one ``lookahead``'s split uses: hits as one GPU batch, uploads after the link's queue, the CPU
pool's task and combine; background moves queue on the link). The shadow's background copies land
one token later (the driver's default lag). At each token's end, before its fills (``decide``),
over a decayed window of ``memory`` tokens: when the shadow's predicted time is below the policy's
by more than ``margin`` (a share), the policy's prefetches, fills, swaps and split are not earning
their link time (the first ``memory`` tokens are only measured: from cold caches, uploads that pay
later look slow), and from that token's fills on, for ``probe`` tokens, it *follows* hybrid, with
no prefetch and no held-over fills of its own. Following that starts again within ``memory`` tokens
of the last ending lasts ``backoff`` times as long as the last (each return to its own planning
costs the tokens it takes the decayed comparison to see the loss again); else ``probe``.
Following has two stages. While the policy's cache holds other experts than the shadow's, a second ``hybrid`` that shares the policy's cache (and has
observed every step it committed) makes each step's decision and each token's fills, its first
victims the residents the shadow's cache lacks (so its uploads bring the cache to the shadow's, at
no link time beyond hybrid's own). Once both caches hold the same experts, in flight alike
(``aligned``), the policy takes the shadow's own decisions and fills, in its own slots: from then
on it moves and runs exactly what ``hybrid`` alone would, so a backend charges both alike. Then the
policy plans again and is measured again. Everything is read from the past and the cost model: no
clock, deterministic, so a simulator and an executor decide alike.
"""
from __future__ import annotations

from collections import deque

from ..cache import ABSENT, RESIDENT
from ..core import Decision, Move
from ..costmodel import CostModel
from .hybrid import HybridPolicy

__all__ = ["Guard", "decision_time"]


def decision_time(cm: CostModel, d: Decision, queued: float) -> tuple[float, float]:
    """(predicted time of the layer, link work left after it) for decision ``d`` with ``queued``
    seconds of link work ahead of its copies (``lookahead``'s model, module docstring there)."""
    layer, step = d.step.layer, d.step
    cnt = dict(zip(step.experts, step.counts)) if step.counts is not None else None
    g = (lambda e: cm.gpu_s(layer, 1)) if cnt is None else (lambda e: cm.gpu_s(layer, cnt[e]))
    c = (lambda e: cm.cpu_s(layer, 1)) if cnt is None else (lambda e: cm.cpu_s(layer, cnt[e]))
    gpu = sum(g(e) for e in d.hits)
    moved = d.uploads + d.streams
    on_cpu = bool(d.cpu)
    if not moved and not on_cpu:  # every expert a hit
        return gpu, max(queued - gpu, 0.0)
    dl = cm.cpu_delay_s if on_cpu else 0.0
    pre = (gpu + cm.gpu_batch_s if d.hits else 0.0) + dl
    t = pre
    if moved:
        t = max(pre, max(queued, dl) + len(moved) * cm.upload_s[layer]) + cm.gpu_batch_s + sum(g(e) for e in moved)
    if on_cpu:
        t = max(t, cm.cpu_task_s + cm.cpu_copy_s + sum(c(e) for e in d.cpu)) + cm.cpu_combine_s
    return t, (0.0 if moved else max(queued - t, 0.0))


class Guard:
    """The shadow, the follower and the decayed comparison of the module docstring."""

    def __init__(self, geometry, capacity, cost_model: CostModel, cache, profile, memory: float, margin: float,
                 probe: int, backoff: float = 1.0):
        self.costs = cost_model
        self.layer_s = cost_model.layer_s or (0.0,) * geometry.num_layers
        self.shadow = HybridPolicy(geometry, capacity, profile, cost_model=cost_model)
        self.follow = HybridPolicy(geometry, capacity, None, cost_model=cost_model)
        self.follow.cache = self.cache = cache  # decides on the policy's cache; the policy commits
        self._mirror = None  # (decision, the shadow's) while it mirrors the shadow
        self._bg: tuple | None = None  # the shadow's fills planned at a followed token's end
        self.decay = 1.0 - 1.0 / memory
        self.margin, self.probe, self.backoff = margin, probe, backoff
        self._span = 0.0  # the last following's length (tokens)
        self._ended = -1  # the token count when the last following ended (-1: none yet)
        self._queue = 0.0  # the shadow's link work left
        self._token_s = 0.0  # the shadow's predicted time of the current token
        self._pending: deque = deque()  # the shadow's background batches not yet landed
        self.own = self.other = 0.0  # decayed predicted token times: the policy's, the shadow's
        self.left = 0  # tokens still to follow (0: the policy plans)
        self.tokens = 0  # tokens ended so far: the first ``memory`` are measured only (both caches cold)
        self.memory = memory
        self.followed = 0  # tokens followed so far (read by tests and reports)

    @property
    def active(self) -> bool:
        return self.left > 0

    def aligned(self) -> bool:
        """The policy's cache holds what the shadow's does, in flight alike (slots aside)."""
        a, b = self.cache, self.shadow.cache
        return a.inflight == b.inflight and a.slot.keys() == b.slot.keys()

    def plan(self, d_step, queue: float) -> tuple[Decision, float, float]:
        """The decision for ``d_step`` while following and its (time, link left) by
        ``decision_time``: the shadow's own, in this cache's slots, when the caches are aligned;
        else the follower's on this cache."""
        self._mirror = None
        if self.aligned():
            s = self.shadow.plan(d_step)
            d = self._slots(s)
            if d is not None:
                self._mirror = (d, s)
        if self._mirror is None:
            self._demote(d_step.layer)
            d = self.follow.plan(d_step)
        queued = max(queue - self.layer_s[d_step.layer], 0.0)
        return (d,) + decision_time(self.costs, d, queued)

    def _demote(self, layer: int) -> None:
        """The layer's residents that the shadow's cache lacks become the follower's first victims
        (least recent first), so its uploads bring this cache to the shadow's."""
        order = self.follow._lru[layer] if self.follow._lru is not None else None
        if order is None:
            return
        mine, its = self.cache.state[layer], self.shadow.cache.state[layer]
        for e in reversed([e for e in order if mine[e] == RESIDENT and its[e] == ABSENT]):
            order.move_to_end(e, last=False)

    def _slots(self, s: Decision) -> Decision | None:
        """The shadow's decision ``s`` with this cache's slots (None if it does not carry over)."""
        if s.promotions or s.retired:
            return None
        n_free = len(s.uploads) - len(s.evictions)
        slots = self.cache.free_slots(s.step.layer, n_free)
        return s._replace(slots=tuple(slots) + tuple(self.cache.slot[v] for v in s.evictions))

    def plan_background(self) -> tuple[Move, ...]:
        """A followed token's end: the shadow's fills in this cache's slots when the caches are
        aligned, else the follower's."""
        if not self.aligned():
            return self.follow.plan_background()
        self._bg = self.shadow.plan_background()
        return self._moves(self._bg)

    def _moves(self, moves) -> tuple[Move, ...]:
        """The shadow's background ``moves`` in this cache's slots."""
        cache, out, taken = self.cache, [], {}
        for m in moves:
            if m.victim is None:
                p = cache.pool_of[m.layer]
                taken[p] = taken.get(p, 0) + 1
                out.append(m._replace(slot=cache.free[p][-taken[p]]))
            else:
                out.append(m._replace(slot=cache.slot[m.victim]))
        return tuple(out)

    def step(self, d: Decision) -> None:
        """The policy committed ``d``: the follower observes it; the shadow commits its own (the
        one mirrored, or its plan now)."""
        self.follow.observe(d)
        sh, layer = self.shadow, d.step.layer
        s = self._mirror[1] if self._mirror is not None and self._mirror[0] is d else sh.plan(d.step)
        self._mirror = None
        sh.commit(s)
        t, self._queue = decision_time(self.costs, s, max(self._queue - self.layer_s[layer], 0.0))
        self._token_s += self.layer_s[layer] + t
        for e in s.uploads:
            sh.complete(layer, e)

    def moved(self, moves, ending: bool) -> None:
        """The policy committed background ``moves`` (``ending``: its token's end)."""
        self.follow.placed((m.layer, m.expert) for m in moves)
        if ending:
            self.follow.observe_background(moves, self.follow._swap_due())

    def complete(self, layer: int, expert: int) -> None:
        self.follow.background.discard((layer, expert))

    def decide(self, own_s: float) -> None:
        """A token's steps ended with ``own_s`` predicted seconds for the policy: the comparison,
        and whether the next tokens follow (decided before the token's fills, so they are the
        fills of whichever plans the next token)."""
        self.own = self.own * self.decay + own_s
        self.other = self.other * self.decay + self._token_s
        self.tokens += 1
        if self.left:
            self.left -= 1
            self.followed += 1
            if not self.left:
                self._ended = self.tokens
        elif self.tokens > self.memory and self.other < self.own * (1.0 - self.margin):
            again = self._ended >= 0 and self.tokens - self._ended <= self.memory
            self._span = self._span * self.backoff if again else float(self.probe)
            self.left = int(round(self._span))

    def end_token(self) -> None:
        """A token ended (after ``decide`` and the policy's fills): the shadow's fills."""
        sh = self.shadow
        moves = sh.plan_background() if self._bg is None else self._bg
        self._bg = None
        sh.commit_background(moves)
        self._queue += sum(self.costs.upload_s[m.layer] for m in moves)
        self._pending.append(moves)
        while len(self._pending) > 1:  # committed a token earlier: landed before the next starts
            for m in self._pending.popleft():
                sh.complete(m.layer, m.expert)
        self._token_s = 0.0
