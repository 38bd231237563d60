"""execute.cpu_experts_baseline (the float32 kernels bench_cpu_experts compares against) computes
what the current kernels compute, on every type it reads. Marked slow: the baseline is a benchmark
reference the executor never imports, and its cold Numba compile is a minute of the default suite
(``python -m pytest -m slow tests/execute/test_cpu_experts_baseline.py`` runs it)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import cpu_experts_baseline as old
from execute import quant as Q
from execute.cpu_experts import run_experts
from execute.experts import random_layer

from .conftest import biased, biased_reference

pytestmark = pytest.mark.slow

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.MXFP4, Q.F32, Q.F16, Q.BF16)


def rel(y, ref):
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("qtype", TYPES, ids=[Q.QTYPES[t].name for t in TYPES])
def test_baseline_matches_run_experts(qtype, rng, reference):
    """Float32 activations: within 1e-5 of the float64 reference; the current kernels' int8
    activations within their 2e-4 of the same reference, so the two agree to 2e-4."""
    layer = random_layer(rng, 2, num_experts=5, hidden=512, ffn=256, qtype=qtype)
    experts = [3, 0, 3, 4, 1, 3]
    x = rng.standard_normal((len(experts), 512)).astype(np.float32)
    want = reference(layer, experts, x)
    y = old.run_experts(layer, experts, x, threads=2)
    assert y.shape == (6, 512) and y.dtype == np.float32
    assert rel(y, want) < 1e-5
    assert rel(y, np.asarray(run_experts(layer, experts, x, threads=2), np.float64)) < 2e-4


def test_baseline_biases_and_oai_activation(rng):
    layer = biased(random_layer(rng, 0, num_experts=3, hidden=256, ffn=256, qtype=Q.Q4_0), rng, "swiglu_oai")
    experts = [2, 0, 2]
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert rel(old.run_experts(layer, experts, x), biased_reference(layer, experts, x)[0]) < 1e-5


def test_baseline_refuses_bad_ids(rng):
    layer = random_layer(rng, 0, num_experts=3, hidden=64, ffn=32, qtype=Q.Q8_0)
    with pytest.raises(ValueError, match="expert ids"):
        old.run_experts(layer, [3], np.zeros((1, 64), np.float32))
