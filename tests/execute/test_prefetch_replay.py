"""hybrid-cost with its cross-layer prefetch through the executor's run loop: the decision log (with
the prefetch's moves) equals the scheduler's replay of the same routes, on the host and on a GPU."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import traces
from execute import model as M
from scheduler import Audit, Capacity, CostModel, Geometry, make_policy, replay

ROOT = Path(__file__).parents[2]
OPTIONS = {"prefetch": 4, "prefetch_fills": True, "prefetch_confidence": 0.2}


def costs(n: int) -> CostModel:  # windows of two uploads: the prefetch moves on every trace
    return CostModel((1e-6,) * n, (1e-6,) * n, (1e-5,) * n, (1e-6,) * n, (5e-5,) * n, 5e-6, layer_s=(2.5e-5,) * n)


def run_gpu(w, policy: str, slots: int, limit: int = 40):
    """The GPU engine over granite's routes folded to ``w`` with ``policy`` (hybrid-cost with the
    prefetch, or cpu); (result, audit, policy, the scheduler replay's digest)."""
    trace = M.fold_trace(traces.load(), w.info)
    g = Geometry(w.info.num_experts, trace.top_k, w.info.expert_bytes)
    cap = Capacity.per_layer(g, slots)
    opts = {"cost_model": costs(g.num_layers), **OPTIONS} if policy == "hybrid-cost" else {}
    make = lambda: make_policy(policy, g, cap, **opts)
    audit = Audit(g, keep_log=True)
    backend = M.EngineExperts(w, cap, 2, True, 120)
    pol = make()
    try:
        res = M.run(M.Qwen3Moe(w, use_gpu=True), backend, pol, M.trace_inputs(trace, w.info, limit=limit),
                    audit=audit, keep_logits=True)
    finally:
        backend.close()
    want = replay(make(), trace.tokens(None, 0, limit), audit=Audit(g, keep_log=True)).digest()
    return res, audit, pol, want


def test_prefetch_decisions_equal_the_scheduler_replay():
    """The executor's run loop (execute.driver.run) with every step settled by an expert engine
    without a GPU (experiments/bench_scheduler.py's stand-ins): the same log as the replay."""
    spec = importlib.util.spec_from_file_location("bench_scheduler", ROOT / "experiments" / "bench_scheduler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    toks = bench.synthetic_tokens(24, 0)
    g = Geometry.uniform(48, 128, 8, 5_000_000)
    make = lambda: make_policy("hybrid-cost", g, Capacity.per_layer(g, 16), cost_model=costs(48), **OPTIONS)
    pol, audit = make(), Audit(g, keep_log=True)
    model = bench._GraphModel(toks, 0)
    bench_run_audit(bench, pol, toks, g, model, audit)
    assert pol.prefetcher.moved > 0
    assert audit.digest() == replay(make(), toks, audit=Audit(g, keep_log=True)).digest()


def bench_run_audit(bench, policy, tokens, geometry, model, audit):
    """bench_scheduler.executor_loop with our audit."""
    from types import SimpleNamespace

    from execute.driver import TokenInput, run
    from execute.engine import ExpertEngine, LayerStats

    engine = ExpertEngine.__new__(ExpertEngine)
    noop = lambda *a: None  # noqa: E731
    engine.stats, engine.slot_of = LayerStats(), dict(policy.cache.slot)
    engine.gpu = SimpleNamespace(begin_copies=noop, upload=noop, compute_after_copies=noop)
    backend = SimpleNamespace(settle_layer=engine.settle_layer, start_background=noop, await_background=noop)
    model.reset()
    run(model, backend, policy, [TokenInput(t.index, 0, t.index, "decode", 0) for t in tokens], audit=audit)


@pytest.mark.gpu
def test_prefetch_on_the_gpu_engine(tiny_weights):
    pytest.importorskip("cupy")
    w = tiny_weights("Q8_0")
    ref, *_ = run_gpu(w, "cpu", 0)
    res, audit, pol, want = run_gpu(w, "hybrid-cost", 3)
    assert pol.prefetcher.moved > 0 and audit.digest() == want
    a, b = np.stack(res.logits), np.stack(ref.logits)
    assert float(((a - b) ** 2).sum() / (b ** 2).sum()) <= 1e-4
