"""experiments/speculative.py's sweeps and checks (moelab.speculative, moelab.speculative_report): every
executor configuration names its policy for moelab run; the simulated sweep's rows; the checks."""
from __future__ import annotations

import argparse
import pytest

from moelab import speculative as spx
from moelab import speculative_report as rep


def test_executor_configs_pass_the_policy_and_its_options():
    args = argparse.Namespace(policies="lru,hybrid,hybrid-cost,cpu", cache_slots=24, cache_mib=None,
                              hardware="h200-xeon16")
    got = list(spx.executor_configs(args))
    assert [p for p, _, _ in got] == ["lru"] + ["hybrid"] * len(spx.FRACTIONS) + ["hybrid-cost", "cpu"]
    for policy, frac, extra in got:
        assert extra[:2] == ["--policy", policy]
        assert ("--cache-slots" in extra) == (policy != "cpu")
        assert ("--miss-fraction" in extra) == (frac is not None) == (policy == "hybrid")
    assert got[-2][2][-2:] == ["--hardware", "h200-xeon16"]


def test_measure_cells_warms_up_then_runs_interleaved_rounds_in_alternating_order():
    calls = []

    def run(extra):
        calls.append(extra[0])
        return {"decode_tokens_per_s": float(len(calls))}, [1, 2, 3]

    got = spx.measure_cells(argparse.Namespace(repeats=3), [["a"], ["b"], ["c"]], run)
    assert calls == ["a", "a", "b", "c", "c", "b", "a", "a", "b", "c"]  # warm-up, then ABC CBA ABC
    assert [len(g) for g in got] == [3, 3, 3]
    assert [f["decode_tokens_per_s"] for f, _ in got[0]] == [2.0, 7.0, 8.0]


def test_measure_cells_refuses_greedy_runs_that_disagree():
    outs = iter([[1], [1], [1], [2]])

    def run(extra):
        return {}, next(outs)

    with pytest.raises(RuntimeError, match="disagree"):
        spx.measure_cells(argparse.Namespace(repeats=3), [["a"]], run)


def test_noise_note_says_whether_a_shortfall_is_inside_the_runs_spread():
    a, b = {"spread": 0.2}, {"spread": 0.1}
    assert rep.noise("r", 0.95, a, b) == "r (inside the runs' noise: half-spread 10%)"
    assert rep.noise("r", 0.85, a, b) == "r (outside the runs' noise: half-spread 10%)"
    assert rep.noise("r", 1.02, a, b) == "r"  # not short
    assert rep.noise("r", 0.9, {}, {"spread": ""}) == "r"  # simulated rows: no spread, no note


def _row(mode, draft, policy, tps, frac=""):
    return {"mode": mode, "draft_len": draft, "policy": policy, "miss_fraction": frac, "tokens_per_s": tps}


def test_evaluate_passes_and_fails_each_check_on_known_rows():
    rows = [_row("decode", 0, "lru", 10.0), _row("decode", 1, "lru", 12.0), _row("prefill", "", "lru", 50.0),
            _row("decode", 0, "hybrid", 11.0, 0.1), _row("decode", 1, "hybrid", 13.0, 0.1),
            _row("prefill", "", "hybrid", 60.0, 0.1),
            _row("decode", 0, "hybrid-cost", 11.0), _row("decode", 1, "hybrid-cost", 14.0),
            _row("prefill", "", "hybrid-cost", 60.0)]
    assert [ok for _, ok, _ in rep.evaluate(rows, 1)] == [True, True, True, True]
    rows[4]["tokens_per_s"] = rows[7]["tokens_per_s"] = 10.5  # speculative hybrid now below plain hybrid, lru gains
    got = {name: ok for name, ok, _ in rep.evaluate(rows, 1)}
    assert not got["spec hybrid beats plain hybrid where spec lru beats plain lru"]
    assert not got["speculative hybrid >= speculative lru"]
    rows[7]["tokens_per_s"] = 10.0  # hybrid-cost short of the fixed fraction
    assert "short in decode 1: 0.95" in dict((n, d) for n, _, d in rep.evaluate(rows, 1))[
        "hybrid-cost >= best fixed miss fraction"]


def test_simulated_sweep_rows_cover_every_draft_policy_and_prefill():
    args = argparse.Namespace(model="qwen3-30b-a3b", hardware="rtx4070super-5950x", cache_mib=5632.0, tokens=16,
                              acceptance=0.7, max_draft=1, prefill_chunk=8, seed=0, plan_repeats=1)
    rows = spx.simulated_sweep(args)
    configs = len(list(spx.policies()))
    assert len(rows) == 2 * configs + configs
    assert {(r["mode"], r["draft_len"]) for r in rows} == {("decode", 0), ("decode", 1), ("prefill", "")}
    assert all(r["tokens_per_s"] > 0 and r["plan_us_per_layer_step"] > 0 for r in rows)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "plan_us_per_layer_step"} for r in rs]  # noqa: E731
    assert strip(spx.simulated_sweep(args)) == strip(rows)  # deterministic but for the planning timer
