"""execute.graph_cpu: a decode token whose misses the CPU pool computes inside its graph.

On the CPU: the pool's side of the protocol (a gated call submitted with k pairs, whose pair count,
ids and input rows are written into the job and mapped buffers before the gate, computes only those
pairs). On the GPU: with the policy wrapped in ``scheduler.graph.CpuMisses``, the graph
(``MOELAB_GRAPH_CPU=1``) gives the bits, routes and decisions of the block-by-block hand-off of the
same decisions, completing every token; an unwrapped policy is refused at its first such step."""
from __future__ import annotations

import numpy as np
import pytest

from execute import cpu_pool as P
from execute.cpu_experts import J_N, run_experts
from execute.experts import ExecutorError, random_layer
from execute.graph_gate import GraphCpuGate
from scheduler import Decision, EndToken, RunLayer, Step, Token

from .conftest import cupy_or_skip


def test_the_gate_checks_each_settled_step_against_the_graphs_cpu_experts():
    t = Token(0, 0, 0, "decode", ())
    s0, s1 = Step(0, (1, 2)), Step(1, (3, 4))
    gate = GraphCpuGate()
    assert gate.want()
    gate.done(True)
    gate.expect([(2,), ()])
    gate.see(RunLayer(t, s0, Decision(s0, (1,), cpu=(2,))))
    with pytest.raises(ExecutorError, match="CpuMisses"):
        gate.see(RunLayer(t, s1, Decision(s1, (3,), uploads=(4,), slots=(0,))))
    gate.see(EndToken(t))
    gate.see(RunLayer(t, s1, Decision(s1, (3,), uploads=(4,), slots=(0,))))  # a block-by-block token: not checked
    gate.expect([(4,)])
    with pytest.raises(ExecutorError, match=r"experts \[4\] on the CPU"):
        gate.see(RunLayer(t, s1, Decision(s1, (4,), cpu=(3,))))


@pytest.mark.parametrize("picks", [[5, 2], [], [7, 0, 3]])
def test_a_gated_call_computes_the_pairs_written_before_its_gate(picks):
    rng = np.random.default_rng(3)
    k, hidden = 4, 64
    layer = random_layer(rng, 0, 8, hidden, 32, 8)
    ids, xin, yout = np.zeros(k, np.int64), np.zeros((k, hidden), np.float32), np.zeros((k, hidden), np.float32)
    x = rng.standard_normal(hidden).astype(np.float32)
    with P.CpuExpertPool(2, 10.0) as pool:
        pool.warmup(layer)
        job = pool.submit(layer, ids, xin, out=yout, gated=True)
        # the GPU's part (graphcpu_put): ids, the count into the call's job, the input rows, the gate
        n = len(picks)
        ids[:n] = picks
        pool._ring[job._seq % P._RING, J_N] = n
        xin[:n] = x
        pool.ctrl[P._C_GATE] = job._seq
        job.result()
    if n:
        want = run_experts(layer, picks, np.repeat(x[None], n, 0))
        assert np.array_equal(yout[:n], want)
    assert not yout[n:].any()


@pytest.mark.parametrize("flag, env, wrapped", [(None, "0", False), (None, "1", True), (True, "0", True)])
def test_moelab_run_graph_cpu_or_the_switch_wraps_the_policy_in_cpu_misses(flag, env, wrapped, monkeypatch):
    from execute.cli_generate import run_policy
    from execute.cli_run import parser_run
    from execute.graph_gate import graph_cpu_wanted
    from scheduler import Capacity, Geometry
    from scheduler.graph import CpuMisses

    monkeypatch.setenv("MOELAB_GRAPH_CPU", env)
    args = parser_run().parse_args(["m.gguf", "-p", "x", "--policy", "lru", *(["--graph-cpu"] if flag else [])])
    assert args.graph_cpu is flag and graph_cpu_wanted(args.graph_cpu) is wrapped
    g = Geometry((8, 8), 2, (100, 100))
    policy = run_policy(args, g, Capacity.per_layer(g, 3))
    assert isinstance(policy, CpuMisses) is wrapped and policy.name == "lru"


@pytest.mark.parametrize("extra, message", [(["--policy", "cpu"], "not with --policy cpu"),
                                            (["--policy", "lru", "--backend", "numpy"], "not with --backend numpy")])
