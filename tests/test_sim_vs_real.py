"""experiments/sim_vs_real.py's analysis on synthetic inputs (no GPU): error statistics, Spearman,
best-fraction agreement, and the --from path (simulate + compare + write) on a fake recording."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from execute import fidelity as ex
from moelab import sim_vs_real as join
from simulate import fidelity as svr

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sim_vs_real", ROOT / "experiments" / "sim_vs_real.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def row(label, policy, f, meas, pred, slots=32):
    return {"label": label, "policy": policy, "slots": slots, "miss_frac_256": f,
            "measured_tokens_per_s": meas, "predicted_tokens_per_s": pred,
            "measured_p50_token_s": 1 / meas, "predicted_p50_token_s": 1 / pred,
            "measured_p99_token_s": 1.2 / meas, "predicted_p99_token_s": 1.2 / pred,
            "measured_upload_bytes": 10, "predicted_upload_bytes": 10, "measured_hit_rate": 0.5,
            "predicted_hit_rate": 0.5, "same_decisions": True}


def test_spearman_and_ranks():
    assert svr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert svr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert list(svr.rank([5, 1, 5])) == [2.5, 1.0, 2.5]
    assert np.isnan(svr.spearman([1, 1], [1, 2]))
    a = np.random.default_rng(0).random(20)
    assert svr.spearman(a, a ** 3) == pytest.approx(1.0)


def test_error_stats_best_fraction_and_targets():
    rows = [row("cpu", "cpu", None, 10, 10.2), row("lru 25%", "lru", None, 50, 45),
            row("hybrid 25%", "hybrid", 44, 60, 61), row("hybrid 25% f=0", "hybrid", 0, 30, 31),
            row("hybrid 25% f=128", "hybrid", 128, 55, 63)]
    an = svr.analyse(rows)
    tps = an["errors"]["tokens_per_s"]
    assert tps["max"] == pytest.approx(8 / 55) and tps["worst"] == "hybrid 25% f=128"
    assert tps["median"] == pytest.approx(sorted([0.02, 0.1, 1 / 60, 1 / 30, 8 / 55])[2])
    assert an["best_fraction"] == {"fractions": [0, 44, 128], "measured": 44, "predicted": 128, "agree": False}
    assert not an["met"]["tokens_per_s_max"] and not an["met"]["best_fraction_agrees"]
    rows[-1]["measured_upload_bytes"] = 11
    assert not svr.analyse(rows)["identical_decisions"]
    with pytest.raises(ValueError):
        svr.rel_error(0.0, 1.0)


def test_configs_cover_the_issue():
    cs = svr.configs(128)
    assert len(cs) >= 12 and len({c["label"] for c in cs}) == len(cs)
    assert {c["slots"] for c in cs if c["policy"] == "lru"} == {13, 32, 64}
    assert sorted(c["miss_frac_256"] for c in cs if c["label"].startswith("hybrid 25%")) == [0, 44, 128, 256]


def fake_recording(tmp_path, scales=(1.0,), configs=5):
    """(raw, hardware, model): the simulator's own token times as the 'measurements', each config
    recorded once per entry of ``scales`` (token times multiplied by it), interleaved like run_device."""
    from simulate import SimConfig, load_hardware, run

    from tests.execute.test_calibrate import fake_measurements
    from execute import calibrate as C

    hwp = tmp_path / "hw.json"
    C.write_json(hwp, C.hardware_json(fake_measurements(), "fake"))
    hw = load_hardware(hwp)
    args = {"layers": 2, "experts": 32, "top_k": 4, "tokens": 12, "seed": 0, "vocab": 1000}
    tokens, _ = C.synth_tokens(2, 32, 4, 12, 1)
    model = svr.sim_model(2, 1000)
    model = model.__class__(**{**model.__dict__, "num_experts": 32, "top_k": 4})
    runs = []
    for rep, k in enumerate(scales):
        for c in svr.configs(32)[:configs]:
            res, _ = run(SimConfig(policy=c["policy"], cache_slots=c["slots"],
                                   miss_fraction=None if c["miss_frac_256"] is None else c["miss_frac_256"] / 256),
                         hardware=hw, model=model, tokens=tokens)
            s, digest = svr.simulate_config(c, hw, model, tokens)
            runs.append({**c, "token_s": [k * t for t in res.token_s], "upload_bytes": s["upload_bytes"],
                         "hit_rate": s["hit_rate"], "digest": digest, "repeat": rep})
    return {"args": args, "runs": runs}, hw, model, str(hwp)


def compare_with(raw, hw, model):
    from execute.calibrate import synth_tokens

    return svr.compare(raw, hw, synth_tokens(2, 32, 4, 12, 1)[0], model)


def test_from_recording_simulates_compares_and_writes(tmp_path, monkeypatch, capsys):
    """A fake recording whose 'measured' times are the simulator's own: zero error, same decisions;
    the script creates its output folder, parents included, and says each round's host state."""
    from execute import calibrate as C

    raw, hw, model, hwp = fake_recording(tmp_path)
    rows = compare_with(raw, hw, model)
    an = svr.analyse(rows)
    assert an["errors"]["tokens_per_s"]["max"] == pytest.approx(0.0, abs=1e-12)
    assert an["identical_decisions"]
    assert svr.spread_summary(rows) is None  # one run per config: no spread
    rec = tmp_path / "rec"
    rec.mkdir()
    state = lambda busy, gbps: {"busy_cores": busy, "cores": 16, "mem_gbps": gbps}
    raw["host_state"] = [{"round": 0, "before": state(0.2, 110.0), "after": state(None, 40.0), "problem": "fell"}]
    C.write_json(rec / "raw.json", raw)
    monkeypatch.setattr(svr, "sim_model", lambda layers, vocab: model)
    out = tmp_path / "new" / "out"
    assert script.main(["--hardware", hwp, "--from", str(rec), "--out", str(out), "--host-calibration", "file"]) == 0
    assert ("round 0: host 0.2 / ? cores busy elsewhere before / after, memory read 110 / 40 GB/s -- BUSY: fell"
            in capsys.readouterr().err)
    for f in ("sim_vs_real.csv", "sim_vs_real.json", "sim_vs_real.png"):
        assert (out / f).stat().st_size > 0
    assert json.loads((out / "sim_vs_real.json").read_text())["analysis"]["identical_decisions"]


