"""execute.model: the executor's forward pass against the float64 reference (execute.reference)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from execute import model as M
from execute.experts import ExecutorError
from execute.reference import reference_forward
from scheduler import Capacity, make_policy
from scheduler.audit import Audit

from .conftest import K_QUANTS, SMALL_QUANTS


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


def run_model(weights, token_ids, backend=None, routes=None, max_tokens=256, policy="cpu", seqs=None):
    info = weights.info
    g = info.geometry()
    pol = make_policy(policy, g, Capacity.per_layer(g, 0 if policy == "cpu" else info.top_k))
    seqs = seqs or [0] * len(token_ids)
    pos, inputs = 0, []
    for i, (t, s) in enumerate(zip(token_ids, seqs)):
        pos = 0 if i == 0 or s != seqs[i - 1] else pos + 1
        inputs.append(M.TokenInput(i, s, pos, "decode", int(t), None if routes is None else routes[i]))
    model = M.Qwen3Moe(weights, max_tokens=max_tokens)
    audit = Audit(g, keep_log=True, record_routes=True)
    res = M.run(model, backend or M.NumpyExperts(weights), pol, inputs, audit=audit, keep_logits=True)
    return np.stack(res.logits), res


TOKENS = [5, 300, 17, 17, 42, 256, 1]


@pytest.mark.parametrize("quant", SMALL_QUANTS + K_QUANTS)
def test_logits_match_float64_reference(quant, tiny_weights):
    w = tiny_weights(quant)
    got, res = run_model(w, TOKENS)
    ref, used = reference_forward(w, TOKENS)
    assert got.shape == (len(TOKENS), w.info.vocab) and np.isfinite(got).all()
    assert nmse(got, ref) <= 1e-6
    routes = [[tuple(r[1]) for r in rec["routes"]] for rec in res.audit.records]
    assert routes == [[u[0] for u in row] for row in used]
    assert res.tokens == len(TOKENS) and res.audit.summary()["cpu"] == len(TOKENS) * 2 * 2


def test_reference_check_detects_swapped_expert_weights(tiny_weights):
    w = tiny_weights("Q8_0")
    ref, used = reference_forward(w, TOKENS)
    routes = [tuple(M.Route(u[0], tuple(reversed(u[1])) if (t, l) == (3, 1) else u[1]) for l, u in enumerate(row))
              for t, row in enumerate(used)]
    got, _ = run_model(w, TOKENS, routes=routes)
    assert nmse(got[:3], ref[:3]) <= 1e-6  # same routing and weights as the reference up to token 3
    assert nmse(got[3:], ref[3:]) > 1e-5  # (agreement is ~1e-13) token 3's two experts swapped weights at block 1


def test_engine_cpu_path_matches_reference(tiny_weights):
    w = tiny_weights("Q4_0")
    cap = Capacity.per_layer(w.info.geometry(), 0)
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=False, timeout_s=120)
    try:
        got, _ = run_model(w, TOKENS, backend=backend)
    finally:
        backend.close()
    ref, _ = reference_forward(w, TOKENS)
    assert nmse(got, ref) <= 1e-6


def test_forced_routes_and_weights(tiny_weights):
    w = tiny_weights("F16")
    rng = np.random.default_rng(3)
    routes = []
    for t in range(len(TOKENS)):
        row = []
        for l in range(w.info.num_layers):
            ids = tuple(int(e) for e in rng.choice(8, 3, replace=False))
            row.append(M.Route(ids, tuple(float(v) for v in rng.dirichlet(np.ones(3)))) if t % 2 else M.Route(ids))
        routes.append(tuple(row))
    got, res = run_model(w, TOKENS, routes=routes)
    ref, used = reference_forward(w, TOKENS, routes=routes)
    assert nmse(got, ref) <= 1e-6
    rec = res.audit.records[1]["routes"][0]
    assert tuple(rec[1]) == routes[1][0].experts and rec[2] == pytest.approx(routes[1][0].weights)
    assert sum(res.audit.records[0]["routes"][1][2]) == pytest.approx(1.0)  # router weights renormalised


def test_kv_cache_grows_and_resets_per_sequence(tiny_weights):
    w = tiny_weights("Q8_0")
    grown, _ = run_model(w, TOKENS, max_tokens=2)
    full, _ = run_model(w, TOKENS, max_tokens=64)
    np.testing.assert_allclose(grown, full, rtol=1e-6, atol=1e-6)
    two, _ = run_model(w, TOKENS[:3] + TOKENS[:3], seqs=[0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(two[3:], two[:3], rtol=1e-6, atol=1e-6)


def test_softmax_topk_breaks_ties_by_id():
    ids, w = M.softmax_topk(np.array([0.1, 0.3, 0.3, 0.2, 0.1]), 3, norm=True)
    assert ids.tolist() == [1, 2, 3] and w.sum() == pytest.approx(1.0)
    ids, w = M.softmax_topk(np.array([0.1, 0.3, 0.3, 0.2, 0.1]), 2, norm=False)
    assert w.tolist() == [0.3, 0.3]


def test_cpu_backend_refuses_gpu_decisions(tiny_weights):
    w = tiny_weights("Q8_0")
    with pytest.raises(ExecutorError, match="only policy 'cpu'"):
        run_model(w, TOKENS[:2], policy="lru")


def test_gpu_without_cupy_is_a_clear_error(tiny_weights, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as on a machine without cupy: import fails
    with pytest.raises(ExecutorError, match="cupy"):
        M.Qwen3Moe(tiny_weights("Q8_0"), use_gpu=True)
