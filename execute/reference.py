"""A float64 numpy reference forward pass of every supported architecture, written separately
from ``execute.model``.

Simple on purpose: every weight (routed experts too) is dequantized with ``gguf_io.dequantize``
and cast to float64; a sequence is processed all at once (causal attention over the whole
sequence, with masks for sliding windows, no KV cache), where the executor runs one token at a
time against its cache. RoPE rotates the pairs of its type directly (the executor permutes rows
instead); routing is re-implemented here from the rules in ``execute.archs``. Only the RoPE angle
table (``archs.rope_angles``) is shared. Only for tiny models.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .archs import rope_angles, yarn_mscale
from .gguf_io import dequantize
from .gguf_model import ModelWeights

__all__ = ["reference_forward"]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, ang: np.ndarray, kind: str, mag: float) -> np.ndarray:
    """x (T, heads, d), ang (T, d/2): rotate pairs (i, i + d/2) ("neox") or (2i, 2i+1) ("norm")."""
    c, s = mag * np.cos(ang)[:, None, :], mag * np.sin(ang)[:, None, :]
    d = x.shape[-1]
    out = np.empty_like(x)
    if kind == "neox":
        a, b = x[..., : d // 2], x[..., d // 2:]
        out[..., : d // 2], out[..., d // 2:] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def _experts64(t) -> np.ndarray:
    """(experts, rows, cols) float64."""
    return dequantize(t.data, t.qtype).reshape(t.num_experts, t.rows, t.cols).astype(np.float64)


def _mask(T: int, window: int) -> np.ndarray:
    """(T, T) additive mask: causal, and key j visible from i only if i - j < window (window > 0)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    bad = (j > i) | ((i - j >= window) if window > 0 else False)
    return np.where(bad, -np.inf, 0.0)


def _attend(q, k, v, mask, scale, sinks=None):
    """q (T, h, d), k (T, h, d), v (T, h, dv) -> (T, h, dv), per head, with optional sink logits."""
    s = np.einsum("thd,uhd->htu", q, k) * scale + mask[None]  # (h, T, T)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True) + (np.exp(sinks[:, None, None] - m) if sinks is not None else 0.0)
    return np.einsum("htu,uhd->thd", e / den, v)


def _gqa(info, lw, h, ang, mag, mask):
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    T, nh, nkv, hd, eps = h.shape[0], info.num_heads, info.num_kv_heads, info.head_dim, info.rms_eps
    b = lw.attn_bias or {}
    q, k, v = h @ f64(lw.wq).T, h @ f64(lw.wk).T, h @ f64(lw.wv).T
    q, k, v = (q + f64(b["q"]) if "q" in b else q), (k + f64(b["k"]) if "k" in b else k), (v + f64(b["v"]) if "v" in b else v)
    if info.spec.qk_norm == "full":
        q, k = _rms(q, f64(lw.q_norm), eps), _rms(k, f64(lw.k_norm), eps)
    q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
    if info.spec.qk_norm == "head":
        q, k = _rms(q, f64(lw.q_norm), eps), _rms(k, f64(lw.k_norm), eps)
    q, k = _rope(q, ang, info.spec.rope, mag), _rope(k, ang, info.spec.rope, mag)
    group = nh // nkv
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = info.attn_scale or 1.0 / np.sqrt(hd)
    o = _attend(q, k, v, mask, scale, None if lw.sinks is None else f64(lw.sinks))
    out = o.reshape(T, nh * hd) @ f64(lw.wo).T
    return out + f64(b["o"]) if "o" in b else out


def _mla(info, lw, h, ang, mask):
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    m, eps = lw.mla, info.rms_eps
    T, nh, hk, vd, kvr = h.shape[0], info.num_heads, info.head_dim, info.v_head_dim, info.kv_lora_rank
    rd = info.rope_dims
    nope = hk - rd
    q = h @ f64(m["q"]).T if "q" in m else _rms(h @ f64(m["q_a"]).T, f64(m["q_a_norm"]), eps) @ f64(m["q_b"]).T
    q = q.reshape(T, nh, hk)
    kva = h @ f64(m["kv_a"]).T  # (T, kvr + rd)
    kv = (_rms(kva[:, :kvr], f64(m["kv_a_norm"]), eps) @ f64(m["kv_b"]).T).reshape(T, nh, nope + vd)
    k_pe = _rope(kva[:, None, kvr:], ang, info.spec.rope, 1.0)  # (T, 1, rd)
    q = np.concatenate([q[..., :nope], _rope(q[..., nope:], ang, info.spec.rope, 1.0)], axis=-1)
    k = np.concatenate([kv[..., :nope], np.repeat(k_pe, nh, axis=1)], axis=-1)
    factor = info.rope_factor if info.rope_scaling == "yarn" else 1.0
    scale = yarn_mscale(factor, info.yarn_log_mul or 1.0) ** 2 / np.sqrt(hk)
    o = _attend(q, k, kv[..., nope:], mask, scale)
    return o.reshape(T, nh * vd) @ f64(lw.wo).T


