"""n-token steps: chunks of T tokens through the forward pass give token-by-token's logits and
routes, one scheduler Step per block with counts, KV rollback, chunked prefill in ``moelab run``,
hybrid-cost's cost model from ``--hardware``, and recorded n-token runs that replay to the same
decisions; (gpu) the hybrid path on chunks."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from execute import model as M
from execute.archs import ARCHS
from execute.cli_replay import replay_main
from execute.cli_run import run_main
from execute.model_spec import model_spec
from execute.gguf_model import load_model
from execute.synth import config_from_preset, synth_model
from scheduler import Capacity, Step, Token, make_policy, replay
from scheduler.audit import Audit
from simulate.speculative import merge_rows

from .conftest import cupy_or_skip

TOKENS = [5, 300, 17, 17, 42, 256, 1, 9, 100, 33, 33, 7, 8, 200]  # longer than gpt-oss's window of 4
QUANT = {"qwen2moe": "Q4_0", "llama": "Q4_0", "deepseek2": "Q4_0"}  # else Q8_0


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    """``arch_model(arch)`` -> (path, ModelWeights) of a tiny model (cached per module)."""
    root = tmp_path_factory.mktemp("batches")
    made = {}

    def get(arch: str = "qwen3moe"):
        if arch not in made:
            cfg = config_from_preset("tiny", arch=arch, quant=QUANT.get(arch, "Q8_0"), seed=5)
            path = synth_model(root / f"{arch}.gguf", cfg)
            made[arch] = (path, load_model(path))
        return made[arch]

    return get


class AnyPlacement(M.NumpyExperts):
    """Test double for decision checks only: computes every expert with numpy on the host, wherever
    the decision placed it, and ignores background copies. It measures nothing about a GPU."""

    def run_layer(self, item, x, ids, weights):
        return self.compute(item.step, x, ids, weights)

    def start_background(self, moves) -> None:
        pass


def run_chunks(weights, sizes, tokens=TOKENS, backend=None, policy="cpu", slots=0, max_tokens=4, **options):
    """Logits (T, vocab) and audit of ``tokens`` run in chunks of ``sizes``, every row's logits kept."""
    g = weights.info.geometry()
    pol = make_policy(policy, g, Capacity.per_layer(g, slots), **options)
    inputs, pos = [], 0
    for i, n in enumerate(sizes):
        inputs.append(M.ChunkInput(i, 0, pos, "prefill", tuple(tokens[pos:pos + n]), all_logits=True))
        pos += n
    assert pos == len(tokens)
    audit = Audit(g, keep_log=True, record_routes=True)
    model = M.MoeModel(weights, max_tokens=max_tokens)  # small: the KV cache grows inside chunks
    model.route_log = []
    res = M.run(model, backend or M.NumpyExperts(weights), pol, inputs, audit=audit, keep_logits=True)
    return np.stack(res.logits), audit, model.route_log


@pytest.mark.parametrize("arch", tuple(ARCHS))
def test_chunks_give_token_by_token_logits_and_routes(arch, arch_model):
    _, w = arch_model(arch)
    one, _, routes1 = run_chunks(w, [1] * len(TOKENS))
    for sizes in ([5, 4, 5], [len(TOKENS)], [2, 1, 7, 4]):
        got, audit, routes = run_chunks(w, sizes)
        assert got.shape == one.shape and nmse(got, one) <= 1e-10, sizes  # measured ~1e-13
        assert [[(l, e) for l, e, _ in r] for _, r in routes] == [[(l, e) for l, e, _ in r] for _, r in routes1]
        assert [p for p, _ in routes] == list(range(len(TOKENS)))
        assert audit.tokens == len(sizes)


