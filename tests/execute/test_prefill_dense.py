"""execute.prefill_dense: the switch; on a GPU each chunk launch against the path it replaces (CuPy
RMSNorm, float32-tile products, host routing, CuPy attention) and whole prefill chunks of every
architecture with the path on and off (the same decisions, logits within float32 rounding)."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from execute import quant as Q
from execute.archs import ARCHS
from execute.experts import ExecutorError
from execute.prefill_dense import dense_env, k_slice, split_k_env

from .conftest import cupy_or_skip


def test_switch(monkeypatch):
    monkeypatch.delenv("MOELAB_PREFILL_DENSE", raising=False)
    assert dense_env()
    monkeypatch.setenv("MOELAB_PREFILL_DENSE", "0")
    assert not dense_env()
    monkeypatch.setenv("MOELAB_PREFILL_DENSE", "on")
    with pytest.raises(ExecutorError, match="MOELAB_PREFILL_DENSE: 'on', expected 0 or 1"):
        dense_env()


def test_k_slices(monkeypatch):
    monkeypatch.delenv("MOELAB_PREFILL_SPLIT_K", raising=False)
    assert split_k_env() == 256
    monkeypatch.setenv("MOELAB_PREFILL_SPLIT_K", "0")
    assert split_k_env() == 0
    monkeypatch.setenv("MOELAB_PREFILL_SPLIT_K", "300")
    with pytest.raises(ExecutorError, match="MOELAB_PREFILL_SPLIT_K: '300', expected one of 0, 128, 256"):
        split_k_env()
    assert k_slice(256, 2048, 256, 5120) == 256 and k_slice(256, 4096, 256, 2048) == 256
    assert k_slice(0, 2048, 256, 5120) == 2048 and k_slice(256, 256, 8, 64) == 256  # off; one slice is the product
    assert k_slice(256, 2880, 16, 64) == 64  # halved until it divides K
    assert k_slice(256, 2048, 256, 32000) == 512  # the head of a 256-token chunk: 4 partial products (131 MB), not 8
    assert k_slice(256, 96, 4, 8) == 96


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def pd():
    cupy_or_skip()
    from execute.prefill_dense import ChunkDense

    return ChunkDense()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,wshape", (((37, 256), (256,)), ((37, 6, 64), (6, 64)), ((5, 2, 6, 64), (6, 64))))
def test_rmsnorm_matches_the_cupy_expression(pd, shape, wshape):
    import cupy as cp

    rng = np.random.default_rng(len(shape))
    x = cp.asarray(rng.standard_normal(shape).astype(np.float32) * 3)
    w = cp.asarray(rng.standard_normal(wshape).astype(np.float32))
    ref = (x * (1.0 / cp.sqrt(cp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * w).get()
    got = pd.rms(x, w, 1e-6).get()
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    assert pd.rms(x, w[:-1] if len(wshape) == 1 else w[1:], 1e-6) is None  # shapes that do not broadcast


@pytest.mark.gpu
@pytest.mark.parametrize("qt", [Q.F16, Q.Q8_0])
def test_k_slices_keep_long_products_at_the_halves_precision(pd, qt):
    """Over K = 4096 one tensor-core product loses ~5e-6 (its float32 accumulation truncates at each
    step); in slices of 256 summed in float32 the error stays near the halves' 2^-22."""
    import cupy as cp

    from execute.gpu_dense import GpuDense, device_matrix

    gd = GpuDense(hidden=4096, heads=8, kv_heads=2, head_dim=32, experts=8, top_k=2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((48, 4096)).astype(np.float32)
    v = (rng.standard_normal((320, 4096)) / 64).astype(np.float32)
    raw = Q.quantize(v, qt)
    vals = Q.dequantize(raw, qt, 4096).reshape(320, 4096).astype(np.float64)
    m = device_matrix((raw, qt), vals.astype(np.float32))
    ref = x.astype(np.float64) @ vals.T
    rel = {}
    for split in (256, 0):
        pd.split_k = split
        got = pd.matmul(cp.asarray(x), m, gd).get()
        rel[split] = float(np.median(np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)))
    pd.split_k = 256
    assert rel[256] < 1e-6 and rel[256] < rel[0] / 3, rel


