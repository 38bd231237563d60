"""The calibration's host check: a busy host is waited for, refused, or measured again."""
import json

import pytest

from execute import calibrate as C
from execute import calibrate_host as H


def state(busy, gbps, cores=16, t=0.0):
    return {"busy_cores": busy, "cores": cores, "mem_gbps": {"median": gbps, "p10": gbps, "p90": gbps, "n": 5},
            "time": t}


def test_busy_cores_reads_proc_stat_or_says_none(tmp_path):
    got = H.busy_cores(0.01)
    if got is not None:  # Linux
        assert 0.0 <= got <= H.os.cpu_count() + 0.5
    assert H.busy_cores(0.0, str(tmp_path / "missing")) is None


def test_a_host_is_busy_when_others_take_the_pool_s_cores_or_the_memory_read_falls():
    assert H.host_problem(state(0.4, 110), threads=15) is None
    assert "3.0 of 16 cores" in H.host_problem(state(3.0, 110), threads=15)
    assert H.host_problem(state(3.0, 110), threads=4) is None  # 11 cores spare beside 4 threads
    assert H.host_problem(state(None, 110), threads=15) is None  # not Linux: the memory read only
    assert "112 to 45 GB/s" in H.host_problem(state(0.2, 45), 15, before=state(0.2, 112))
    assert H.host_problem(state(0.2, 100), 15, before=state(0.2, 112)) is None


def test_quiet_host_waits_a_bounded_time_and_says_so_once():
    seq = iter([state(5, 100), state(4, 100), state(0.5, 100)])
    said, slept = [], []
    s, problem = H.quiet_host(15, 30.0, said.append, probe=lambda t, b: next(seq), sleep=slept.append)
    assert problem is None and s["busy_cores"] == 0.5 and len(slept) == 2 and len(said) == 1
    s, problem = H.quiet_host(15, 0.0, said.append, probe=lambda t, b: state(5, 100), sleep=slept.append)
    assert "5.0 of 16" in problem and len(slept) == 2  # no wait allowed: one probe


ARGS = ["--cpu-only", "--base", "rtx4060-laptop", "--quick", "--threads", "1", "--host-wait", "0"]


