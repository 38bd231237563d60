"""Every ``moelab`` command over a table of bad inputs, run as a user runs it (a subprocess).

Each case must exit non-zero with exactly one ``moelab ...`` line on stderr that names the file or
flag and what was expected, print no traceback, and leave the working directory as it found it.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import traces

CMD = [sys.executable, "-m", "moelab"]


def moelab(args, cwd, timeout=300, **kw):
    return subprocess.run(CMD + [str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """Bad (and a few good) input files, shared by the cases."""
    root = tmp_path_factory.mktemp("inputs")
    t = traces.load()
    t.save(root / "good")
    ids = np.array(t.expert_ids)
    ids[3, 5, 1] = 99  # layer 5 has 32 experts
    traces.Trace(t.model, t.num_experts, t.top_k, ids, t.seq, t.pos, t.phase, None, t.meta, check=False).save(root / "badid")
    t.save(root / "garbage")
    (root / "garbage" / "expert_ids.npy").write_bytes(b"\x80\x04\x95garbage pickle")
    t.save(root / "floatids")
    np.save(root / "floatids" / "expert_ids.npy", np.asarray(t.expert_ids, np.float32))
    (root / "junk.bin").write_bytes(b"root:x:0:0:not a profile\n" * 4)
    (root / "params.json").write_text("[1, 2]")
    (root / "afile").write_text("x")
    model = root / "m.gguf"
    r = moelab(["model", "synth", model, "--quant", "Q8_0", "--quiet"], root)
    assert r.returncode == 0, r.stderr
    return {"root": root, "model": model}


# (id, argv with {placeholders}, text the error line must hold)
CASES = [
    ("stats-slots-0", ["trace", "stats", "--slots", "0"], "--slots"),
    ("stats-slots-negative", ["trace", "stats", "--slots", "8,-1"], "expected cache sizes >= 1"),
    ("stats-out-missing-parent", ["trace", "stats", "--out", "nope/st"], "nope does not exist"),
    ("stats-out-is-file", ["trace", "stats", "--out", "{root}/afile"], "is not a directory"),
    ("stats-bad-id", ["trace", "stats", "{root}/badid"], "id 99 out of range"),
    ("info-bad-id", ["trace", "info", "{root}/badid"], "row 3 layer 5: id 99 out of range"),
    ("info-garbage-npy", ["trace", "info", "{root}/garbage"], "expert_ids.npy: not a .npy"),
    ("info-float-ids", ["trace", "info", "{root}/floatids"], "expected integers"),
    ("info-not-a-trace", ["trace", "info", "{root}"], "not a trace directory"),
    ("fit-out-is-dir", ["trace", "fit", "--out", "."], "is a directory"),
    ("fit-out-missing-parent", ["trace", "fit", "--out", "nope/fit.json"], "nope does not exist"),
    ("synth-params-not-object", ["trace", "synth", "s", "--params", "{root}/params.json"], "expected a JSON object"),
    ("synth-no-geometry", ["trace", "synth", "s"], "missing --layers"),
    ("synth-dest-missing-parent", ["trace", "synth", "nope/s", "--preset", "granite"], "nope does not exist"),
    ("import-missing-metadata", ["trace", "import", "switch", "{root}/afile", "t", "--metadata", "nope.json"],
     "--metadata nope.json"),
    ("import-metadata-not-switch", ["trace", "import", "vllm", "{root}/afile", "t", "--metadata", "{root}/afile"],
     "read only by the switch importer, not vllm"),
    ("import-layers-not-vllm", ["trace", "import", "granite", "{root}/afile", "t", "--layers", "4"],
     "read only by the vllm and strata importers, not granite"),
    ("import-dest-is-file", ["trace", "import", "switch", "{root}/afile", "{root}/afile"], "not a directory"),
    ("profile-out-missing-parent", ["profile", "build", "nope/p.strp"], "nope does not exist"),
    ("profile-bad-trace", ["profile", "build", "{root}/badid", "p.strp"], "id 99 out of range"),
    ("profile-show-junk", ["profile", "show", "{root}/junk.bin"], "expected b'STRP'"),
    ("simulate-bad-id", ["simulate", "--trace", "{root}/badid"], "id 99 out of range"),
    ("simulate-garbage", ["simulate", "--trace", "{root}/garbage"], "not a .npy"),
    ("simulate-timeline-dir", ["simulate", "--timeline", "."], "is a directory"),
    ("simulate-timeline-missing-parent", ["simulate", "--timeline", "nope/tl.json"], "nope does not exist"),
    ("simulate-bad-policy", ["simulate", "--policy", "bogus"], "unknown 'bogus'"),
    ("sweep-bad-policy", ["sweep", "--policies", "lru,bogus", "--out", "sw"], "unknown 'bogus'"),
    ("sweep-missing-trace", ["sweep", "--trace", "nope", "--out", "sw"], "nope: not a trace directory"),
    ("sweep-bad-model", ["sweep", "--models", "nope", "--out", "sw"], "unknown model 'nope'"),
    ("sweep-out-is-file", ["sweep", "--out", "{root}/afile"], "is not a directory"),
    ("sweep-jobs-0", ["sweep", "--jobs", "0", "--out", "sw"], "--jobs: expected an integer >= 1, got 0"),
    ("simulate-tokens-0", ["simulate", "--tokens", "0"], "--tokens: expected an integer >= 1, got 0"),
    ("simulate-miss-fraction", ["simulate", "--miss-fraction", "2"], "--miss-fraction: expected a fraction 0..1"),
    ("replay-bad-policy", ["replay", "{model}", "--policy", "bogus"], "--policy 'bogus'"),
    ("replay-bad-profile", ["replay", "{model}", "--policy", "static", "--map", "--cache-slots", "2", "--profile",
                            "{root}/junk.bin"], "--profile: {root}/junk.bin"),
    ("replay-bad-trace", ["replay", "{model}", "--policy", "cpu", "--trace", "{root}/badid"], "id 99 out of range"),
    ("replay-threads-0", ["replay", "{model}", "--policy", "cpu", "--threads", "0"], "--threads 0"),
    ("replay-audit-missing-parent", ["replay", "{model}", "--policy", "cpu", "--audit", "nope/a.jsonl"],
     "nope does not exist"),
    ("run-threads-0", ["run", "{model}", "-p", "hi", "--threads", "0"], "--threads 0"),
    ("run-threads-huge", ["run", "{model}", "-p", "hi", "--threads", "100000"], "--threads 100000"),
    ("run-timeout-0", ["run", "{model}", "-p", "hi", "--timeout-s", "0"], "--timeout-s 0"),
    ("run-audit-dir", ["run", "{model}", "-p", "hi", "--audit", "."], "is a directory"),
    ("run-record-trace-file", ["run", "{model}", "-p", "hi", "--record-trace", "{root}/afile"], "not a directory"),
    ("run-bad-profile", ["run", "{model}", "-p", "hi", "--profile", "{root}/junk.bin"], "expected b'STRP'"),
    ("model-synth-missing-parent", ["model", "synth", "nope/m.gguf", "--quant", "Q8_0"], "nope does not exist"),
    ("model-synth-dir", ["model", "synth", ".", "--quant", "Q8_0"], "is a directory"),
    ("model-info-junk", ["model", "info", "{root}/junk.bin"], "junk.bin"),
    ("calibrate-out-missing-parent", ["calibrate", "--out", "nope/hw.json"], "nope does not exist"),
    ("calibrate-layers-0", ["calibrate", "--cpu-only", "--base", "rtx4060-laptop", "--layers", "0"], "--layers 0"),
    ("calibrate-top-k", ["calibrate", "--cpu-only", "--base", "rtx4060-laptop", "--top-k", "9", "--experts", "8"],
     "--top-k 9: expected <= --experts 8"),
    ("calibrate-bad-base", ["calibrate", "--cpu-only", "--base", "nope"], "--base nope"),
]


def _error_line(stderr: str) -> str:
    """The one line of stderr, a ``moelab ...`` line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moelab"), stderr
    return lines[0]


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize("argv, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_leaves_nothing(tmp_path, inputs, argv, expect):
    subs = {"{root}": str(inputs["root"]), "{model}": str(inputs["model"])}

    def fill(text: str) -> str:
        for k, v in subs.items():
            text = text.replace(k, v)
        return text

    before_inputs = _tree(inputs["root"])
    r = moelab([fill(a) for a in argv], tmp_path)
    assert r.returncode not in (0, None), r.stdout
    assert "Traceback" not in r.stderr
    assert fill(expect) in _error_line(r.stderr)
    assert _tree(tmp_path) == set(), "output left behind"
    assert _tree(inputs["root"]) == before_inputs


def test_calibrate_without_a_gpu_stops_before_measuring(tmp_path):
    try:
        import cupy  # noqa: F401

        pytest.skip("a GPU stack is installed here")
    except ImportError:
        pass
    r = moelab(["calibrate", "--quick"], tmp_path, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--cpu-only --base" in _error_line(r.stderr)
    assert _tree(tmp_path) == set()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused_before_the_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for argv in (["trace", "fit", "--out", ro / "fit.json"], ["trace", "synth", ro / "s", "--preset", "granite"],
                     ["simulate", "--timeline", ro / "tl.json"], ["profile", "build", ro / "p.strp"]):
            r = moelab(argv, tmp_path)
            assert r.returncode != 0 and "is not writable" in _error_line(r.stderr)
    finally:
        ro.chmod(0o755)


def test_sweep_exits_non_zero_and_counts_failed_rows(tmp_path):
    r = moelab(["sweep", "--tokens", "4", "--policies", "lru,cpu", "--cache-slots", "2", "--out", "sw", "--jobs", "1",
                "--no-plots", "--quiet"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "2 configs: 2 run" in r.stderr and "1 failed" in r.stderr
    assert len((tmp_path / "sw" / "results.csv").read_text().splitlines()) == 3  # header + both rows


def test_ctrl_c_in_a_sweep_is_one_line_and_keeps_rows(tmp_path):
    slots = ",".join(str(s) for s in range(8, 33))
    p = subprocess.Popen(CMD + ["sweep", "--tokens", "800", "--phase", "all", "--policies", "lru,hybrid,belady",
                                "--cache-slots", slots, "--out", "sw", "--jobs", "2", "--no-plots", "--quiet"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    csv = tmp_path / "sw" / "results.csv"
    try:
        while p.poll() is None and not (csv.exists() and len(csv.read_text().splitlines()) > 1):
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole process group
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    line = _error_line(err)
    kept = len(csv.read_text().splitlines()) - 1
    assert "interrupted" in line and f"{kept} rows kept" in line and kept >= 1


def test_result_files_have_the_usual_mode(tmp_path):
    """Files written through scheduler.files get 0o666 less the umask, as open() would."""
    env = dict(os.environ)
    runs = [["trace", "stats", "--slots", "8", "--out", "st"], ["profile", "build", "p.strp"],
            ["simulate", "--tokens", "3", "--timeline", "tl.json"], ["trace", "synth", "s", "--preset", "granite"],
            ["sweep", "--tokens", "3", "--policies", "cpu", "--cache-slots", "0", "--out", "sw", "--jobs", "1",
             "--no-plots", "--quiet"]]
    for argv in runs:
        r = subprocess.run(["sh", "-c", 'umask 022 && exec "$@"', "sh", *CMD, *map(str, argv)], cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 12  # 3 stats files, STRP, timeline, 5 trace files, CSV, the sweep's lock
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o755


def test_audit_file_has_the_usual_mode(tmp_path):
    from scheduler import Audit, Geometry

    old = os.umask(0o027)
    try:
        Audit(Geometry((4,), 2, (10,))).write_jsonl(tmp_path / "a.jsonl")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.jsonl").stat().st_mode) == 0o640


def test_synth_takes_the_geometry_from_a_fit(tmp_path, monkeypatch):
    import functools

    from moelab import trace_cli
    from traces import synth

    # the command's own fit and writer, with a short search (the full one takes ~20 s)
    monkeypatch.setattr(synth, "fit", functools.partial(synth.fit, num_random=2, passes=1))
    monkeypatch.chdir(tmp_path)
    assert trace_cli.main(["fit", "--out", "fit.json", "--quiet"]) == 0
    r = moelab(["trace", "synth", "s", "--params", "fit.json", "--tokens", "50"], tmp_path)
    assert r.returncode == 0, r.stderr
    t = traces.load(tmp_path / "s", check=True)
    geo = json.loads((tmp_path / "fit.json").read_text())["geometry"]
    assert (len(t.num_experts), max(t.num_experts), t.top_k, len(t)) == (geo["num_layers"], geo["num_experts"],
                                                                          geo["top_k"], 50)
    assert stat.S_IMODE((tmp_path / "fit.json").stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_nan_weights_stop_the_run_naming_the_tensor(tmp_path, inputs):
    from execute.gguf_model import load_model

    model = tmp_path / "nan.gguf"
    model.write_bytes(inputs["model"].read_bytes())
    w = load_model(model)
    off = int(next(t for t in w.reader.tensors if t.name == "blk.1.attn_norm.weight").data_offset)
    del w
    with open(model, "r+b") as f:
        f.seek(off)
        f.write(np.full(4, np.nan, np.float32).tobytes())
    r = moelab(["run", model, "-p", "hi", "-n", "4", "--backend", "numpy"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tensor blk.1.attn_norm.weight holds a NaN or Inf (F32 element 0)" in _error_line(r.stderr)
    assert "\x00" not in r.stdout


@pytest.mark.parametrize("extra", [["--prefill-chunk", "8"], ["--prefill-chunk", "5", "--speculative", "2"]])
def test_run_audit_with_multi_token_batches_imports_as_the_recorded_trace(tmp_path, inputs, extra):
    r = moelab(["run", inputs["model"], "-p", "the cat sat on the mat, the cat sat on the", "-n", "6",
                "--audit", "a.jsonl", "--record-trace", "rt", *extra], tmp_path)
    assert r.returncode == 0, r.stderr
    r = moelab(["trace", "import", "audit", "a.jsonl", "imp"], tmp_path)
    assert r.returncode == 0, r.stderr
    got, want = traces.load(tmp_path / "imp", check=True), traces.load(tmp_path / "rt", check=True)
    assert len(got) == len(want) > 20
    for name in ("expert_ids", "pos", "phase"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    np.testing.assert_allclose(got.weights, want.weights, rtol=1e-6)


@pytest.mark.parametrize("fault", ["stall", "crash"])
def test_a_stalled_or_crashed_cpu_worker_is_a_step_error_not_a_hang(inputs, monkeypatch, fault):
    """``moelab replay`` on the CPU path with the pool's kernel call stalled (or raising): the
    command ends with one error line within --timeout-s; a hang fails the join below."""
    import contextlib
    import io
    import threading

    from execute import cpu_pool
    from execute.cli_replay import replay_main

    real = cpu_pool._launch
    calls, held = [], []

    def faulty(ctrl, *args):
        calls.append(1)
        if len(calls) > 3:  # a few layers run, then the fault
            if fault == "crash":
                raise RuntimeError("worker died")
            ctrl[cpu_pool._C_HOLD] = 1  # the pool's team holds its next call: a stall
            held.append(ctrl)
        return real(ctrl, *args)

    monkeypatch.setattr(cpu_pool, "_launch", faulty)
    err, result = io.StringIO(), []
    argv = [str(inputs["model"]), "--policy", "cpu", "--map", "--tokens", "8", "--threads", "1", "--timeout-s", "2",
            "--quiet"]

    def go():
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            result.append(replay_main(argv))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(120)
    for ctrl in held:
        ctrl[cpu_pool._C_HOLD] = 0
    assert not t.is_alive(), "replay hung on a faulty CPU worker"
    assert result == [2]
    line = _error_line(err.getvalue())
    assert ("did not finish within 2.0 s" if fault == "stall" else "CPU experts failed: RuntimeError('worker died')") in line


def test_every_model_preset_simulates_with_a_synthetic_trace(capsys):
    """Presets with leading dense layers (deepseek-v2-lite) included: the dense layers are masked."""
    from moelab.simulate_cli import simulate_main
    from scheduler.models import MODEL_PRESETS

    for name in MODEL_PRESETS:
        assert simulate_main(["--model", name, "--trace", "synth", "--synth-tokens", "6", "--cache-mib", "auto",
                              "--hardware", "h200-xeon16"]) == 0, name
        out = capsys.readouterr().out
        assert f"trace: synthetic (6 rows, seed 0)" in out and "tokens/s simulated" in out


def test_ctrl_c_in_model_synth_is_one_line_and_leaves_no_file(tmp_path):
    p = subprocess.Popen(CMD + ["model", "synth", "big.gguf", "--quant", "Q8_0", "--layers", "8", "--experts", "64",
                                "--hidden", "1024", "--ffn", "1024"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = ""
        while ", tensor " not in seen and p.poll() is None:  # the bar names a tensor: the file is being written
            seen += os.read(p.stderr.fileno(), 4096).decode()
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and "Traceback" not in err
    assert "interrupted" in _error_line(_without_bars(err, "model synth"))
    assert _tree(tmp_path) == set()


def _without_bars(stderr: str, desc: str) -> str:
    """``stderr`` less the progress bar's redraws (``\r``-separated, starting with ``desc``)."""
    return "\n".join(ln for ln in stderr.replace("\r", "\n").splitlines() if not ln.startswith(desc))


@pytest.mark.parametrize("argv", [["trace", "synth", "{dir}", "--preset", "granite"],
                                  ["trace", "import", "switch", "{root}/afile", "{dir}"],
                                  ["run", "{model}", "-p", "hi", "--record-trace", "{dir}"]])
def test_a_directory_that_is_not_a_trace_is_refused_before_the_work(tmp_path, inputs, argv):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    subs = {"{dir}": str(keep), "{root}": str(inputs["root"]), "{model}": str(inputs["model"])}
    r = moelab([subs.get(a, a).replace("{root}", str(inputs["root"])) for a in argv], tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "exists and is not a trace directory" in _error_line(r.stderr)
    assert _tree(tmp_path) == {"mine", "mine/notes.txt"}


def test_a_closed_pipe_ends_quietly(tmp_path):
    # `true` exits at once: the command writes into a pipe nobody reads (as `| head` once satisfied)
    r = subprocess.run(["sh", "-c", '"$@" | true', "sh", *CMD, "trace", "info"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.stderr == ""


def test_calibrate_base_takes_a_preset_name(tmp_path):
    from execute.calibrate import _base_path
    from scheduler.hardware import HARDWARE_DIR

    assert _base_path("rtx4060-laptop") == HARDWARE_DIR / "rtx4060-laptop.json"
    (tmp_path / "hw.json").write_text("{}")
    assert _base_path(str(tmp_path / "hw.json")) == tmp_path / "hw.json"


@pytest.mark.parametrize("slots", [0, -3])
def test_the_reference_lru_refuses_caches_of_no_slots(slots):
    """Not a hit rate read from the wrong end of the recency order (a -1 index)."""
    from traces import stats

    with pytest.raises(ValueError, match=f"capacities: {slots} slots, expected cache sizes >= 1"):
        stats.lru_hit_rates(traces.load(), [8, slots])
