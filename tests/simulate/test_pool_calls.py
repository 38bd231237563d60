"""The CPU pool's per-count call factor (``Hardware.cpu_call_factor``) and the host lane's copy
terms (``host_copy_round_s``, ``host_plan_copy_s``): validation, and that every timing path charges
them (times in microseconds; conftest's round hardware: 20 us per call + 150 us per expert)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scheduler import Decision, EndToken, RunLayer, Step, Token
from simulate import Costs, ExecConfig, HardwareError, Simulator, load_hardware

from .conftest import round_hardware

US = 1e-6


def test_call_factor_keys_become_counts_and_bad_tables_name_the_field(tmp_path):
    assert round_hardware(cpu_call_factor={"1": 0.9, 2: 1.1}).cpu_call_factor == {1: 0.9, 2: 1.1}
    assert round_hardware().cpu_call_factor == {}
    for table, msg in (([0.9], "cpu_call_factor: expected an object"), ({"0": 1.0}, "key '0'"),
                       ({"x": 1.0}, "key 'x'"), ({"1.5": 1.0}, "key '1.5'"), ({"1": 0.0}, r"cpu_call_factor\.1: 0\.0"),
                       ({"2": 5}, r"cpu_call_factor\.2: 5"), ({"1": True}, r"cpu_call_factor\.1: True"),
                       ({"1": float("nan")}, r"cpu_call_factor\.1: nan")):
        with pytest.raises(ValueError, match=msg):
            round_hardware(cpu_call_factor=table)
    data = {k: v for k, v in round_hardware().__dict__.items() if k not in ("cpu_call_factor",)}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({**data, "cpu_call_factor": {"1": -1}}))
    with pytest.raises(HardwareError, match=r"bad\.json: field cpu_call_factor\.1: -1, expected a factor"):
        load_hardware(p)


def test_cpu_call_s_applies_the_factor_of_its_count_only(model, exec_cfg):
    c = Costs(model, round_hardware(cpu_call_factor={"1": 0.8, "3": 1.5}), exec_cfg)
    assert c.cpu_call_s(0, 0) == 0.0
    assert c.cpu_call_s(0, 1) == pytest.approx(0.8 * 170 * US)
    assert c.cpu_call_s(0, 2) == pytest.approx(320 * US)  # no factor for 2: the linear cost
    assert c.cpu_call_s(0, 3, [1, 1, 1]) == pytest.approx(1.5 * 470 * US)
    assert c.cpu_call_s(0, 1, [3]) == pytest.approx(0.8 * (20 + 450) * US)  # compute-bound batch: 3 tokens


def _items(decision_of, num_tokens: int = 1, counts=None):
    step = Step(0, (0, 1, 2), counts=counts)
    t = Token(0, 0, 0, "decode" if num_tokens == 1 else "prefill", (step,), num_tokens=num_tokens)
    return [RunLayer(t, step, decision_of(step)), EndToken(t)]


@pytest.mark.parametrize("executor", [{}, {"host_dense_s": 50 * US, "readback_s": 10 * US, "host_cpu_submit_s": 5 * US}])
@pytest.mark.parametrize("num_tokens,counts", [(1, None), (4, (4, 2, 1))])
def test_both_timing_loops_and_batches_charge_the_call_factor(model, exec_cfg, executor, num_tokens, counts):
    """A layer whose CPU call is its longest path: the token is shorter by exactly the factor's saving."""
    hw = round_hardware(executor=executor)
    fast = replace(hw, cpu_call_factor={1: 0.5})
    items = _items(lambda s: Decision(s, (0,), cpu=(2,)), num_tokens, counts)
    t_lin = Simulator(Costs(model, hw, exec_cfg)).run(items).token_s[0]
    t_fast = Simulator(Costs(model, fast, exec_cfg)).run(items).token_s[0]
    call = Costs(model, hw, exec_cfg).cpu_call_s(0, 1, None if counts is None else [1])
    assert call == pytest.approx(170 * US)
    assert t_lin - t_fast == pytest.approx(0.5 * call)


def test_a_copy_round_is_charged_once_and_copies_slow_the_next_layers_plan(model, exec_cfg):
    """Two layers on the host lane, the first with two uploads: the copy round (7 us) once in the
    first layer; the second layer's plan 2 x 4 us longer (host-bound: copies are fast here)."""
    ex = {"host_dense_s": 50 * US, "readback_s": 10 * US, "host_copy_s": 1 * US, "host_layer_plan_s": 20 * US}
    hw = round_hardware(pcie_h2d_gbps=1e4, executor=ex, gpu_mem_gbps=1e4)
    m = replace(model, num_layers=2)
    s0, s1 = Step(0, (0, 1)), Step(1, (0, 1))
    t = Token(0, 0, 0, "decode", (s0, s1))
    items = [RunLayer(t, s0, Decision(s0, (), uploads=(0, 1), slots=(0, 1))), RunLayer(t, s1, Decision(s1, (0, 1))),
             EndToken(t)]
    base = Simulator(Costs(m, hw, exec_cfg)).run(items).token_s[0]
    more = replace(hw, executor={**ex, "host_copy_round_s": 7 * US, "host_plan_copy_s": 4 * US})
    assert Simulator(Costs(m, more, exec_cfg)).run(items).token_s[0] - base == pytest.approx((7 + 2 * 4) * US)
