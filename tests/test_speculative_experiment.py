"""experiments/speculative.py's executor sweep: every configuration names its policy for moelab run."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

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
