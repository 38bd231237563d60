"""When a decode token runs as one CUDA graph: the rule the executor's token graph follows and the
simulator charges by.

The executor (``execute.token_graph``) captures a whole decode token, every block's dense part and
routed experts and the head, as one graph. A block's experts run in it only when every routed
expert of the block is in the slot table the graph read at its launch; the first block that
misses one halts the expert work (later blocks still run their dense launches, on stale inputs),
and the host runs the token block by block from there. Whether a token tries the graph at all is
:class:`GraphBackoff`'s: after a token the graph did not complete, the next 1, 2, 4 .. ``MAX_SKIP``
tokens run block by block (the wasted dense launches of an incomplete graph are not paid on every
token), and a complete token resets the back-off. The back-off alone would keep skipping tokens
that the graph would have completed; so every token that could run as a graph is scored, tried or
not (a skipped one from the driver items of its block-by-block run, ``see``), and while the
smoothed rate of tokens that would have completed is at least ``MIN_RATE`` every token tries.

With :class:`CpuMisses` wrapped around the policy, a one-token step never uploads: its misses run
on the CPU pool and the uploads the policy chose are queued as fills after the token, so a decode
token runs as one graph whatever the cache holds (the executor's ``MOELAB_GRAPH_CPU``, the
simulator's ``graph_cpu``); :func:`runs_in_graph` is that graph's rule for a block.

Both backends read these pieces from here; neither reads a clock.
"""
from __future__ import annotations

from typing import Iterable

from .cache import INFLIGHT
from .core import Decision, Move, Step
from .drive import AwaitBackground, EndToken, RunLayer

__all__ = ["MAX_SKIP", "MIN_RATE", "SMOOTHING", "GRAPH_CPU_AHEAD", "CpuMisses", "GraphBackoff", "resident_at_launch", "runs_in_graph"]

MAX_SKIP = 64  # the longest run of tokens that skip the graph after incomplete ones
MIN_RATE = 0.13  # every token tries while this share of recent tokens would have completed (dev routing)
SMOOTHING = 0.125  # weight of the newest token in that share (an exponential mean)
GRAPH_CPU_AHEAD = 15  # CPU-graph calls submitted ahead of the block being settled (the pool's ring of 16, less one)


class GraphBackoff:
    """Whether the next decode token tries the graph.

    ``want()`` is asked once per token that could run as a graph (a skipped one consumes one token
    of ``skip``); ``done(complete)`` is told the outcome of each token that tried; ``see(item)`` is
    given every driver item (``scheduler.drive``) in order and scores a skipped token at its
    ``EndToken``: it would have completed when every block was ``resident_at_launch``, copies
    awaited after its first block counting as arrived after the launch. Invariants: ``skip`` is 0
    after a complete token, and after ``n`` incomplete ones in a row it is
    ``min(2 ** (n - 1), MAX_SKIP)``; ``rate`` is the exponential mean (weight ``smoothing``) of
    the scores of the tokens asked about, in order, starting at 0; ``want()`` is True when ``skip``
    is 0 or ``rate >= min_rate``."""

    def __init__(self, min_rate: float = MIN_RATE, smoothing: float = SMOOTHING) -> None:
        if not 0.0 <= min_rate <= 1.0:
            raise ValueError(f"min_rate: {min_rate}, expected in [0, 1]")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: {smoothing}, expected in (0, 1]")
        self.min_rate, self.smoothing = min_rate, smoothing
        self.skip = 0  # tokens still to run block by block
        self.backoff = 1  # the skip after the next incomplete token
        self.rate = 0.0  # smoothed share of tokens that would have completed
        self._watch: tuple[bool, set] | None = None  # a skipped token being scored: (launched, arrived)
        self._whole = True  # every block of the watched token so far was resident at launch

    def want(self) -> bool:
        self._watch = None
        if self.skip and self.rate < self.min_rate:
            self.skip -= 1
            self._watch, self._whole = (False, set()), True
            return False
        return True

    def done(self, complete: bool) -> None:
        self._score(complete)
        if complete:
            self.skip, self.backoff = 0, 1
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, MAX_SKIP)

    def see(self, item) -> None:
        """Score a skipped token from its driver items; items of other tokens are ignored."""
        w = self._watch
        if w is None:
            return
        k = type(item)
        if k is RunLayer:
            if self._whole and not resident_at_launch(item.decision, w[1]):
                self._whole = False
            if not w[0]:
                self._watch = (True, w[1])
        elif k is AwaitBackground and w[0]:
            w[1].update((m.layer, m.expert) for m in item.moves)
        elif k is EndToken:
            self._watch = None
            self._score(self._whole)

    def _score(self, complete: bool) -> None:
        self.rate += self.smoothing * (float(complete) - self.rate)


def resident_at_launch(decision: Decision, arrived: Iterable[tuple[int, int]] = ()) -> bool:
    """Whether the graph runs ``decision``'s block: every routed expert is a hit and none of them
    became resident after the graph's launch (``arrived``: ``(layer, expert)`` pairs whose copies
    completed since then, e.g. a prefetch inside the token, or fills awaited after a launch ahead)."""
    d = decision
    if d.uploads or d.streams or d.cpu or len(d.hits) != len(d.step.experts):
        return False
    arrived = arrived if isinstance(arrived, (set, frozenset)) else set(arrived)
    layer = d.step.layer
    return not arrived or not any((layer, e) in arrived for e in d.hits)