def test_moelab_run_graph_cpu_without_the_gpu_token_graph_is_refused_before_loading(extra, message, tmp_path, capsys):
    from execute.cli_run import run_main

    assert run_main([str(tmp_path / "none.gguf"), "-p", "x", "--graph-cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert "--graph-cpu" in err and message in err and err.count("\n") == 1


def _run(w, policy: str, slots: int, tokens, graph_cpu: bool, monkeypatch, wrap: bool = True):
    from execute import model as M
    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit
    from scheduler.graph import CpuMisses

    monkeypatch.setenv("MOELAB_TOKEN_GRAPH", "1" if graph_cpu else "0")
    monkeypatch.setenv("MOELAB_GRAPH_CPU", "1" if graph_cpu else "0")
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    audit = Audit(g, keep_log=True)
    pol = make_policy(policy, g, cap)
    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        res = M.run(model, backend, CpuMisses(pol) if wrap else pol, inputs, audit=audit, keep_logits=True)
        stats = backend.engine.stats
    finally:
        backend.close()
    return np.stack(res.logits), model, audit, stats


@pytest.fixture(scope="module")
def weights(graph_models):
    return graph_models


@pytest.mark.gpu
@pytest.mark.parametrize("arch, policy, slots, stream", [
    ("qwen3moe", "lru", 3, "0"), ("qwen3moe", "hybrid", 3, "0"), ("gpt-oss", "lru", 4, "0"),
    ("qwen3moe", "hybrid", 3, "1"), ("gpt-oss", "lru", 4, "1")])
def test_the_graph_gives_the_block_by_block_bits_of_the_same_decisions(weights, arch, policy, slots, stream,
                                                                       monkeypatch):
    """The four launches a block; stream: each block's step settled while the graph runs
    (MOELAB_GRAPH_CPU_STREAM)."""
    cupy_or_skip()
    monkeypatch.setenv("MOELAB_GRAPH_CPU_STREAM", stream)
    import execute.graph_cpu as G

    monkeypatch.setattr(G, "_AHEAD", 2)  # 6 blocks: the calls after the first 2 submitted block by block
    w = weights(arch)
    tokens = np.random.default_rng(5).integers(w.info.vocab, size=40).tolist()  # the cache grows 8 -> 64
    plain, m0, a0, _ = _run(w, policy, slots, tokens, False, monkeypatch)
    got, m1, a1, st = _run(w, policy, slots, tokens, True, monkeypatch)
    tg = m1.token_graph
    assert m0.token_graph is None and tg is not None and tg.cpu is not None
    assert tg.cpu.stream == (stream == "1")
    assert np.array_equal(got, plain)
    assert m1.route_log == m0.route_log and a1.digest() == a0.digest()
    s = a1.summary()
    assert tg.tokens == tg.complete == len(tokens) and st.graph_steps == len(tokens) * w.info.num_layers
    assert s["uploads"] == 0 and s["cpu"] == tg.cpu.cpu_pairs > 0 and s["fills"] + s["swaps"] > 0


@pytest.mark.gpu
def test_an_unwrapped_policy_is_refused(weights, monkeypatch):
    cupy_or_skip()
    w = weights("qwen3moe")
    with pytest.raises(ExecutorError, match="CpuMisses"):
        _run(w, "lru", 3, list(range(1, 6)), True, monkeypatch, wrap=False)


@pytest.mark.gpu
def test_a_streamed_wait_for_a_route_the_ended_graph_never_wrote_is_an_error():
    """seen_block polls the graph's event while it spins: an ended graph without the block's flag
    is an ExecutorError naming the block (not a hang, not an AttributeError)."""
    cp = cupy_or_skip()
    from execute.graph_cpu import GraphCpu
    g = GraphCpu.__new__(GraphCpu)
    g._base, g.seen_flag, g.timeout_ns = 0, np.zeros(3, np.int64), 10**9
    ev = cp.cuda.Event(disable_timing=True)
    ev.record()
    ev.synchronize()
    with pytest.raises(ExecutorError, match="block 1: the token graph ended without handing over its route"):
        g.seen_block(1, ev)
