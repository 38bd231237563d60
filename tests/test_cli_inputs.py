"""Bad inputs, second round: each case as a user meets it, with the one-line error and exit status 2.

Cases run through ``moelab.cli.main`` in a fresh interpreter, several per subprocess (``_batch``),
so the table stays cheap; cases about a full disk or a second process use their own subprocess.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traces

CMD = [sys.executable, "-m", "moelab"]

# Runs each argv of argv[1] (a JSON list) through moelab.cli.main in this one interpreter; prints
# [status, stderr] per argv. An exception escaping main is printed as the status "raised".
_DRIVER = r"""
import contextlib, io, json, sys, traceback
from moelab.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException:
            rc, _ = "raised", err.write(traceback.format_exc())
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def _batch(cases: list[list[str]], cwd: Path) -> list[tuple[object, str]]:
    r = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([[str(a) for a in c] for c in cases])], cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return [tuple(x) for x in json.loads(r.stdout.splitlines()[-1])]


def _one_line(stderr: str) -> str:
    """The one line a terminal shows: a carriage return starts its line over (a cleared bar)."""
    lines = [ln.rsplit("\r", 1)[-1] for ln in stderr.split("\n")]
    lines = [ln for ln in lines if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moelab"), stderr
    return lines[0]


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad2")
    t = traces.load()
    masked = np.full_like(np.asarray(t.expert_ids), -1)
    traces.Trace(t.model, t.num_experts, t.top_k, masked, t.seq, t.pos, t.phase, None, t.meta).save(root / "masked")
    ids = np.array(t.expert_ids)
    ids[5, 2, 1] = ids[5, 2, 0]
    traces.Trace(t.model, t.num_experts, t.top_k, ids, t.seq, t.pos, t.phase, None, t.meta, check=False).save(root / "dup")
    hw = json.loads((Path(__import__("scheduler.hardware", fromlist=["x"]).HARDWARE_DIR) / "rtx4060-laptop.json").read_text())
    (root / "neg.json").write_text(json.dumps({**hw, "pcie_h2d_gbps": -12.5}))
    (root / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x00\x00")
    (root / "adir").mkdir()
    return {"root": root}


# (id, argv, text the one error line must hold); every case exits 2 and writes nothing
CASES = [
    ("cache-mib-inf", ["simulate", "--cache-mib", "inf"], "--cache-mib: expected a finite number of MiB"),
    ("cache-mib-nan", ["simulate", "--cache-mib", "nan"], "--cache-mib: expected a finite number of MiB"),
    ("sweep-cache-mib-inf", ["sweep", "--cache-mib", "512,inf", "--out", "sw"], "--cache-mib: expected one or more"),
    ("seed-negative", ["simulate", "--trace", "synth", "--seed", "-1"], "--seed: expected an integer >= 0, got -1"),
    ("synth-seed-negative", ["trace", "synth", "s", "--preset", "granite", "--seed", "-1"], "--seed: expected an"),
    ("run-seed-negative", ["run", "{root}/cut.gguf", "-p", "hi", "--seed", "-1"], "--seed: expected an integer >= 0"),
    ("replay-seed-negative", ["replay", "{root}/cut.gguf", "--policy", "cpu", "--seed", "-1"], "--seed: expected an"),
    ("model-synth-seed-negative", ["model", "synth", "s.gguf", "--quant", "Q8_0", "--seed", "-1"], "--seed: expected"),
    ("calibrate-seed-negative", ["calibrate", "--cpu-only", "--base", "rtx4060-laptop", "--quick", "--seed", "-1"],
     "--seed: expected an integer >= 0"),
    ("gpu-cache-too-big", ["simulate", "--model", "qwen3-30b-a3b", "--policy", "gpu", "--trace", "synth",
                           "--synth-tokens", "4"], "more than the 8192 MiB of GPU memory of rtx4060-laptop"),
    ("slots-too-big", ["simulate", "--model", "qwen3-30b-a3b", "--cache-slots", "128", "--trace", "synth",
                       "--synth-tokens", "4"], "--cache-slots 128: the cache"),
    ("zero-slots", ["simulate", "--model", "mixtral-8x7b", "--trace", "synth", "--synth-tokens", "4"],
     "--cache-mib 512: 0 of 8 experts per layer of mixtral-8x7b"),
    ("synth-70000-experts", ["trace", "synth", "s", "--layers", "2", "--experts", "70000", "--top-k", "2",
                             "--tokens", "10"], "--experts 70000: expected at most 65535"),
    ("synth-top-k-above-experts", ["trace", "synth", "s", "--layers", "2", "--experts", "4", "--top-k", "6",
                                   "--tokens", "10"], "--top-k 6: expected <= --experts 4"),
    ("stats-out-no-slots", ["trace", "stats", "--out", "st"], "--out writes hit rates per cache size: give --slots"),
    ("all-masked", ["simulate", "--trace", "{root}/masked", "--policy", "belady"], "is masked (-1)"),
    ("duplicate-ids", ["trace", "info", "{root}/dup"], "row 5 layer 2: expert"),
    ("top-negative", ["profile", "show", "x.strp", "--top", "-5"], "--top: expected an integer >= 0, got -5"),
    ("policies-empty", ["sweep", "--policies", "", "--out", "sw"], "--policies: expected one or more"),
    ("trace-bad-input", ["trace", "info", "nope"], "nope: not a trace directory"),
    ("calibrate-hidden-33", ["calibrate", "--cpu-only", "--base", "rtx4060-laptop", "--quick", "--hidden", "33"],
     "--hidden 33: expected a multiple of 32"),
    ("calibrate-negative-link", ["calibrate", "--cpu-only", "--base", "{root}/neg.json", "--quick"],
     "pcie_h2d_gbps: -12.5, expected a number > 0"),
    ("gguf-cut-in-header", ["model", "info", "{root}/cut.gguf"], "10 bytes, truncated inside the 24-byte GGUF header"),
    ("model-is-a-directory", ["run", "{root}/adir", "-p", "hi"], "adir: is a directory; expected a GGUF file"),
]


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, files):
    root = str(files["root"])
    before = _tree(files["root"])
    results = _batch([[a.replace("{root}", root) for a in c[1]] for c in CASES], tmp_path)
    for (name, _, expect), (rc, err) in zip(CASES, results):
        assert rc == 2, (name, rc, err)
        assert expect in _one_line(err), (name, err)
    assert _tree(tmp_path) == set()
    assert _tree(files["root"]) == before


def test_simulate_help_lists_every_policy():
    from scheduler import POLICIES

    r = subprocess.run(CMD + ["simulate", "--help"], capture_output=True, text=True, timeout=120)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and all(p in text for p in POLICIES), text


def test_a_trace_of_more_experts_than_the_scheduler_takes_is_refused():
    ids = np.zeros((2, 1, 1), np.int32)
    with pytest.raises(traces.TraceError, match="expected at most 65535"):
        traces.Trace("m", (70000,), 1, ids, np.zeros(2), np.arange(2), np.ones(2))


def _full_disk():
    """The child may write files of at most 2 KiB: a write past it fails as on a full disk (EFBIG)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(tmp_path):
    slots = ",".join(str(s) for s in range(40))
    r = subprocess.run(CMD + ["model", "synth", "m.gguf", "--preset", "tiny", "--quant", "Q8_0", "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    runs = [(["trace", "synth", "s", "--preset", "granite"], "s"),
            (["simulate", "--tokens", "3", "--timeline", "tl.json"], "tl.json"),
            (["trace", "stats", "--slots", "8", "--out", "st"], "st/"),
            (["profile", "build", "p.strp"], "p.strp"),
            (["model", "synth", "m2.gguf", "--preset", "tiny", "--quant", "Q8_0"], "m2.gguf"),
            (["run", "m.gguf", "-p", "hello there my friend", "-n", "8", "--backend", "numpy", "--audit", "a.jsonl"],
             "a.jsonl"),
            (["sweep", "--tokens", "2", "--policies", "cpu", "--cache-slots", slots, "--out", "sw", "--jobs", "1",
              "--no-plots"], "sw/results.csv")]
    for argv, name in runs:
        r = subprocess.run(CMD + argv + ["--quiet"] * (argv[0] != "profile"), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300, preexec_fn=_full_disk)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        line = _one_line(r.stderr)
        assert f" {name}" in line and "File too large" in line, line
    # the sweep keeps the rows it finished (it resumes from them) and its lock; nothing else is left
    assert _tree(tmp_path) <= {"m.gguf", "sw", "sw/results.csv", "sw/.sweep.lock"}


def test_a_second_sweep_into_a_busy_folder_is_refused(tmp_path):
    from simulate.sweep import locked

    (tmp_path / "sw").mkdir()
    with locked(tmp_path / "sw"):  # another sweep is writing there
        r = subprocess.run(CMD + ["sweep", "--tokens", "2", "--policies", "cpu", "--cache-slots", "0", "--out", "sw",
                                  "--jobs", "1", "--no-plots", "--quiet"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 2 and "another moelab sweep" in _one_line(r.stderr)
    assert _tree(tmp_path) == {"sw", "sw/.sweep.lock"}  # no CSV: nothing ran


def test_two_sweeps_at_once_write_each_row_once(tmp_path):
    argv = CMD + ["sweep", "--tokens", "40", "--policies", "cpu,hybrid", "--cache-slots", "8,12,16", "--out", "sw",
                  "--jobs", "1", "--no-plots", "--quiet"]
    procs = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    rows = (tmp_path / "sw" / "results.csv").read_text().splitlines()[1:]
    assert len(rows) == 6 and len({r.split(",")[0] for r in rows}) == 6
    assert sorted(rc for rc, _ in results) in ([0, 0], [0, 2]), results  # one ran, the other ran none or was refused


def test_sweep_with_its_default_sizes_runs_every_config(tmp_path, capsys):
    from moelab.simulate_cli import sweep_main

    assert sweep_main(["--tokens", "2", "--out", str(tmp_path / "sw"), "--jobs", "1", "--no-plots"]) == 0
    assert "0 failed" in capsys.readouterr().err


def test_sweep_jobs_leaves_no_semaphore_behind(tmp_path):
    r = subprocess.run(CMD + ["sweep", "--tokens", "2", "--policies", "cpu,lru", "--cache-slots", "8,16", "--out", "sw",
                              "--jobs", "2", "--no-plots", "--quiet"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_sweep_dask_unreachable_is_one_line_and_no_folder(tmp_path, monkeypatch, capsys):
    pytest.importorskip("dask.distributed")
    from moelab.simulate_cli import sweep_main
    from simulate import sweep

    monkeypatch.setattr(sweep, "DASK_CONNECT_S", 1)
    assert sweep_main(["--tokens", "2", "--policies", "cpu", "--cache-slots", "0", "--out", str(tmp_path / "sw"),
                       "--dask", "127.0.0.1:1", "--quiet"]) == 2
    assert "--dask 127.0.0.1:1: cannot reach a Dask scheduler" in _one_line(capsys.readouterr().err)
    assert _tree(tmp_path) == set()


# non-finite weights ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_models(tmp_path_factory) -> dict:
    """The tiny Q8_0 model, and copies with one NaN or Inf planted: an expert scale (the CPU pool's
    ZeroDivisionError), an up projection, the embedding (F16) and the output norm (F32)."""
    from execute.gguf_file import GGUFFile

    root = tmp_path_factory.mktemp("nan")
    r = subprocess.run(CMD + ["model", "synth", "t.gguf", "--preset", "tiny", "--quant", "Q8_0", "--quiet"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    good = (root / "t.gguf").read_bytes()
    offsets = {t.name: t.data_offset for t in GGUFFile(root / "t.gguf").tensors}
    plants = {"gate": ("blk.0.ffn_gate_exps.weight", 34 * 70, np.float16(np.nan)),  # block 70: expert 1
              "up": ("blk.1.ffn_up_exps.weight", 34 * 200, np.float16(np.nan)),
              "embd": ("token_embd.weight", 2 * 100, np.float16(np.inf)),
              "norm": ("output_norm.weight", 4 * 3, np.float32(-np.inf))}
    out = {"good": root / "t.gguf"}
    for key, (name, at, value) in plants.items():
        data = bytearray(good)
        off = offsets[name] + at
        data[off:off + value.nbytes] = value.tobytes()
        (root / f"{key}.gguf").write_bytes(bytes(data))
        out[key] = root / f"{key}.gguf"
    return out


def test_non_finite_weights_are_found_at_load_on_every_path(tmp_path, nan_models):
    expect = {"gate": "tensor blk.0.ffn_gate_exps.weight holds a NaN or Inf (Q8_0 block 70, expert 1)",
              "up": "tensor blk.1.ffn_up_exps.weight holds a NaN or Inf (Q8_0 block 200, expert 3)",
              "embd": "tensor token_embd.weight holds a NaN or Inf (F16 element 100)",
              "norm": "tensor output_norm.weight holds a NaN or Inf (F32 element 3)"}
    cases, wants = [], []
    for key, want in expect.items():
        m = nan_models[key]
        for argv in (["run", m, "-p", "hi", "-n", "4"], ["replay", m, "--policy", "cpu", "--map", "--tokens", "4"],
                     ["kld", m, "--policy", "cpu", "-p", "hello there", "--tokens", "8"]):
            cases.append(argv + ["--timeout-s", "30"])
            wants.append(want)
    for argv, want, (rc, err) in zip(cases, wants, _batch(cases, tmp_path)):
        assert rc == 2, (argv, rc, err)
        line = _one_line(err)  # one line: no worker traceback, no numpy RuntimeWarning before it
        assert want in line and "--allow-non-finite" in line, (argv, line)


def test_allow_non_finite_runs_past_the_check(tmp_path, nan_models):
    (rc, err), = _batch([["run", nan_models["norm"], "-p", "hi", "-n", "2", "--backend", "numpy",
                          "--allow-non-finite"]], tmp_path)
    assert rc == 2 and "is not finite" in _one_line(err) and "holds a NaN or Inf" not in err


@pytest.mark.parametrize("qtype", sorted(__import__("execute.quant", fromlist=["LAYOUTS"]).LAYOUTS))
def test_every_layout_s_non_finite_scale_is_found(qtype):
    from execute import quant as Q
    from execute.weights_check import _bad_in

    rng = np.random.default_rng(qtype)
    q = Q.LAYOUTS[qtype]
    raw = Q.random_blocks(rng, qtype, 4, 512)  # (rows, row_bytes), finite
    assert _bad_in(raw.reshape(-1), qtype) is None
    np.testing.assert_array_equal(np.isfinite(Q.dequantize(raw, qtype, 512)), True)
    flat = raw.reshape(-1).copy()
    unit = 5  # the 6th element (float types) or block
    if q.block_weights == 1:
        v = {Q.F32: np.float32(np.nan), Q.F16: np.float16(np.inf)}.get(qtype)
        bits = v.tobytes() if v is not None else np.uint16(0x7FC0).tobytes()  # BF16 NaN
        flat[unit * q.block_bytes:(unit + 1) * q.block_bytes] = np.frombuffer(bits, np.uint8)
    else:
        block = flat[unit * q.block_bytes:(unit + 1) * q.block_bytes]
        if qtype == Q.MXFP4:
            block[0] = 255
            block[1:] = 0x77  # values 12: 12 * 2^127 overflows float32
        elif qtype == Q.IQ1_M:
            s = block[48:56].view("<u2")
            s |= np.uint16(0xF000)  # d's exponent nibble and more: all ones
        else:
            off = Q._F16_FIELDS[qtype][-1]
            block[off:off + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    assert _bad_in(flat, qtype) == unit
    with np.errstate(all="ignore"):
        w = Q.dequantize(flat.reshape(raw.shape), qtype, 512).reshape(-1)
    assert not np.isfinite(w[unit * q.block_weights:(unit + 1) * q.block_weights]).all()


def test_the_prompt_time_leaves_out_the_backend_s_closing(monkeypatch, nan_models):
    """The backend closes after the run's clock stops: its closing is neither prompt nor decode
    (it was taken off the prompt, which then read -0.000 s)."""
    import time

    from execute import cli_generate
    from execute.cli_run import run_figures

    real = cli_generate.make_backend

    def slow_to_close(*args, **kwargs):
        backend = real(*args, **kwargs)
        close = backend.close
        backend.close = lambda: (time.sleep(1.0), close())
        return backend

    monkeypatch.setattr(cli_generate, "make_backend", slow_to_close)
    out, _ = run_figures([str(nan_models["good"]), "-p", "hi", "-n", "3", "--backend", "numpy", "--quiet"])
    assert out["prompt_s"] > 0 and out["decode_s"] > 0 and out["prompt_tokens_per_s"] > 0


def test_the_context_length_is_enforced_before_the_work(tmp_path):
    r = subprocess.run(CMD + ["model", "synth", "c.gguf", "--preset", "tiny", "--quant", "Q8_0", "--context", "64",
                              "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    text = "hello world " * 50  # more than 64 tokens
    cases = [["run", "c.gguf", "-p", "hi", "-n", "100000000"], ["run", "c.gguf", "-p", text, "-n", "4"],
             ["kld", "c.gguf", "--policy", "cpu", "-p", text, "--tokens", "1000"]]
    results = _batch(cases, tmp_path)
    for argv, (rc, err) in zip(cases, results):
        assert rc == 2 and "context length 64" in _one_line(err), (argv, err)
    assert "-n 100000000 need 100000" in results[0][1]


def test_a_file_without_a_context_length_is_capped_at_the_default(tmp_path):
    """No ``<arch>.context_length`` in the metadata: 4096 positions (--ctx N sets another), named in the error."""
    from execute.cli_options import DEFAULT_CONTEXT

    r = subprocess.run(CMD + ["model", "synth", "c.gguf", "--preset", "tiny", "--quant", "Q8_0", "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = (tmp_path / "c.gguf").read_bytes()
    assert data.count(b"qwen3moe.context_length") == 1  # the key renamed: the reader skips unknown keys
    (tmp_path / "n.gguf").write_bytes(data.replace(b"qwen3moe.context_length", b"qwen3moe.context_lengtX"))
    text = "hello world " * 2000
    cases = [["run", "n.gguf", "-p", "hi", "-n", "100000000"], ["kld", "n.gguf", "--policy", "cpu", "-p", text,
                                                               "--tokens", "100000"],
             ["run", "n.gguf", "-p", "hi", "-n", "40", "--ctx", "30"], ["run", "c.gguf", "-p", "hi", "--ctx", "0"],
             ["run", "n.gguf", "-p", "hi", "-n", "3", "--ctx", "64", "--backend", "numpy", "--quiet"]]
    results = _batch(cases, tmp_path)
    for argv, (rc, err) in zip(cases[:2], results):
        line = _one_line(err)
        assert rc == 2 and f"the default context {DEFAULT_CONTEXT}" in line and "qwen3moe.context_length" in line \
            and "--ctx N" in line, (argv, err)
    assert results[2][0] == 2 and "more than --ctx 30" in _one_line(results[2][1])
    assert results[3][0] == 2 and "--ctx: expected an integer >= 1" in _one_line(results[3][1])
    assert results[4] == (0, "")


def test_a_cache_larger_than_the_gpu_s_free_memory_is_refused_up_front(monkeypatch, capsys, nan_models):
    """run, replay and kld check the cache against the device's free memory (stubbed here: 64 KiB
    free of 8 GiB; the tiny model's 8 experts per layer are 0.1 MiB) before a backend is built."""
    from execute import cli_generate, cli_options, cli_replay, kld
    from execute.cli_replay import replay_main
    from execute.cli_run import run_main

    monkeypatch.setattr(cli_options, "gpu_free_bytes", lambda: (64 << 10, 8 << 30))
    monkeypatch.setattr(kld, "gpu_missing", lambda: None)
    for mod in (cli_generate, cli_replay, kld):
        monkeypatch.setattr(mod, "make_backend" if mod is not kld else "_backend",
                            lambda *a, **k: pytest.fail("a backend was built"))
    model = str(nan_models["good"])
    cases = [(run_main, [model, "-p", "hi", "--policy", "gpu"], "moelab run: --policy gpu (every expert resident)"),
             (replay_main, [model, "--map", "--policy", "lru", "--cache-slots", "8"], "moelab replay: --cache-slots 8"),
             (kld.main, [model, "-p", "hello there", "--policy", "lru", "--cache-mib", "0.1"], "moelab kld: --cache-mib 0.1")]
    for main, argv, head in cases:
        assert main(argv + ["--quiet"]) == 2, argv
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(head) and "is more than the GPU's free memory (0 MiB of 8192 MiB)" in line, line
    from scheduler import Geometry

    g = Geometry.uniform(2, 8, 2, 1 << 20)  # 1 MiB experts
    monkeypatch.setattr(cli_options, "gpu_free_bytes", lambda: (6 << 20, 8 << 30))
    args = __import__("argparse").Namespace(cache_slots=3, cache_mib=None, policy="lru")
    assert cli_options.build_capacity(args, g).slot_bytes(g) == 6 << 20  # exactly what is free
    args.cache_slots = 4
    with pytest.raises(cli_options.Fail, match="--cache-slots 4: the expert cache [(]8 MiB[)]"):
        cli_options.build_capacity(args, g)
    monkeypatch.setattr(cli_options, "gpu_free_bytes", lambda: None)  # no GPU: the backend says why later
    assert cli_options.build_capacity(args, g).slot_bytes(g) == 8 << 20


def test_calibrate_calls_measured_only_the_types_it_measured():
    from execute.calibrate import _efficiency_source

    assert "measured" not in _efficiency_source([], ["Q4_K", "Q6_K"]).split(";")[0]
    assert "Q4_K, Q6_K: the base file's ratios to Q8_0, not measured here" in _efficiency_source([], ["Q4_K", "Q6_K"])
    assert _efficiency_source(["Q4_K"], ["Q4_K"]).startswith("measured: pool GB/s of Q4_K")


def test_a_cpu_worker_that_dies_is_one_error_long_before_the_timeout(nan_models, monkeypatch):
    """A worker thread's exception (a ZeroDivisionError in the kernel, as a NaN scale gave) fails the
    pool at once: ``moelab replay`` ends with one line naming it, not after --timeout-s 120."""
    import contextlib
    import io
    import threading

    from execute import cpu_pool
    from execute.cli_replay import replay_main

    real = cpu_pool._team_worker

    def dies(ctrl, ring, t, *rest):
        if t == 0:
            raise ZeroDivisionError("division by zero")
        return real(ctrl, ring, t, *rest)

    dies.compile = real.compile  # the pool compiles the team's loop before starting it
    monkeypatch.setattr(cpu_pool, "_team_worker", dies)
    err, result = io.StringIO(), []
    argv = [str(nan_models["good"]), "--policy", "cpu", "--map", "--tokens", "4", "--threads", "2", "--timeout-s", "120",
            "--quiet"]

    def go():
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            result.append(replay_main(argv))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(60)  # half the timeout: a wait for it fails here
    assert not t.is_alive(), "replay waited for the timeout on a dead CPU worker"
    assert result == [2]
    assert "CPU experts failed: worker 0 died: ZeroDivisionError('division by zero')" in _one_line(err.getvalue())


def test_the_exit_statuses_are_documented():
    text = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "Exit status, the same for every command: 0 done; 2 bad input; 1 `sweep`" in text


def test_a_misaligned_tensor_offset_is_refused(tmp_path, nan_models):
    import struct

    data = bytearray(nan_models["good"].read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # its tensor-table entry
    n_dims = struct.unpack_from("<I", data, at)[0]
    off_at = at + 4 + 8 * n_dims + 4
    struct.pack_into("<Q", data, off_at, struct.unpack_from("<Q", data, off_at)[0] + 2)
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    (rc, err), = _batch([["model", "info", "m.gguf"]], tmp_path)
    assert rc == 2 and "tensor 'token_embd.weight': data offset" in _one_line(err) and "alignment 32" in err
