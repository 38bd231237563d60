"""The stage-by-stage precision comparison (``execute.prefill_precision``): its float64 reference
block is the reference forward pass's, a float32 implementation of every stage stays within the
stated bounds, and a stage that rounds its input to f16 stands out by its ratio."""
from __future__ import annotations

import numpy as np
import pytest

from execute import prefill_precision as P
from execute import quant as Q
from execute.archs import rope_angles
from execute.batch_route import route_rows
from execute.reference import reference_forward


@pytest.fixture(scope="module")
def weights(tiny_weights):
    return tiny_weights("Q8_0")


def test_reference_blocks_give_the_reference_forward_pass(weights):
    info = weights.info
    ids = [5, 17, 3, 200, 9, 11, 40, 2]
    logits, used = reference_forward(weights, ids)
    x = np.asarray(weights.token_embd[ids], np.float64) * info.embedding_scale
    for l in range(info.num_layers):
        r = P.reference_block(weights, l, x, 1.0 / np.sqrt(info.head_dim))
        assert [tuple(int(e) for e in r["ids"][t]) for t in range(len(ids))] == [used[t][l][0] for t in range(len(ids))]
        np.testing.assert_allclose(r["w"], [used[t][l][1] for t in range(len(ids))], rtol=1e-12)
        x = r["out"]
    xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + info.rms_eps) * weights.output_norm
    np.testing.assert_allclose(xn @ np.asarray(weights.output, np.float64).T / info.logit_scale, logits, rtol=1e-10,
                               atol=1e-12)
    assert P.supported(weights) is None