def test_repeats_give_the_median_the_spread_and_whether_the_prediction_is_inside(tmp_path):
    raw, hw, model, _ = fake_recording(tmp_path, scales=(0.9, 1.2, 1.0), configs=3)
    # the third config's repeats are all slower than predicted: the prediction is outside its range
    for r in raw["runs"]:
        if r["label"] == svr.configs(32)[2]["label"]:
            r["token_s"] = [t * 1.5 for t in r["token_s"]]
    rows = compare_with(raw, hw, model)
    assert [r["repeats"] for r in rows] == [3, 3, 3]
    first = rows[0]
    assert first["measured_tokens_per_s"] == pytest.approx(first["predicted_tokens_per_s"])  # median: scale 1.0
    assert first["spread_tokens_per_s"] == pytest.approx(1 / 0.9 - 1 / 1.2)
    assert first["inside_tokens_per_s"] and first["inside_p99_token_s"]
    assert not rows[2]["inside_tokens_per_s"]
    assert rows[2]["measured_tokens_per_s"] == pytest.approx(rows[2]["predicted_tokens_per_s"] / 1.5)
    nz = svr.spread_summary(rows)
    assert nz["configs"] == 3 and nz["repeats"] == [3]
    assert nz["tokens_per_s"]["inside"] == 2
    # a repeat whose decisions differ (other bytes) makes the config's decisions differ
    raw["runs"][-1]["upload_bytes"] += 1
    assert not all(r["same_decisions"] for r in compare_with(raw, hw, model))


def test_older_recordings_with_one_marked_repeat_still_group():
    runs = [{"label": "lru 25%"}, {"label": "cpu"}, {"label": "lru 25% (repeat)"}]
    g = svr.group_runs(runs)
    assert list(g) == ["lru 25%", "cpu"] and len(g["lru 25%"]) == 2


