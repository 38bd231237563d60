"""When a decode token runs as one CUDA graph: the rule the executor's token graph follows and the
simulator charges by.

The executor (``execute.token_graph``) captures a whole decode token, every block's dense part and
routed experts and the head, as one graph. A block's experts run in it only when every routed
expert of the block is in the slot table the graph read at its launch; the first block that
misses one halts the expert work (later blocks still run their dense launches, on stale inputs),
and the host runs the token block by block from there. Whether a token tries the graph at all is
:class:`GraphBackoff`'s: after a token the graph did not complete, the next 1, 2, 4 .. ``MAX_SKIP``
tokens run block by block (the wasted dense launches of an incomplete graph are not paid on every
token), and a complete token resets the back-off.

Both backends read these two pieces from here; neither reads a clock.
"""
from __future__ import annotations

from typing import Iterable

from .core import Decision

__all__ = ["MAX_SKIP", "GraphBackoff", "resident_at_launch"]

MAX_SKIP = 64  # the longest run of tokens that skip the graph after incomplete ones


class GraphBackoff:
    """Whether the next decode token tries the graph.

    ``want()`` is asked once per token that could run as a graph (it consumes one skipped token);
    ``done(complete)`` is told the outcome of each token that tried. Invariant: ``skip`` is 0 after
    a complete token, and after ``n`` incomplete ones in a row it is ``min(2 ** (n - 1), MAX_SKIP)``."""

    def __init__(self) -> None:
        self.skip = 0  # tokens still to run block by block
        self.backoff = 1  # the skip after the next incomplete token

    def want(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def done(self, complete: bool) -> None:
        if complete:
            self.backoff = 1
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, MAX_SKIP)


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
