"""Fixtures for the traces tests: the bundled trace, small synthetic traces, real-format writers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import traces
from traces.format import Trace
from traces.synth import SynthParams, generate

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def granite() -> Trace:
    return traces.load()


@pytest.fixture(scope="session")
def switch_dir() -> Path:
    return DATA / "switch-base-8"


def small_trace(rng: np.random.Generator, T: int = 40, L: int = 4, E: int = 16, k: int = 4,
                weights: bool = True, mask_share: float = 0.0, seqs: int = 2) -> Trace:
    """A synthetic trace with router weights and, optionally, masked (layer, row) entries."""
    t = generate(L, E, k, T, SynthParams(), rng, num_seqs=seqs)
    ids = np.array(t.expert_ids)
    w = None
    if weights:
        w = rng.dirichlet(np.ones(k), size=(T, L)).astype(np.float32)
        w = -np.sort(-w, axis=2)
    if mask_share:
        m = rng.random((T, L)) < mask_share
        ids[m] = -1
        if w is not None:
            w[m] = np.nan
    return Trace("tiny", (E,) * L, k, ids, t.seq, t.pos, t.phase, w, {"source": "test"})


@pytest.fixture
def tiny() -> Trace:
    return small_trace(np.random.default_rng(7))


def write_vllm(path: Path, trace: Trace, order: np.random.Generator | None = None, drop: float = 0.0,
               rng: np.random.Generator | None = None) -> int:
    """Write ``trace`` as vLLM-profiler JSONL (one record per routed (token, layer)); returns records."""
    recs = []
    for r in range(len(trace)):
        for l in range(trace.num_layers):
            ids = [int(e) for e in trace.expert_ids[r, l] if e >= 0]
            if not ids or (rng is not None and rng.random() < drop):
                continue
            rec = {"dataset": "gsm8k", "problem_id": int(trace.seq[r]), "layer": l, "token_idx": int(trace.pos[r]),
                   "experts": ids,
                   "gating_probs": None if trace.weights is None else [float(w) for w in trace.weights[r, l][:len(ids)]]}
            if trace.phase[r] == 0:
                rec["phase"] = "prefill"
            recs.append(rec)
    if order is not None:
        order.shuffle(recs)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return len(recs)


def strata_records(trace: Trace):
    """(layer, ids, weights) records of a single-sequence trace without masked entries."""
    for r in range(len(trace)):
        for l in range(trace.num_layers):
            yield l, trace.expert_ids[r, l].tolist(), trace.weights[r, l].tolist()
