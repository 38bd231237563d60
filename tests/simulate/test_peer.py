"""The peer benchmark's rows as their commands ran them (simulate.peer): hybrid's share from the
command line, the recorded trace stepped in the run's batches."""
from __future__ import annotations

import pytest

from scheduler import MISS_FRAC_256, Step, Token
from simulate.peer import batched_tokens, miss_fraction_of


def test_hybrids_share_is_the_commands():
    run = ["python", "-m", "moelab", "run", "m.gguf", "--policy", "hybrid", "--cache-mib", "4096"]
    assert miss_fraction_of(run) == MISS_FRAC_256 / 256  # no --hardware: the fixed default share
    assert miss_fraction_of(run + ["--hardware", "cal.json"]) is None  # the cost model's share
    assert miss_fraction_of(run + ["--hardware", "cal.json", "--miss-fraction", "0.5"]) == 0.5
    assert miss_fraction_of(run + ["--miss-fraction=0.25"]) == 0.25


def test_rows_are_stepped_in_the_runs_batches():
    rows = [Token(i, 0, i, "prefill" if i < 3 else "decode", (Step(0, (i % 2, 2)),)) for i in range(6)]
    out = batched_tokens(rows, [3, 1, 1])
    assert [(t.index, t.pos, t.phase, t.num_tokens) for t in out] == [(0, 0, "prefill", 3), (1, 3, "decode", 1),
                                                                      (2, 4, "decode", 1), (3, 5, "decode", 1)]
    step = out[0].steps[0]
    assert dict(zip(step.experts, step.counts)) == {0: 2, 2: 3, 1: 1}
    with pytest.raises(ValueError, match="batches"):
        batched_tokens(rows, [4, 4])


def test_cpugraph_rows_are_simulated_with_the_cpu_graph(tmp_path):
    """A ``POLICY+cpugraph`` cell (``moelab run --graph-cpu``) is its policy under the CPU graph:
    every miss of a decode token on the CPU, no upload inside a token (CpuMisses), the uploads
    deferred as fills; the plain cell of the same policy uploads. Another suffix is refused."""
    from pathlib import Path

    import numpy as np

    from scheduler.hardware import load_hardware
    from simulate import peer
    from traces import Trace

    assert peer.policy_of("moelab hybrid+cpugraph") == ("hybrid", True)
    assert peer.policy_of("moelab lru") == ("lru", False)
    with pytest.raises(ValueError, match="cell 'moelab lru\\+other'"):
        peer.policy_of("moelab lru+other")
    root = Path(__file__).resolve().parents[2]
    result = peer.load_result(root / "docs" / "perf" / "peer_h200" / "budget-4096" / "result.json")
    lru = next(r for r in result["rows"] if r["cell"] == "moelab lru")
    small = {**result, "rows": [lru, {**lru, "cell": "moelab lru+cpugraph"}]}
    T, L, k = 12, 48, 8
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(128, k, replace=False) for _ in range(L)]) for _ in range(T)]).astype(np.int32)
    phase = np.array([0] * 8 + [1] * 4, np.int8)
    Trace("peer", (128,) * L, k, ids, np.zeros(T, np.int32), np.arange(T, dtype=np.int32), phase,
          np.full((T, L, k), 1.0 / k, np.float32), {"batches": [8, 1, 1, 1, 1], "prompt_tokens": 8}).save(str(tmp_path / "t"))
    hw = load_hardware(root / "docs" / "fidelity" / "h200-calibrated.json")
    rows = {r["row"]: r for r in peer.predict_peer(small, hw, trace=tmp_path / "t")}
    assert set(rows) == {"moelab lru", "moelab lru+cpugraph"}
    assert rows["moelab lru+cpugraph"]["policy"] == "lru"
    assert all(r["predicted_tokens_per_s"] > 0 for r in rows.values())
    assert rows["moelab lru+cpugraph"]["predicted_tokens_per_s"] != rows["moelab lru"]["predicted_tokens_per_s"]


def test_run_with_graph_cpu_sends_decode_misses_to_the_cpu():
    from simulate.run import SimConfig, SimError, run

    cfg = SimConfig(model="qwen3-30b-a3b", hardware="h200-xeon16", policy="lru", cache_mib=2048, trace="synth",
                    synth_tokens=12)
    plain, graph = (run(cfg, graph_cpu=g)[0].summary() for g in (False, True))
    assert plain["cpu_experts"] == 0 < graph["cpu_experts"]
    with pytest.raises(SimError, match="graph_cpu: policy cpu"):
        run(SimConfig(model="qwen3-30b-a3b", hardware="h200-xeon16", policy="cpu", cache_mib=0, trace="synth",
                      synth_tokens=4), graph_cpu=True)
