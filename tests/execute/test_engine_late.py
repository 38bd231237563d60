"""The late start (``gpu_step.LateStart``, ``MOELAB_LATE_START=1``) under the model's run loop:
decode tokens of a 6-block model with ``lru`` on 3 of 8 slots (most steps upload, so most late
pairs wait for their copy), each token tried as one graph (which halts at a miss; the token then
continues block by block, its steps begun early), and the same block by block: bitwise the
logits, routes and decisions of the run without it. A late pair that timed out (its output not
computed) is raised by the engine's ``synchronize`` with its step, layer, the word it last saw and
when the host queued its entries."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import graph as scheduler_graph

from .conftest import cupy_or_skip, decode_bits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def weights(graph_models):
    return graph_models


def _run(w, tokens, graph: bool, late: bool, monkeypatch):
    """(logits, route log, decision digest, late pairs) of ``lru`` on 3 slots per layer."""
    logits, routes, digest, late_pairs, built = decode_bits(w, tokens, "lru", monkeypatch, TOKEN_GRAPH=str(int(graph)),
                                                            LATE_START=str(int(late)))
    assert built == graph
    return logits, routes, digest, late_pairs


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_late_start_gives_the_bits_with_and_without_the_token_graph(weights, arch, monkeypatch):
    cupy_or_skip()
    w = weights(arch)
    tokens = np.random.default_rng(5).integers(w.info.vocab, size=40).tolist()  # the KV cache grows 8 -> 64
    monkeypatch.setattr(scheduler_graph, "MAX_SKIP", 0)  # try the graph on (almost) every token
    logits, routes, digest, n = _run(w, tokens, False, False, monkeypatch)
    assert n == 0
    for graph in (False, True):
        got, r, d, n = _run(w, tokens, graph, True, monkeypatch)
        assert n > 0, graph  # pairs ran late
        assert r == routes and d == digest, graph
        assert np.array_equal(got, logits), graph
