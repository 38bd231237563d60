"""The honest yardstick: a prefetch that lands after its step is no hit (simulator and trace stats
agree), demand hits, the evaluation set's cross-validation, and the oracle as a ceiling."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moelab.trace_cli import main
from scheduler import Audit, Capacity, drive, make_policy
from scheduler.costs import Costs, ExecConfig
from scheduler.hardware import load_hardware
from simulate import Simulator
from simulate.evaluate import (Case, cross_validate, gap_closed, measure, moe_only, synthetic_cases, trace_model)
from traces import load
from traces.stats import DemandAudit, summarize, sweep

ONLINE = ("lru", "freq-lru", "hybrid", "hybrid-cost", "predict", "lookahead")


@pytest.fixture(scope="module")
def granite():
    g = load(None)
    return g, tuple(g.tokens("decode"))[:24], trace_model(g)


def test_a_late_prefetch_is_no_hit(granite):
    """On the laptop preset one expert's copy (262 us) outlasts a layer's dense part (93 us), so
    each of predict's cross-layer prefetches lands after its step could start: the step waits, and
    the simulator does not count the expert as a hit, though the replay (no timing) does."""
    g, toks, model = granite
    hw = load_hardware("rtx4060-laptop")
    costs = Costs(model, hw, ExecConfig(policy="predict"))
    assert costs.upload_s[0] > costs.dense_s[0] + costs.route_s
    geometry = model.geometry()
    policy = make_policy("predict", geometry, Capacity.per_layer(geometry, 8))
    audit = DemandAudit(geometry, keep_records=False)
    res = Simulator(costs).run(drive(policy, toks, 1), audit)
    s = res.summary()
    a = audit.summary()
    assert res.late_hits > 0
    assert a["hits"] - res.late_hits >= audit.demand_hits  # a late prefetch is never a demand hit
    assert s["hit_rate"] == pytest.approx((a["hits"] - res.late_hits) / a["experts_served"])
    assert s["hit_rate"] < a["hit_rate"]
    # no prefetch: nothing is late, the simulator's hits are the audit's
    lru = make_policy("lru", geometry, Capacity.per_layer(geometry, 8))
    r2 = Simulator(Costs(model, hw, ExecConfig(policy="lru"))).run(drive(lru, toks, 1), Audit(geometry, keep_records=False))
    assert r2.late_hits == 0 and r2.summary()["hit_rate"] == r2.audit.summary()["hit_rate"]


def test_trace_stats_and_the_simulator_agree(granite, capsys):
    g, toks, model = granite
    assert main(["stats", "--phase", "decode", "--slots", "8", "--policies", "lru,predict", "--hardware",
                 "rtx4060-laptop", "--json", "--quiet"]) == 0
    s = json.loads(capsys.readouterr().out)
    all_toks = tuple(g.tokens("decode"))
    for name in ("lru", "predict"):
        m = measure(all_toks, model, "rtx4060-laptop", name, 8)
        assert s["hit_rate"][name]["8"] == pytest.approx(m["hit_rate"])
        assert s["demand_hit_rate"][name]["8"] == pytest.approx(m["demand_hit_rate"])
        assert s["tokens_per_s"][name]["8"] == pytest.approx(m["tokens_per_s"], rel=1e-9)
        assert s["pcie_experts_per_token"][name]["8"] == pytest.approx(m["moved_per_token"])
    free = sweep(g, [8], ["predict"], "decode")["predict"][8]  # replay: every prefetch a hit
    assert s["hit_rate"]["predict"]["8"] < free


def test_demand_hits_leave_out_prefetches(granite):
    g, toks, _ = granite
    out = summarize(g, "decode", [8], ["lru", "predict", "hybrid"])
    assert out["demand_hit_rate"]["lru"]["8"] == out["hit_rate"]["lru"]["8"]
    assert out["demand_hit_rate"]["predict"]["8"] < out["hit_rate"]["predict"]["8"]
    assert out["demand_hit_rate"]["hybrid"]["8"] <= out["hit_rate"]["hybrid"]["8"]


def test_cross_validation_holds_each_case_out():
    # case c prefers config 1 strongly; the others prefer config 0
    table = {"a": [1.0, 0.0], "b": [1.0, 0.0], "c": [0.0, 5.0]}
    default, held = cross_validate(lambda c, i: table[c][i], table, 2)
    assert default == 1  # 5 > 2 on all cases
    assert held == {"a": 1, "b": 1, "c": 0}  # c's own preference is not used for c
    assert gap_closed(1.5, 1.0, 2.0) == 0.5 and gap_closed(1.0, 2.0, 2.0) is None


def test_trace_model_fits_any_geometry():
    from traces import synth

    t = synth.generate(3, 16, 2, 6, synth.SynthParams(), np.random.default_rng(0))
    m = trace_model(t)
    assert m.geometry().num_experts == (16,) * 3 and m.top_k == 2
    assert moe_only(t) is t
    assert measure(tuple(t.tokens()), m, "h200-xeon16", "lru", 1) is None  # lru needs top_k slots
    assert measure(tuple(t.tokens()), m, "h200-xeon16", "oracle", 1)["tokens_per_s"] > 0
    r = measure(tuple(t.tokens()), m, "h200-xeon16", "lookahead", 2)  # its guard's share of tokens followed
    assert 0.0 <= r["followed"] <= 1.0 and "followed" not in measure(tuple(t.tokens()), m, "h200-xeon16", "lru", 2)
    assert "followed" not in measure(tuple(t.tokens()), m, "h200-xeon16", "lookahead", 2, {"guard_memory": 0.0})


def _online_below_oracle(cases, hardware):
    bad = []
    for c in cases:
        for h in hardware:
            for s in c.slots:
                top = measure(c.tokens, c.model, h, "oracle", s)["tokens_per_s"]
                for p in ONLINE:
                    r = measure(c.tokens, c.model, h, p, s)
                    if r is not None and r["tokens_per_s"] > top * (1 + 1e-9):
                        bad.append((c.name, h, s, p, r["tokens_per_s"], top))
    return bad


def test_oracle_is_a_ceiling_on_a_small_set(granite):
    g, toks, model = granite
    cases = [Case("granite", "real", toks, model, (8, 16))] + synthetic_cases(24)[:2]
    assert _online_below_oracle(cases, ("h200-xeon16", "rtx4060-laptop")) == []


@pytest.mark.slow
def test_oracle_is_a_ceiling_on_the_evaluation_set():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pe", Path(__file__).parents[2] / "experiments" / "policies_eval.py")
    pe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pe)
    assert _online_below_oracle(pe.cases(None), pe.HARDWARE) == []
