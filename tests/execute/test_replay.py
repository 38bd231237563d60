"""Trace replay through the real forward pass: decisions identical to scheduler.replay, folding, CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from execute import model as M
from execute.cli_replay import replay_main
from execute.gguf_io import read_model_info
from scheduler import Capacity, Geometry, make_policy, replay
from scheduler.audit import Audit
from traces import Trace


def granite_folded(info):
    return M.fold_trace(traces.load(), info)


def executor_replay(weights, trace, policy="cpu", slots=0, limit=30, use_gpu=False, backend=None):
    info = weights.info
    g = Geometry(info.num_experts, trace.top_k, info.expert_bytes)
    cap = Capacity.per_layer(g, slots)
    audit = Audit(g, keep_log=True, record_routes=True)
    model = M.Qwen3Moe(weights, use_gpu=use_gpu)
    backend = backend or (M.EngineExperts(weights, cap, 2, use_gpu, 120) if use_gpu else M.NumpyExperts(weights))
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), M.trace_inputs(trace, info, limit=limit),
                    audit=audit, keep_logits=True)
    finally:
        backend.close()
    return res, audit, g, cap


def scheduler_digest(g, cap, trace, policy="cpu", limit=30) -> str:
    audit = replay(make_policy(policy, g, cap), trace.tokens(None, 0, limit), audit=Audit(g, keep_log=True))
    return audit.digest()


def test_decision_log_equals_scheduler_replay(tiny_weights):
    w = tiny_weights("Q8_0")
    trace = granite_folded(w.info)
    res, audit, g, cap = executor_replay(w, trace)
    assert res.tokens == 30 and audit.tokens == 30
    assert audit.digest() == scheduler_digest(g, cap, trace)
    for rec, tok in zip(audit.records, trace.tokens(None, 0, 30)):
        assert [tuple(r[1]) for r in rec["routes"]] == [s.experts for s in tok.steps]


def test_trace_weights_are_used(tiny_weights):
    w = tiny_weights("F32")
    rng = np.random.default_rng(5)
    T, L, E, k = 6, 2, 8, 2
    ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)]).astype(np.int16)
    weights = rng.dirichlet(np.ones(k), size=(T, L)).astype(np.float32)
    trace = Trace("hand-made", [E] * L, k, ids, np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                  np.ones(T, np.int8), weights)
    M.check_trace(trace, w.info)
    res, audit, *_ = executor_replay(w, trace, limit=None)
    for t, rec in enumerate(audit.records):
        for l, (layer, experts, ws) in enumerate(rec["routes"]):
            assert experts == ids[t, l].tolist() and ws == pytest.approx(weights[t, l].tolist())


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**31))
def test_fold_trace_properties(num_layers, num_experts, top_k, model_layers, seed):
    top_k = min(top_k, num_experts)
    rng = np.random.default_rng(seed)
    T = 5
    ids = np.stack([np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers)])
                    for _ in range(T)]).astype(np.int16)
    trace = Trace("t", [num_experts] * num_layers, top_k, ids, np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                  np.ones(T, np.int8), rng.dirichlet(np.ones(top_k), size=(T, num_layers)).astype(np.float32))

    class Info:  # the fields fold_trace reads
        path, num_layers, num_experts, top_k, norm_topk = "m.gguf", model_layers, (3,) * model_layers, 2, True

    f = M.fold_trace(trace, Info)
    assert f.num_experts == (3,) * model_layers and f.top_k == min(2, top_k)
    for t, tok in enumerate(f.tokens()):
        for s in tok.steps:
            src = ids[t, s.layer % num_layers]
            assert len(set(s.experts)) == len(s.experts) <= 2 and all(0 <= e < 3 for e in s.experts)
            assert s.experts[0] == src[0] % 3 and sum(s.weights) == pytest.approx(1.0, abs=1e-5)
            kept = [int(e) % 3 for e in src]
            assert list(s.experts) == list(dict.fromkeys(kept))[:2]


def test_cli_replay_json_and_audit(synth_path, tmp_path, capsys):
    path = synth_path("Q8_0")
    audit_path = tmp_path / "audit.jsonl"
    rc = replay_main([str(path), "--policy", "cpu", "--map", "--tokens", "12", "--backend", "numpy", "--json",
                      "--audit", str(audit_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 12 and out["hit_rate"] == 0.0 and out["cpu"] == 12 * 2 * 2
    assert out["tokens_per_s"] > 0 and len(out["per_layer_ms_per_token"]) == 2
    lines = [json.loads(x) for x in audit_path.read_text().splitlines()]
    assert len(lines) == 13 and lines[-1]["summary"] and lines[-1]["digest"] == out["digest"]
    trace = granite_folded(read_model_info(path))
    for rec, tok in zip(lines[:-1], trace.tokens(None, 0, 12)):
        assert [tuple(r[1]) for r in rec["routes"]] == [s.experts for s in tok.steps]


def test_cli_replay_errors(synth_path, capsys):
    path = str(synth_path("Q8_0"))
    assert replay_main([path, "--policy", "cpu", "--tokens", "2"]) == 2
    assert "pass --map" in capsys.readouterr().err
    assert replay_main([path, "--policy", "lru", "--map", "--tokens", "2"]) == 2
    assert "--cache-mib" in capsys.readouterr().err


# on a GPU machine ------------------------------------------------------------------------------
GPU_POLICIES = [("gpu", 8), ("lru", 4), ("hybrid", 3), ("freq-lru", 4), ("predict", 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_gpu_policies_match_cpu_and_scheduler(quant, tiny_weights):
    pytest.importorskip("cupy")
    w = tiny_weights(quant)
    trace = granite_folded(w.info)
    base, *_ = executor_replay(w, trace, "cpu", 0, limit=40, use_gpu=True)
    ref = np.stack(base.logits)
    for policy, slots in GPU_POLICIES:
        res, audit, g, cap = executor_replay(w, trace, policy, slots, limit=40, use_gpu=True)
        got = np.stack(res.logits)
        assert float(((got - ref) ** 2).sum() / (ref**2).sum()) <= 1e-4, policy
        assert audit.digest() == scheduler_digest(g, cap, trace, policy, limit=40), policy
        if policy != "gpu":
            assert audit.summary()["hits"] > 0, policy
