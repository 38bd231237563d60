"""``lookahead``'s guard: hybrid's decisions wherever its own extra moves do not pay.

The guard runs a *shadow* ``hybrid`` (its own cache, the same cost model) on the routes the policy
sees and prices both, token by token, with the policy's own timing model (``decision_time``, the
one ``lookahead``'s split uses: hits as one GPU batch, uploads after the link's queue, the CPU
pool's task and combine; background moves queue on the link). The shadow's background copies land
one token later (the driver's default lag). Over a decayed window of ``memory`` tokens, when the
shadow's predicted time is below the policy's by more than ``margin`` (a share), the policy's
prefetches, fills, swaps and split are not earning their link time (the first ``memory`` tokens are
only measured: from cold caches, uploads that pay later look slow), and for the next ``probe``
tokens it *follows*: a second ``hybrid`` that shares the policy's cache (and has observed every
step it committed) makes each step's decision and each token's fills; no prefetch, no held-over
fills. Then the policy plans again and is measured again. Everything is read from the past and
the cost model: no clock, deterministic, so a simulator and an executor decide alike.
"""
from __future__ import annotations

from collections import deque

from ..core import Decision
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
                 probe: int):
        self.costs = cost_model
        self.layer_s = cost_model.layer_s or (0.0,) * geometry.num_layers
        self.shadow = HybridPolicy(geometry, capacity, profile, cost_model=cost_model)
        self.follow = HybridPolicy(geometry, capacity, None, cost_model=cost_model)
        self.follow.cache = cache  # decides on the policy's cache; the policy commits
        self.decay = 1.0 - 1.0 / memory
        self.margin, self.probe = margin, probe
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

    def plan(self, d_step, queue: float) -> tuple[Decision, float, float]:
        """The follower's decision for ``d_step`` and its (time, link left) by ``decision_time``."""
        d = self.follow.plan(d_step)
        queued = max(queue - self.layer_s[d_step.layer], 0.0)
        return (d,) + decision_time(self.costs, d, queued)

    def step(self, d: Decision) -> None:
        """The policy committed ``d``: the follower observes it, the shadow plans its own."""
        self.follow.observe(d)
        sh, layer = self.shadow, d.step.layer
        s = sh.plan(d.step)
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

    def end_token(self, own_s: float) -> None:
        """A token ended with ``own_s`` predicted seconds for the policy: the shadow's fills, the
        comparison, and whether the next tokens follow."""
        sh = self.shadow
        moves = sh.plan_background()
        sh.commit_background(moves)
        self._queue += sum(self.costs.upload_s[m.layer] for m in moves)
        self._pending.append(moves)
        while len(self._pending) > 1:  # committed a token earlier: landed before the next starts
            for m in self._pending.popleft():
                sh.complete(m.layer, m.expert)
        self.own = self.own * self.decay + own_s
        self.other = self.other * self.decay + self._token_s
        self._token_s = 0.0
        self.tokens += 1
        if self.left:
            self.left -= 1
            self.followed += 1
        elif self.tokens > self.memory and self.other < self.own * (1.0 - self.margin):
            self.left = self.probe
