"""The executor's mapped-memory hand-off on the simulator's host lane (tiny model of test_engine:
dense 4 us, the CPU pool 150 us per expert + 20 us per call)."""
from __future__ import annotations

import pytest

from scheduler import Decision, EndToken, RunLayer, Step, Token
from simulate import Costs, Simulator

from .conftest import round_hardware, tiny_model

US = 1e-6
HOST = {"host_dense_s": 50 * US, "readback_s": 10 * US, "host_cpu_submit_s": 20 * US}


def cpu_token(layers: int):
    t = Token(0, 0, 0, "decode", ())
    items = []
    for l in range(layers):
        s = Step(l, (0,))
        items.append(RunLayer(t, s, Decision(s, (), cpu=(0,))))
    return items + [EndToken(t)]


def total(executor: dict, layers: int, exec_cfg) -> float:
    costs = Costs(tiny_model(num_layers=layers), round_hardware(executor=executor), exec_cfg)
    return Simulator(costs).run(iter(cpu_token(layers))).total_s


def test_handed_off_cpu_layers_let_the_host_issue_the_next_dense_part(exec_cfg):
    """Synchronized, the host waits for the pool before it issues the next layer (50 us of
    dense issue after each CPU call); handed off, that issue overlaps the pool, whose calls run
    back to back but each after its input is put (edges 5 and 7 us)."""
    sync = {**HOST, "cpu_start_s": 5 * US, "cpu_return_s": 7 * US}
    handed = {**HOST, "handoff_in_s": 5 * US, "handoff_out_s": 7 * US}
    s = [total(sync, n, exec_cfg) for n in (1, 2, 3)]
    h = [total(handed, n, exec_cfg) for n in (1, 2, 3)]
    # synchronized, each further layer: dense issue 50, read-back 10, submit 20, start 5, pool 170, return 7
    assert s[2] - s[1] == pytest.approx(s[1] - s[0]) == pytest.approx(262 * US, abs=0.01 * US)
    # handed off, the dense issue and the head's issue run while the pool computes
    assert h[0] < s[0] and (s[2] - h[2]) - (s[1] - h[1]) >= 45 * US
    assert h[2] - h[1] >= (10 + 20 + 5 + 170 + 7) * US  # read-back, submit, in-edge, pool, out-edge in a chain


def test_cost_model_of_a_handed_off_layer(exec_cfg):
    """A handed-off call holds the host for its submit only; the pool's task carries both edges."""
    hw = round_hardware(executor={**HOST, "handoff_in_s": 5 * US, "handoff_out_s": 7 * US, "cpu_return_s": 99 * US})
    cm = Costs(tiny_model(), hw, exec_cfg).cost_model()
    assert cm.cpu_task_s == pytest.approx((20 + 20 + 5 + 7) * US) and cm.cpu_delay_s == pytest.approx(20 * US)
