"""simulate.fidelity.fit_lane: the read-back and the CPU layers' hand-off solved on the session's
own unlogged calibration runs; a recording made by the simulator itself gives its terms back."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from scheduler.hardware import load_hardware
from simulate import fidelity as fd
from simulate.run import SimConfig, run
from traces import synth

RUNS = (("lru", 25, None), ("lru", 64, None), ("hybrid", 25, 96), ("cpu", 25, None))


def _setup():
    model = fd.sim_model(3, 1024)
    trace = synth.generate(3, 128, 8, 40, synth.SynthParams(), np.random.default_rng(4))
    return model, tuple(trace.tokens()), load_hardware("docs/fidelity/h200-calibrated.json")


def _recorded(hw, model, tokens) -> dict:
    out = []
    for policy, slots, frac in RUNS:
        cfg = SimConfig(model=model.name, hardware=hw.name, policy=policy, cache_slots=slots,
                        miss_fraction=None if frac is None else frac / 256, token_graph=False)
        res, _ = run(cfg, hardware=hw, model=model, tokens=tokens)
        out.append({"policy": policy, "slots": slots, "miss_frac_256": frac, "token_s": list(res.token_s[16:])})
    return {"calibration_runs": out}


def test_the_simulators_own_runs_give_their_read_back_and_hand_off_back():
    model, tokens, hw = _setup()
    truth = replace(hw, executor={**hw.executor, "readback_s": 31e-6, "handoff_out_s": 47e-6})
    got, lane = fd.fit_lane(_recorded(truth, model, tokens), hw, model, tokens)
    assert set(lane) == {"readback_s", "handoff_out_s"}
    assert lane["readback_s"][0] == hw.executor["readback_s"]  # (the file's, the solved)
    assert lane["readback_s"][1] == pytest.approx(31e-6, rel=0.05)
    assert lane["handoff_out_s"][1] == pytest.approx(47e-6, rel=0.1)
    assert got.executor["readback_s"] == lane["readback_s"][1] and got.cpu_task_s == hw.cpu_task_s


def test_without_runs_of_both_kinds_nothing_is_solved():
    model, tokens, hw = _setup()
    raw = _recorded(hw, model, tokens)
    for keep in (("lru",), ("hybrid", "cpu")):
        only = {"calibration_runs": [c for c in raw["calibration_runs"] if c["policy"] in keep]}
        assert fd.fit_lane(only, hw, model, tokens) == (hw, None)
    assert fd.fit_lane({}, hw, model, tokens) == (hw, None)
