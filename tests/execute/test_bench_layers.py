"""execute.bench_layers (experiments/bench_executor.py's parts): the bound of a decision list, the
warm-up profile, the layers built as copies, the report's tables and ratio, the three output files
with the hand-off edge columns, the script's argument checks, policy specs and the cost model a
hardware file gives the bench's shape; (gpu) a whole small run."""
from __future__ import annotations

import csv
import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import pytest

from execute import bench_layers as B

from .conftest import cupy_or_skip

_spec = importlib.util.spec_from_file_location("bench_executor", Path(__file__).parents[2] / "experiments" /
                                               "bench_executor.py")
bench_executor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_executor)


def _decision(hits=0, uploads=0, streams=0, cpu=0):
    return types.SimpleNamespace(hits=tuple(range(hits)), uploads=tuple(range(uploads)),
                                 streams=tuple(range(streams)), cpu=tuple(range(cpu)))


def test_bound_of_decisions():
    rates = {"gpu_gbps": 4.0, "upload_gbps": 1.0, "cpu_gbps": 0.5, "dense_s_per_layer": 1e-3}
    eb = 10**6  # 1 MB: 0.25 ms on the GPU, 1 ms over PCIe, 2 ms on the CPU
    own, ideal = B.bound_s([_decision(hits=4), _decision(hits=2, uploads=1, cpu=2)], eb, rates)
    # layer 1: dense + 4 x 0.25 ms; layer 2: dense + max(3 x 0.25, 1 x 1, 2 x 2) ms
    assert own == pytest.approx(1e-3 + 1e-3 + 1e-3 + 4e-3)
    # ideal: layer 2's 3 misses over PCIe + CPU together (1.5 GB/s): 2 ms > 2 hits' 0.5 ms
    assert ideal == pytest.approx(1e-3 + 1e-3 + 1e-3 + 2e-3)
    own0, ideal0 = B.bound_s([_decision(hits=1, streams=2)], eb, dict(rates, cpu_gbps=0.0))
    assert own0 == pytest.approx(1e-3 + 2e-3) and ideal0 == pytest.approx(1e-3 + 2e-3)  # no CPU: PCIe alone


def test_trace_and_warmup_profile():
    args = types.SimpleNamespace(layers=3, experts=16, top_k=2)
    trace, src = B.make_trace(args, seed=1, num_tokens=20)
    assert trace.num_layers == 3 and len(trace.expert_ids) == 20 and src
    prof = B.warmup_profile(trace, rows=8, slots=6)
    ids = np.asarray(trace.expert_ids[:8])
    counts = np.zeros((3, 16), int)
    for l in range(3):
        np.add.at(counts[l], ids[:, l][ids[:, l] >= 0], 1)
    assert prof.slots == 6 and len(prof.ranked) == int((counts > 0).sum())  # the warm-up rows' pairs only
    ranked = [counts[l, e] for l, e in prof.ranked]
    assert ranked == sorted(ranked, reverse=True)  # hottest first
    assert np.allclose(prof.frequency, counts / counts.sum())


def test_layers_beyond_the_distinct_ones_are_copies_in_their_own_memory():
    args = types.SimpleNamespace(layers=3, distinct_layers=2, experts=2, hidden=64, ffn=32)
    layers = B.build_layers(args, np.random.default_rng(0))
    assert [l.layer for l in layers] == [0, 1, 2]
    for a, b in ((layers[2].gate, layers[0].gate), (layers[2].down, layers[0].down)):
        assert np.array_equal(a.data, b.data) and not np.shares_memory(a.data, b.data)
        assert a.name.startswith("blk.2.") and b.name.startswith("blk.0.")


def _result(policy, tps, options=None, profile=False, sync=False):
    keys = [f"{p}_us" for p in B.HOST_PHASES] + [f"{k[:-2]}_us" for k in B.ENGINE_PHASES]
    per_layer = {k: 1.5 for k in keys} | {"wall_us": 9.0, "handoff_in_us": 3.25, "handoff_out_us": 4.5}
    return {"policy": policy, "options": options or {}, "profile": profile, "sync": sync, "early": True,
            "tokens": 10, "wall_s": 10 / tps, "tokens_per_s": tps, "hit_rate": 0.5, "uploaded_gb": 0.1,
            "background_gb": 0.0, "cpu_pairs": 3, "gpu_pairs": 5, "bound_tokens_per_s": 2 * tps,
            "ideal_split_bound_tokens_per_s": 4 * tps, "per_layer_us": per_layer}


def _rates():
    names = ("experts", "combine", "experts1_fused", "dense", "dense_cupy_ops")
    return {"gpu_us": dict.fromkeys(names, 2.0), "host_us": dict.fromkeys(names + ("layer_meta",), 1.0),
            "dense_rel_err": {"fused_vs_f64": 1e-4, "cupy_ops_vs_f64": 2e-4, "experts1_vs_grouped": 0.0}}


