"""``moelab run``: text out, figures, sampling, recorded traces that replay to the same decisions
and feed trace stats / profile build, and the errors users meet."""
from __future__ import annotations

import json

import numpy as np
import pytest

import traces
from execute import model as M
from execute.archs import ARCHS
from execute.cli_replay import replay_main
from execute.cli_run import run_main
from execute.gguf_io import write_gguf
from execute.gguf_model import load_model
from scheduler import Capacity, make_policy, replay
from scheduler.audit import Audit

from .conftest import cupy_or_skip, run_json




@pytest.mark.parametrize("arch", tuple(ARCHS))
def test_every_architecture_runs_on_the_cpu_path(arch, models, capsys):
    assert run_main([str(models(arch)), "-p", "Hello there", "-n", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompt:" in out and "decode:" in out and "hit rate 0.000" in out and "uploaded 0.00 MiB" in out


def test_gpt_oss_runs_on_the_engine_cpu_pool(models, capsys):
    """gpt-oss's experts (biases, clamped swiglu) on the Numba pool: the numpy backend's text."""
    path = models("gpt-oss")
    engine, fig = run_json(capsys, path, "-p", "Hello there", "-n", "6", "--backend", "engine", "--policy", "cpu")
    numpy, fig_np = run_json(capsys, path, "-p", "Hello there", "-n", "6", "--backend", "numpy")
    assert engine == numpy and fig["digest"] == fig_np["digest"] and fig["cpu"] > 0


def test_figures_and_greedy_determinism(models, capsys):
    text1, fig = run_json(capsys, models(), "-p", "The cat", "-n", "6", "--prefill-chunk", "1")
    text2, fig2 = run_json(capsys, models(), "-p", "The cat", "-n", "6", "--prefill-chunk", "1")
    assert text1 == text2 and fig["digest"] == fig2["digest"]
    n_moe = 2 * 2  # blocks x top-k
    assert fig["generated"] == 6 or fig["stopped_at_eos"]
    assert fig["decode_tokens"] == fig["generated"] - 1  # the last sampled token is not run
    assert fig["cpu"] == (fig["prompt_tokens"] + fig["decode_tokens"]) * n_moe and fig["hit_rate"] == 0.0
    assert fig["prompt_tokens_per_s"] > 0 and fig["decode_tokens_per_s"] > 0
    assert fig["prompt_s"] < fig["first_token_s"]  # from the command's start: loading and preparation too
    text3, chunked = run_json(capsys, models(), "-p", "The cat", "-n", "6")  # default: prefill in chunks of 32
    assert text3 == text1 and chunked["tokens"] == 1 + fig["decode_tokens"]  # one prefill batch, then decode
    assert chunked["cpu"] == fig["decode_tokens"] * n_moe + 2 * 8  # each block's batch used all 8 experts once


def test_seeded_sampling(models, capsys):
    a = run_json(capsys, models(), "-p", "x", "-n", "8", "--temp", "1.5", "--seed", "1")[0]
    b = run_json(capsys, models(), "-p", "x", "-n", "8", "--temp", "1.5", "--seed", "1")[0]
    c = run_json(capsys, models(), "-p", "x", "-n", "8", "--temp", "1.5", "--seed", "2")[0]
    assert a == b and a != c


def test_recorded_trace_replays_to_the_same_decisions(models, tmp_path, capsys):
    path = models("deepseek2")  # a dense block and grouped routing
    _, fig = run_json(capsys, path, "-p", "Hi", "-n", "5", "--record-trace", tmp_path / "tr", "--audit", tmp_path / "a.jsonl")
    tr = traces.load(tmp_path / "tr", check=True)
    w = load_model(path)
    assert tr.num_experts == w.info.num_experts and len(tr) == fig["prompt_tokens"] + fig["decode_tokens"]
    assert (tr.phase == 0).sum() == fig["prompt_tokens"] and (tr.expert_ids[:, 0] == -1).all()
    g = w.info.geometry()
    cap = Capacity.per_layer(g, 0)
    assert replay(make_policy("cpu", g, cap), M.trace_tokens(tr), audit=Audit(g, keep_log=True)).digest() == fig["digest"]
    audit = Audit(g, keep_log=True, record_routes=True)  # the executor forced to the trace: same routes, same log
    M.run(M.MoeModel(w), M.NumpyExperts(w), make_policy("cpu", g, cap), M.trace_inputs(tr, w.info), audit=audit)
    assert audit.digest() == fig["digest"]
    recorded = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    assert [[r[1] for r in rec["routes"]] for rec in audit.records] == \
        [[r[1] for r in rec["routes"]] for rec in recorded if "routes" in rec]
    assert replay_main([str(path), "--trace", str(tmp_path / "tr"), "--policy", "cpu", "--backend", "numpy"]) == 0
    assert fig["digest"][:16] in capsys.readouterr().out


def test_trace_feeds_stats_and_profile(models, tmp_path, capsys):
    from scheduler.profile import read_strp
    from moelab.profile_cli import main as profile_main
    from moelab.trace_cli import main as trace_main

    run_json(capsys, models(), "-p", "Hello", "-n", "4", "--record-trace", tmp_path / "tr")
    assert trace_main(["stats", str(tmp_path / "tr")]) == 0
    assert profile_main(["build", str(tmp_path / "tr"), str(tmp_path / "p.strp"), "--slots", "2"]) == 0
    prof = read_strp(tmp_path / "p.strp")
    prof.check_geometry(load_model(models()).info.geometry())


def test_errors_exit_2(models, tmp_path, capsys):
    bad = tmp_path / "mamba.gguf"
    write_gguf(bad, "mamba", [("mamba.block_count", 1, "u32")], [])
    cases = [([str(bad), "-p", "x"], "mamba"), ([str(models()), "-p", "x", "--policy", "belady"], "belady"),
             ([str(models()), "-p", "x", "--policy", "lru"], "cache-mib"),
             ([str(models()), "-p", "x", "--temp", "-1"], "temp"),
             ([str(models()), "-p", "x", "--pageable"], "policy 'cpu' uploads none"),
             ([str(models()), "-p", "x", "--policy", "lru", "--cache-slots", "2", "--cpu-dense"], "only with --policy cpu")]
    try:
        import cupy  # noqa: F401
    except ImportError:
        cases.append(([str(models()), "-p", "x", "--policy", "lru", "--cache-slots", "2"], "cupy"))
    for argv, word in cases:
        assert run_main(argv) == 2, argv
        assert word in capsys.readouterr().err, argv


@pytest.mark.gpu
def test_gpu_run_with_a_profile_from_a_recorded_trace(models, tmp_path, capsys):
    cupy_or_skip()
    from moelab.profile_cli import main as profile_main

    cpu_text, _ = run_json(capsys, models(), "-p", "Hello", "-n", "6", "--record-trace", tmp_path / "tr")
    assert profile_main(["build", str(tmp_path / "tr"), str(tmp_path / "p.strp"), "--slots", "3"]) == 0
    capsys.readouterr()  # profile build's own message
    text, fig = run_json(capsys, models(), "-p", "Hello", "-n", "6", "--policy", "hybrid", "--cache-slots", "3",
                         "--profile", tmp_path / "p.strp")
    assert fig["hits"] > 0 and fig["hits"] + fig["cpu"] + fig["uploads"] + fig["streams"] == fig["experts_served"]
    assert np.isfinite(fig["decode_tokens_per_s"]) and text == cpu_text  # greedy text agrees with the CPU run


@pytest.mark.gpu
def test_cpu_policy_runs_its_dense_path_on_the_gpu(models, capsys):
    """``--policy cpu`` on a GPU machine: experts on the CPU pool, the dense path on the GPU (as
    llama.cpp's --cpu-moe); the same tokens and decisions as the host-only run."""
    cupy_or_skip()
    from execute.cli_options import wants_gpu
    from execute.cli_run import parser_run

    assert wants_gpu(parser_run().parse_args([str(models()), "-p", "x"]))
    assert not wants_gpu(parser_run().parse_args([str(models()), "-p", "x", "--cpu-dense"]))
    text, fig = run_json(capsys, models(), "-p", "Hello there", "-n", "6", "--policy", "cpu")
    host_text, host_fig = run_json(capsys, models(), "-p", "Hello there", "-n", "6", "--cpu-dense")
    assert text == host_text and fig["digest"] == host_fig["digest"] and fig["cpu"] == fig["experts_served"]


def test_pageable_runs_give_hybrid_cost_the_pageable_link_rate(models):
    from execute.cli_options import cost_options
    from execute.cli_run import parser_run
    from scheduler.hardware import load_hardware

    path = str(models())
    ups = {}
    for extra in ([], ["--pageable"]):
        args = parser_run().parse_args([path, "-p", "x", "--policy", "hybrid-cost", "--cache-slots", "2",
                                         "--hardware", "h200-xeon16"] + extra)
        ups[bool(extra)] = cost_options(args, "moelab run")["cost_model"].upload_s[0]
    hw = load_hardware("h200-xeon16")
    assert ups[True] > ups[False]  # the same expert's bytes over the slower pageable path
    assert (ups[True] - hw.copy_latency_s) / (ups[False] - hw.copy_latency_s) == pytest.approx(
        hw.h2d_gbps(True) / hw.h2d_gbps(False))