def runs_in_graph(decision: Decision, arrived: Iterable[tuple[int, int]] = (), cpu: bool = False) -> bool:
    """Whether the graph runs ``decision``'s block: ``resident_at_launch``, or with ``cpu`` (the
    graph hands its misses to the CPU pool) when the block uploads and streams nothing and none of
    its hits became resident after the launch."""
    if not cpu:
        return resident_at_launch(decision, arrived)
    d = decision
    if d.uploads or d.streams:
        return False
    arrived = arrived if isinstance(arrived, (set, frozenset)) else set(arrived)
    layer = d.step.layer
    return not arrived or not any((layer, e) in arrived for e in d.hits)


class CpuMisses:
    """``policy`` with every miss of a one-token step (``counts`` None) computed on the CPU: the
    step's decision keeps the policy's hits, evictions and retired experts, puts every other routed
    expert on the CPU, and uploads nothing; the uploads (and promotions) the policy chose are
    committed to it at once (their slots taken, the experts in flight) and queued, in step order,
    as fills at the head of the token's background moves. Other steps get the policy's decision.
    A routed expert still in flight (its fill not complete) never gets a slot: the policy's upload
    of it (with the eviction paired with it) or its promotion is dropped, and it runs on the CPU.
    Prefetch (``plan_prefetch``) is off for one-token steps. ``max_fills``: a token defers at most
    that many uploads (in step order); the policy's uploads past it are dropped in the same way (the
    copy link then carries at most that many experts per token).

    Invariants: a one-token step's decision has no uploads, streams or promotions; every fill
    queued goes into the slot the policy took for it at the step; the policy commits its own
    decisions (less the slots dropped above) and its uploads complete as those fills do; planning
    changes no residency (``plan`` keeps only the pair to commit)."""

    def __init__(self, policy, max_fills: int | None = None) -> None:
        if max_fills is not None and max_fills < 0:
            raise ValueError(f"max_fills: {max_fills}, expected >= 0 (or None: no limit)")
        self.policy = policy
        self.max_fills = max_fills  # uploads deferred per token at most; the rest are not made
        self.name, self.geometry, self.capacity = policy.name, policy.geometry, policy.capacity
        self._planned: tuple | None = None  # (decision given, the policy's decision to commit)
        self._fills: list[Move] = []  # the token's deferred uploads
        self._own = 0  # how many moves of the last plan_background are the deferred fills
        if hasattr(policy, "plan_prefetch"):
            self.plan_prefetch = self._prefetch

    def __getattr__(self, name: str):  # cache, config, statistics: the policy's
        try:
            policy = self.__dict__["policy"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(policy, name)

    def plan(self, step: Step) -> Decision:
        p = self.policy
        d = p.plan(step)
        state = p.cache.state[step.layer]
        if any(state[e] == INFLIGHT for e in d.uploads + d.promotions):
            d = _without(d, lambda e: state[e] == INFLIGHT)
        if step.counts is None and self.max_fills is not None:
            room = self.max_fills - len(self._fills)
            if len(d.uploads) + len(d.promotions) > room:
                over = set((d.uploads + d.promotions)[max(room, 0):])
                d = _without(d, over.__contains__)
        if step.counts is not None:
            out = d
        else:
            hits = set(d.hits)
            cpu = tuple(e for e in step.experts if e not in hits)
            out = Decision(step, d.hits, cpu=cpu, evictions=d.evictions, retired=d.retired)
        self._planned = (out, d)
        return out

    def commit(self, decision: Decision) -> None:
        planned = self._planned
        if planned is None or planned[0] is not decision:
            raise ValueError("CpuMisses.commit: commit the decision its last plan returned")
        self._planned = None
        d = planned[1]
        self.policy.commit(d)
        if d is not decision:
            layer = d.step.layer
            self._fills.extend(Move(layer, e, s) for e, s in zip(d.uploads + d.promotions, d.slots + d.promotion_slots))

    def plan_background(self) -> tuple[Move, ...]:
        own = tuple(self._fills)
        self._fills = []
        self._own = len(own)
        return own + tuple(self.policy.plan_background())

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        self.policy.commit_background(moves[self._own:])
        self._own = 0

    def complete(self, layer: int, expert: int) -> None:
        self.policy.complete(layer, expert)

    def residents(self) -> list[tuple[int, int]]:
        return self.policy.residents()

    def _prefetch(self, step: Step) -> tuple[Move, ...]:
        return () if step.counts is None else self.policy.plan_prefetch(step)


def _without(d: Decision, drop) -> Decision:
    """``d`` without giving a slot to the experts ``drop(e)`` picks (in flight, or past the fill
    budget): such an upload leaves with its slot (and the eviction paired with it: uploads past the
    free slots take the evictions' slots in order) and runs on the CPU; such a promotion leaves with
    its slot (the expert stays streamed)."""
    n_free = len(d.uploads) - len(d.evictions)
    ups, slots, evs, cpu = [], [], [], list(d.cpu)
    for i, (e, s) in enumerate(zip(d.uploads, d.slots)):
        if drop(e):
            cpu.append(e)
            continue
        ups.append(e)
        slots.append(s)
        if i >= n_free:
            evs.append(d.evictions[i - n_free])
    keep = [i for i, e in enumerate(d.promotions) if not drop(e)]
    return d._replace(uploads=tuple(ups), slots=tuple(slots), evictions=tuple(evs), cpu=tuple(cpu),
                      promotions=tuple(d.promotions[i] for i in keep),
                      promotion_slots=tuple(d.promotion_slots[i] for i in keep))