def test_chunk_check_sees_a_broken_causal_mask(arch_model, monkeypatch):
    """The agreement above is not vacuous: letting a chunk's queries see later keys breaks it."""
    _, w = arch_model("qwen3moe")
    one, _, _ = run_chunks(w, [1] * len(TOKENS))
    orig = M.MoeModel._window

    def no_mask(self, l, t):
        lo, _ = orig(self, l, t)
        return lo, None

    monkeypatch.setattr(M.MoeModel, "_window", no_mask)
    got, _, _ = run_chunks(w, [5, 4, 5])
    assert nmse(got, one) > 1e-4


@pytest.mark.parametrize("arch", ("qwen2moe", "deepseek2"))
def test_engine_cpu_path_runs_chunks(arch, arch_model):
    _, w = arch_model(arch)
    one, _, _ = run_chunks(w, [1] * len(TOKENS))
    g = w.info.geometry()
    backend = M.EngineExperts(w, Capacity.per_layer(g, 0), threads=2, use_gpu=False, timeout_s=120)
    try:
        got, _, _ = run_chunks(w, [6, 8], backend=backend)
    finally:
        backend.close()
    assert nmse(got, one) <= 1e-8  # the CPU kernels' inputs are two int8 levels (NMSE ~1e-9)


def test_step_of_a_chunk_has_counts_and_summed_weights(arch_model):
    _, w = arch_model("qwen3moe")
    _, audit, routes = run_chunks(w, [4, 10])
    first = [r for rec in audit.records[:1] for r in rec["routes"]]
    for layer, experts, weights in first:
        per_token = [dict((l, (e, v)) for l, e, v in r)[layer] for _, r in routes[:4]]
        flat = [e for ids, _ in per_token for e in ids]
        assert experts == list(dict.fromkeys(flat))
        assert weights == pytest.approx([sum(v for ids, ws in per_token for e2, v in zip(ids, ws) if e2 == e)
                                         for e in experts])
    assert audit.summary()["cpu"] == sum(len(r[1]) for rec in audit.records for r in rec["routes"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3, unique=True), min_size=1, max_size=6))
def test_merge_step_matches_the_simulators_batches(rows):
    ids = np.array(rows)
    w = np.arange(ids.size, dtype=np.float64).reshape(ids.shape) / 7
    step = M.merge_step(2, ids, w)
    toks = [Token(i, 0, i, "decode", (Step(2, tuple(r), None, tuple(wr)),)) for i, (r, wr) in enumerate(zip(rows, w.tolist()))]
    if len(rows) > 1:
        assert step == merge_rows(toks, 0).steps[0]
    assert sum(step.count(i) for i in range(len(step.experts))) == ids.size
    assert len(set(step.experts)) == len(step.experts)


def test_rollback_forgets_rejected_positions(arch_model):
    _, w = arch_model("gpt-oss")  # sinks and a sliding window too
    model = M.MoeModel(w, max_tokens=64)
    backend = M.NumpyExperts(w)
    g = w.info.geometry()
    a = [M.ChunkInput(0, 0, 0, "prefill", (5, 300, 17)), M.ChunkInput(1, 0, 3, "decode", (9, 8, 7, 6), all_logits=True),
         M.ChunkInput(2, 0, 5, "decode", (42, 1), all_logits=True)]  # positions 5, 6 of the second batch rejected
    b = [M.ChunkInput(0, 0, 0, "prefill", (5, 300, 17, 9, 8)), M.ChunkInput(1, 0, 5, "decode", (42, 1), all_logits=True)]
    la = M.run(model, backend, make_policy("cpu", g, Capacity.per_layer(g, 0)), a, keep_logits=True).logits
    lb = M.run(M.MoeModel(w), backend, make_policy("cpu", g, Capacity.per_layer(g, 0)), b, keep_logits=True).logits
    assert nmse(np.stack(la[-2:]), np.stack(lb[-2:])) <= 1e-10
    assert model.pos == 7


