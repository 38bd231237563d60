"""moelab run/replay: ``--hardware`` gives ``hybrid`` the simulator's cost model for its PCIe share;
without it (or with ``--miss-fraction``) hybrid keeps a fixed share."""
from __future__ import annotations

import argparse

from execute.cli_generate import run_policy
from execute.cli_options import cost_options
from execute.model_spec import model_spec
from execute.synth import config_from_preset, synth_model
from scheduler import Capacity
from scheduler.costs import Costs, ExecConfig
from scheduler.hardware import load_hardware


def test_hardware_gives_hybrid_the_simulators_cost_model(tmp_path):
    path = synth_model(tmp_path / "m.gguf", config_from_preset("tiny", arch="qwen3moe", quant="Q8_0", seed=5))
    spec = model_spec(path)
    g = spec.geometry()
    args = argparse.Namespace(policy="hybrid", hardware="h200-xeon16", model=str(path), pageable=False,
                              miss_fraction=None, profile=None)
    cm = cost_options(args, "test")["cost_model"]
    assert cm == Costs(spec, load_hardware("h200-xeon16"), ExecConfig()).cost_model()  # the simulator's
    cap = Capacity.per_layer(g, 2)
    assert run_policy(args, g, cap).share is not None
    fixed = run_policy(argparse.Namespace(**{**vars(args), "miss_fraction": 0.5}), g, cap)
    assert fixed.share is None and fixed.miss_frac_256 == 128
    plain = argparse.Namespace(**{**vars(args), "hardware": None})
    assert cost_options(plain, "test") == {}
    assert run_policy(plain, g, cap).share is None and run_policy(plain, g, cap).miss_frac_256 == 44
