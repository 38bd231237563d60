"""MOELAB_DECODE_KERNELS=v2: each v2 one-token kernel against its v1 twin and the float64
reference on the same inputs (experts of every arena type, gate and up of different types, biases,
a missing expert; the dense GEMV of every stored type with its prologue and epilogue; the router's
top k and weights; the split attention over key counts around its 64-key chunks, with sinks), and
the token graph of tiny models under v2 against v1 and the numpy model (needs CUDA)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from execute import model as M
from execute import quant as Q
from execute.experts import ACTIVATIONS, random_layer
from scheduler import Capacity, make_policy
from scheduler.core import Geometry

from .conftest import biased, biased_reference, cupy_or_skip

pytestmark = pytest.mark.gpu

ALL = sorted(Q.QTYPES)
REL_ERR = 1e-5
_HALT_NONE = 0x7F7F7F7F


def rel_err(y, ref) -> float:
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def routed(layer, variant: str, ids, weights, x, monkeypatch, missing=()):
    """One token through ``routed_layer``'s two launches of ``variant`` (every expert resident
    except ``missing``): the (hidden,) output, halt after the launches."""
    import cupy as cp

    from execute.gpu_experts import GpuExperts

    monkeypatch.setenv("MOELAB_DECODE_KERNELS", variant)
    geo = Geometry((layer.num_experts,), len(ids), (layer.expert_bytes,))
    gx = GpuExperts([layer], Capacity.per_layer(geo, layer.num_experts), scratch_slots=1, pinned=False)
    try:
        gx.begin_copies()
        for e in range(layer.num_experts):
            gx.upload(0, e, e)
        gx.wait(gx.copies_event())
        table = cp.asarray(np.array([0 if e in missing else gx.source_ptr(0, e) for e in range(layer.num_experts)],
                                    np.uint64))
        k = len(ids)
        ids32 = np.asarray(ids, np.int32).view(np.float32)  # the router's layout: ids as int bits, then weights
        route = cp.asarray(np.concatenate([ids32, np.asarray(weights, np.float32)]))
        halt = cp.full(1, _HALT_NONE, cp.int32)
        xd = cp.asarray(np.asarray(x, np.float32))
        h = cp.zeros(k * layer.ffn, cp.float32)
        out = cp.full(layer.hidden, -7.0, cp.float32)  # unchanged when the layer halts
        cp.cuda.Device().synchronize()
        s = cp.cuda.get_current_stream()
        for f in gx.routed_layer(0, int(route.data.ptr), int(table.data.ptr), int(halt.data.ptr), int(xd.data.ptr),
                                 int(h.data.ptr), int(out.data.ptr), k):
            f(s.ptr)
        s.synchronize()
        return out.get(), int(halt.get()[0])
    finally:
        gx.close()


def both(layer, ids, weights, x, monkeypatch, missing=()):
    """v1, v2 and v4 (v4: Q8_0 rows staged in shared memory, down 4 rows per block)."""
    return [routed(layer, v, ids, weights, x, monkeypatch, missing) for v in ("v1", "v2", "v4")]


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_v2_experts_match_v1_and_reference(qtype, rng, reference, monkeypatch):
    """hidden 1280: gate/up rows of 40 units (two batches of 32, the second partly past the row);
    ffn 768: down rows of 24 units (one batch); a repeated expert counts once per pair."""
    cupy_or_skip()
    layer = random_layer(rng, 0, num_experts=10, hidden=1280, ffn=768, qtype=qtype)
    ids, w = [7, 2, 9, 2, 0], np.array([0.4, 0.25, 0.2, 0.1, 0.05], np.float32)
    x = rng.standard_normal(1280).astype(np.float32)
    (y1, h1), (y2, h2), (y4, h4) = both(layer, ids, w, x, monkeypatch)
    ref = w.astype(np.float64) @ reference(layer, ids, np.repeat(x[None], len(ids), axis=0))
    assert h1 == h2 == h4 == _HALT_NONE
    assert rel_err(y1, ref) < REL_ERR and rel_err(y2, ref) < REL_ERR and rel_err(y4, ref) < REL_ERR
    for y in (y2, y4):  # the same sums in the same order
        assert np.allclose(y, y1, rtol=1e-6, atol=1e-6 * np.abs(y1).max())


def test_v2_gate_and_up_of_different_types(rng, reference, monkeypatch):
    cupy_or_skip()
    a = random_layer(rng, 0, num_experts=4, hidden=512, ffn=256, qtype=Q.Q8_0)
    b = random_layer(rng, 0, num_experts=4, hidden=512, ffn=256, qtype=Q.Q4_0)
    layer = dataclasses.replace(a, up=b.up)
    ids, w = [3, 1], np.array([0.7, 0.3], np.float32)
    x = rng.standard_normal(512).astype(np.float32)
    ref = w.astype(np.float64) @ reference(layer, ids, np.repeat(x[None], 2, axis=0))
    assert all(rel_err(y, ref) < REL_ERR for y, _ in both(layer, ids, w, x, monkeypatch))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_v2_experts_add_biases(activation, rng, monkeypatch):
    cupy_or_skip()
    layer = biased(random_layer(rng, 0, num_experts=5, hidden=256, ffn=512, qtype=Q.Q8_0), rng, activation)
    ids, w = [0, 3], np.array([0.75, 0.25], np.float32)
    x = (rng.standard_normal(256) * 6.0).astype(np.float32)
    ref, _ = biased_reference(layer, ids, np.repeat(x[None], 2, axis=0))
    want = w.astype(np.float64) @ ref
    assert all(rel_err(y, want) < REL_ERR for y, _ in both(layer, ids, w, x, monkeypatch))


def test_v4_windows_and_unaligned_rows(rng, reference, monkeypatch):
    """Q8_0 rows that do not fit v4's staging at once (hidden 2336: gate/up in windows of 64 and 9
    units; 32 pairs: each warp of down has 52 16-byte chunks, windows of 4 and 1 units) and rows
    that are not 16-byte aligned (gate/up rows of 73 blocks, 2482 bytes; down rows of 5, 170 bytes)."""
    cupy_or_skip()
    layer = random_layer(rng, 0, num_experts=32, hidden=2336, ffn=160, qtype=Q.Q8_0)
    ids = rng.integers(0, 32, 32).tolist()
    w = rng.uniform(0.0, 1.0, 32).astype(np.float32)
    x = rng.standard_normal(2336).astype(np.float32)
    (y1, _), (y2, _), (y4, h4) = both(layer, ids, w, x, monkeypatch)
    ref = w.astype(np.float64) @ reference(layer, ids, np.repeat(x[None], len(ids), axis=0))
    assert h4 == _HALT_NONE and rel_err(y4, ref) < REL_ERR
    assert np.allclose(y4, y1, rtol=1e-6, atol=1e-6 * np.abs(y1).max())


def test_v2_missing_expert_halts_the_layer(rng, monkeypatch):
    cupy_or_skip()
    layer = random_layer(rng, 0, num_experts=6, hidden=256, ffn=256, qtype=Q.Q8_0)
    x = rng.standard_normal(256).astype(np.float32)
    for y, halt in both(layer, [1, 4, 5], [0.5, 0.3, 0.2], x, monkeypatch, missing=(4,)):
        assert halt == 0 and (y == -7.0).all()


# dense ------------------------------------------------------------------------------------------
def dense_pair(monkeypatch):
    """GpuDense of v1, v2, v3 and v4 (v3: the v2 kernels launched with programmatic dependent
    launch; v4: v3 with dense_gemv_v4, 2 rows per warp of 4 up to 4 KB rows)."""
    from execute.gpu_dense import GpuDense

    out = []
    for v in ("v1", "v2", "v3", "v4"):
        monkeypatch.setenv("MOELAB_DECODE_KERNELS", v)
        out.append(GpuDense(hidden=256, heads=8, kv_heads=2, head_dim=64, experts=40, top_k=6))
    assert [g.kernels for g in out] == ["v1", "v2", "v3", "v4"]
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0])
@pytest.mark.parametrize("rows, cols", [(203, 256), (37, 4096), (9, 96), (45, 2048), (21, 11776)])
def test_v2_gemv_matches_v1_and_numpy(qtype, rows, cols, monkeypatch):
    """4096 columns: more 16-byte loads per lane than the prefetch holds (F32: v4 one row per warp);
    96: fewer than one per lane; 2048: v4's two rows per warp (F16: both rows' 8 loads per lane
    prefetched; an odd row count: a warp with one row); 11776: the longest row (MAX_COLS)."""
    cupy_or_skip()
    import cupy as cp

    from execute.gpu_dense import device_matrix

    rng = np.random.default_rng(qtype + cols)
    raw = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    vals = Q.dequantize(raw, qtype, cols).reshape(rows, cols)
    m = device_matrix((raw, qtype), vals)
    x, add, nw = (rng.standard_normal(cols).astype(np.float32) for _ in range(3))
    bias, resid = rng.standard_normal(rows).astype(np.float32), rng.standard_normal(rows).astype(np.float32)
    v = x + 0.5 * add
    xn = v / np.sqrt(np.mean(v.astype(np.float64) ** 2) + 1e-5) * nw
    want = resid + 0.75 * (vals.astype(np.float64) @ xn + bias)
    got = []
    for g in dense_pair(monkeypatch):
        y = cp.asarray(resid)
        g.gemv(m, cp.asarray(x), y, add=cp.asarray(add), add_scale=0.5, norm=cp.asarray(nw), eps=1e-5,
               bias=cp.asarray(bias), resid=y, out_scale=0.75)
        got.append(y.get())
    assert all(rel_err(g, want) < 1e-5 for g in got)
    for g in (got[1], got[3]):  # v2, v4: v1's sums in v1's order
        assert np.allclose(g, got[0], rtol=1e-6, atol=1e-6 * np.abs(got[0]).max())
    assert np.array_equal(got[2], got[1])  # v3: the same kernel, launched otherwise
    from execute import pdl_launch

    assert pdl_launch.refused is None  # the driver took the programmatic launches


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0])
def test_v4_gemv_of_a_plain_input(qtype, monkeypatch):
    """No add, norm or residual (wo's case): v4 copies the input to shared memory asynchronously."""
    cupy_or_skip()
    import cupy as cp

    from execute.gpu_dense import device_matrix

    rng = np.random.default_rng(7)
    rows, cols = 300, 4096
    raw = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    vals = Q.dequantize(raw, qtype, cols).reshape(rows, cols)
    m, x = device_matrix((raw, qtype), vals), rng.standard_normal(cols).astype(np.float32)
    want = vals.astype(np.float64) @ x
    got = []
    for g in dense_pair(monkeypatch):
        y = cp.zeros(rows, cp.float32)
        g.gemv(m, cp.asarray(x), y)
        got.append(y.get())
    assert all(rel_err(g, want) < 1e-5 for g in got)
    assert np.allclose(got[3], got[0], rtol=1e-6, atol=1e-6 * np.abs(got[0]).max())


@pytest.mark.parametrize("gating, norm_topk", [(0, True), (0, False), (1, False)])
@pytest.mark.parametrize("qtype, experts, k", [(Q.F32, 40, 6), (Q.F32, 128, 8), (Q.Q8_0, 256, 32)])
def test_v2_router_picks_v1_ids(gating, norm_topk, qtype, experts, k, monkeypatch):
    """The same ids as v1 (an exact tie: the lower id first) and weights within float32 rounding of
    v1's and of ``route_weights``; the grid counter is reset for the next launch."""
    cupy_or_skip()
    import cupy as cp

    from execute.gpu_dense import GpuDense, device_matrix

    rng = np.random.default_rng(experts + gating)
    raw = Q.quantize(rng.standard_normal((experts, 256)).astype(np.float32) * 0.05, qtype)
    vals = Q.dequantize(raw, qtype, 256).reshape(experts, 256)
    raw[7], vals[7] = raw[3], vals[3]
    x, norm, bias = rng.standard_normal(256).astype(np.float32), np.ones(256, np.float32), np.zeros(experts, np.float32)
    bias[[3, 7]] = 50.0
    info = type("Info", (), dict(gating=("softmax", "softmax_topk")[gating], norm_topk=norm_topk, top_k=k,
                                 expert_groups=1, expert_weights_scale=2.0))()
    logits = vals.astype(np.float64) @ (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6)) + bias
    r_ids, r_w = M.route_weights(info, logits)
    m, got = device_matrix((raw, qtype), vals), []
    for v in ("v1", "v2", "v3", "v4"):
        monkeypatch.setenv("MOELAB_DECODE_KERNELS", v)
        g = GpuDense(hidden=256, heads=8, kv_heads=2, head_dim=64, experts=experts, top_k=k)
        for _ in range(1 if v == "v1" else 2):  # twice: the grid counter was reset
            ids, w = g.route(m, cp.asarray(x), cp.asarray(norm), 1e-6, cp.empty(256, cp.float32), cp.asarray(bias),
                             gating, norm_topk, 2.0)
            got.append((ids[0].tolist(), w[0]))
    (i1, w1), (i2, w2) = got[:2]
    assert all(i == r_ids.tolist() for i, _ in got) and i2[:2] == [3, 7]
    np.testing.assert_allclose(w2, w1, rtol=1e-6)
    np.testing.assert_allclose(w2, r_w, rtol=1e-5)
    assert all(np.array_equal(w, w2) for _, w in got[1:5])  # v2, v3: the same kernel
    w4 = got[5][1]  # v4: the logits summed over a block round otherwise
    np.testing.assert_allclose(w4, w1, rtol=1e-5)
    np.testing.assert_allclose(w4, r_w, rtol=1e-5)
    assert np.array_equal(got[6][1], w4)


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_v2_qk_rope_kv_is_v1s(mode, monkeypatch):
    """qk_rope_kv_v2 is qk_rope_kv's code after its wait: the same bits (v3 launched programmatically)."""
    cupy_or_skip()
    import cupy as cp

    rng = np.random.default_rng(mode)
    nh, nkv, hd, n, pos = 8, 2, 64, 16, 11
    qkv = cp.asarray(rng.standard_normal((nh + 2 * nkv) * hd).astype(np.float32))
    nw = cp.asarray((1 + 0.1 * rng.standard_normal((nh + nkv) * hd)).astype(np.float32))
    cos, sin = (cp.asarray(rng.standard_normal((n, hd)).astype(np.float32)) for _ in range(2))
    got = []
    for g in dense_pair(monkeypatch):
        kc, vc = cp.zeros((nkv, n, hd), cp.float32), cp.zeros((nkv, n, hd), cp.float32)
        g.qkv[...] = qkv
        g.qk_rope_kv(nw, mode, 1e-6, cos, sin, pos, kc, vc)
        got.append((g.q.get(), kc.get(), vc.get()))
    for q, k, v in got[1:]:
        assert np.array_equal(q, got[0][0]) and np.array_equal(k, got[0][1]) and np.array_equal(v, got[0][2])
    assert got[0][1][:, pos].any() and not got[0][1][:, :pos].any()


