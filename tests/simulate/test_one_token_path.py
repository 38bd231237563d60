"""The executor's one-token path on the host lane: a one-token step of hits and uploads only runs
as two launches (``engine._run_one``), charged ``gpu_one_s`` + ``gpu_one_expert_scale`` x the
batch's per-expert time, the combine included; any other step stays a batch and its combine."""
from __future__ import annotations

import pytest

from scheduler import Decision, EndToken, RunLayer, Step, Token
from simulate import Costs, ExecConfig, Simulator

from .conftest import round_hardware, tiny_model

EX = {"host_dense_s": 100e-6, "dense_fixed_s": 0.0, "readback_s": 10e-6, "host_gpu_layer_s": 50e-6,
      "host_gpu_expert_s": 0.0, "host_copy_s": 5e-6, "gpu_batch_s": 20e-6, "combine_s": 8e-6, "wait_poll_s": 0.0,
      "plan_s": {"x": 1e-6}, "host_layer_plan_s": 15e-6, "host_layer_combine_s": 5e-6,
      "host_cpu_submit_s": 20e-6, "host_cpu_handoff_s": 7e-6, "host_cpu_queue_s": 40e-6,
      "host_cpu_combine_s": 25e-6, "cpu_start_s": 12e-6, "cpu_return_s": 9e-6, "host_head_s": 30e-6}
ONE = {"gpu_one_s": 300e-6, "gpu_one_expert_scale": 2.0}


def costs(executor: dict) -> Costs:
    hw = round_hardware(copy_latency_s=0.0, cpu_threads=1, cpu_thread_gbps=20.0, cpu_task_s=0.0, executor=executor)
    model = tiny_model(top_k=3, kv_elem_bytes=1, kv_elems_per_token=1)
    return Costs(model, hw, ExecConfig(policy="x"))


def token_s(executor: dict, decision_of) -> float:
    step = Step(0, (0, 1, 2))
    t = Token(0, 0, 0, "decode", (step,))
    return float(Simulator(costs(executor)).run([RunLayer(t, step, decision_of(step)), EndToken(t)]).token_s[0])


def test_costs_carry_the_one_token_path_only_with_its_fields():
    c = costs({**EX, **ONE})
    assert c.one_s == 300e-6 and c.one_expert_s[0] == pytest.approx(2 * c.gpu_expert_s[0])
    assert c.gpu_expert_s[0] == pytest.approx(3e6 / 100e9)  # 3 x 1000 x 500 F16 weights at 100 GB/s
    assert costs(EX).one_s is None


def test_hits_and_uploads_take_the_one_token_path():
    """The GPU's experts end the token here (the host's combine and head issue take 35 us, the
    experts 90 us or more), so the token grows by the difference of the two GPU charges."""
    for decide in (lambda s: Decision(s, (0, 1, 2)), lambda s: Decision(s, (0, 1), uploads=(2,), slots=(0,))):
        batch = token_s(EX, decide)
        one = token_s({**EX, **ONE}, decide)
        e = 3e6 / 100e9
        assert one - batch == pytest.approx((300e-6 + 3 * 2 * e) - (20e-6 + 3 * e + 8e-6))


@pytest.mark.parametrize("decide", [lambda s: Decision(s, (0, 1), cpu=(2,)),
                                    lambda s: Decision(s, (0, 1), streams=(2,))])
def test_cpu_experts_or_streams_keep_the_batch(decide):
    assert token_s({**EX, **ONE}, decide) == pytest.approx(token_s(EX, decide))


def test_the_scale_must_be_a_ratio(tmp_path):
    import json

    from simulate import HardwareError, load_hardware

    base = costs(EX).hw
    raw = {k: getattr(base, k) for k in ("name", "gpu_name", "gpu_mem_bytes", "gpu_mem_gbps", "gpu_tflops",
                                         "launch_s", "pcie_h2d_gbps", "pageable_gbps", "copy_latency_s", "cpu_name",
                                         "cpu_threads", "cpu_mem_gbps", "cpu_thread_gbps", "cpu_task_s")}
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({**raw, "executor": {**EX, **ONE, "gpu_one_expert_scale": 5.0}}))
    with pytest.raises(HardwareError, match="gpu_one_expert_scale"):
        load_hardware(p)
    p.write_text(json.dumps({**raw, "executor": {**EX, **ONE}}))
    assert load_hardware(p).executor["gpu_one_expert_scale"] == 2.0
