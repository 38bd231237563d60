"""The peer rows' prediction (simulate.peer, experiments/sim_vs_real.py --peer): a row that ran with
``--hardware`` plans with that file, the CPU graph's own block and per-pair times, the runs' copies
against the file's, and the recording a run leaves (rows.csv, README.md)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.hardware import load_hardware
from simulate import peer
from simulate.run import SimConfig, run

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "docs" / "perf" / "peer_h200" / "8deec37" / "budget-2048" / "result.json"
HW = ROOT / "docs" / "perf" / "peer_h200" / "89450d6" / "h200-calibrated.json"


def test_a_rows_hardware_file_is_found_where_the_run_named_it_or_under_this_checkout(tmp_path):
    cmd = ["moelab", "run", "m.gguf", "--policy", "hybrid-cost", "--hardware", "/work/main/docs/x.json"]
    assert peer.hardware_of(cmd) == "/work/main/docs/x.json"
    assert peer.hardware_of(["moelab", "run", "--hardware=a.json"]) == "a.json"
    assert peer.hardware_of(["moelab", "run", "m.gguf"]) is None
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.json").write_text("{}")
    assert peer.plan_hardware("/elsewhere/main/docs/x.json", tmp_path) == tmp_path / "docs" / "x.json"
    assert peer.plan_hardware(str(tmp_path / "docs" / "x.json")) == tmp_path / "docs" / "x.json"
    (tmp_path / "cal.json").write_text("{}")
    assert peer.plan_hardware("/tmp/cal.json", tmp_path) is None  # a bare name is not matched
    assert peer.plan_hardware("/nowhere/docs/y.json", tmp_path) is None
    assert peer.plan_hardware(None, tmp_path) is None


def test_a_cost_model_policy_plans_with_its_own_file_and_is_timed_on_the_other():
    """``run(policy_hardware=B)`` decides as a run on B does and times on the hardware given."""
    hw = load_hardware("h200-xeon16")
    slow = replace(hw, name="slow-link", pcie_h2d_gbps=hw.pcie_h2d_gbps / 16)
    cfg = SimConfig(model="qwen3-30b-a3b", hardware=hw.name, policy="hybrid-cost", cache_mib=2048, trace="synth",
                    synth_tokens=12)
    on_hw = run(cfg, hardware=hw)[0].summary()
    on_slow = run(cfg, hardware=slow)[0].summary()
    planned_slow = run(cfg, hardware=hw, policy_hardware=slow)[0].summary()
    assert on_hw["hit_rate"] != on_slow["hit_rate"]  # the link's speed moves the cost model's split
    for k in ("hit_rate", "uploads", "cpu_experts", "streams"):
        assert planned_slow[k] == on_slow[k]
    assert planned_slow["tokens_per_s"] != on_slow["tokens_per_s"]  # timed on hw, not on the slow link


def test_the_upload_factor_slows_the_copies_only_and_the_plan_file_is_reported():
    result = peer.load_result(RESULT)
    keep = {"moelab lru", "moelab hybrid-cost", "moelab lru+cpugraph"}
    small = {**result, "rows": [r for r in result["rows"] if r["cell"] in keep]}
    hw = load_hardware(HW)
    t = RESULT.parent / "trace"  # the run's recorded routing
    base = {r["row"]: r for r in peer.predict_peer(small, hw, trace=t, root=ROOT)}
    slow = {r["row"]: r for r in peer.predict_peer(small, hw, trace=t, root=ROOT, upload_factor=2.0)}
    assert set(base) == keep
    for row in keep:
        assert slow[row]["predicted_hit_rate"] == base[row]["predicted_hit_rate"]  # the same decisions
    assert slow["moelab lru"]["predicted_tokens_per_s"] < base["moelab lru"]["predicted_tokens_per_s"]
    # hybrid-cost ran with --hardware /work/main/docs/fidelity/h200-calibrated.json: found in this checkout
    assert base["moelab hybrid-cost"]["plan_file"] == str(ROOT / "docs" / "fidelity" / "h200-calibrated.json")
    assert base["moelab lru"]["plan_file"] is None
    blocky = {r["row"]: r for r in peer.predict_peer(small, hw, trace=t, root=ROOT, graph_cpu_block_s=3e-3)}  # past any block's pool call
    assert blocky["moelab lru+cpugraph"]["predicted_tokens_per_s"] < base["moelab lru+cpugraph"]["predicted_tokens_per_s"]
    assert blocky["moelab lru"]["predicted_tokens_per_s"] == base["moelab lru"]["predicted_tokens_per_s"]
    paired = {r["row"]: r for r in peer.predict_peer(small, hw, trace=t, root=ROOT, graph_cpu_pair_s=1e-3)}
    assert paired["moelab lru+cpugraph"]["predicted_tokens_per_s"] < base["moelab lru+cpugraph"]["predicted_tokens_per_s"]
    assert paired["moelab lru"]["predicted_tokens_per_s"] == base["moelab lru"]["predicted_tokens_per_s"]
    with pytest.raises(ValueError, match="upload_factor"):
        peer.predict_peer(small, hw, trace=t, upload_factor=0.0)


def script(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "sim_vs_real.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_peer_with_out_writes_the_rows_and_a_readme(tmp_path):
    import shutil

    res = json.loads(RESULT.read_text())
    res["rows"] = [r for r in res["rows"] if r["cell"] in ("moelab lru", "moelab lru+cpugraph", "llama.cpp -ncmoe 0")]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "result.json").write_text(json.dumps(res))
    shutil.copytree(RESULT.parent / "trace", tmp_path / "b" / "trace")
    out = tmp_path / "out" / "deeper"
    p = script("--hardware", str(HW), "--peer", str(tmp_path / "b" / "result.json"), "--graph-cpu-block-us", "117",
               "--graph-cpu-pair-us", "56", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "default rows within 15%: " in p.stdout and "+cpugraph rows within 15%: " in p.stdout
    rows = list(csv.DictReader(open(out / "rows.csv")))
    assert [r["row"] for r in rows] == ["moelab lru", "moelab lru+cpugraph"]
    readme = (out / "README.md").read_text()
    assert "--graph-cpu-block-us 117" in readme and "117 us (given), 56 us more a CPU pair (given)" in readme
    assert "| 2048 | `moelab lru+cpugraph` |" in readme


@pytest.mark.parametrize("args, says", [
    (["--upload-factor", "0"], "--upload-factor 0: expected a ratio in (0, 4]"),
    (["--graph-cpu-block-us", "-1"], "--graph-cpu-block-us -1: expected > 0 microseconds"),
    (["--graph-cpu-pair-us", "-1"], "--graph-cpu-pair-us -1: expected >= 0 microseconds"),
])
def test_bad_peer_options_are_one_line_errors(args, says):
    p = script("--hardware", str(HW), "--peer", str(RESULT), *args)
    assert p.returncode == 2 and says in p.stderr and p.stdout == ""


def test_peer_options_without_peer_are_refused():
    p = script("--hardware", str(HW), "--upload-factor", "1.5", "--from", "nowhere")
    assert p.returncode == 2 and "only with --peer" in p.stderr


def test_an_out_that_is_a_file_is_a_one_line_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    res = json.loads(RESULT.read_text())
    res["rows"] = [r for r in res["rows"] if r["cell"] == "moelab gpu"]
    (tmp_path / "result.json").write_text(json.dumps(res))
    p = script("--hardware", str(HW), "--peer", str(tmp_path / "result.json"), "--out", str(f / "sub"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--out" in p.stderr and p.stdout == ""
