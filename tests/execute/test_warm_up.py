"""MoeModel.warm_up (the chunk path's first uses and the decode graphs before a run's clock) changes
no bit: a prompt chunk and greedy decode tokens after it give the logits, decisions and routes of a
model that was not warmed, under ``gpu`` (token graphs complete) and ``lru`` (misses, uploads)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import model as M
from execute.gguf_model import load_model
from execute.synth import config_from_preset, synth_model
from scheduler import Capacity, make_policy
from scheduler.audit import Audit

from .conftest import cupy_or_skip

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    cfg = config_from_preset("tiny", arch="qwen3moe", quant="Q8_0", num_layers=4, seed=21)
    return load_model(synth_model(tmp_path_factory.mktemp("warm") / "m.gguf", cfg))


def _run(w, policy: str, slots: int, warm: bool):
    from execute.xp import host

    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    model = M.MoeModel(w, use_gpu=True, max_tokens=32)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    prompt = np.random.default_rng(3).integers(w.info.vocab, size=12).tolist()
    if warm:
        model.warm_up(len(prompt))
        assert model.pos == 0 and model.logits is None
        model.token_graph = backend.token_graph(model)
        assert model.token_graph is not None and model.token_graph.prepare()
    out = []

    def inputs(model):
        yield M.ChunkInput(0, 0, 0, "prefill", tuple(prompt))
        for i in range(6):
            t = int(np.argmax(host(model.logits)))
            out.append(t)
            yield M.TokenInput(len(prompt) + i, 0, len(prompt) + i, "decode", t)

    audit = Audit(g, keep_log=True)
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), inputs(model), 1, audit=audit, keep_logits=True)
    finally:
        backend.close()
    return np.concatenate([np.atleast_2d(x) for x in res.logits]), out, model.route_log, audit.digest()


@pytest.mark.parametrize("policy, slots", [("gpu", 8), ("lru", 3)])
def test_warm_up_changes_no_bit(weights, policy, slots):
    cupy_or_skip()
    cold = _run(weights, policy, slots, False)
    warm = _run(weights, policy, slots, True)
    assert np.array_equal(warm[0], cold[0])
    assert warm[1:] == cold[1:]


def test_warm_up_leaves_a_running_sequence_alone(weights):
    cp = cupy_or_skip()
    model = M.MoeModel(weights, use_gpu=True, max_tokens=16)
    model.pos = 3  # mid-sequence: the KV entries at 0..2 are the sequence's
    before = [k.copy() for k in model.k_cache]
    model.warm_up(8)
    assert all(bool(cp.array_equal(a, b)) for a, b in zip(before, model.k_cache)) and model.pos == 3
