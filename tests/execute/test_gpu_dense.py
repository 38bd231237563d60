"""execute.gpu_dense: each fused dense kernel against numpy, the GPU model (fused one-token path,
dequantized chunks) against the numpy model on tiny synthetic GGUFs of every architecture, and the
fused path's CUDA graph replay against its plain launches (bit-identical) with its switch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from execute import model as M
from execute import quant as Q
from execute.archs import ARCHS, rope_angles
from execute.experts import ExecutorError
from execute.gguf_model import load_model
from execute.synth import config_from_preset, synth_model
from scheduler import Capacity, make_policy
from scheduler.audit import Audit

from .conftest import cupy_or_skip

pytestmark = pytest.mark.gpu

TOKENS = [5, 300, 17, 17, 42, 256, 1, 9, 100]  # longer than gpt-oss's window of 4


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def gd():
    cupy_or_skip()
    from execute.gpu_dense import GpuDense

    return GpuDense(hidden=256, heads=8, kv_heads=2, head_dim=64, experts=40, top_k=6)


def stored(rng, qtype: int, rows: int, cols: int):
    """Random (rows, cols) weights stored as ``qtype`` rows, and their float32 values."""
    raw = Q.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    return raw, Q.dequantize(raw, qtype, cols).reshape(rows, cols)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


# kernels ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0])
def test_gemv_with_prologue_and_epilogue(gd, qtype):
    import cupy as cp

    from execute.gpu_dense import device_matrix

    rng = np.random.default_rng(qtype)
    raw, vals = stored(rng, qtype, 203, 256)  # rows not a multiple of the block's 8
    m = device_matrix((raw, qtype), vals)
    assert m.qt == qtype and m.rows == 203
    x, add, norm, bias, resid = (rng.standard_normal(n).astype(np.float32) for n in (256, 256, 256, 203, 203))
    v = x.astype(np.float64) + 0.5 * add
    ref = resid + 0.25 * (vals.astype(np.float64) @ rms(v, norm, 1e-6) + bias)
    y, xo, xn = cp.asarray(resid), cp.empty(256, cp.float32), cp.empty(256, cp.float32)
    gd.gemv(m, cp.asarray(x), y, add=cp.asarray(add), add_scale=0.5, x_out=xo, norm=cp.asarray(norm), eps=1e-6,
            xn_out=xn, bias=cp.asarray(bias), resid=y, out_scale=0.25)
    assert nmse(y.get(), ref) <= 1e-6
    assert nmse(xo.get(), v) <= 1e-12 and nmse(xn.get(), rms(v, norm, 1e-6)) <= 1e-12
    plain = gd.matmul(cp.asarray(x[None]), m).get()[0]
    assert nmse(plain, vals.astype(np.float64) @ x) <= 1e-6


def test_other_types_go_to_f16_and_chunks_dequantize(gd):
    import cupy as cp

    from execute.gpu_dense import device_matrix

    rng = np.random.default_rng(1)
    raw, vals = stored(rng, Q.Q4_0, 64, 128)
    m = device_matrix((raw, Q.Q4_0), vals)
    assert m.qt == Q.F16
    x = rng.standard_normal((5, 128)).astype(np.float32)
    ref = x.astype(np.float64) @ vals.T.astype(np.float64)
    assert nmse(gd.matmul(cp.asarray(x), m).get(), ref) <= 1e-4  # F16 copy of Q4_0 values
    q8raw, q8 = stored(rng, Q.Q8_0, 64, 128)
    got = gd.matmul(cp.asarray(x), device_matrix((q8raw, Q.Q8_0), q8)).get()  # float32 tiles
    assert nmse(got, x.astype(np.float64) @ q8.T.astype(np.float64)) <= 1e-10
    assert device_matrix((raw, Q.Q4_0), vals[:, :100]) is None  # rows not a multiple of 32


@pytest.mark.parametrize("gating, norm_topk", [(0, True), (0, False), (1, False)])
def test_router_topk_matches_route_weights(gd, gating, norm_topk):
    import cupy as cp

    from execute.gpu_dense import device_matrix

    rng = np.random.default_rng(gating + 2 * norm_topk)
    raw, vals = stored(rng, Q.F32, 40, 256)
    raw[7], vals[7] = raw[3], vals[3]  # an exact tie: 3 must come first
    x, norm, bias = rng.standard_normal(256).astype(np.float32), np.ones(256, np.float32), np.zeros(40, np.float32)
    bias[[3, 7]] = 50.0  # both in the top k
    xn = cp.empty(256, cp.float32)
    ids, w = gd.route(device_matrix((raw, Q.F32), vals), cp.asarray(x), cp.asarray(norm), 1e-6, xn, cp.asarray(bias),
                      gating, norm_topk, 2.0)
    info = type("Info", (), dict(gating=("softmax", "softmax_topk")[gating], norm_topk=norm_topk, top_k=6,
                                 expert_groups=1, expert_weights_scale=2.0))()
    logits = vals.astype(np.float64) @ rms(x.astype(np.float64), norm, 1e-6) + bias
    r_ids, r_w = M.route_weights(info, logits)
    assert ids.dtype == np.int64 and ids.shape == (1, 6) and w.shape == (1, 6)
    assert ids[0].tolist() == r_ids.tolist() and ids[0].tolist()[:2] == [3, 7]
    np.testing.assert_allclose(w[0], r_w, rtol=1e-5)
    again, _ = gd.route(device_matrix((raw, Q.F32), vals), cp.asarray(x), cp.asarray(norm), 1e-6, xn,
                        cp.asarray(bias), gating, norm_topk, 2.0)
    assert again.tolist() == ids.tolist()  # the grid counter was reset


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_qk_norm_rope_and_cache_append(gd, mode):
    import cupy as cp

    rng = np.random.default_rng(mode)
    nh, nkv, hd, n, pos = 8, 2, 64, 16, 11
    qkv = rng.standard_normal((nh + 2 * nkv) * hd).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal((nh + nkv) * hd)).astype(np.float32)
    ang = rope_angles(np.arange(n), hd, 10000.0)
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=1).astype(np.float32)
    sin = np.concatenate([-np.sin(ang), np.sin(ang)], axis=1).astype(np.float32)
    kc, vc = cp.zeros((nkv, n, hd), cp.float32), cp.zeros((nkv, n, hd), cp.float32)
    gd.qkv[...] = cp.asarray(qkv)
    gd.qk_rope_kv(cp.asarray(nw), mode, 1e-6, cp.asarray(cos), cp.asarray(sin), pos, kc, vc)
    qk = qkv[: (nh + nkv) * hd].astype(np.float64)
    if mode == 1:
        qk = rms(qk.reshape(-1, hd), nw.reshape(-1, hd), 1e-6).reshape(-1)
    elif mode == 2:
        qk = np.concatenate([rms(qk[: nh * hd], nw[: nh * hd], 1e-6), rms(qk[nh * hd:], nw[nh * hd:], 1e-6)])
    h = qk.reshape(-1, hd)
    roped = h * cos[pos] + np.concatenate([h[:, hd // 2:], h[:, : hd // 2]], axis=1) * sin[pos]
    assert nmse(gd.q.get().reshape(nh, hd), roped[:nh]) <= 1e-12
    assert nmse(kc.get()[:, pos], roped[nh:]) <= 1e-12 and not kc.get()[:, :pos].any()
    assert np.array_equal(vc.get()[:, pos], qkv[(nh + nkv) * hd:].reshape(nkv, hd))


@pytest.mark.parametrize("lo, n_keys, sinks", [(0, 1, False), (0, 300, False), (37, 200, True)])
def test_decode_attention_splits_window_sinks(gd, lo, n_keys, sinks):
    import cupy as cp

    rng = np.random.default_rng(n_keys)
    nh, nkv, hd, n = 8, 2, 64, 320
    kc = rng.standard_normal((nkv, n, hd)).astype(np.float32)
    vc = rng.standard_normal((nkv, n, hd)).astype(np.float32)
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    sk = rng.standard_normal(nh).astype(np.float32) if sinks else None
    gd.q[...] = cp.asarray(q.reshape(-1))
    gd.attention(cp.asarray(kc), cp.asarray(vc), lo, n_keys, 0.125, None if sk is None else cp.asarray(sk))
    ref = np.empty((nh, hd))
    for h in range(nh):
        keys, vals = kc[h // 4, lo:lo + n_keys].astype(np.float64), vc[h // 4, lo:lo + n_keys].astype(np.float64)
        s = keys @ q[h] * 0.125
        m = max(s.max(), sk[h]) if sinks else s.max()
        e = np.exp(s - m)
        ref[h] = e @ vals / (e.sum() + (np.exp(sk[h] - m) if sinks else 0.0))
    assert nmse(gd.o.get().reshape(nh, hd), ref) <= 1e-10


# the model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def arch_weights(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("dense"), {}

    def get(arch: str, dense_quant: str = "F16"):
        key = (arch, dense_quant)
        if key not in cache:
            cfg = config_from_preset("tiny", arch=arch, quant="Q8_0", seed=13)
            cfg = dataclasses.replace(cfg, dense_quant=dense_quant)
            cache[key] = load_model(synth_model(root / f"{arch}_{dense_quant}.gguf", cfg))
        return cache[key]

    return get


def run(weights, inputs, use_gpu: bool, cuda_graphs: bool | None = None):
    g = weights.info.geometry()
    model = M.MoeModel(weights, use_gpu=use_gpu, max_tokens=8, cuda_graphs=cuda_graphs)  # grows during the run
    audit = Audit(g, keep_log=True, record_routes=True)
    model.route_log = []
    res = M.run(model, M.NumpyExperts(weights), make_policy("cpu", g, Capacity.per_layer(g, 0)), inputs,
                audit=audit, keep_logits=True)
    return np.stack(res.logits), model


def decode_inputs(tokens, routes=None):
    return [M.TokenInput(i, 0, i, "decode", t, None if routes is None else routes[i]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("arch", tuple(ARCHS))
def test_gpu_model_matches_numpy_model(arch, arch_weights):
    cupy_or_skip()
    w = arch_weights(arch)
    ref, ref_model = run(w, decode_inputs(TOKENS), use_gpu=False)
    got, model = run(w, decode_inputs(TOKENS), use_gpu=True)
    assert model.fast == (arch != "deepseek2")  # MLA stays on the generic path
    assert nmse(got, ref) <= 1e-6
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()  # greedy tokens unchanged
    assert [[r[:2] for r in row] for _, row in model.route_log] == [[r[:2] for r in row] for _, row in ref_model.route_log]


@pytest.mark.parametrize("dense_quant", ["Q8_0", "BF16", "F32"])
def test_stored_dense_types(dense_quant, arch_weights):
    cupy_or_skip()
    w = arch_weights("qwen3moe", dense_quant)
    ref, _ = run(w, decode_inputs(TOKENS), use_gpu=False)
    got, model = run(w, decode_inputs(TOKENS), use_gpu=True)
    assert model.fast and model.layers[0]["wqkv"].qt == Q.QTYPE_BY_NAME[dense_quant]
    assert nmse(got, ref) <= 1e-6 and (got.argmax(axis=1) == ref.argmax(axis=1)).all()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_prefill_chunk_then_decode(arch, arch_weights):
    cupy_or_skip()
    w = arch_weights(arch)
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(TOKENS[:6]), all_logits=True)]
    inputs += [M.TokenInput(1 + i, 0, 6 + i, "decode", t) for i, t in enumerate(TOKENS[6:])]
    ref, _ = run(w, inputs, use_gpu=False)
    got, _ = run(w, inputs, use_gpu=True)
    assert got.shape == (len(TOKENS), w.info.vocab)
    assert nmse(got, ref) <= 1e-6 and (got.argmax(axis=1) == ref.argmax(axis=1)).all()


def test_forced_routes(arch_weights):
    cupy_or_skip()
    w = arch_weights("qwen3moe")
    _, model = run(w, decode_inputs(TOKENS), use_gpu=False)
    routes = [tuple(M.Route(tuple(ids[::-1]), None if i % 2 else tuple(wt)) for _, ids, wt in row)
              for i, (_, row) in enumerate(model.route_log)]  # reversed order; every other token: router weights
    ref, _ = run(w, decode_inputs(TOKENS, routes), use_gpu=False)
    got, gpu = run(w, decode_inputs(TOKENS, routes), use_gpu=True)
    assert gpu.fast and nmse(got, ref) <= 1e-6
    assert [[r[1] for r in row] for _, row in gpu.route_log] == [[list(r.experts) for r in rr] for rr in routes]


# CUDA graphs --------------------------------------------------------------------------------------
FUSED_ARCHS = tuple(a for a in ARCHS if a != "deepseek2")


def plain_and_graphed(weights, inputs):
    """The fused path's logits and model with plain launches, then with graph replay."""
    plain, plain_model = run(weights, inputs, use_gpu=True, cuda_graphs=False)
    got, model = run(weights, inputs, use_gpu=True, cuda_graphs=True)
    assert plain_model.fast and not plain_model.graphed and plain_model.gd.captures == 0
    assert model.graphed
    return plain, plain_model, got, model


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_graph_replay_is_bit_identical(arch, arch_weights):
    cupy_or_skip()
    w = arch_weights(arch)
    plain, plain_model, got, model = plain_and_graphed(w, decode_inputs(TOKENS))
    assert model.gd.captures == 2  # at 8 positions, then again when the cache grew to 16 for the ninth token
    assert np.array_equal(got, plain)
    assert model.route_log == plain_model.route_log  # ids and weights, exactly