@pytest.mark.gpu
def test_products_match_the_tile_path(pd, monkeypatch):
    import cupy as cp

    from execute import prefill_dense
    from execute.gpu_dense import GpuDense, device_matrix

    gd = GpuDense(hidden=256, heads=8, kv_heads=2, head_dim=32, experts=40, top_k=6)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((37, 256)).astype(np.float32)
    x[3] *= 1e3  # rows of very different scales: each row's halves have their own power of two
    x[5] *= 1e-4
    x[7] = 0.0
    xd = cp.asarray(x)
    for qt in (Q.F16, Q.F32, Q.Q8_0, Q.BF16):
        v = rng.standard_normal((203, 256)).astype(np.float32) * 0.05
        v[9] *= 1e-4  # a weight row of small values: its own power of two (Q8_0, BF16)
        raw = Q.quantize(v, qt)
        vals = Q.dequantize(raw, qt, 256).reshape(203, 256)
        m = device_matrix((raw, qt), vals)
        assert m.qt == qt
        got = pd.matmul(xd, m, gd).get()
        old = gd.matmul(xd, m).get()
        ref = x.astype(np.float64) @ vals.T.astype(np.float64)
        assert got.shape == (37, 203) and not got[7].any()
        for r in (0, 3, 5, 36):  # row by row: the scaled rows as exact as the others
            assert nmse(got[r], ref[r]) <= 1e-11 and nmse(old[r], ref[r]) <= 1e-11
        assert nmse(got[:, 9], ref[:, 9]) <= 1e-11
        assert nmse(got, old) <= 1e-11
        if qt in (Q.Q8_0, Q.BF16):  # without a GpuDense, or over the size limit: the tile path's
            assert pd.matmul(xd, m) is None
            monkeypatch.setattr(prefill_dense, "_MAX_SPLIT_WEIGHTS", 203 * 256 - 1)
            assert pd.matmul(xd, m, gd) is None
            monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("gating", ("softmax", "softmax_topk"))
@pytest.mark.parametrize("norm,scale", ((True, 0.0), (False, 2.5)))
@pytest.mark.parametrize("experts,k", ((32, 4), (128, 8), (160, 10)))
def test_route_matches_the_host_rule(pd, gating, norm, scale, experts, k):
    import cupy as cp

    from execute.batch_route import route_rows

    info = types.SimpleNamespace(gating=gating, norm_topk=norm, expert_weights_scale=scale, expert_groups=1, top_k=k)
    assert pd.routes(info, None) and not pd.routes(info, np.zeros(experts))
    rng = np.random.default_rng(experts + k)
    logits = (rng.standard_normal((70, experts)) * 3).astype(np.float32)
    logits[3] = 0.0  # all tied: lower ids first
    logits[4, :4] = logits[4, 4:8]
    logits[5, ::2] = logits[5, 1::2]
    for bias in (None, rng.standard_normal(experts).astype(np.float32)):
        ids, w = pd.route(cp.asarray(logits), None if bias is None else cp.asarray(bias), info)
        host = logits.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
        r_ids, r_w = route_rows(info, host)
        assert ids.dtype == np.int64 and w.dtype == np.float64 and ids.shape == w.shape == (70, k)
        assert np.array_equal(ids, r_ids)
        np.testing.assert_allclose(w, r_w, rtol=1e-13, atol=1e-300)
    bad = logits.copy()
    bad[9, 2] = np.nan
    assert pd.route(cp.asarray(bad), None, info) is None  # the caller routes on the host


# attention and whole chunks on tiny models ---------------------------------------------------------
@pytest.fixture(scope="module")
def arch_weights(tmp_path_factory):
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model

    root, cache = tmp_path_factory.mktemp("prefill_dense"), {}

    def get(arch: str, dense_quant: str = "F16"):
        if (arch, dense_quant) not in cache:
            cfg = dataclasses.replace(config_from_preset("tiny", arch=arch, quant="Q8_0", seed=21),
                                      dense_quant=dense_quant)
            cache[arch, dense_quant] = load_model(synth_model(root / f"{arch}_{dense_quant}.gguf", cfg))
        return cache[arch, dense_quant]

    return get


