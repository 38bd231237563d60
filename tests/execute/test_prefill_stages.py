"""Prefill stage accounting: the counts at a hand-checked geometry, the tile expectation against a
simulation, the host-work measurement, the experiment's files; the GPU timing on a tiny preset."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from execute.prefill_stages import ChunkShape, cost_rows, expected_tiles, fused_costs, host_costs, stage_costs, table

from .conftest import cupy_or_skip

ROOT = Path(__file__).resolve().parents[2]


def test_counts_at_a_small_geometry():
    s = ChunkShape(tokens=4, pos=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, ffn=32,
                   dense_bytes_per_weight=1.0, expert_bytes_per_weight=1.0)
    st = {x.name: x for x in stage_costs(s)}
    assert st["qkv_proj"].flops == 2 * 4 * (4 + 2 * 2) * 16 * 64  # T x (q + k + v rows) x hidden
    assert st["o_proj"].flops == 2 * 4 * 64 * 64
    # dequant reads the stored matrix (1 byte/weight here) and writes a float32 tile, the product reads it again
    assert st["o_proj"].bytes == 64 * 64 * (1 + 4 + 4) + 4 * 4 * 64 * 2 + 8 * 4 * 64
    assert st["attention"].flops == 4 * 4 * 4 * (2 + 4) * 16  # QK^T and PV over pos + T keys
    assert st["route_host"].host_waits == 1 and sum(x.host_waits for x in st.values()) == 1
    assert st["experts"].flops == 2 * 2 * (4 * 2) * 3 * 64 * 32  # hi/lo halves double the pairs' products
    fused = {x.name: x for x in fused_costs(s)}
    assert fused["qkv_proj_f16"].flops == 2 * st["qkv_proj"].flops  # two halves of the activations
    assert fused["attn_norm_fused"].launches == fused["ffn_norm_fused"].launches == 1
    assert fused["route_gpu"].host_waits == 1 and fused["attention_fused"].flops == st["attention"].flops
    rows = cost_rows(s)
    assert rows[-1]["launches"] == sum(x.launches for x in st.values())
    assert rows[-1]["MB"] == pytest.approx(sum(x.bytes for x in st.values()) / 1e6)


def test_expected_tiles_matches_a_simulation():
    rng = np.random.default_rng(0)
    t, e, k = 96, 16, 4
    sims = []
    for _ in range(400):
        counts = np.zeros(e, int)
        for _ in range(t):
            counts[rng.choice(e, k, replace=False)] += 1
        sims.append(np.ceil(counts / 32).sum())
    assert expected_tiles(t, e, k) == pytest.approx(np.mean(sims), rel=0.02)
    assert expected_tiles(256, 128, 8) >= 128  # every expert is routed in a 256-token chunk, almost surely


def test_bad_shape():
    with pytest.raises(ValueError, match="ChunkShape.tokens"):
        ChunkShape(tokens=0)
    with pytest.raises(ValueError, match="top_k"):
        ChunkShape(experts=4, top_k=8)


def test_host_costs_and_table():
    s = ChunkShape(tokens=32, experts=16, top_k=2)
    h = host_costs(s, layers=3, repeats=1)
    assert set(h) == {"route_s", "step_s", "plan_s"} and all(v > 0 for v in h.values())
    with pytest.raises(ValueError, match="policy"):
        host_costs(s, layers=1, policy="lru")
    text = table(cost_rows(s))
    assert text.splitlines()[0].startswith("| stage | launches") and "block total" in text


def test_experiment_writes_its_files(tmp_path):
    out = tmp_path / "st"
    r = subprocess.run([sys.executable, str(ROOT / "experiments/bench_prefill_stages.py"), "--out", str(out),
                        "--tokens", "64"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "result.json").read_text())
    assert res["config"]["shape"]["tokens"] == 64 and res["gpu"] is None
    assert res["counts"][-1]["stage"] == "block total" and "Counted from the code" in (out / "README.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "experiments/bench_prefill_stages.py"), "--out", str(tmp_path / "b"),
                          "--tokens", "0"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--tokens 0" in bad.stderr and not (tmp_path / "b").exists()


@pytest.mark.gpu
def test_time_stages_on_a_tiny_model(tmp_path):
    cupy_or_skip()
    from execute.prefill_timing import time_stages

    res = time_stages(tokens=32, preset="tiny", reps=3, warmup=1, workdir=str(tmp_path))
    names = [r["stage"] for r in res["rows"]]
    for want in ("attn_norm", "qkv_proj", "attention_block", "route", "experts_engine", "chunk_run_loop",
                 "attn_norm_cupy", "qkv_proj_tile", "attention_block_cupy", "route_host", "chunk_run_loop_old"):
        assert want in names
    assert "experts_batched" in names  # T >= 16, Q8_0, SiLU: the batched path takes the step
    assert all(r["device_ms"] is None or r["device_ms"] > 0 for r in res["rows"])


@pytest.mark.gpu
def test_chunk_profile_on_a_tiny_model(tmp_path):
    cupy_or_skip()
    from execute.prefill_timing import chunk_profile
    from execute.synth import config_from_preset, synth_model

    path = synth_model(tmp_path / "tiny.gguf", config_from_preset("tiny", num_layers=2, quant="Q8_0"))
    res = chunk_profile(path, tokens=32, reps=2)
    cases = [r["case"] for r in res["rows"]]
    if res["logits_identical"] is None:  # the device chunk does not apply to this model: block by block only
        assert cases == ["first_chunk_after_warm_up", "warm, block by block"]
    else:
        assert cases == ["first_chunk_after_warm_up (device)", "warm, block by block", "warm, chunk on the device"]
        assert res["device_chunks"] > 0 and res["device_reruns"] == 0 and res["logits_identical"]
    assert res["blocks"] == 2 and all(r["wall_ms"] > 0 and len(r["gc_ms"]) == 3 for r in res["rows"])
    assert {k.rsplit(" (", 1)[0] for k in res["host_profile"]} == {"own", "cumulative"}


def test_the_gc_clock_counts_collections_by_generation():
    import gc

    from execute.prefill_timing import _GcClock

    with _GcClock() as g:
        gc.collect(1)
        gc.collect(2)
    gc.collect()
    assert g.n[1] >= 1 and g.n[2] >= 1 and all(s >= 0 for s in g.s) and g not in gc.callbacks


def test_bench_stages_refuses_a_missing_model(tmp_path):
    bad = subprocess.run([sys.executable, str(ROOT / "experiments/bench_prefill_stages.py"), "--out", str(tmp_path / "c"),
                          "--model", str(tmp_path / "none.gguf")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "none.gguf" in bad.stderr and not (tmp_path / "c").exists()


def test_top_k_equals_the_stable_sort():
    from execute.batch_route import _top_k

    rng = np.random.default_rng(1)
    for trial in range(200):
        t, e = int(rng.integers(1, 120)), int(rng.choice([2, 8, 16, 128, 256]))
        k = int(rng.integers(1, min(e, 12) + 1))
        a = rng.standard_normal((t, e))
        if trial % 3 == 0:
            a = np.round(a * 2) / 2  # many ties, at the k-th value too
        if trial % 7 == 0:
            a[:] = 0.0
        assert np.array_equal(_top_k(a, k), np.argsort(-a, axis=1, kind="stable")[:, :k]), (t, e, k)
    a = rng.standard_normal((10, 16))
    a[3, 5] = np.nan
    assert np.array_equal(_top_k(a, 4), np.argsort(-a, axis=1, kind="stable")[:, :4])


def test_host_profile_names_the_costly_function():
    from execute.prefill_timing import host_profile

    def slow():
        return sum(i * i for i in range(200_000))

    prof = host_profile(lambda: [slow() for _ in range(3)], top=5)
    assert set(prof) == {"own", "cumulative"} and all(len(v) <= 5 for v in prof.values())
    top = prof["cumulative"][:3]
    assert any("(slow)" in r["function"] and r["calls"] == 3 and r["cumulative_ms"] > 0 for r in top)