class NumpyBlock:
    """Every stage in float32 numpy (the GpuBlock interface); ``f16``: a projection whose input is
    rounded to float16 first."""

    def __init__(self, weights, l: int, f16: str | None = None):
        self.info, lw, self.lx = weights.info, weights.layers[l], weights.experts[l]
        self.f16 = f16
        self.w = {"attn_norm": lw.attn_norm, "ffn_norm": lw.ffn_norm, "wqkv": np.concatenate([lw.wq, lw.wk, lw.wv]),
                  "wo": lw.wo, "router": lw.router, "q_norm": lw.q_norm, "k_norm": lw.k_norm}
        self.k = self.v = None
        self._deq = {}

    @staticmethod
    def dev(a):
        return np.ascontiguousarray(a, np.float32)

    def rms(self, x, key):
        return x * (np.float32(1) / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(self.info.rms_eps))) * self.w[key]

    def proj(self, x, key):
        x = x.astype(np.float16).astype(np.float32) if key == self.f16 else x
        return x @ self.w[key].T

    def qk_rope(self, qkv):
        info = self.info
        nh, nkv, hd, t = info.num_heads, info.num_kv_heads, info.head_dim, len(qkv)
        q = self.rms(qkv[:, :nh * hd].reshape(t, nh, hd), "q_norm")
        k = self.rms(qkv[:, nh * hd:(nh + nkv) * hd].reshape(t, nkv, hd), "k_norm")
        ang = rope_angles(np.arange(t), hd, info.rope_theta)
        c, s = np.cos(ang).astype(np.float32)[:, None], np.sin(ang).astype(np.float32)[:, None]
        rot = lambda a: np.concatenate([a[..., :hd // 2] * c - a[..., hd // 2:] * s,  # noqa: E731
                                        a[..., hd // 2:] * c + a[..., :hd // 2] * s], axis=-1)
        return rot(q), rot(k), qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd)

    def set_cache(self, k, v):
        self.k, self.v = k, v

    def route(self, logits):
        return route_rows(self.info, logits.astype(np.float64), None)

    def _attend_rows(self, q, rows):
        info = self.info
        g = info.num_heads // info.num_kv_heads
        out = []
        for t, qt in zip(rows, q):
            kk, vv = np.repeat(self.k[:t + 1], g, axis=1), np.repeat(self.v[:t + 1], g, axis=1)
            s = np.einsum("hd,uhd->hu", qt, kk) * np.float32(1 / np.sqrt(info.head_dim))
            e = np.exp(s - s.max(-1, keepdims=True))
            out.append(np.einsum("hu,uhd->hd", e / e.sum(-1, keepdims=True), vv).reshape(-1))
        return np.array(out)

    def attend(self, q, k, v):
        self.set_cache(k, v)
        return self._attend_rows(q, range(len(q)))

    def decode_attend(self, q_row, p):
        return self._attend_rows(self.dev(q_row)[None], [p])[0]

    def experts(self, hn, ids, w, act_in=None, y_in=None):
        lx = self.lx

        def deq(t, e):
            if (id(t), e) not in self._deq:
                self._deq[id(t), e] = Q.dequantize(t.data[e], t.qtype, t.cols)
            return self._deq[id(t), e]

        T, k = ids.shape
        act = np.empty((T * k, lx.ffn), np.float32)
        y = np.empty((T * k, lx.hidden), np.float32)
        for p in range(T * k):
            e = ids[p // k, p % k]
            g, u = deq(lx.gate, e) @ hn[p // k], deq(lx.up, e) @ hn[p // k]
            act[p] = g / (1 + np.exp(-g)) * u
            y[p] = deq(lx.down, e) @ (act[p] if act_in is None else self.dev(act_in[p]))
        src = y if y_in is None else self.dev(y_in)
        return act, y, (src.reshape(T, k, -1) * w[:, :, None]).sum(axis=1)


def _records(weights, f16=None, tokens: int = 16):
    info = weights.info
    x = np.asarray(weights.token_embd[np.arange(tokens) * 7 % info.vocab], np.float64) * info.embedding_scale
    rows = []
    for l in range(info.num_layers):
        ref = P.reference_block(weights, l, x, 1.0 / np.sqrt(info.head_dim))
        P.block_records(rows, NumpyBlock(weights, l, f16), l, ref, [1, tokens - 1])
        x = ref["out"]
    return rows


def test_float32_stages_stay_within_their_bounds(weights):
    rows = _records(weights)
    assert not [r for r in rows if r["stage"] == "error"]
    stages = {(r["path"], r["mode"], r["stage"]) for r in rows}
    assert {("chunk", m, s) for m in ("isolated", "chained") for s in (
        "attn_norm", "qkv", "q_norm_rope", "attention", "wo", "ffn_norm", "router_logits", "routes",
        "expert_gate_up", "expert_down", "combine")} <= stages
    assert ("chunk", "chained", "block_out") in stages and ("decode", "isolated", "attention") in stages
    measured = [r for r in rows if "ratio_median" in r]
    assert max(r["ratio_median"] for r in measured) < 3, P.table(rows)
    assert all(r["differ"] == 0 for r in rows if r["stage"] == "routes")


def test_a_stage_rounded_to_f16_stands_out(weights):
    rows = _records(weights, f16="wqkv")
    qkv = [r for r in rows if r["stage"] == "qkv" and r["path"] == "chunk"]
    assert min(r["ratio_median"] for r in qkv) > 30
    iso = [r for r in rows if r["mode"] == "isolated" and r["path"] == "chunk" and "ratio_median" in r
           and r["stage"] not in ("qkv", "q_norm_rope", "k_norm_rope")]
    assert max(r["ratio_median"] for r in iso) < 3  # the isolated stages after it do not inherit it
    assert "qkv" in P.table(rows)


@pytest.mark.gpu
def test_the_gpu_chunk_path_stays_within_its_bounds(weights):
    """Every isolated stage of the device's chunk path and decode kernels within a few times its
    stated bound on a tiny model (the bounds are typical sizes: the medians are compared)."""
    from .conftest import cupy_or_skip

    cp = cupy_or_skip()
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("the chunk path's tiles need compute capability 8.0")
    rows = P.compare(weights, tokens=24, decode_positions=(1, -1))
    assert not [r for r in rows if r["stage"] == "error"], P.table(rows)
    iso = [r for r in rows if r["mode"] == "isolated" and "ratio_median" in r]
    assert len({(r["path"], r["stage"]) for r in iso}) == 15
    assert max(r["ratio_median"] for r in iso) < 4, P.table(rows)
