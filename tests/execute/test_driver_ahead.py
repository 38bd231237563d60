"""execute.driver: the run loop's look-ahead for a token graph (``TokenGraph.ahead``). A model whose
token graph completes every token asks for the next input while the finished token's steps are
still to be settled; the loop hands it over only when it continues the sequence, runs every input
exactly once and in order, and gives the decisions of a loop that never looks ahead. A model here
stands in for the GPU model: it follows ``MoeModel._token_fast``'s protocol (``launched``,
``steps``: the model after the token before its steps, then ``ahead(pos + 1)``)."""
from __future__ import annotations

import numpy as np

from execute.driver import ChunkInput, TokenInput, run
from scheduler import Capacity, Geometry, Step, make_policy
from scheduler.audit import Audit

L, E, K = 4, 16, 2


def _route(pos: int, token: int, layer: int) -> tuple[int, ...]:
    r = np.random.default_rng((pos, token, layer)).choice(E, K, replace=False)
    return tuple(int(e) for e in r)


class _Graph:
    def __init__(self, use_ahead: bool):
        self.use_ahead = use_ahead
        self.ahead = None
        self.pending = None
        self.offered: list[tuple[int, int | None]] = []  # (pos, what ahead gave)

    def launched(self, pos, token):
        return self.pending == (pos, token)

    def drop(self):
        self.pending = None


class _Model:
    """One token: every block through the 'graph' (step_done); a chunk: block by block (run_layer)."""

    class info:
        num_layers = L

    def __init__(self, use_ahead: bool):
        self.token_graph = _Graph(use_ahead)
        self.step_done = False
        self.router_predictor = None
        self.pos = 0
        self.logits = self.chunk_logits = None
        self.ran: list[tuple[int, tuple[int, ...]]] = []  # (pos, ids) in the order run

    def reset(self):
        self.pos = 0

    def deliver(self, y):
        pass

    def chunk_steps(self, ids, routes, all_logits, rollback):
        self.pos -= rollback
        tg = self.token_graph
        pos = self.pos
        self.ran.append((pos, tuple(ids)))
        if len(ids) == 1 and routes is None:
            assert tg.pending in (None, (pos, ids[0]))
            tg.pending = None
            self.chunk_logits = np.array([[float(pos * 7 + ids[0])]])
            self.logits = self.chunk_logits[-1]
            self.pos = pos + 1
            if tg.use_ahead and tg.ahead is not None:
                nxt = tg.ahead(pos + 1)
                tg.offered.append((pos + 1, nxt))
                if nxt is not None:
                    tg.pending = (pos + 1, nxt)
            for l in range(L):
                self.step_done = True
                try:
                    yield Step(l, _route(pos, ids[0], l))
                finally:
                    self.step_done = False
            return
        for l in range(L):
            self.last_input, self.last_ids, self.last_weights = None, None, None
            yield Step(l, tuple(sorted({e for t in ids for e in _route(pos, t, l)})))
        self.chunk_logits = np.array([[float(pos * 7 + ids[-1])]])
        self.logits = self.chunk_logits[-1]
        self.pos = pos + len(ids)


class _Backend:
    def __init__(self):
        self.settled = self.ran = 0

    def settle_layer(self, item):
        self.settled += 1

    def run_layer(self, item, x, ids, w):
        self.ran += 1

    def start_background(self, moves):
        pass

    def await_background(self, moves):
        pass


def _generation(model, n: int):
    """Inputs chosen from the model's logits as a generation loop does: a prompt chunk, one token,
    a second sequence, a forced route, then greedy-like tokens."""
    yield ChunkInput(0, 0, 0, "prefill", (3, 4, 5))
    yield TokenInput(1, 0, 3, "prefill", 6)
    yield TokenInput(2, 1, 0, "prefill", 1)  # a new sequence: reset, never taken ahead
    yield TokenInput(3, 1, 1, "prefill", 2, routes=(None,) * L)  # forced routes: never ahead
    pos = 2
    for i in range(n):
        tok = int(model.logits[0]) % 11
        yield TokenInput(4 + i, 1, pos, "decode", tok)
        pos += 1


def _run(use_ahead: bool, policy: str):
    model = _Model(use_ahead)
    g = Geometry.uniform(L, E, K, 1000)
    cap = Capacity.per_layer(g, 6)
    audit = Audit(g, keep_log=True)
    backend = _Backend()
    res = run(model, backend, make_policy(policy, g, cap), _generation(model, 12), audit=audit, keep_logits=True)
    return model, backend, audit, res


def test_look_ahead_takes_only_the_next_token_and_keeps_every_decision():
    for policy in ("lru", "hybrid"):
        m0, b0, a0, r0 = _run(False, policy)
        m1, b1, a1, r1 = _run(True, policy)
        assert m1.ran == m0.ran and len(m1.ran) == 16  # every input once, in order
        assert a1.digest() == a0.digest() and a1.records == a0.records
        assert [float(x[0]) for x in r1.logits] == [float(x[0]) for x in r0.logits]
        assert b1.settled == b0.settled == 14 * L and b1.ran == b0.ran == 2 * L
        offered = m1.token_graph.offered
        given = [p for p, t in offered if t is not None]
        # after the single prompt token the next input is a new sequence; after sequence 1's first
        # token, a forced route; after that and each decode token, the next decode token (the last
        # offer finds no input left)
        assert (4, None) in offered and (1, None) in offered and offered[-1] == (14, None)
        assert given == list(range(3, 14))
        assert m1.token_graph.ahead is None and m1.token_graph.pending is None
