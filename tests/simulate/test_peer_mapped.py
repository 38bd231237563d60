"""simulate.peer.mapped_pool: the pool's calls on a memory-mapped model file take the hardware
file's cpu_mapped_factor times their time on the calibration's buffers."""
from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.costs import Costs, ExecConfig
from scheduler.hardware import load_hardware
from scheduler.models import load_model
from simulate.peer import mapped_pool


def test_every_pool_call_takes_the_factor_longer_and_nothing_else_moves():
    hw = load_hardware("h200-xeon16")
    assert not (hw.executor or {}).get("cpu_mapped_factor") and mapped_pool(hw) is hw  # no factor: as given
    with_factor = replace(hw, executor={**(hw.executor or {}), "cpu_mapped_factor": 1.5})
    mapped = mapped_pool(with_factor)
    model = load_model("qwen3-30b-a3b")
    a, b = Costs(model, with_factor, ExecConfig()), Costs(model, mapped, ExecConfig())
    for n in (1, 3, 8):
        assert b.cpu_call_s(0, n) == pytest.approx(1.5 * a.cpu_call_s(0, n))
    assert b.upload_s == a.upload_s and b.gpu_expert_s == a.gpu_expert_s
