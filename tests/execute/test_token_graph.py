"""execute.token_graph: a decode token as one CUDA graph (experts reading the routes and the slot
table on the device) gives the bits of the block-by-block path, with the same decisions, when every
expert is resident (``gpu``) and when a block misses (``lru`` on 3 of 8 slots: the graph halts and
the token continues block by block from that block); with each next token chosen from the logits
(greedy), a token's graph launched while the host still settles the previous token (pipelining)
gives the same bits, tokens and decisions, background copies included (``hybrid``)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import model as M
from scheduler import Capacity, make_policy
from scheduler import graph as scheduler_graph
from scheduler.audit import Audit

from .conftest import cupy_or_skip

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def weights(graph_models):
    return graph_models


def _run(w, policy: str, slots: int, tokens, graph: bool, monkeypatch, lag_tokens: int = 1):
    monkeypatch.setenv("MOELAB_TOKEN_GRAPH", "1" if graph else "0")
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    audit = Audit(g, keep_log=True)
    inputs = tokens(model) if callable(tokens) else [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), inputs, lag_tokens, audit=audit, keep_logits=True)
        stats = backend.engine.stats
    finally:
        backend.close()
    return np.stack(res.logits), model, audit, stats


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("policy, slots", [("gpu", 8), ("lru", 3)])
def test_token_graph_gives_the_block_by_block_bits(weights, arch, policy, slots, monkeypatch):
    cupy_or_skip()
    w = weights(arch)
    tokens = np.random.default_rng(5).integers(w.info.vocab, size=40).tolist()  # the cache grows 8 -> 64
    monkeypatch.setattr(scheduler_graph, "MAX_SKIP", 0)  # try the graph on (almost) every token
    plain, m0, a0, _ = _run(w, policy, slots, tokens, False, monkeypatch)
    got, m1, a1, st = _run(w, policy, slots, tokens, True, monkeypatch)
    assert m0.token_graph is None and m1.token_graph is not None
    tg = m1.token_graph
    assert np.array_equal(got, plain)
    assert m1.route_log == m0.route_log and a1.digest() == a0.digest()
    if policy == "gpu":  # every expert resident: every token is one graph, every step settled
        assert tg.tokens == tg.complete == len(tokens)
        assert st.graph_steps == len(tokens) * w.info.num_layers and st.settled_moves == 0
    else:  # some tokens halt at a miss and continue block by block; some complete
        assert tg.tokens >= len(tokens) // 2 and st.graph_steps > 0 and a1.summary()["uploads"] > 0


def _greedy(first: int, n: int, out: list):
    """Inputs of a greedy generation: each token after the first is the argmax of the model's
    logits when the loop asks for it (appended to ``out``)."""
    from execute.xp import host

    def inputs(model):
        t = first
        for i in range(n):
            if i:
                t = int(np.argmax(host(model.logits)))
            out.append(t)
            yield M.TokenInput(i, 0, i, "decode", t)

    return inputs


# 7 of 8 slots: about one token in five finds every routed expert resident (the graph completes it
# and the next is launched ahead), the rest halt at a miss
@pytest.mark.parametrize("policy, slots, lag", [("gpu", 8, 1), ("hybrid", 7, 1), ("hybrid", 7, 0), ("lru", 7, 1)])
def test_pipelined_graphs_give_the_block_by_block_tokens(weights, policy, slots, lag, monkeypatch):
    cupy_or_skip()
    w = weights("qwen3moe")
    monkeypatch.setattr(scheduler_graph, "MAX_SKIP", 0)
    off, on = [], []
    plain, m0, a0, _ = _run(w, policy, slots, _greedy(7, 40, off), False, monkeypatch, lag)
    got, m1, a1, st = _run(w, policy, slots, _greedy(7, 40, on), True, monkeypatch, lag)
    tg = m1.token_graph
    assert on == off and np.array_equal(got, plain)
    assert m1.route_log == m0.route_log and a1.digest() == a0.digest()
    assert tg.ahead is None and tg._pending is None
    # after each completed token but the last, the next is launched ahead unless the KV cache grows
    # then (8 -> 16 -> 32 -> 64 positions)
    assert tg.complete > 0 and tg.complete - 4 <= tg.launched_ahead <= tg.complete
    if policy == "gpu":  # every token completes
        assert tg.complete == tg.tokens == len(on)
    else:  # some halt at a miss and continue block by block
        assert tg.complete < len(on) and a1.summary()["uploads"] + a1.summary()["cpu"] > 0
    if policy == "hybrid":
        assert a1.summary()["fills"] + a1.summary()["swaps"] > 0