def test_session_hardware_takes_the_host_lane_and_pool_from_the_recorded_replays(tmp_path):
    from simulate import load_hardware

    from tests.execute.test_calibrate import replay_records

    raw, hw, model, hwp = fake_recording(tmp_path)
    raw["calibration_records"] = replay_records(np.random.default_rng(3))
    raw["expert_bytes"], raw["args"]["threads"] = 5_013_504, 15
    path = ex.session_hardware(hwp, raw, tmp_path / "out")
    got = load_hardware(path)
    assert got.executor["host_cpu_handoff_s"] == pytest.approx(180e-6)
    assert got.executor["host_copy_s"] == pytest.approx(20e-6, abs=0.5e-6)
    assert got.cpu_task_s == pytest.approx(150e-6) and got.cpu_thread_gbps * 15 == pytest.approx(5_013_504 / 200e-6 / 1e9)
    assert got.executor["readback_s"] == hw.executor["readback_s"]  # fields the replay does not measure are kept
    assert "session_replay" in json.loads(path.read_text())["_calibration"]
    assert "gpu_one_s" not in got.executor  # no session GPU tables recorded: the file's fields


def test_session_hardware_takes_the_gpu_expert_fields_from_the_session_tables(tmp_path):
    from simulate import load_hardware

    from tests.execute.test_calibrate import replay_records, st

    raw, hw, model, hwp = fake_recording(tmp_path)
    raw["calibration_records"] = replay_records(np.random.default_rng(3))
    raw["expert_bytes"], raw["args"]["threads"], raw["args"]["top_k"] = 5_013_504, 15, 8
    raw["gpu_experts"] = {"batch": {str(n): st(30e-6 + 4e-6 * n) for n in (1, 2, 4, 8, 16)}, "combine": st(6e-6),
                          "one": {str(n): st(18e-6 + 2e-6 * n) for n in (1, 2, 4, 8)}}
    got = load_hardware(ex.session_hardware(hwp, raw, tmp_path / "out"))
    assert got.executor["gpu_batch_s"] == pytest.approx(30e-6) and got.executor["combine_s"] == pytest.approx(6e-6)
    assert got.executor["gpu_one_s"] == pytest.approx(18e-6)
    assert got.executor["gpu_one_expert_scale"] == pytest.approx(0.5)
    assert 5_013_504 / (got.gpu_gbps("Q8_0") * 1e9) == pytest.approx(4e-6)  # the batch's per-expert time


def test_select_picks_labels_in_table_order_and_names_unknown_ones():
    runs = svr.configs(128)
    assert [c["label"] for c in svr.select(runs, "lru 50%, cpu")] == ["cpu", "lru 50%"]
    assert svr.select(runs, None) == runs
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        svr.select(runs, "cpu,nope")


def test_fit_terms_recovers_known_costs_and_marks_absent_terms():
    rng = np.random.default_rng(2)
    f = np.c_[np.ones(60), rng.integers(0, 5, 60), rng.integers(0, 3, 60), np.zeros(60)]
    t = 3e-3 + 600e-6 * f[:, 1] + 200e-6 * f[:, 2]
    got = svr.fit_terms(f, t)
    assert got["token"] == pytest.approx(3e-3) and got["cpu_layer"] == pytest.approx(600e-6)
    assert got["cpu_expert"] == pytest.approx(200e-6) and got["copy"] is None
    with pytest.raises(ValueError, match="60 feature rows for 3 token times"):
        svr.fit_terms(f, t[:3])


def test_decompose_on_a_recording_of_the_simulators_own_times_agrees_side_by_side(tmp_path):
    from execute.calibrate import synth_tokens

    raw, hw, model, _ = fake_recording(tmp_path, scales=(1.0, 1.1, 0.9))
    f = svr.token_features(raw["runs"][0], model, synth_tokens(2, 32, 4, 12, 1)[0])
    assert f.shape == (12, 4) and (f[:, 0] == 1).all() and (f[:, 1] == 2).all()  # cpu: both layers, every token
    rows = svr.decompose(raw, hw, synth_tokens(2, 32, 4, 12, 1)[0], model)
    assert [r["label"] for r in rows] == [c["label"] for c in svr.configs(32)[:5]]
    cpu = rows[0]  # policy cpu: every layer has CPU experts, no copies
    assert cpu["per_token_cpu_layer"] == 2 and cpu["per_token_copy"] == 0 and cpu["measured_copy_s"] is None
    for r in rows:  # the median over repeats (x1, x1.1, x0.9) is the simulator's own time
        for k in svr.DECOMPOSE_TERMS:
            m, p = r[f"measured_{k}_s"], r[f"predicted_{k}_s"]
            assert (m is None and p is None) or m == pytest.approx(p, rel=1e-9, abs=1e-12)
    assert any(r["per_token_copy"] > 0 and r["measured_copy_s"] > 0 for r in rows)