# moelab run / replay ------------------------------------------------------------------------------
def run_json(capsys, *argv) -> tuple[str, dict]:
    assert run_main([*map(str, argv), "--json", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    text, _, figures = out.partition("\n{")
    return text, json.loads("{" + figures)


PROMPT = "one two three one two three one two three one two"


@pytest.mark.parametrize("arch", ("qwen3moe", "deepseek2"))
def test_chunked_prefill_gives_the_same_text(arch, arch_model, capsys):
    path, _ = arch_model(arch)
    one, f1 = run_json(capsys, path, "-p", PROMPT, "-n", "8", "--prefill-chunk", "1", "--backend", "numpy")
    for chunk in (3, 32):
        text, f = run_json(capsys, path, "-p", PROMPT, "-n", "8", "--prefill-chunk", chunk, "--backend", "numpy")
        assert text == one and f["prefill_chunk"] == chunk
        assert f["tokens"] == -(-f["prompt_tokens"] // chunk) + f["decode_steps"]  # audit: one record per batch
        assert f["cpu"] < f1["cpu"]  # an expert shared by a chunk's tokens runs once per block


def test_recorded_n_token_run_replays_to_the_same_decisions(arch_model, tmp_path, capsys):
    """A run with chunked prefill and speculative batches (with rollbacks) is recorded; the scheduler
    over the merged trace and the executor forced to it make the run's decisions, for every policy."""
    path, w = arch_model("qwen3moe")
    _, fig = run_json(capsys, path, "-p", PROMPT, "-n", "40", "--prefill-chunk", "5", "--speculative", "3",
                      "--record-trace", tmp_path / "tr", "--backend", "numpy")
    tr = traces.load(tmp_path / "tr", check=True)
    batches = M.trace_batches(tr)
    assert fig["accepted"] < fig["drafted"]  # some drafts were rejected: positions were rolled back
    assert batches is not None and batches[-1] + 1 == fig["tokens"]
    assert len(tr) == fig["prompt_tokens"] + fig["decode_positions"] and (np.diff(tr.pos) < 0).any()
    g = w.info.geometry()
    cap0 = Capacity.per_layer(g, 0)
    assert replay(make_policy("cpu", g, cap0), M.trace_tokens(tr), audit=Audit(g, keep_log=True)).digest() == fig["digest"]
    from scheduler.costs import Costs
    from scheduler.hardware import load_hardware
    from scheduler.models import ModelSpec

    cm = Costs(model_spec(path), load_hardware("rtx4070super-5950x")).cost_model()
    for policy, options in (("cpu", {}), ("lru", {}), ("hybrid", {}), ("hybrid-cost", {"cost_model": cm})):
        cap = cap0 if policy == "cpu" else Capacity.per_layer(g, 3)
        want = replay(make_policy(policy, g, cap, **options), M.trace_tokens(tr), audit=Audit(g, keep_log=True))
        audit = Audit(g, keep_log=True)
        M.run(M.MoeModel(w), AnyPlacement(w), make_policy(policy, g, cap, **options), M.trace_inputs(tr, w.info),
              audit=audit)
        assert audit.digest() == want.digest(), policy
        if policy == "cpu":
            assert audit.digest() == fig["digest"]
    assert replay_main([str(path), "--trace", str(tmp_path / "tr"), "--policy", "cpu", "--backend", "numpy"]) == 0
    assert fig["digest"][:16] in capsys.readouterr().out


def test_hybrid_cost_needs_a_hardware_description(arch_model, capsys, tmp_path):
    path, _ = arch_model("qwen3moe")
    bad = tmp_path / "hw.json"
    bad.write_text('{"pcie_gbps": 1}')
    cases = [(["--policy", "hybrid-cost", "--cache-slots", "2"], "--hardware"),
             (["--policy", "hybrid-cost", "--cache-slots", "2", "--hardware", "nosuch"], "nosuch"),
             (["--policy", "hybrid-cost", "--cache-slots", "2", "--hardware", str(bad)], "hw.json"),
             (["--hardware", "rtx4070super-5950x"], "only by --policy hybrid-cost"),
             (["--prefill-chunk", "0"], "--prefill-chunk")]
    for extra, word in cases:
        assert run_main([str(path), "-p", "x", *extra]) == 2, extra
        assert word in capsys.readouterr().err, extra
    assert replay_main([str(path), "--policy", "hybrid-cost", "--cache-slots", "2", "--map"]) == 2
    assert "--hardware" in capsys.readouterr().err


def test_hybrid_cost_options_from_hardware(arch_model):
    import argparse

    from execute.cli_options import cost_options
    from scheduler.costs import Costs
    from scheduler.hardware import load_hardware
    from scheduler.models import ModelSpec

    path, w = arch_model("deepseek2")  # a leading dense block: 0-byte layer 0
    args = argparse.Namespace(policy="hybrid-cost", hardware="rtx4070super-5950x", model=str(path),
                              pageable=False)
    cm = cost_options(args, "test")["cost_model"]
    assert cm == Costs(model_spec(path), load_hardware("rtx4070super-5950x")).cost_model()
    assert len(cm.upload_s) == w.info.num_layers and cm.upload_s[1] > 0
    g = w.info.geometry()
    make_policy("hybrid-cost", g, Capacity.per_layer(g, 2), cost_model=cm)


# GPU: the hybrid path on chunks --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ("qwen3moe", "qwen2moe", "deepseek2"))
def test_gpu_policies_on_chunks_match_token_by_token_cpu(arch, arch_model):
    cupy_or_skip()
    from scheduler.costs import Costs
    from scheduler.hardware import load_hardware
    from scheduler.models import ModelSpec

    path, w = arch_model(arch)
    one, _, _ = run_chunks(w, [1] * len(TOKENS))
    g = w.info.geometry()
    cm = Costs(model_spec(path), load_hardware("h200-xeon16")).cost_model()
    for policy, slots, options in (("hybrid", 3, {}), ("hybrid-cost", 3, {"cost_model": cm}), ("lru", 2, {}),
                                   ("gpu", 8, {})):
        cap = Capacity.per_layer(g, slots)
        pol = make_policy(policy, g, cap, **options)
        backend = M.EngineExperts(w, cap, threads=2, use_gpu=True, timeout_s=120)
        try:
            inputs, pos = [], 0
            for i, n in enumerate((5, 4, 5)):
                inputs.append(M.ChunkInput(i, 0, pos, "prefill", tuple(TOKENS[pos:pos + n]), all_logits=True))
                pos += n
            audit = Audit(g, keep_log=True)
            res = M.run(M.MoeModel(w, use_gpu=True, max_tokens=4), backend, pol, inputs, audit=audit,
                        keep_logits=True)
        finally:
            backend.close()
        assert nmse(np.stack(res.logits), one) <= 1e-4, policy
        assert audit.summary()["hits"] + audit.summary()["uploads"] + audit.summary()["streams"] > 0, policy


@pytest.mark.gpu
def test_gpu_hybrid_cost_speculative_run_replays_to_its_decisions(arch_model, tmp_path, capsys):
    cupy_or_skip()
    path, _ = arch_model("qwen3moe")
    text, fig = run_json(capsys, path, "-p", PROMPT, "-n", "40", "--policy", "hybrid-cost", "--cache-slots", "3",
                         "--hardware", "h200-xeon16", "--speculative", "3", "--prefill-chunk", "8",
                         "--record-trace", tmp_path / "tr", "--compare")
    assert fig["same_tokens"] and fig["drafted"] > 0
    cpu_text, _ = run_json(capsys, path, "-p", PROMPT, "-n", "40")
    assert text == cpu_text  # greedy text agrees with the CPU run
    assert replay_main([str(path), "--trace", str(tmp_path / "tr"), "--policy", "hybrid-cost", "--cache-slots", "3",
                        "--hardware", "h200-xeon16", "--threads", "1"]) == 0
    assert fig["digest"][:16] in capsys.readouterr().out