GQA = tuple(a for a in ARCHS if ARCHS[a].attn == "gqa")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GQA)
def test_chunk_attention_matches_the_cupy_path(arch, arch_weights):
    """Two chunks (20 tokens at 0, 17 at 20; gpt-oss: window and sinks): output and the KV cache
    entries written, fused path against the CuPy expressions (pd off)."""
    cp = cupy_or_skip()
    from execute.model import MoeModel

    w = arch_weights(arch)
    model = MoeModel(w, use_gpu=True, max_tokens=64)
    pd = model.pd
    assert pd is not None
    rng = np.random.default_rng(2)
    for pos, t in ((0, 20), (20, 17)):
        model.pos = pos
        x = cp.asarray(rng.standard_normal((t, w.info.hidden)).astype(np.float32))
        for l in range(w.info.num_layers):
            y = pd.attention(model, l, x)
            assert y is not None
            kc, vc = model.k_cache[l].get(), model.v_cache[l].get()
            model.pd = None
            try:
                ref = model._attention(l, x).get()
            finally:
                model.pd = pd
            assert nmse(y.get(), ref) <= 1e-10
            k_ref, v_ref = model.k_cache[l].get(), model.v_cache[l].get()
            assert nmse(kc[:, pos:pos + t], k_ref[:, pos:pos + t]) <= 1e-11
            assert nmse(vc[:, pos:pos + t], v_ref[:, pos:pos + t]) <= 1e-11


def _run(weights, monkeypatch, dense: str):
    from execute import model as M
    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit

    monkeypatch.setenv("MOELAB_PREFILL_DENSE", dense)
    g = weights.info.geometry()
    toks = np.random.default_rng(9).integers(weights.info.vocab, size=45).tolist()
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(toks[:20]), all_logits=True),
              M.ChunkInput(1, 0, 20, "prefill", tuple(toks[20:37]), all_logits=True)]
    inputs += [M.TokenInput(2 + i, 0, 37 + i, "decode", t) for i, t in enumerate(toks[37:])]
    model = M.MoeModel(weights, use_gpu=True, max_tokens=8)  # grows inside the chunks
    assert (model.pd is not None) == (dense == "1")
    model.route_log = []
    audit = Audit(g, keep_log=True, record_routes=True)
    res = M.run(model, M.NumpyExperts(weights), make_policy("cpu", g, Capacity.per_layer(g, 0)), inputs,
                audit=audit, keep_logits=True)
    return np.stack(res.logits), audit, model.route_log


@pytest.mark.gpu
@pytest.mark.parametrize("arch,dense_quant", [(a, "F16") for a in ARCHS] + [("qwen3moe", "Q8_0"), ("qwen3moe", "BF16")])
def test_chunks_with_the_path_on_and_off(arch, dense_quant, arch_weights, monkeypatch):
    """The same decisions (audit digest) and expert ids, logits and router weights within the
    projections' ~22-bit activation halves."""
    cupy_or_skip()
    w = arch_weights(arch, dense_quant)
    on, a_on, log_on = _run(w, monkeypatch, "1")
    off, a_off, log_off = _run(w, monkeypatch, "0")
    assert on.shape == off.shape == (45, w.info.vocab) and np.isfinite(on).all()
    assert a_on.digest() == a_off.digest()
    assert nmse(on, off) <= 1e-9 and (on.argmax(axis=1) == off.argmax(axis=1)).all()
    assert [[r[:2] for r in row] for _, row in log_on] == [[r[:2] for r in row] for _, row in log_off]
    w_on = np.array([wt for _, row in log_on for r in row for wt in r[2]])
    w_off = np.array([wt for _, row in log_off for r in row for wt in r[2]])
    np.testing.assert_allclose(w_on, w_off, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_warm_library_runs_the_shapes_of_a_model_and_leaves_nothing(models):
    """The start-up thread's warm work (GpuInit) on a model's shapes runs on its own stream and
    leaves the caller's current stream as it was."""
    cp = cupy_or_skip()
    from execute.gguf_model import load_model
    from execute.prefill_dense import warm_library

    info = load_model(models()).info
    cur = cp.cuda.get_current_stream()
    warm_library(info, 40, 64)
    warm_library(info, 1, 1)  # fewer than two tokens: run as two
    assert cp.cuda.get_current_stream() == cur
