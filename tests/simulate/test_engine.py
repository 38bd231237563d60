"""Small scenarios computed by hand (times in microseconds, see conftest's round numbers).

Tiny model: one expert = 3,000,000 B; dense part 200,000 B (2 launches); head 2,000,000 B.
So: dense 4 us (+0.00064 us of KV per context position), route readback 10 us, an upload
10 + 300 = 310 us, a GPU expert batch 3 + 30 us per expert, the CPU pool 20 GB/s (150 us per expert)
+ 20 us per call, hidden-state copies 10.4 us each, the add of the CPU result 1 us, the head
2 + 20 + 10 = 32 us.
"""
from __future__ import annotations

import pytest

from scheduler import AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from simulate import Costs, Simulator

US = 1e-6
KV = 0.00064  # us per context position


def tok(i: int) -> Token:
    return Token(i, 0, i, "decode", ())


def layer(t: Token, **decision) -> RunLayer:
    experts = tuple(sorted(sum((tuple(v) for k, v in decision.items() if k in ("hits", "uploads", "cpu")), ())))
    step = Step(0, experts)
    return RunLayer(t, step, Decision(step, tuple(decision.get("hits", ())), uploads=tuple(decision.get("uploads", ())),
                                      slots=tuple(range(len(decision.get("uploads", ())))),
                                      cpu=tuple(decision.get("cpu", ()))))


@pytest.fixture
def sim(model, hw, exec_cfg):
    return Simulator(Costs(model, hw, exec_cfg))


def test_costs_match_hand_numbers(model, hw, exec_cfg):
    c = Costs(model, hw, exec_cfg)
    assert model.expert_bytes(0) == 3_000_000
    assert c.dense_s[0] == pytest.approx(4 * US)
    assert c.upload_s[0] == pytest.approx(310 * US)
    assert c.gpu_expert_s[0] == pytest.approx(30 * US)
    assert c.cpu_expert_s[0] == pytest.approx(150 * US)
    assert c.small_copy_s == pytest.approx(10.4 * US)
    assert c.token_s == pytest.approx(32 * US)


def test_one_upload(sim):
    t0 = tok(0)
    r = sim.run([layer(t0, uploads=(1,)), EndToken(t0)])
    # dense + KV(1 position) + route, then the copy, then the GPU batch, then the head
    assert r.token_s[0] == pytest.approx((4 + KV + 10 + 310 + 33 + 32) * US)
    assert r.bound_s[0] == pytest.approx((310 + 32) * US)  # PCIe-bound layer + head
    assert r.copy_busy_s == pytest.approx(310 * US)


def test_one_cpu_expert(sim):
    t0 = tok(0)
    r = sim.run([layer(t0, cpu=(2,)), EndToken(t0)])
    assert r.token_s[0] == pytest.approx((4 + KV + 10 + 10.4 + 20 + 150 + 10.4 + 1 + 32) * US)
    assert r.cpu_busy_s == pytest.approx(170 * US)


def test_hit_upload_and_cpu_overlap(sim):
    t0 = tok(0)
    r = sim.run([layer(t0, hits=(0,), uploads=(1,), cpu=(2,)), EndToken(t0)])
    # GPU hits (33) run during the upload (310); the CPU (10.4+170+10.4) finishes before the upload
    assert r.token_s[0] == pytest.approx((4 + KV + 10 + 310 + 33 + 1 + 32) * US)
    assert r.bound_s[0] == pytest.approx((310 + 32) * US)
    assert r.gpu_busy_s == pytest.approx((4 + KV + 33 + 33 + 1 + 32) * US)


def test_upload_queues_behind_background_copies(sim):
    t0, t1 = tok(0), tok(1)
    moves = (Move(0, 2, 0), Move(0, 3, 1))
    items = [layer(t0, hits=(0,)), StartBackground(t0, moves), EndToken(t0), layer(t1, uploads=(1,)), EndToken(t1)]
    r = sim.run(items)
    end0 = 4 + KV + 10 + 33 + 32
    assert r.token_s[0] == pytest.approx(end0 * US)
    # background copies run from 47.00064 to 667.00064 us; token 1's upload waits behind them (FIFO)
    bg_done = end0 - 32 + 2 * 310
    assert r.token_s[1] == pytest.approx((bg_done + 310 + 33 + 32 - end0) * US)
    assert r.copy_busy_s == pytest.approx(3 * 310 * US)