def test_graph_replay_over_many_key_splits(arch_weights):
    """140 positions: the cache grows 8 -> 256 (six captures) and the attention uses up to 3 of the
    graph's 4 splits of 64 keys (the rest exit at once); the same bits as the plain launches."""
    cupy_or_skip()
    w = arch_weights("qwen3moe")
    tokens = np.random.default_rng(3).integers(w.info.vocab, size=140).tolist()
    plain, plain_model, got, model = plain_and_graphed(w, decode_inputs(tokens))
    assert model.k_cache[0].shape[1] == 256 and model.gd.captures == 6
    assert np.array_equal(got, plain) and model.route_log == plain_model.route_log


def test_graph_replay_with_forced_routes(arch_weights):
    cupy_or_skip()
    w = arch_weights("qwen3moe")
    _, model = run(w, decode_inputs(TOKENS), use_gpu=False)
    routes = [tuple(M.Route(tuple(ids[::-1]), None if i % 2 else tuple(wt)) for _, ids, wt in row)
              for i, (_, row) in enumerate(model.route_log)]  # reversed order; every other token: router weights
    plain, plain_model, got, graphed = plain_and_graphed(w, decode_inputs(TOKENS, routes))
    assert np.array_equal(got, plain) and graphed.route_log == plain_model.route_log
    assert [[r[1] for r in row] for _, row in graphed.route_log] == [[list(r.experts) for r in rr] for rr in routes]


