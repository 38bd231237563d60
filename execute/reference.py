"""A float64 numpy reference forward pass of qwen3moe, written separately from ``execute.model``.

Simple on purpose: every weight (routed experts too) is dequantized with ``gguf_io.dequantize`` and
cast to float64; a sequence is processed all at once (causal attention over the whole sequence, no
KV cache), where the executor runs one token at a time against its cache. Only for tiny models.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .gguf_io import ModelWeights, dequantize

__all__ = ["reference_forward"]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope_neox(x: np.ndarray, theta: float) -> np.ndarray:
    """x (T, heads, d): rotate pairs (i, i + d/2) of position t by t * theta^(-2i/d)."""
    t, d = x.shape[0], x.shape[-1]
    ang = np.arange(t)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]  # (T, d/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _experts64(t) -> np.ndarray:
    """(experts, rows, cols) float64."""
    return dequantize(t.data, t.qtype).reshape(t.num_experts, t.rows, t.cols).astype(np.float64)


def reference_forward(weights: ModelWeights, token_ids: Sequence[int], routes=None):
    """Logits ``(T, vocab)`` float64 of one sequence, and the routing used ``[t][layer] = (ids, w)``.

    ``routes[t][l]``, when given and not None, is a ``model.Route`` forcing token t's experts at
    block l (its weights, or the router's probabilities of those ids renormalised)."""
    info = weights.info
    f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    eps, nh, nkv, hd = info.rms_eps, info.num_heads, info.num_kv_heads, info.head_dim
    ids = np.asarray(token_ids)
    x = f64(weights.token_embd)[ids]  # (T, hidden)
    T = len(ids)
    used = [[None] * info.num_layers for _ in range(T)]
    causal = np.triu(np.full((T, T), -np.inf), k=1)
    for l, lw in enumerate(weights.layers):
        h = _rms(x, f64(lw.attn_norm), eps)
        q = (h @ f64(lw.wq).T).reshape(T, nh, hd)
        k = (h @ f64(lw.wk).T).reshape(T, nkv, hd)
        v = (h @ f64(lw.wv).T).reshape(T, nkv, hd)
        if lw.q_norm is not None:
            q, k = _rms(q, f64(lw.q_norm), eps), _rms(k, f64(lw.k_norm), eps)
        q, k = _rope_neox(q, info.rope_theta), _rope_neox(k, info.rope_theta)
        out = np.empty((T, nh, hd))
        group = nh // nkv
        for head in range(nh):
            kh = head // group
            s = q[:, head] @ k[:, kh].T / np.sqrt(hd) + causal  # (T, T)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, kh]
        x = x + out.reshape(T, nh * hd) @ f64(lw.wo).T
        h = _rms(x, f64(lw.ffn_norm), eps)
        logits = h @ f64(lw.router).T  # (T, experts)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        ex = weights.experts[l]
        gate, up, down = _experts64(ex.gate), _experts64(ex.up), _experts64(ex.down)
        y = np.zeros_like(x)
        for t in range(T):
            forced = None if routes is None else routes[t][l]
            if forced is None:
                sel = np.argsort(-probs[t], kind="stable")[: info.top_k]
                w = probs[t][sel]
            else:
                sel = np.asarray(forced.experts)
                w = probs[t][sel] if forced.weights is None else np.asarray(forced.weights, dtype=np.float64)
            if info.norm_topk and (forced is None or forced.weights is None):
                w = w / w.sum()
            used[t][l] = (tuple(int(e) for e in sel), tuple(float(a) for a in w))
            for e, we in zip(sel, w):
                g, u = gate[e] @ h[t], up[e] @ h[t]
                y[t] += we * (down[e] @ (g / (1.0 + np.exp(-g)) * u))
        x = x + y
    x = _rms(x, f64(weights.output_norm), eps)
    return x @ f64(weights.output).T, used