def test_between_split_separates_the_engine_from_the_time_between_layers(tmp_path):
    raw, hw, _, _ = fake_recording(tmp_path, scales=(1.0, 1.2, 0.9), configs=2)
    for r in raw["runs"]:  # 24 layer steps; the engine's counters hold 60% of the token time
        r["steps"] = 24
        total = sum(r["token_s"])
        r["host_s"] = {"host_plan_s": 0.4 * total, "host_queue_s": 0.2 * total}
    rows = svr.between_split(raw, hw)
    assert [r["label"] for r in rows] == ["cpu", "lru 10%"]
    ex = hw.executor
    for r, c in zip(rows, svr.configs(32)):
        total = np.median([sum(x["token_s"]) for x in raw["runs"] if x["label"] == c["label"]]) / 24
        assert r["measured_step_s"] == pytest.approx(total)
        assert r["measured_inside_s"] == pytest.approx(0.6 * total)
        assert r["measured_between_s"] == pytest.approx(0.4 * total)
        want = ex["plan_s"].get(c["policy"], 0.0) + ex["host_dense_s"] + ex["readback_s"] + ex["host_head_s"] / 2
        assert r["model_between_s"] == pytest.approx(want)
    for r in raw["runs"]:
        del r["host_s"]
    assert svr.between_split(raw, hw) == []  # recordings without phase counters


def layer_costs(n_gpu, n_up, n_cpu, prev) -> dict:
    """Known per-layer engine phase costs (s) for test_calibration_ratios_*."""
    return {"host_plan_s": 50e-6 + 3e-6 * prev + (60e-6 if n_cpu else 0.0),
            "host_queue_s": 20e-6 + 4e-6 * max(n_gpu - 1, 0) + 10e-6 * (n_up > 0) + 15e-6 * n_up,
            "host_combine_s": 20e-6 + (50e-6 if n_cpu else 0.0), "input_wait_s": 100e-6 if n_cpu else 0.0,
            "cpu_compute_s": 200e-6 + 150e-6 * n_cpu if n_cpu else 0.0}


def test_calibration_ratios_measure_each_phase_against_the_calibration_records(tmp_path):
    from scheduler import Capacity, RunLayer, drive, make_policy

    raw, _, model, _ = fake_recording(tmp_path, scales=(1.0, 1.0), configs=5)
    rng = np.random.default_rng(5)
    recs, prev = [], 0
    for _ in range(400):
        n_cpu = int(rng.integers(0, 4))
        n_gpu, n_up = int(rng.integers(0 if n_cpu else 1, 8)), int(rng.integers(0, 3))
        n_up = min(n_up, n_gpu)
        c = layer_costs(n_gpu, n_up, n_cpu, prev)
        r = {"n_gpu": n_gpu, "n_up": n_up, "n_cpu": n_cpu, **{k: c[k] for k in svr.PHASE_COUNTERS}}
        if n_cpu:
            r["parts"] = {"compute": c["cpu_compute_s"]}
        recs.append(r)
        prev = n_up
    raw["calibration_records"] = recs
    tokens, _ = join.checked_inputs(raw["args"])
    geo = model.geometry()
    slow = {"host_plan_s": 1.5, "input_wait_s": 1.2, "host_queue_s": 1.0, "host_combine_s": 0.8, "cpu_compute_s": 1.1}
    for run in raw["runs"]:
        pol = make_policy(run["policy"], geo, Capacity.per_layer(geo, run["slots"]),
                          profile=svr.profile_of(run, tokens, geo), **svr.options_of(run))
        tot, u = dict.fromkeys(slow, 0.0), 0
        for it in drive(pol, tokens):
            if type(it) is RunLayer:
                d = it.decision
                nu = len(d.uploads) + len(d.streams)
                for k, v in layer_costs(len(d.hits) + nu, nu, len(d.cpu), u).items():
                    tot[k] += v * slow[k]
                u = nu
        run["host_s"] = {k: tot[k] for k in svr.PHASE_COUNTERS}
        run["cpu_compute_s"] = tot["cpu_compute_s"]
    got = svr.calibration_ratios(raw, model, tokens)
    assert list(got) == [c["label"] for c in svr.configs(32)[:5]]
    for label, r in got.items():
        for k, f in slow.items():
            if r[f"ratio_{k}"] is not None:
                assert r[f"ratio_{k}"] == pytest.approx(f, rel=1e-6), (label, k)
    assert got["cpu"]["ratio_cpu_compute_s"] == pytest.approx(1.1)
    assert got["lru 10%"]["ratio_cpu_compute_s"] is None and got["lru 10%"]["ratio_input_wait_s"] is None
    assert svr.calibration_ratios({**raw, "calibration_records": []}, model, tokens) == {}