def test_prefill_chunk_then_graphed_decode(arch_weights):
    cupy_or_skip()
    w = arch_weights("gpt-oss")  # window 4, sinks, biases
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(TOKENS[:6]), all_logits=True)]
    inputs += [M.TokenInput(1 + i, 0, 6 + i, "decode", t) for i, t in enumerate(TOKENS[6:])]
    plain, _, got, _ = plain_and_graphed(w, inputs)
    assert np.array_equal(got, plain)


def test_graph_switch_and_fallback(arch_weights, monkeypatch, capsys):
    cupy_or_skip()
    from execute.gpu_dense import DecodeBlock

    w = arch_weights("qwen3moe")
    inputs = decode_inputs(TOKENS[:4])
    monkeypatch.setenv("MOELAB_CUDA_GRAPHS", "0")
    off, m_off = run(w, inputs, use_gpu=True)
    assert m_off.fast and not m_off.cuda_graphs and not m_off.graphed and m_off.gd.captures == 0
    monkeypatch.setenv("MOELAB_CUDA_GRAPHS", "1")
    on, m_on = run(w, inputs, use_gpu=True)
    assert m_on.graphed and m_on.gd.captures == 1 and np.array_equal(on, off)
    monkeypatch.setenv("MOELAB_CUDA_GRAPHS", "yes")
    with pytest.raises(ExecutorError, match="MOELAB_CUDA_GRAPHS: 'yes', expected 0 or 1"):
        M.MoeModel(w, use_gpu=True)
    monkeypatch.delenv("MOELAB_CUDA_GRAPHS")

    def refuse(self, stream):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(DecodeBlock, "record", refuse)  # a capture that fails: warn once, plain launches
    capsys.readouterr()
    fell, m_fell = run(w, decode_inputs(TOKENS), use_gpu=True)  # grows the cache: no second attempt
    lines = [l for l in capsys.readouterr().err.splitlines() if "CUDA graph capture failed" in l]
    assert len(lines) == 1 and "RuntimeError: capture refused" in lines[0]
    assert not m_fell.graphed and not m_fell.cuda_graphs and m_fell.gd.captures == 0
    assert np.array_equal(fell[: len(off)], off)
