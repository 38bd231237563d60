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

Both backends read these pieces from here; neither reads a clock.
"""
from __future__ import annotations

from typing import Iterable

from .core import Decision
from .drive import AwaitBackground, EndToken, RunLayer

__all__ = ["MAX_SKIP", "MIN_RATE", "SMOOTHING", "GraphBackoff", "resident_at_launch"]

MAX_SKIP = 64  # the longest run of tokens that skip the graph after incomplete ones
MIN_RATE = 0.13  # every token tries while this share of recent tokens would have completed (dev routing)
SMOOTHING = 0.125  # weight of the newest token in that share (an exponential mean)


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
