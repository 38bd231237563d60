"""The moves probe's workloads (execute.calibrate_moves) and their simulation (moelab.sim_vs_real):
one event of one kind per layer and token, residency consistent, and the summary's arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from execute.calibrate_moves import EVENTS, KINDS, RESIDENT, ScriptedPolicy, moves_summary, moves_tokens
from moelab.sim_vs_real import predict_moves
from scheduler.core import Geometry
from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from scheduler.hardware import load_hardware
from simulate.fidelity import sim_model

GEO = Geometry((128,) * 4, 8, (5013504,) * 4)


def replay(kind, n=9):
    """Drive the workload, tracking residency as the engine does; returns per-kind event counts."""
    pol = ScriptedPolicy(GEO, kind)
    res = dict(pol.residents())  # (layer, expert) -> slot
    slots = {}
    for (l, e), s in res.items():
        assert slots.setdefault((l, s), e) == e  # one expert a slot
    got = {"uploads": 0, "streams": 0, "moves": 0, "cpu": 0, "tokens": 0}
    for item in drive(pol, moves_tokens(kind, GEO.num_layers, n)):
        if type(item) is RunLayer:
            d = item.decision
            assert sorted(d.hits + d.uploads + d.streams + d.cpu) == sorted(item.step.experts)
            assert all((d.step.layer, e) in res for e in d.hits)
            assert all(e < RESIDENT for e in d.hits)
            for v in d.evictions:
                del res[v]
            for e, s in zip(d.uploads, d.slots):
                assert s not in {res[k] for k in res if k[0] == d.step.layer}  # the slot was freed
                res[d.step.layer, e] = s
            got["uploads"] += len(d.uploads)
            got["streams"] += len(d.streams)
            got["cpu"] += len(d.cpu)
        elif type(item) is StartBackground:
            for m in item.moves:
                if m.victim is None:  # a fill: into a slot no expert ever held
                    assert m.slot not in {v for (l, _), v in res.items() if l == m.layer} and m.slot >= 27
                else:
                    assert res.pop(m.victim) == m.slot  # the victim held the slot
            got["moves"] += len(item.moves)
        elif type(item) is AwaitBackground:
            for m in item.moves:
                res[m.layer, m.expert] = m.slot
        elif type(item) is EndToken:
            got["tokens"] += 1
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_one_event_per_layer_and_token(kind):
    got = replay(kind)
    n = 9 * GEO.num_layers
    want = {"hits": {}, "upload": {"uploads": n}, "stream": {"streams": n}, "stream2": {"streams": 2 * n},
            "swap": {"moves": n}, "fill": {"moves": n}, "cpu": {"cpu": n}, "cpuswap": {"cpu": n, "moves": n},
            "cpufill": {"cpu": n, "moves": n}, "cpustream": {"cpu": n, "streams": n}}[kind]
    assert got == {"uploads": 0, "streams": 0, "moves": 0, "cpu": 0, **want, "tokens": 9}
    assert EVENTS[kind] * n == want.get("moves", want.get("streams", sum(want.values())))


def test_bad_kind_and_top_k():
    with pytest.raises(ValueError, match="kind"):
        moves_tokens("evict", 2, 2)
    with pytest.raises(ValueError, match="top_k"):
        moves_tokens("hits", 2, 2, top_k=40)


def runs_of(ms_per_token: dict, rounds=2, layers=16):
    rng = np.random.default_rng(1)
    return [{"kind": k, "round": r, "layers": layers, "warm": 2, "top_k": 8,
             "token_s": list(v * 1e-3 * (1 + 0.01 * r) + rng.random(6) * 1e-9),
             "host_s": {"host_plan_s": 6e-4, "host_queue_s": 1.2e-3}}
            for r in range(rounds) for k, v in ms_per_token.items()]


def test_summary_deltas_per_event():
    s = moves_summary(runs_of({"hits": 2.0, "upload": 3.6, "stream": 4.0, "stream2": 5.2, "swap": 2.8,
                               "cpu": 4.4, "cpuswap": 6.0}))
    assert s["stream2"]["delta_s"] == pytest.approx(3.2e-3 / 32, rel=0.01)
    assert s["cpuswap"]["delta_s"] == pytest.approx(1.6e-3 / 16, rel=0.01)  # against cpu
    assert s["upload"]["delta_s"] == pytest.approx(1.6e-3 / 16, rel=0.01)
    assert s["swap"]["delta_s"] == pytest.approx(0.8e-3 / 16, rel=0.01)
    assert s["stream"]["stream_over_upload_s"] == pytest.approx(0.4e-3 / 16, rel=0.01)
    assert s["hits"]["spread"] == pytest.approx(0.01, rel=0.05)
    assert s["hits"]["host_token_s"]["host_queue_s"] == pytest.approx(1.2e-3 / 6)


def test_simulated_probe_charges_an_upload_on_the_critical_path():
    hw = load_hardware("docs/fidelity/2026-12-02-d32bfea/hardware-session.json")
    model = sim_model(16, 151936)
    rows = predict_moves(runs_of({"hits": 2.0, "upload": 3.6, "stream": 4.0, "swap": 2.8}), hw, model)
    up_s = hw.copy_latency_s + 5013504 / (hw.pcie_h2d_gbps * 1e9)
    assert rows["upload"]["predicted_delta_s"] >= 0.9 * up_s  # each layer waits for its copy
    assert rows["stream"]["predicted_delta_s"] > rows["upload"]["predicted_delta_s"]  # the batch path
    assert 0 < rows["swap"]["predicted_delta_s"] < 0.5 * up_s  # copies in the background
    assert rows["upload"]["measured_delta_s"] == pytest.approx(1.6e-3 / 16, rel=0.01)


def test_stream_steps_pay_the_general_paths_host_time():
    """host_stream_layer_s + host_stream_s per streamed expert, on the host lane of a one-token step with
    streams and no CPU expert only: the upload workload is unchanged, the stream workloads slower by
    about that much a layer (the host lane is their critical path here)."""
    from dataclasses import replace

    from scheduler.costs import Costs, ExecConfig
    from simulate.engine import Simulator

    hw = load_hardware("docs/fidelity/2026-12-02-d32bfea/hardware-session.json")
    model = sim_model(4, 151936)
    geo = model.geometry()

    def per_token(h, kind):
        toks = moves_tokens(kind, 4, 6)
        return Simulator(Costs(model, h, ExecConfig(policy="gpu"))).run(drive(ScriptedPolicy(geo, kind), toks)).token_s[2:].mean()

    more = replace(hw, executor={**hw.executor, "host_stream_layer_s": 50e-6, "host_stream_s": 20e-6})
    assert per_token(more, "upload") == per_token(hw, "upload")
    assert per_token(more, "cpu") == per_token(hw, "cpu")
    for kind, n in (("stream", 1), ("stream2", 2)):
        d = per_token(more, kind) - per_token(hw, kind)
        assert 0.8 * 4 * (50e-6 + n * 20e-6) <= d <= 4 * (50e-6 + n * 20e-6) + 1e-9


def test_stream_fields_from_the_host_phases():
    from execute.calibrate_moves import moves_fields

    s = {k: {"layers": 4, "host_token_s": {"host_plan_s": 4 * p, "host_queue_s": 4 * q, "host_combine_s": 0.0}}
         for k, p, q in (("upload", 10e-6, 30e-6), ("stream", 40e-6, 50e-6), ("stream2", 45e-6, 65e-6))}
    f = moves_fields(s, {"host_copy_s": 4e-6, "host_gpu_expert_s": 2e-6})
    assert f["host_stream_s"] == pytest.approx(20e-6 - 4e-6 + 2e-6)
    assert f["host_stream_layer_s"] == pytest.approx(50e-6 - 18e-6)
    assert moves_fields({"upload": s["upload"]}, {}) == {}
    s["stream"]["host_token_s"]["host_plan_s"] = 0.0  # a cheaper streamed step: no negative keys
    assert min(moves_fields(s, {}).values()) >= 0.0


def test_apply_moves_writes_the_keys_with_their_source():
    from execute.calibrate_moves import apply_moves

    s = {k: {"layers": 1, "host_token_s": {"host_plan_s": v}} for k, v in (("upload", 10e-6), ("stream", 90e-6),
                                                                           ("stream2", 100e-6))}
    hw, src = {"executor": {"host_copy_s": 0.0}}, {}
    apply_moves(hw, {"moves": s}, src)
    assert hw["executor"]["host_stream_s"] == pytest.approx(10e-6)
    assert hw["executor"]["host_stream_layer_s"] == pytest.approx(70e-6)
    assert "executor.host_stream" in src
    hw2 = {}
    apply_moves(hw2, {"moves": {"error": "no GPU"}}, src)  # not measured: nothing written
    assert hw2 == {}


@pytest.mark.gpu
def test_the_probe_runs_every_workload_on_the_device():
    """measure_moves on small experts: every workload's tokens timed, the moved experts moved as
    scripted (uploads and streams counted by the engine), and a summary with the stream fields."""
    from ..execute.conftest import cupy_or_skip

    cp = cupy_or_skip()
    from execute.calibrate_measure import build_layers
    from execute.calibrate_moves import KINDS, moves_fields, measure_moves
    from execute.gpu_experts import GpuExperts
    from execute.standin import StandIn
    from scheduler import Capacity

    layers = build_layers(np.random.default_rng(0), 2, 128, 256, 128, distinct=2)
    geo = Geometry((128, 128), 8, (layers[0].expert_bytes,) * 2)
    gx = GpuExperts(layers, Capacity.per_layer(geo, 64), scratch_slots=16, pinned=True, timeout_s=60)
    try:
        dense = StandIn(cp, 2, 256, 128, 32, 128, 1000, 3)
        runs = measure_moves(cp, gx, layers, dense, 2, rounds=1, tokens=6, warm=2, kinds=KINDS)
    finally:
        gx.close()
    by = {r["kind"]: r for r in runs}
    assert set(by) == set(KINDS) and all(len(r["token_s"]) == 6 for r in runs)
    assert by["upload"]["uploads"] == 8 * 2 and by["stream"]["streams"] == 8 * 2 and by["stream2"]["streams"] == 32
    s = moves_summary(runs)
    assert set(moves_fields(s, {})) == {"host_stream_layer_s", "host_stream_s"}
    assert by["swap"]["host_s"]["start_background_s"] > 0


def test_calibrate_skips_the_probe_unless_switched_on(monkeypatch):
    """Not yet run on a GPU: moelab calibrate leaves the probe out (no stream keys) by default."""
    import execute.calibrate_moves as M

    monkeypatch.setattr(M, "CALIBRATE_MOVES", False)
    got = M.calibration_moves(None, None, [], None)
    assert "skipped" in got
    hw = {"executor": {}}
    M.apply_moves(hw, {"moves": got}, {})
    assert hw == {"executor": {}}
