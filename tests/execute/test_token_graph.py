"""execute.token_graph: a decode token as one CUDA graph (experts reading the routes and the slot
table on the device) gives the bits of the block-by-block path, with the same decisions, when every
expert is resident (``gpu``) and when a block misses (``lru`` on 3 of 8 slots: the graph halts and
the token continues block by block from that block)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import model as M
from execute.gguf_io import load_model
from execute.synth import config_from_preset, synth_model
from scheduler import Capacity, make_policy
from scheduler.audit import Audit

from .conftest import cupy_or_skip

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("token_graph"), {}

    def get(arch: str):
        if arch not in cache:
            cfg = config_from_preset("tiny", arch=arch, quant="Q8_0", num_layers=6, seed=13)
            cache[arch] = load_model(synth_model(root / f"{arch}.gguf", cfg))
        return cache[arch]

    return get


def _run(w, policy: str, slots: int, tokens, graph: bool, monkeypatch):
    monkeypatch.setenv("MOELAB_TOKEN_GRAPH", "1" if graph else "0")
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    audit = Audit(g, keep_log=True)
    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), inputs, audit=audit, keep_logits=True)
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
    from execute import token_graph

    monkeypatch.setattr(token_graph, "_MAX_SKIP", 0)  # try the graph on (almost) every token
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
