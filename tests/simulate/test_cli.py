"""``moelab simulate`` and ``moelab sweep``: defaults, JSON, errors, timeline, resumable CSV."""
from __future__ import annotations

import csv
import json

import pytest

from moelab.simulate_cli import simulate_main, sweep_main
from simulate.sweep import COLUMNS, Sweep, config_key, expand

JSON_KEYS = {"tokens_per_s", "bound_tokens_per_s", "hit_rate", "upload_bytes", "cpu_experts", "p50_token_s",
             "p99_token_s", "gpu_busy", "pcie_busy", "cpu_busy"}


def test_no_arguments_runs_the_bundled_trace(capsys):
    assert simulate_main([]) == 0
    out = capsys.readouterr().out
    assert "granite-3.0-1b-a400m" in out and "tokens/s" in out and "7/32 experts per layer" in out


def test_json_has_the_documented_keys(capsys):
    assert simulate_main(["--json", "--tokens", "30", "--policy", "lru", "--cache-slots", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(data)
    assert data["tokens"] == 30 and data["slots_per_layer"] == 16
    assert 0 < data["tokens_per_s"] <= data["bound_tokens_per_s"]
    assert 0 <= data["hit_rate"] <= 1 and data["upload_bytes"] > 0
    for k in ("gpu_busy", "pcie_busy", "cpu_busy"):
        assert 0 <= data[k] <= 1


def test_bad_hardware_file_is_a_clear_error(tmp_path, capsys):
    p = tmp_path / "hw.json"
    p.write_text(json.dumps({"name": "x", "pcie_h2d_gbps": "fast"}))
    assert simulate_main(["--hardware", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "missing field" in err


def test_mismatched_trace_geometry_is_a_clear_error(capsys):
    assert simulate_main(["--model", "qwen3-30b-a3b"]) == 2
    err = capsys.readouterr().err
    assert "does not match" in err and "48 layers x 128 experts" in err


def test_synthetic_trace_for_a_model(capsys):
    assert simulate_main(["--model", "olmoe-1b-7b", "--trace", "synth", "--synth-tokens", "40", "--cache-mib", "1024",
                          "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 40


def test_timeline_is_chrome_trace_json(tmp_path, capsys):
    out = tmp_path / "tl.json"
    assert simulate_main(["--tokens", "5", "--timeline", str(out)]) == 0
    data = json.loads(out.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"] for e in spans}
    assert {1, 2, 3} <= lanes  # GPU, copy, CPU
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_sweep_writes_rows_plots_and_resumes(tmp_path, capsys):
    out = tmp_path / "sw"
    args = ["--tokens", "12", "--policies", "lru,hybrid", "--cache-slots", "8,16", "--miss-fractions", "0.1,0.5",
            "--out", str(out), "--jobs", "1"]
    assert sweep_main(args) == 0
    rows = _rows(out / "results.csv")
    assert len(rows) == 2 + 4  # lru x 2 caches, hybrid x 2 caches x 2 fractions
    assert all(r["error"] == "" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert list(rows[0]) == list(COLUMNS)
    assert (out / "sweep_granite-3.0-1b-a400m_rtx4060-laptop.png").stat().st_size > 0
    # interrupted sweep: drop two rows and tear the last line, then resume
    lines = (out / "results.csv").read_text().splitlines(keepends=True)
    (out / "results.csv").write_text("".join(lines[:4]) + lines[4][:10])
    capsys.readouterr()
    assert sweep_main(args) == 0
    err = capsys.readouterr().err
    assert "3 run, 3 already" in err
    again = _rows(out / "results.csv")
    assert sorted(r["key"] for r in again) == sorted(r["key"] for r in rows)
    by_key = {r["key"]: r for r in rows}
    assert all(r["tokens_per_s"] == by_key[r["key"]]["tokens_per_s"] for r in again)  # deterministic


def test_sweep_in_parallel_matches_serial(tmp_path):
    configs = expand(["granite-3.0-1b-a400m"], ["l4-colab"], ["hybrid", "cpu"], [4, 8], [None], "slots", tokens=8)
    a, b = Sweep(tmp_path / "a.csv"), Sweep(tmp_path / "b.csv")
    assert a.run(configs, jobs=1, progress=False) == 4
    b.run(configs, jobs=2, progress=False)
    ka = {r["key"]: r["tokens_per_s"] for r in _rows(tmp_path / "a.csv")}
    kb = {r["key"]: r["tokens_per_s"] for r in _rows(tmp_path / "b.csv")}
    assert ka == kb and len(ka) == len(configs) == 4
    assert set(ka) == {config_key(c) for c in configs}


def test_sweep_rejects_a_foreign_csv(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a moelab sweep CSV"):
        Sweep(p)


def test_sweep_records_a_config_that_cannot_run(tmp_path):
    configs = expand(["granite-3.0-1b-a400m"], ["l4-colab"], ["lru"], [2], [None], "slots", tokens=4)
    s = Sweep(tmp_path / "e.csv")
    s.run(configs, progress=False)
    assert "top_k" in s.rows[0]["error"]


def test_sweep_workers_are_started_with_sigint_ignored(monkeypatch):
    """A worker still importing when Ctrl-C comes must not print a traceback: the pool is created
    while the parent ignores SIGINT (a spawned interpreter keeps it ignored), and the parent's own
    handler is back afterwards, also when the pool cannot start."""
    import multiprocessing as mp
    import signal

    from simulate import sweep as S

    seen = []

    class Ctx:
        def Pool(self, jobs, initializer=None):
            seen.append((jobs, signal.getsignal(signal.SIGINT), initializer))
            if len(seen) == 2:
                raise OSError("no processes")
            return "pool"

    monkeypatch.setattr(mp, "get_context", lambda method: Ctx())
    handler = signal.getsignal(signal.SIGINT)
    assert S._start_pool(3) == "pool"
    assert seen == [(3, signal.SIG_IGN, S._ignore_sigint)] and signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(OSError, match="no processes"):
        S._start_pool(2)
    assert signal.getsignal(signal.SIGINT) is handler