def test_report_and_outputs(tmp_path):
    results = [_result("lru", 20.0), _result("hybrid", 30.0, {"miss_frac_256": 44}, profile=True),
               _result("cpu", 10.0, sync=True)]
    assert [B.label(r) for r in results] == ["lru", "hybrid f=44 +prof", "cpu sync"]
    text, summary = B.report(results, _rates())
    assert summary == {"ratio": 1.5, "hybrid": "hybrid f=44 +prof", "best": "lru"}
    assert "hybrid / best non-hybrid: 1.50x" in text and "handoff_in" in text and "handoff_out" in text
    assert B.report([results[0]], _rates())[1] is None  # no hybrid run: no ratio
    config = {"layers": 2, "experts": 8, "slots_per_layer": 2, "gpu": "none"}
    B.write_outputs(tmp_path / "o", config, _rates(), results, summary)
    out = tmp_path / "o"
    assert sorted(p.name for p in out.iterdir()) == ["bench_executor.csv", "bench_executor.json", "bench_executor.png"]
    assert json.loads((out / "bench_executor.json").read_text())["summary"]["ratio"] == 1.5
    rows = list(csv.DictReader(open(out / "bench_executor.csv")))
    assert [r["label"] for r in rows] == ["lru", "hybrid f=44 +prof", "cpu sync"]
    assert rows[1]["per_layer_handoff_in_us"] == "3.25" and rows[1]["per_layer_handoff_out_us"] == "4.5"
    assert float(rows[2]["tokens_per_s"]) == 10.0


@pytest.mark.parametrize("argv, message", [
    (["--miss-fracs", "4,x"], "--miss-fracs: expected integers 0..256 (or 'cost') separated by commas"),
    (["--miss-fracs", "300"], "--miss-fracs: expected integers 0..256"),
    (["--layers", "4", "--distinct-layers", "5"], "--distinct-layers: expected 1..4"),
    (["--hidden", "100"], "--hidden must be a multiple of 8"),
    (["--engine-variants", "device"], "--engine-variants: engine variant 'device': expected WAIT:PUT"),
    (["--miss-fracs", "cost"], "--miss-fracs: 'cost' needs --hardware"),
    (["--hardware", "nowhere.json"], "--hardware: nowhere.json"),
    (["--policies", "hybrid-cost"], "--policies: hybrid-cost needs --hardware"),
    (["--policies", "lru,mru"], "--policies: unknown policy 'mru'"),
    (["--policies", "hybrid-cost:speed=2", "--hardware", "h200-xeon16"], "policy 'hybrid-cost': unknown option speed"),
    (["--policies", "hybrid-cost:prefetch=99", "--hardware", "h200-xeon16"], "hybrid-cost prefetch: 99"),
    (["--policies", "lru:fast"], "'fast' is not FIELD=VALUE"),
])
def test_script_checks_its_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_executor.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    args, fracs, variants = bench_executor.parse(["--miss-fracs", "0,256"])
    assert fracs == [0, 256] and args.layers == 48 and variants == [None]
    assert bench_executor.parse(["--engine-variants", "host:compute,device:early"])[2] == ["host:compute",
                                                                                           "device:early"]


def test_policy_specs_and_the_hardware_cost_model():
    assert B.policy_spec("hybrid-cost:prefetch=4:prefetch_confidence=0.5:admit=usage:prefetch_fills=true") == (
        "hybrid-cost", {"prefetch": 4, "prefetch_confidence": 0.5, "admit": "usage", "prefetch_fills": True})
    args, fracs, _ = bench_executor.parse(["--hardware", "h200-xeon16", "--miss-fracs", "cost,44",
                                           "--policies", "lru,hybrid,hybrid-cost:prefetch=4"])
    assert fracs == ["cost", 44] and args.specs[2] == ("hybrid-cost", {"prefetch": 4})
    from scheduler.costs import Costs, ExecConfig
    from scheduler.hardware import load_hardware
    from scheduler.models import load_model
    hw = load_hardware("h200-xeon16")  # the default shape is the preset's: the simulator's cost model
    want = Costs(load_model("qwen3-30b-a3b"), hw, ExecConfig(policy="hybrid-cost")).cost_model()
    assert B.bench_cost_model(args, hw, "hybrid-cost") == want
    small = bench_executor.parse(["--layers", "3", "--experts", "16", "--top-k", "2", "--hidden", "256", "--ffn",
                                  "64", "--distinct-layers", "1"])[0]
    cm = B.bench_cost_model(small, hw, "hybrid")
    assert len(cm.upload_s) == 3 and cm.upload_s[0] < want.upload_s[0]
    r = {"policy": "hybrid", "options": {}, "cost_model": True, "profile": False}
    assert B.label(r) == "hybrid cost"
    assert B.label({**r, "policy": "hybrid-cost", "options": {"prefetch": 4}}) == "hybrid-cost prefetch=4"


@pytest.mark.gpu
def test_a_small_run_writes_its_files(tmp_path, capsys):
    cupy_or_skip()
    out = tmp_path / "b"
    assert bench_executor.main(["--layers", "2", "--distinct-layers", "1", "--experts", "8", "--hidden", "256",
                                "--ffn", "128", "--top-k", "2", "--warmup", "2", "--tokens", "4", "--threads", "1",
                                "--policies", "gpu,lru,hybrid-cost,hybrid", "--miss-fracs", "128", "--out", str(out),
                                "--engine-variants", "host:compute,device:early", "--hardware", "h200-xeon16"]) == 0
    data = json.loads((out / "bench_executor.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["gpu", "lru", "hybrid-cost", "hybrid", "hybrid"]
    assert [r["variant"] for r in data["results"][3:]] == ["host:compute", "device:early"]
    assert data["results"][2]["cost_model"] and data["config"]["hardware"] == "h200-xeon16"
    assert all(r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 for r in data["results"])
    assert data["rates"]["dense_rel_err"]["experts1_vs_grouped"] < 1e-5
    assert "hybrid / best non-hybrid" in capsys.readouterr().out