def _select(info, logits: np.ndarray, lw, forced):
    """(ids, weights) of one token: the routing rules of execute.archs, written out plainly."""
    g = info.gating
    if g == "softmax":
        probs = np.exp(logits - logits.max())
        probs = probs / probs.sum()
    elif g == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = logits.copy()
    if forced is not None and forced.weights is not None:
        return tuple(int(e) for e in forced.experts), tuple(float(a) for a in forced.weights)
    if forced is not None:
        sel = np.asarray(forced.experts)
    else:
        score = probs + (np.asarray(lw.exp_probs_b, np.float64) if lw.exp_probs_b is not None else 0.0)
        if info.expert_groups > 1:
            per = len(score) // info.expert_groups
            group_score = [sum(sorted(score[i * per:(i + 1) * per])[-2:]) for i in range(info.expert_groups)]
            keep = sorted(range(info.expert_groups), key=lambda i: (-group_score[i], i))[: info.expert_groups_used]
            score = np.array([s if e // per in keep else -np.inf for e, s in enumerate(score)])
        sel = np.array(sorted(range(len(score)), key=lambda e: (-score[e], e))[: info.top_k])
    w = probs[sel]
    if g == "softmax_topk":
        w = np.exp(w - w.max())
        w = w / w.sum()
    if info.norm_topk:
        w = w / max(w.sum(), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return tuple(int(e) for e in sel), tuple(float(a) for a in w)


def _act(kind: str, g, u):
    if kind == "swiglu_oai":
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return g * (1.0 / (1.0 + np.exp(-1.702 * g))) * (u + 1.0)
    return g / (1.0 + np.exp(-g)) * u


def _swiglu(f: dict, h):
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    return _act("silu", h @ f64(f["gate"]).T, h @ f64(f["up"]).T) @ f64(f["down"]).T


def _moe(info, lw, ex, h, routes_l):
    """Routed (+ shared) experts of one block for all T tokens; returns (y, used)."""
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    logits = h @ f64(lw.router).T + (f64(lw.router_bias) if lw.router_bias is not None else 0.0)  # (T, experts)
    gate, up, down = _experts64(ex.gate), _experts64(ex.up), _experts64(ex.down)
    b = {k: f64(v) for k, v in (lw.expert_bias or {}).items()}
    y, used = np.zeros_like(h), []
    for t in range(h.shape[0]):
        ids, ws = _select(info, logits[t], lw, routes_l[t])
        used.append((ids, ws))
        for e, we in zip(ids, ws):
            g, u = gate[e] @ h[t], up[e] @ h[t]
            if b:
                g, u = g + b["gate"][e], u + b["up"][e]
            d = down[e] @ _act(info.spec.activation, g, u)
            y[t] += we * (d + b["down"][e] if b else d)
    if lw.shared is not None:
        s = _swiglu(lw.shared, h)
        if lw.shared.get("gate_inp") is not None:
            s = s / (1.0 + np.exp(-(h @ f64(lw.shared["gate_inp"]))))[:, None]
        y = y + s
    return y, used


def reference_forward(weights: ModelWeights, token_ids: Sequence[int], routes=None):
    """Logits ``(T, vocab)`` float64 of one sequence, and the routing used ``[t][layer] = (ids, w)``
    (None at a dense block).

    ``routes[t][l]``, when given and not None, is a ``model.Route`` forcing token t's experts at
    block l (its weights, or the router's weights of those ids computed by the usual rules)."""
    info = weights.info
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    eps = info.rms_eps
    ids = np.asarray(token_ids)
    T = len(ids)
    x = f64(weights.token_embd)[ids] * info.embedding_scale  # (T, hidden)
    used = [[None] * info.num_layers for _ in range(T)]
    rd = info.rope_dims or info.head_dim
    ang = rope_angles(np.arange(T), rd, info.rope_theta, info.rope_scaling, info.rope_factor, info.rope_orig_ctx)
    mag = yarn_mscale(info.rope_factor) if info.rope_scaling == "yarn" else 1.0
    for l, lw in enumerate(weights.layers):
        mask = _mask(T, info.sliding_window if info.is_swa(l) else 0)
        h = _rms(x, f64(lw.attn_norm), eps)
        att = _mla(info, lw, h, ang, mask) if info.spec.attn == "mla" else _gqa(info, lw, h, ang, mag, mask)
        x = x + info.residual_scale * att
        h = _rms(x, f64(lw.ffn_norm), eps)
        if lw.router is None:
            x = x + info.residual_scale * _swiglu(lw.dense_ffn, h)
            continue
        routes_l = [None if routes is None else routes[t][l] for t in range(T)]
        y, u = _moe(info, lw, weights.experts[l], h, routes_l)
        for t in range(T):
            used[t][l] = u[t]
        x = x + info.residual_scale * y
    x = _rms(x, f64(weights.output_norm), eps)
    return (x @ f64(weights.output).T) / info.logit_scale, used