def test_calibrate_refuses_a_busy_host_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(H, "host_state", lambda *a, **k: state(5.0, 50, cores=2))
    monkeypatch.setattr(C, "measure_all", lambda *a, **k: pytest.fail("measured on a busy host"))
    out = tmp_path / "hw.json"
    assert C.main([*ARGS, "--out", str(out)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert "refusing to measure on a busy host" in err[-1] and "--busy-ok" in err[-1]
    assert not any(tmp_path.iterdir())


def test_a_host_that_got_busy_is_measured_again_then_refused(tmp_path, monkeypatch, capsys):
    seq = iter([state(0.0, 110, cores=2), state(5.0, 110, cores=2)] * 2)  # before quiet, after busy: twice
    monkeypatch.setattr(H, "host_state", lambda *a, **k: next(seq))
    calls = []
    monkeypatch.setattr(C, "measure_all", lambda args, partial: calls.append(1) or partial.update(x=1) or partial)
    out = tmp_path / "hw.json"
    assert C.main([*ARGS, "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert len(calls) == 2 and "measuring again" in err and "refusing to write" in err.strip().splitlines()[-1]
    assert not out.exists()
    kept = json.loads((tmp_path / "hw.json.partial.json").read_text())
    assert kept["host_state"]["problem"].startswith("other processes kept 5.0 of 2 cores busy")


def test_a_memory_read_that_fell_alone_is_written_with_a_warning(monkeypatch, capsys):
    reads = iter([110, 40])
    monkeypatch.setattr(H, "host_state", lambda *a, **k: state(0.0, next(reads)))
    args = C._parser().parse_args(ARGS)
    monkeypatch.setattr(C, "measure_all", lambda args, partial: partial)
    m = C._measure_on_quiet_host(args)
    st = m["host_state"]
    assert st["problem"] is None and st["warning"].startswith("the memory read fell from 110 to 40")
    assert "warning: the memory read fell" in capsys.readouterr().err


def test_busy_ok_records_the_state_and_measures(monkeypatch):
    monkeypatch.setattr(H, "host_state", lambda *a, **k: state(30.0, 50))
    args = C._parser().parse_args([*ARGS, "--busy-ok", "--quiet"])
    monkeypatch.setattr(C, "measure_all", lambda args, partial: partial)
    m = C._measure_on_quiet_host(args)
    assert "cores busy" in m["host_state"]["problem"] and m["host_state"]["before"]["mem_gbps"] == 50


def test_host_wait_must_not_be_negative(capsys):
    assert C.main([*ARGS[:-1], "-1"]) == 2
    assert "--host-wait -1" in capsys.readouterr().err


def test_measurements_that_disagree_say_the_host_was_busy():
    eb = 5_000_000
    m = {"expert_bytes": eb, "cpu_mem": {"median": 45.0},
         "cpu_pool": {"compute_s": {"1": {"median": 100e-6}, "8": {"median": 500e-6}}},  # 8 x 5 MB in 0.5 ms: 80 GB/s
         "engine_replay": {"pool": {"by_count": {"1": {"median": 110e-6, "n": 100}, "8": {"median": 720e-6, "n": 64}}}}}
    got = H.measurement_problems(m)
    assert len(got) == 2 and "45 GB/s" in got[0] and "80 GB/s" in got[0] and "1.44x" in got[1]
    quiet = dict(m, cpu_mem={"median": 110.0},
                 engine_replay={"pool": {"by_count": {"1": {"median": 110e-6, "n": 100}, "8": {"median": 900e-6, "n": 3}}}})
    assert H.measurement_problems(quiet) == []  # 8: too few replayed calls; 1: 1.1x
    assert H.measurement_problems(dict(quiet, cpu_mem={"median": 68.0})) == []  # a quiet host's read under the pool's
    assert H.measurement_problems({}) == []


def test_sim_vs_real_logs_a_round_s_host_state(monkeypatch, capsys):
    from types import SimpleNamespace

    from execute import fidelity as F

    monkeypatch.setattr(H, "host_state", lambda *a, **k: state(9.0, 40))
    got = F._host(SimpleNamespace(threads=15), 1, "after", (state(0.0, 110), None))
    assert got[0]["busy_cores"] == 9.0 and "9.0 of 16 cores" in got[1]
    line = capsys.readouterr().err.strip()
    assert "[1] host after the round: 9.0 of 16 cores busy elsewhere, memory read 40 GB/s -- BUSY" in line


def test_a_calibration_found_busy_fits_the_pool_over_medians():
    import numpy as np

    from execute import calibrate_fit as F
    from tests.execute.test_calibrate import fake_measurements, pool_records, replay_records

    m = fake_measurements()
    recs = replay_records(np.random.default_rng(3))
    tails = [dict(r, parts={"compute": r["parts"]["compute"] * (5.0 if i % 8 == 0 else 1.0)})
             for i, r in enumerate(pool_records(np.random.default_rng(2), {1: 80, 2: 80, 4: 80, 8: 80}, {}))]
    m["engine_replay"] = {"fields": F.replay_host_fields(recs), "pool": F.replay_pool_fit(tails)}
    quiet = C.hardware_json(m, "q")
    busy = C.hardware_json({**m, "host_state": {"problem": "other processes kept 9.0 of 16 cores busy"}}, "b")
    assert busy["cpu_thread_gbps"] == pytest.approx(1.5 * quiet["cpu_thread_gbps"], rel=0.05)  # tails left out
    assert "replay, the median call" in busy["sources"]["cpu_call_factor"]
    assert "replay, the mean call" in quiet["sources"]["cpu_call_factor"]
    # a recorded problem is read again by this version's rules where the states were kept
    state = lambda busy, mem: {"busy_cores": busy, "cores": 16, "mem_gbps": mem}
    old_rule = {"problem": "the memory read (82 GB/s) was slower than ...", "before": state(0.1, 87.0),
                "after": state(0.0, 88.0)}
    assert not H.found_busy({**m, "threads": 15, "host_state": old_rule})
    assert H.found_busy({**m, "threads": 15, "host_state": {**old_rule, "after": state(9.0, 88.0)}})
    assert H.found_busy({**m, "threads": 15, "host_state": {**old_rule, "after": state(0.0, 40.0)}})  # the read fell