def test_unlogged_calibration_runs_round_trip_through_from_and_ignore_the_checked_runs(tmp_path, monkeypatch):
    from tests.execute.test_calibrate import UNLOGGED, fake_runs, replay_records

    from execute import calibrate as C

    raw, hw, model, hwp = fake_recording(tmp_path, configs=3)
    raw["calibration_records"] = replay_records(np.random.default_rng(3))
    raw["calibration_runs"] = fake_runs(np.random.default_rng(1), C.replay_host_fields(raw["calibration_records"]))
    raw["expert_bytes"], raw["args"]["threads"] = 5_013_504, 15
    monkeypatch.setattr(svr, "sim_model", lambda layers, vocab: model)

    def session(raw, name):
        rec = tmp_path / name
        rec.mkdir(exist_ok=True)
        C.write_json(rec / "raw.json", raw)
        out = tmp_path / f"{name}-out"
        assert script.main(["--hardware", hwp, "--from", str(rec), "--out", str(out)]) == 0
        return json.loads((out / "hardware-session.json").read_text()), (out / "sim_vs_real.csv").read_text()

    hw1, csv1 = session(raw, "rec")
    assert hw1["executor"]["host_layer_plan_s"] == pytest.approx(UNLOGGED["plan"], abs=1e-6)
    assert hw1["_calibration"]["session_replay"]["unlogged"]["runs"] == 9
    assert "executor.unlogged" in hw1["sources"]
    # the checked runs' timings do not enter the calibration
    slower = {**raw, "runs": [{**r, "token_s": [2 * t for t in r["token_s"]]} for r in raw["runs"]]}
    hw2, csv2 = session(slower, "slower")
    assert hw2 == hw1 and csv2 != csv1
    # without the unlogged runs (every recording before them) the fields are the logged replay's
    hw3, _ = session({k: v for k, v in raw.items() if k != "calibration_runs"}, "old")
    assert hw3["executor"]["host_layer_plan_s"] == pytest.approx(70e-6, abs=0.5e-6)
    assert "unlogged" not in hw3["_calibration"]["session_replay"]


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, capsys):
    from execute import calibrate as C

    from tests.execute.test_calibrate import fake_measurements

    hwp = tmp_path / "hw.json"
    C.write_json(hwp, C.hardware_json(fake_measurements(), "fake"))
    (tmp_path / "file").write_text("x")
    assert script.main(["--hardware", str(hwp), "--from", str(tmp_path), "--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0]


def test_budget_configs_are_the_peer_benchmarks():
    eb = 5_013_504
    runs = svr.configs(128, [2048, 4096, 12288], 48, eb)
    assert [c["label"] for c in runs] == ["gpu", "cpu", "lru 2048MiB", "hybrid 2048MiB", "lru 4096MiB",
                                          "hybrid 4096MiB", "lru 12288MiB", "hybrid 12288MiB"]
    slots = {c["label"]: c["slots"] for c in runs}
    assert slots["gpu"] == 128 and slots["lru 4096MiB"] == 4096 * 2**20 // (48 * eb) == 17
    assert join.runs_of({"experts": 128, "budgets": [4096], "layers": 48, "hidden": 2048, "ffn": 768,
                         "configs": "lru 4096MiB"}) == [c for c in runs if c["label"] == "lru 4096MiB"]


def test_peer_rows_are_predicted_from_a_hardware_file(capsys):
    from scheduler.hardware import load_hardware
    from simulate import peer

    result = peer.load_result(ROOT / "docs" / "perf" / "peer_h200" / "budget-4096" / "result.json")
    m = peer.peer_model(result["config"])
    assert m.num_layers == 48 and abs(m.vocab - 32000) < 0.15 * 32000  # synth file: vocab 32000 (router F32)
    small = {**result, "rows": [r for r in result["rows"] if r["cell"] in ("moelab lru", "moelab cpu")]}
    rows = peer.predict_peer(small, load_hardware(ROOT / "docs" / "fidelity" / "h200-calibrated.json"), seeds=1)
    assert [r["row"] for r in rows] == ["moelab lru", "moelab cpu"]
    lru = [r["decode_tokens_per_s"] for r in result["rows"] if r["cell"] == "moelab lru"]
    assert rows[0]["measured_tokens_per_s"] == pytest.approx(float(np.median(lru)))
    assert rows[0]["predicted_tokens_per_s"] > rows[1]["predicted_tokens_per_s"] > 0
    text = peer.format_peer(rows, 4096)
    assert text.splitlines()[-1].startswith("rows within 15%: ") and "moelab cpu" in text


def test_peer_rows_replay_the_routing_the_benchmark_recorded(tmp_path):
    """With the run's recorded routing, the prediction replays it (prompt and generation) in the
    run's batches (``meta.batches``: the 8-token prompt is one step) and the hit rate is the
    trace's under the policy: every expert of the trace resident under ``gpu``, a trace that routes
    every token to the same 8 experts misses them once under ``lru``."""
    from scheduler.hardware import load_hardware
    from simulate import peer
    from traces import Trace

    result = peer.load_result(ROOT / "docs" / "perf" / "peer_h200" / "budget-4096" / "result.json")
    small = {**result, "rows": [r for r in result["rows"] if r["cell"] in ("moelab lru", "moelab gpu")]}
    T, L, k = 12, 48, 8
    ids = np.broadcast_to(np.arange(k, dtype=np.int32), (T, L, k)).copy()
    phase = np.array([0] * 8 + [1] * 4, np.int8)
    w = np.full((T, L, k), 1.0 / k, np.float32)
    Trace("peer", (128,) * L, k, ids, np.zeros(T, np.int32), np.arange(T, dtype=np.int32), phase, w,
          {"batches": [8, 1, 1, 1, 1], "prompt_tokens": 8}).save(str(tmp_path / "trace"))
    rows = peer.predict_peer(small, load_hardware(ROOT / "docs" / "fidelity" / "h200-calibrated.json"),
                             trace=tmp_path / "trace")
    hits = {r["row"]: r["predicted_hit_rate"] for r in rows}
    assert hits["moelab gpu"] == 1.0  # every expert of every step a hit; under lru the prompt's one step
    assert hits["moelab lru"] == pytest.approx(1 - 8 / 40)  # misses its 8 experts, the 4 decode steps' 32 hit


def test_a_calibration_round_keeps_its_own_replays_and_the_other_rounds_runs():
    from execute.fidelity import calibrated_on_round

    runs = [{"label": "lru", "repeat": r} for r in range(3)]
    tagged = [{"round": r, "n": i} for r in range(3) for i in range(2)]
    raw = {"args": {"repeats": 3}, "runs": runs, "calibration_records": tagged,
           "calibration_runs": [{"round": r} for r in range(3)]}
    one = calibrated_on_round(raw, 1)
    assert [r["round"] for r in one["calibration_records"]] == [1, 1]
    assert one["calibration_runs"] == [{"round": 1}] and [r["repeat"] for r in one["runs"]] == [0, 2]
    same = calibrated_on_round(raw, 1, same=True)
    assert same["calibration_records"] == one["calibration_records"] and [r["repeat"] for r in same["runs"]] == [1]
    old = calibrated_on_round({**raw, "calibration_records": [{"n": i} for i in range(6)]}, 2)  # untagged: even split
    assert [r["n"] for r in old["calibration_records"]] == [4, 5]
    for bad in (3, -1):
        with pytest.raises(ValueError, match="rounds 0..2"):
            calibrated_on_round(raw, bad)
    with pytest.raises(ValueError, match="rounds 0..0"):
        calibrated_on_round({**raw, "args": {"repeats": 1}}, 0)


def test_calibration_check_predicts_the_sessions_own_calibration_runs(tmp_path):
    """Runs 'measured' as the simulator's own times, twice as slow in one round: the prediction
    meets their median over the rounds, so the error is the scale's."""
    from execute.calibrate import synth_tokens
    from simulate import SimConfig, run

    _, hw, model, _ = fake_recording(tmp_path, configs=1)
    tokens, _ = synth_tokens(2, 32, 4, 20, 3)
    runs = []
    for policy, slots, frac in (("lru", 8, None), ("hybrid", 8, 96)):
        res, _ = run(SimConfig(policy=policy, cache_slots=slots, miss_fraction=None if frac is None else frac / 256,
                               token_graph=False), hardware=hw, model=model, tokens=tokens)
        for k in (1.0, 1.0, 2.0):
            runs.append({"policy": policy, "slots": slots, **({"miss_frac_256": frac} if frac else {}),
                         "token_s": [k * t for t in res.token_s[4:]]})
    got = svr.calibration_check({"calibration_runs": runs}, hw, model, tokens, warm=4)
    assert [(c["policy"], c["miss_frac_256"], c["rounds"]) for c in got] == [("lru", None, 3), ("hybrid", 96, 3)]
    assert all(abs(c["error"]) < 1e-9 for c in got)
    assert svr.calibration_check({}, hw, model, tokens) == []


def test_a_checked_runs_pool_is_warmed_with_one_call_per_layer():
    from execute.calibrate_measure import build_layers

    layers = build_layers(np.random.default_rng(2), 3, 4, 64, 64, distinct=1)
    calls = []

    class Pool:  # records the calls; each result() waits for nothing
        def submit(self, lx, experts, x):
            calls.append((lx.layer, list(experts), x.shape))
            return self

        def result(self):
            return None

    assert ex.warm_pool(Pool(), layers, 8) >= 0
    assert calls == [(l, [0, 1, 2, 3], (4, 64)) for l in range(3)]  # top-k capped at the layer's experts


def test_per_round_predicts_each_round_from_its_own_calibration(tmp_path, monkeypatch, capsys):
    """Two rounds of the same calibration, the second round's runs 1.25x slower: each round's error
    follows its own runs (round 1's = 1.25 x (1 + round 0's) - 1); the calibration is not pooled."""
    from tests.execute.test_calibrate import fake_runs, replay_records

    from execute import calibrate as C

    raw, hw, model, hwp = fake_recording(tmp_path, scales=(1.0, 1.25), configs=1)
    recs = replay_records(np.random.default_rng(3))
    runs = fake_runs(np.random.default_rng(1), C.replay_host_fields(recs))
    raw["calibration_records"] = [{**r, "round": k} for k in (0, 1) for r in recs]
    raw["calibration_runs"] = [{**r, "round": k} for k in (0, 1) for r in runs]
    raw["expert_bytes"], raw["args"]["threads"], raw["args"]["repeats"] = 5_013_504, 15, 2
    monkeypatch.setattr(svr, "sim_model", lambda layers, vocab: model)
    rec = tmp_path / "rec"
    rec.mkdir()
    C.write_json(rec / "raw.json", raw)
    assert script.main(["--hardware", hwp, "--from", str(rec), "--out", str(tmp_path / "o"), "--per-round",
                        "--no-lane-fit"]) == 0
    lines = [l.split() for l in capsys.readouterr().out.splitlines() if l.startswith(("cpu ", "lru "))]
    assert len(lines) == 1
    for l in lines:
        e0, e1 = (float(x.rstrip("%")) / 100 for x in l[-3:-1])
        assert e1 == pytest.approx(1.25 * (1 + e0) - 1, abs=2e-3)
    with pytest.raises(SystemExit):
        script.main(["--hardware", hwp, "--from", str(rec), "--per-round", "--host-calibration", "file"])
