"""``CostModel.step_s`` charges a layer what the simulator charges it (``simulate.engine``), with
and without the executor's host lane, so that ``hybrid-cost`` and ``hybrid``'s share price their
split with the simulator's own timing."""
from dataclasses import replace
from itertools import product

import pytest

from scheduler import Decision, Step, Token
from scheduler.costs import Costs, ExecConfig
from scheduler.drive import EndToken, RunLayer
from scheduler.hardware import load_hardware
from simulate.engine import Simulator

from .conftest import tiny_model

CALIBRATED = "docs/fidelity/h200-calibrated.json"


def hardware(kind: str):
    """The calibrated H200 (its host's planning and dense issue longer than the GPU's dense part
    with ``slow_host``), with the mapped-memory hand-off, or the preset (no host lane)."""
    if kind == "preset":
        return load_hardware("h200-xeon16")
    hw = load_hardware(CALIBRATED)
    ex = dict(hw.executor)
    if kind == "slow_host":
        ex.update(plan_s={"hybrid-cost": 2e-4}, host_dense_s=3e-4)
    if kind == "handoff":
        ex.update(handoff_in_s=21e-6, handoff_out_s=34e-6)
    return replace(hw, executor=ex)


def token_s(costs: Costs, d: Decision) -> float:
    """Simulated time of a token whose layer 0 runs ``d`` and layer 1 one fixed hit."""
    tok = Token(0, 0, 0, "decode", (d.step, Step(1, (0,))))
    items = [RunLayer(tok, d.step, d), RunLayer(tok, tok.steps[1], Decision(tok.steps[1], (0,))), EndToken(tok)]
    return float(Simulator(costs).run(items).token_s[0])


@pytest.mark.parametrize("kind", ["preset", "calibrated", "slow_host", "handoff"])
def test_step_s_is_the_simulators_layer_time(kind):
    model = tiny_model(num_layers=2, num_experts=16, top_k=8, hidden=2048, expert_ffn=768, expert_quant="Q8_0")
    costs = Costs(model, hardware(kind), ExecConfig(policy="hybrid-cost"))
    cm = costs.cost_model()
    assert (cm.lane is None) == (kind == "preset")
    offsets = []
    for n_hits, n_up, n_cpu in product(range(3), range(4), range(4)):
        if n_hits + n_up + n_cpu == 0:
            continue
        experts = tuple(range(n_hits + n_up + n_cpu))
        hits, up, cpu = experts[:n_hits], experts[n_hits:n_hits + n_up], experts[n_hits + n_up:]
        d = Decision(Step(0, experts), hits, uploads=up, slots=tuple(range(8, 8 + n_up)), cpu=cpu)
        g, c = cm.gpu_s(0, 1), cm.cpu_s(0, 1)
        t, left = cm.step_s(0, n_hits * g, n_hits, n_up * g, n_up, cm.pool_s(n_cpu * c, n_cpu))
        assert left == 0.0
        offsets.append(token_s(costs, d) - t)  # the rest of the token: the same for every split
    # the same to a nanosecond: the lead leaves out the next layer's KV read (one position here)
    assert max(offsets) - min(offsets) < 1e-9