def test_await_background_blocks_the_next_token(sim):
    t0, t1 = tok(0), tok(1)
    moves = (Move(0, 2, 0), Move(0, 3, 1))
    items = [layer(t0, hits=(0,)), StartBackground(t0, moves), EndToken(t0), AwaitBackground(moves),
             layer(t1, hits=(2,)), EndToken(t1)]
    r = sim.run(items)
    end0 = 4 + KV + 10 + 33 + 32
    bg_done = end0 - 32 + 2 * 310
    assert r.token_s[1] == pytest.approx((bg_done + 4 + 2 * KV + 10 + 33 + 32 - end0) * US)
    assert r.total_s == pytest.approx((bg_done + 4 + 2 * KV + 10 + 33 + 32) * US)


def test_pageable_uploads_are_slower(model, hw):
    from simulate import ExecConfig

    pinned = Costs(model, hw, ExecConfig(pinned=True)).upload_s[0]
    pageable = Costs(model, hw, ExecConfig(pinned=False)).upload_s[0]
    assert pageable == pytest.approx(10 * US + 3e6 / 5e9)
    assert pageable > pinned


def test_multi_token_step_scales_compute(model, hw, exec_cfg):
    c = Costs(model, hw.__class__(**{**hw.__dict__, "gpu_tflops": 0.001}), exec_cfg)
    # 1.5e6 weights * 2 flops per token at 1 GFLOP/s = 3 ms per token: compute-bound beyond 1 token
    assert c.gpu_experts(0, [1]) == pytest.approx(3e-3)
    assert c.gpu_experts(0, [4]) == pytest.approx(4 * 3e-3)
    assert c.cpu_experts(0, [1]) == pytest.approx(150 * US)
    assert c.cpu_experts(0, [3]) == pytest.approx(3 * 150 * US)  # compute-bound: 20 GB/s per token


def test_cost_model_for_the_scheduler_is_the_simulators_charge(model, hw, exec_cfg):
    c = Costs(model, hw, exec_cfg)
    cm = c.cost_model()
    for tokens in (1, 2, 3, 8, 64, 512):  # the roofline: weights read once, compute per token
        assert cm.gpu_s(0, tokens) == pytest.approx(c.gpu_experts(0, [tokens]))
        assert cm.cpu_s(0, tokens) == pytest.approx(c.cpu_experts(0, [tokens]))
    assert cm.upload_s[0] == pytest.approx(310 * US) and cm.cpu_task_s == pytest.approx(20 * US)


def test_cost_model_charges_a_cpu_layer_the_executors_host_work(model, hw, exec_cfg):
    """With measured executor costs, using the pool at all also holds the host thread: submit,
    pool start, hand-off, return and the combine beyond a GPU-only layer's, once per layer."""
    ex = {"host_cpu_submit_s": 50 * US, "cpu_start_s": 30 * US, "host_cpu_handoff_s": 150 * US,
          "cpu_return_s": 35 * US, "host_cpu_combine_s": 90 * US, "host_layer_combine_s": 25 * US}
    c = Costs(model, hw.__class__(**{**hw.__dict__, "executor": ex}), exec_cfg)
    cm = c.cost_model()
    assert cm.cpu_task_s == pytest.approx((20 + 50 + 30 + 150 + 35 + 65) * US)
    assert cm.cpu_delay_s == pytest.approx((50 + 150) * US)  # submitted before the GPU work is queued
    assert Costs(model, hw, exec_cfg).cost_model().cpu_delay_s == 0.0  # no executor block: no host lane


def test_hybrid_cost_policy_runs_with_the_simulators_costs():
    from simulate import SimConfig, run

    result, _ = run(SimConfig(policy="hybrid-cost", tokens=20))
    s = result.summary()
    assert s["tokens"] == 20 and s["hits"] + s["uploads"] + s["streams"] + s["cpu_experts"] == 20 * 24 * 8
