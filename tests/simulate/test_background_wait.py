"""Awaited background copies on the host lane, as the executor waits for them: the GPU's next
expert work waits while the host goes on ("device", the default), or the host blocks ("host")."""
from __future__ import annotations

import pytest

from scheduler import Audit, AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from simulate import Costs, ExecConfig, Simulator

from .conftest import round_hardware, tiny_model

EX = {"host_dense_s": 20e-6, "dense_fixed_s": 0.0, "readback_s": 10e-6, "host_gpu_layer_s": 30e-6,
      "host_gpu_expert_s": 0.0, "host_copy_s": 5e-6, "gpu_batch_s": 10e-6, "combine_s": 2e-6, "wait_poll_s": 40e-6,
      "plan_s": {"x": 1e-6}, "host_layer_plan_s": 10e-6, "host_layer_combine_s": 0.0, "host_head_s": 10e-6}


def costs() -> Costs:
    hw = round_hardware(gpu_mem_gbps=1000.0, copy_latency_s=0.0, cpu_threads=1, cpu_thread_gbps=20.0, cpu_task_s=0.0,
                        executor=EX)
    model = tiny_model(num_layers=2, top_k=1, kv_elem_bytes=1, kv_elems_per_token=1)
    return Costs(model, hw, ExecConfig(policy="x"))


def items():
    """Layer 0 hits expert 0; a fill of (1, 2) starts (300 us over the link) and is awaited
    before layer 1, which then hits it."""
    s0, s1 = Step(0, (0,)), Step(1, (2,))
    t = Token(0, 0, 0, "decode", (s0, s1))
    moves = (Move(1, 2, 0),)
    return [RunLayer(t, s0, Decision(s0, (0,))), StartBackground(t, moves), AwaitBackground(moves),
            RunLayer(t, s1, Decision(s1, (2,))), EndToken(t)]


def run(wait: str, record: bool = False):
    c = costs()
    return Simulator(c, record=record, background_wait=wait).run(items(), Audit(c.model.geometry()))


def test_the_device_wait_frees_the_host_and_the_gpu_still_waits_for_the_copy():
    host, device = run("host", record=True), run("device", record=True)
    span = lambda r, lane, name: next(e for e in r.events if e[0] == lane and e[1].startswith(name))
    land = 3e6 / 10e9  # one F16 expert of 3 MB over 10 GB/s
    # device: a fill into a fresh slot starts as the host issues it; layer 1's experts start as it lands
    c = span(device, "copy", "background")
    assert span(device, "gpu", "L1 experts")[2] == pytest.approx(c[2] + land)
    # host: the batch waits for the GPU work queued before it (layer 0's experts and combine), the
    # host for the copy (half a poll), then queues layer 1's experts (20 us) before they start
    l0 = span(host, "gpu", "L0 experts")
    c = span(host, "copy", "background")
    assert c[2] == pytest.approx(l0[2] + l0[3] + EX["combine_s"])
    queue = EX["host_gpu_layer_s"] - EX["host_layer_plan_s"]
    assert span(host, "gpu", "L1 experts")[2] == pytest.approx(c[2] + land + EX["wait_poll_s"] / 2 + queue)
    assert device.token_s[0] < host.token_s[0]


def test_a_swap_waits_for_the_queued_kernels_on_the_device_too():
    its = items()
    moves = (Move(1, 2, 0, victim=(1, 3)),)
    its[1], its[2] = StartBackground(its[0].token, moves), AwaitBackground(moves)
    c = costs()
    r = Simulator(c, record=True, background_wait="device").run(its, Audit(c.model.geometry()))
    l0 = next(e for e in r.events if e[1].startswith("L0 experts"))
    assert next(e for e in r.events if e[0] == "copy")[2] == pytest.approx(l0[2] + l0[3] + EX["combine_s"])


def test_an_unknown_wait_is_refused():
    with pytest.raises(ValueError, match="background_wait"):
        Simulator(costs(), background_wait="sometimes")
