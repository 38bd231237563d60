"""The one loop that drives a policy over a trace, for every backend.

Work items are immutable NamedTuples (one is built per layer-step).

``drive`` is a generator of work items. A backend consumes them in order and does the work:
the simulator in simulated time, the executor for real, ``replay`` not at all. The loop, not the
backend, passes completions back to the policy, at points fixed by the trace, so the same trace
and policy give the same decisions whatever the backend's speed:

- an on-demand upload (``RunLayer``) completes when its layer has run;
- background moves committed after token n complete before token ``n + 1 + lag_tokens`` starts
  (``AwaitBackground``: the backend blocks until those copies are done). ``lag_tokens=0`` is
  synchronous; the default 1 lets a fill overlap the next token's compute.
- a policy with ``plan_prefetch(step)`` may also return moves after each step (cross-layer
  prefetch): they start then and complete before the token's next step is planned, and before
  its background work; background batches started earlier complete first (the link is FIFO).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, NamedTuple, Union

from .core import Decision, Move, Policy, Step, Token

__all__ = ["RunLayer", "StartBackground", "AwaitBackground", "EndToken", "Item", "drive"]


class RunLayer(NamedTuple):
    """Run one step as decided: hits, uploads and streams on the GPU, cpu on the CPU pool; then
    copy each promoted expert from scratch into its slot."""

    token: Token
    step: Step
    decision: Decision


class StartBackground(NamedTuple):
    """Start these background copies (fills and swaps) on the copy stream."""

    token: Token
    moves: tuple[Move, ...]


class AwaitBackground(NamedTuple):
    """Block until these background copies have finished; they become resident after."""

    moves: tuple[Move, ...]


class EndToken(NamedTuple):
    token: Token


Item = Union[RunLayer, StartBackground, AwaitBackground, EndToken]


def drive(policy: Policy, tokens: Iterable[Token], lag_tokens: int = 1) -> Iterator[Item]:
    """Yield the work of replaying ``tokens`` under ``policy`` (see the module docstring)."""
    if lag_tokens < 0:
        raise ValueError(f"lag_tokens: {lag_tokens}, expected >= 0")
    pending: deque[tuple[int, tuple[Move, ...]]] = deque()
    complete = policy.complete
    plan, commit = policy.plan, policy.commit
    prefetch = getattr(policy, "plan_prefetch", None)
    n = 0
    for tok in tokens:
        while pending and pending[0][0] <= n:
            moves = pending.popleft()[1]
            yield AwaitBackground(moves)
            for m in moves:
                complete(m.layer, m.expert)
        early: tuple[Move, ...] = ()
        for step in tok.steps:
            if early:
                yield from _await_early(pending, early, complete)
                early = ()
            d = plan(step)
            commit(d)
            yield RunLayer(tok, step, d)
            if d.uploads:
                for e in d.uploads:
                    complete(step.layer, e)
            if d.promotions:
                for e in d.promotions:
                    complete(step.layer, e)
            if prefetch is not None:
                early = prefetch(step)
                if early:
                    policy.commit_background(early)
                    yield StartBackground(tok, early)
        if early:
            yield from _await_early(pending, early, complete)
        moves = policy.plan_background()
        policy.commit_background(moves)
        if moves:
            yield StartBackground(tok, moves)
            pending.append((n + 1 + lag_tokens, moves))
        yield EndToken(tok)
        n += 1
    while pending:
        moves = pending.popleft()[1]
        yield AwaitBackground(moves)
        for m in moves:
            complete(m.layer, m.expert)


def _await_early(pending: deque, early: tuple[Move, ...], complete) -> Iterator[Item]:
    """Complete every earlier background batch, then the prefetch ``early``."""
    while pending:
        moves = pending.popleft()[1]
        yield AwaitBackground(moves)
        for m in moves:
            complete(m.layer, m.expert)
    yield AwaitBackground(early)
    for m in early:
        complete(m.layer, m.expert)