@pytest.mark.parametrize("lo, n_keys, sinks", [(0, 1, False), (0, 3, False), (0, 64, False), (0, 65, False),
                                               (0, 300, False), (37, 200, True), (5, 17, True)])
def test_v2_attention_matches_reference(lo, n_keys, sinks, monkeypatch):
    """Key counts around the 64-key chunks and the 8 keys a warp reads per round."""
    cupy_or_skip()
    import cupy as cp

    rng = np.random.default_rng(n_keys)
    nh, nkv, hd, n = 8, 2, 64, 320
    kc = rng.standard_normal((nkv, n, hd)).astype(np.float32)
    vc = rng.standard_normal((nkv, n, hd)).astype(np.float32)
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    sk = rng.standard_normal(nh).astype(np.float32) if sinks else None
    ref = np.empty((nh, hd))
    for h in range(nh):
        keys, vals = kc[h // 4, lo:lo + n_keys].astype(np.float64), vc[h // 4, lo:lo + n_keys].astype(np.float64)
        s = keys @ q[h] * 0.125
        m = max(s.max(), sk[h]) if sinks else s.max()
        e = np.exp(s - m)
        ref[h] = e @ vals / (e.sum() + (np.exp(sk[h] - m) if sinks else 0.0))
    for g in dense_pair(monkeypatch):
        g.q[...] = cp.asarray(q.reshape(-1))
        g.attention(cp.asarray(kc), cp.asarray(vc), lo, n_keys, 0.125, None if sk is None else cp.asarray(sk))
        o = g.o.get().reshape(nh, hd).astype(np.float64)
        assert ((o - ref) ** 2).sum() / (ref**2).sum() <= 1e-10


# the token graph --------------------------------------------------------------------------------
def _token_graph_run(w, variant: str, tokens, monkeypatch):
    from scheduler.audit import Audit

    monkeypatch.setenv("MOELAB_DECODE_KERNELS", variant)
    monkeypatch.setenv("MOELAB_TOKEN_GRAPH", "1")
    g = w.info.geometry()
    cap = Capacity.per_layer(g, max(g.num_experts))
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        res = M.run(model, backend, make_policy("gpu", g, cap), inputs, audit=Audit(g, keep_log=True), keep_logits=True)
    finally:
        backend.close()
    return np.stack(res.logits), model


@pytest.mark.parametrize("variant", ["v2", "v3", "v4"])
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_v2_token_graph_matches_v1_and_numpy(arch, variant, tmp_path, monkeypatch):
    """Every expert resident (``gpu``): each token one graph of v2 kernels (v3: the dense ones
    programmatically dependent on the kernel before); logits within float32 rounding of v1's and
    the numpy model's, the same routes and greedy tokens."""
    cupy_or_skip()
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model

    cfg = config_from_preset("tiny", arch=arch, quant="Q8_0", num_layers=4, seed=13)
    w = load_model(synth_model(tmp_path / f"{arch}.gguf", cfg))
    tokens = np.random.default_rng(5).integers(w.info.vocab, size=70).tolist()  # cache 8 -> 128: two key chunks
    l1, m1 = _token_graph_run(w, "v1", tokens, monkeypatch)
    l2, m2 = _token_graph_run(w, variant, tokens, monkeypatch)
    assert m2.token_graph is not None and m2.token_graph.complete == len(tokens) and m2.gd.kernels == variant
    from execute import pdl_launch

    assert pdl_launch.refused is None  # v3: the captures took the programmatic launches
    ref_model = M.MoeModel(w, use_gpu=False, max_tokens=8)
    g = w.info.geometry()
    ref = M.run(ref_model, M.NumpyExperts(w), make_policy("cpu", g, Capacity.per_layer(g, 0)),
                [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)], keep_logits=True)
    ref = np.stack(ref.logits).astype(np.float64)
    for got in (l1, l2):
        assert ((got - ref) ** 2).sum() / (ref**2).sum() <= 1e-6
    assert ((l2 - l1) ** 2).sum() / (l1.astype(np.float64) ** 2).sum() <= 1e-10
    assert (l2.argmax(axis=1) == l1.argmax(axis=1)).all()
    assert [[r[:2] for r in row] for _, row in m2.route_log] == [[r[:2] for r in row] for _, row in m1.route_log]
