"""Progress on stderr: every long-running ``moelab`` command shows a tqdm bar named after itself, and
``--quiet`` leaves stderr empty (errors aside); results go to stdout or files either way.

Small runs of each command, as a user runs them (a subprocess); ``trace fit`` in-process with a
short search.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

CMD = [sys.executable, "-m", "moelab"]


def moelab(args, cwd, timeout=300):
    return subprocess.run(CMD + [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("progress")
    r = moelab(["model", "synth", "m.gguf", "--quant", "Q8_0", "--quiet"], root)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    with open(root / "rec.jsonl", "w") as f:  # a vLLM-profiler recording: 2 tokens x 2 layers
        for tok in range(2):
            for layer in range(2):
                f.write(json.dumps({"dataset": "d", "problem_id": 0, "layer": layer, "token_idx": tok,
                                    "experts": [tok, layer + 2]}) + "\n")
    return {"model": root / "m.gguf", "rec": root / "rec.jsonl"}


# (id, argv, the bar's name: None where the command shows no bar)
CASES = [
    ("simulate", ["simulate", "--tokens", "20"], "simulate"),
    ("simulate-static", ["simulate", "--tokens", "20", "--policy", "static", "--timeline", "tl.json"], "simulate"),
    ("sweep", ["sweep", "--tokens", "3", "--policies", "cpu,lru", "--cache-slots", "8", "--out", "sw", "--jobs", "1"],
     "sweep"),
    ("trace-stats", ["trace", "stats", "--slots", "8,16"], "trace stats"),
    ("trace-synth", ["trace", "synth", "s", "--preset", "granite"], "trace synth"),
    ("trace-import", ["trace", "import", "vllm", "{rec}", "t"], None),
    ("model-synth", ["model", "synth", "m2.gguf", "--quant", "Q8_0"], "model synth"),
    ("replay", ["replay", "{model}", "--policy", "cpu", "--map", "--tokens", "4", "--threads", "1"], "replay"),
    ("run", ["run", "{model}", "-p", "hi", "-n", "2", "--threads", "1"], "run"),
    ("kld", ["kld", "{model}", "--policy", "cpu", "-p", "hello there", "--tokens", "8", "--threads", "1"], "kld"),
    ("calibrate", ["calibrate", "--cpu-only", "--base", "rtx4060-laptop", "--quick", "--small", "--layers", "1",
                   "--experts", "8", "--top-k", "2", "--hidden", "256", "--ffn", "256", "--threads", "1",
                   "--out", "hw.json"], "calibrate"),
]


@pytest.mark.parametrize("argv, bar", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_progress_on_stderr_and_quiet_silences_it(tmp_path, files, argv, bar):
    argv = [str(files["model"]) if a == "{model}" else str(files["rec"]) if a == "{rec}" else a for a in argv]
    loud, quiet = tmp_path / "loud", tmp_path / "quiet"
    loud.mkdir()
    quiet.mkdir()
    r = moelab(argv, loud)
    assert r.returncode == 0, r.stderr
    if bar is not None:
        assert f"{bar}: 100%|" in r.stderr, r.stderr  # the bar, finished
        assert f"{bar}:" not in r.stdout
    q = moelab(argv + ["--quiet"], quiet)
    assert q.returncode == 0, q.stderr
    assert q.stderr == ""
    assert sorted(p.name for p in quiet.iterdir()) == sorted(p.name for p in loud.iterdir())  # same outputs


def test_run_s_bar_covers_the_prompt_then_the_tokens_and_ends_full(tmp_path, files):
    """Text to a pipe: the bar counts prompt positions, then generated tokens; it ends at 100% even
    when an end token stops the run short of -n."""
    r = moelab(["run", files["model"], "-p", "hello there", "-n", "50", "--threads", "1", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.rindex("\n{") + 1:])  # after the streamed text
    n = out["prompt_tokens"] + out["generated"]
    last = [s for s in r.stderr.replace("\r", "\n").splitlines() if s.strip()][-1]
    assert last.startswith(f"run: 100%|") and f"| {n}/{n} " in last, last


def test_a_cold_numba_cache_is_found_from_its_index(tmp_path, monkeypatch):
    """No index, then one written by the first call; a changed source makes the index stale."""
    import importlib

    from execute.cli_options import cpu_kernels_cold

    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    src = tmp_path / "moelab_cold_probe.py"
    src.write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("moelab_cold_probe")
    assert cpu_kernels_cold(mod.f)
    assert mod.f(1) == 2  # compiled, and the index written
    assert not cpu_kernels_cold(mod.f)
    src.write_text(src.read_text() + "# changed\n")
    sys.modules.pop("moelab_cold_probe")
    assert cpu_kernels_cold(importlib.import_module("moelab_cold_probe").f)
    sys.modules.pop("moelab_cold_probe")
    assert not cpu_kernels_cold(object())  # not where this Numba keeps its cache: nothing said


@pytest.mark.parametrize("cold, quiet", [(True, False), (True, True), (False, False)])
def test_a_cold_cache_is_announced_before_the_compile(files, monkeypatch, capsys, cold, quiet):
    from execute import cli_options
    from execute.cli_run import run_main

    monkeypatch.setattr(cli_options, "cpu_kernels_cold", lambda: cold)
    assert run_main([str(files["model"]), "-p", "hi", "-n", "2", "--threads", "1"] + ["--quiet"] * quiet) == 0
    err = capsys.readouterr().err
    said = "moelab run: compiling the CPU expert kernels (first run after an install or update, ~10-30 s)..."
    assert (said in err) == (cold and not quiet), err
    if quiet:
        assert err == ""


def test_a_bad_input_with_quiet_still_says_why(tmp_path):
    r = moelab(["simulate", "--trace", "nope", "--quiet"], tmp_path)
    assert r.returncode == 2 and "nope" in r.stderr and len(r.stderr.splitlines()) == 1


def test_sweep_quiet_still_reports_failed_rows(tmp_path):
    r = moelab(["sweep", "--tokens", "3", "--policies", "lru", "--cache-slots", "2", "--out", "sw", "--jobs", "1",
                "--no-plots", "--quiet"], tmp_path)  # lru refuses 2 slots below top-8
    assert r.returncode == 1 and "1 failed" in r.stderr and "%|" not in r.stderr


@pytest.mark.parametrize("quiet", [False, True])
def test_trace_fit_shows_its_search_unless_quiet(monkeypatch, capsys, tmp_path, quiet):
    from moelab import trace_cli as cli
    from traces import synth

    monkeypatch.setattr(synth, "fit", functools.partial(synth.fit, num_random=2, passes=1))
    assert cli.main(["fit", "--out", str(tmp_path / "fit.json")] + ["--quiet"] * quiet) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["params"]
    if quiet:
        assert out.err == ""
    else:
        assert "trace fit: 100%|" in out.err and "3/3" in out.err and "loss" in out.err


def test_the_simulate_bar_counts_the_simulated_tokens(capsys):
    """static reads the tokens once before the simulation: the bar restarts, and ends at the token count."""
    from moelab.simulate_cli import simulate_main

    assert simulate_main(["--tokens", "7", "--policy", "static", "--cache-slots", "8"]) == 0
    err = capsys.readouterr().err
    assert "7/7" in err and "14/7" not in err


@pytest.mark.parametrize("argv, bar", [(["trace", "synth", "big", "--layers", "48", "--experts", "128", "--top-k", "8",
                                         "--tokens", "400000"], "trace synth"),
                                        (["simulate", "--trace", "synth", "--synth-tokens", "20000"], "simulate")])
def test_ctrl_c_during_a_bar_ends_with_the_interrupted_line(tmp_path, argv, bar):
    import os
    import signal

    p = subprocess.Popen(CMD + argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = ""
        while seen.count(f"{bar}:") < 4:  # the bar has been drawn a few times: the work is under way
            chunk = os.read(p.stderr.fileno(), 4096).decode()
            assert chunk, seen
            seen += chunk
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [s for s in (seen + err).replace("\r", "\n").splitlines() if s.strip()]
    assert p.returncode == 130 and "Traceback" not in err
    assert lines[-1].startswith("moelab") and "interrupted" in lines[-1], lines[-3:]
    assert not (tmp_path / "big").exists()
