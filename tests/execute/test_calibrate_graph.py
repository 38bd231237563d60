"""The token graph's calibration (execute.calibrate_graph): the fit over model sizes, its fields in
the hardware file and on the simulator's graph lane; on a GPU, a measurement of a small model."""
from __future__ import annotations

import argparse

import pytest

from execute import calibrate as C
from execute import calibrate_graph as G
from scheduler.costs import Costs, ExecConfig

from .test_calibrate import fake_measurements, st

US = 1e-6


def runs(block: float, step: float, token: float, head: float = 30 * US) -> dict:
    """Per token at each model size: device = head + blocks x block; host = token + blocks x step."""
    return {str(b): {"device_s": st(head + b * block), "host_s": st(token + b * step)} for b in G.GRAPH_LAYERS}


def test_graph_fields_recover_block_step_and_token_costs():
    f = G.graph_fields(runs(70 * US, 9 * US, 25 * US))
    assert f["graph_block_s"] == pytest.approx(70 * US)
    assert f["graph_step_s"] == pytest.approx(9 * US)
    assert f["graph_token_s"] == pytest.approx(25 * US)


def test_graph_fields_fall_back_when_noise_hides_the_slope():
    r = runs(70 * US, 9 * US, 25 * US)
    big = str(max(G.GRAPH_LAYERS))
    r[big]["host_s"] = st(r[str(min(G.GRAPH_LAYERS))]["host_s"]["median"] * 0.9)  # host time fell with blocks
    f = G.graph_fields(r)
    assert f["graph_token_s"] == 0.0 and f["graph_step_s"] == pytest.approx(r[big]["host_s"]["median"] / int(big))
    with pytest.raises(ValueError, match="two model sizes"):
        G.graph_fields({"2": r["2"]})


def test_hardware_json_carries_the_graph_fields_to_the_simulator(tmp_path):
    m = fake_measurements()
    m["token_graph"] = {"runs": runs(70 * US, 9 * US, 25 * US), "fields": G.graph_fields(runs(70 * US, 9 * US, 25 * US))}
    path = tmp_path / "hw.json"
    C.write_json(path, C.hardware_json(m, "box"))
    from scheduler.hardware import load_hardware
    from scheduler.models import load_model

    hw = load_hardware(path)
    assert hw.executor["graph_block_s"] == pytest.approx(70 * US)
    assert "executor.token_graph" in hw.sources
    host = Costs(load_model("qwen3-30b-a3b"), hw, ExecConfig(policy="lru")).host
    assert host.graph_block_s == pytest.approx(70 * US) and host.graph_token_s == pytest.approx(25 * US)
    assert host.graph_step_s == pytest.approx(9 * US)  # no gpu planning measured: as measured
    m["plan_s"]["gpu"] = st(2 * US)
    hw = load_hardware(C.write_json(path, C.hardware_json(m, "box")) or path)
    host = Costs(load_model("qwen3-30b-a3b"), hw, ExecConfig(policy="lru")).host
    assert host.graph_step_s == pytest.approx((9 - 2 + 20) * US)  # measured under gpu: lru's planning in its place


def test_a_failed_graph_measurement_gives_no_graph_fields():
    m = fake_measurements()
    m["token_graph"] = {"error": "capture failed"}
    assert "graph_block_s" not in C.hardware_json(m, "box")["executor"]


@pytest.mark.gpu
def test_token_graph_measurement_on_a_small_model(tmp_path):
    pytest.importorskip("cupy")
    args = argparse.Namespace(experts=16, top_k=4, hidden=256, ffn=128, heads=4, kv_heads=2, head_dim=64, seed=0,
                              threads=2)
    m = G.measure_token_graph(args, tmp_path, reps=2, tokens=12, warmup=4)
    for b in G.GRAPH_LAYERS:
        r = m["runs"][str(b)]
        assert r["device_s"]["n"] == 2 and 0 < r["device_s"]["median"] <= r["wall_s"]["median"]
        assert 0 < r["host_s"]["median"] <= r["wall_s"]["median"] * 1.001
    f = m["fields"]
    assert f["graph_block_s"] > 0 and f["graph_step_s"] > 0 and f["graph_token_s"] >= 0
