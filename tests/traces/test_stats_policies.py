"""Every scheduler policy works in ``trace stats``: hybrid-cost with the default cost model, the
traffic beside each hit rate, and predict's gap closure on the bundled granite trace."""
from __future__ import annotations

import json

import numpy as np
import pytest

from scheduler import POLICIES
from traces import stats
from moelab.trace_cli import main

from .conftest import small_trace


def test_every_policy_runs_in_trace_stats(capsys):
    names = ",".join(POLICIES)
    assert main(["stats", "--phase", "decode", "--slots", "8", "--policies", names, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s["hit_rate"]) == set(POLICIES) == set(s["pcie_experts_per_token"])
    assert s["pcie_experts_per_token"]["gpu"]["8"] is None or s["pcie_experts_per_token"]["gpu"]["8"] == 0.0
    assert s["pcie_experts_per_token"]["static"]["8"] == 0.0
    assert s["pcie_experts_per_token"]["cpu"]["8"] == 0.0
    # lru uploads every miss: experts moved per token = misses per token
    lru_misses = (1 - s["hit_rate"]["lru"]["8"]) * 24 * 8
    assert s["pcie_experts_per_token"]["lru"]["8"] == pytest.approx(lru_misses, rel=1e-9)


def test_predict_closes_half_the_gap_on_granite(granite):
    s = stats.sweep(granite, [8, 16], ["lru", "predict", "belady"], "decode")
    for c in (8, 16):
        lru, pred, bel = s["lru"][c], s["predict"][c], s["belady"][c]
        assert (pred - lru) / (bel - lru) >= 0.5, c


def test_default_cost_model_fits_any_geometry():
    t = small_trace(np.random.default_rng(0), T=10, L=3, E=8, k=2)
    cm = stats.default_cost_model(t)
    assert len(cm.upload_s) == t.num_layers and len(set(cm.upload_s)) == 1 and cm.upload_s[0] > 0
    assert stats.sweep(t, [2], ["hybrid-cost"])["hybrid-cost"][2] is not None
