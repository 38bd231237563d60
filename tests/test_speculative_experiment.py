"""experiments/speculative.py's executor sweep: every configuration names its policy for moelab run."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("speculative_experiment",
                                               Path(__file__).parents[1] / "experiments" / "speculative.py")
spx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spx)


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
    assert spx._noise("r", 0.95, a, b) == "r (inside the runs' noise: half-spread 10%)"
    assert spx._noise("r", 0.85, a, b) == "r (outside the runs' noise: half-spread 10%)"
    assert spx._noise("r", 1.02, a, b) == "r"  # not short
    assert spx._noise("r", 0.9, {}, {"spread": ""}) == "r"  # simulated rows: no spread, no note
