"""experiments/pool_wait_policy.py: one setting's measurement, in this process."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("pool_wait_policy",
                                               Path(__file__).parents[1] / "experiments" / "pool_wait_policy.py")
pwp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pwp)


def test_child_times_calls_pool_round_trips_and_the_gap():
    a = argparse.Namespace(threads=1, experts=2, hidden=64, ffn=32, gap_us=50.0, calls=20)
    got = pwp.child(a)
    assert set(got) == {"call_us", "pool_us", "gap_us", "layer"}
    assert got["call_us"] > 0 and got["pool_us"] > 0 and got["gap_us"] > 0
    assert set(pwp.SETTINGS) >= {"PASSIVE", "ACTIVE"}  # the reference and the spinning extreme
