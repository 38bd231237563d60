"""The MoE forward pass of every supported architecture, written once against the array API
(``xp`` = numpy or cupy).

One step runs a chunk of T tokens (T = 1 in plain decode; a prefill chunk or a speculative
verification batch otherwise): embeddings, then per block RMSNorm -> attention (GQA with optional
biases, q/k norms, sinks and a sliding window; or deepseek2's MLA; causal inside the chunk) ->
residual -> RMSNorm -> router -> routed experts (+ shared expert) -> residual, then the output norm
and head. A dense block (deepseek2's leading blocks) runs its SwiGLU FFN instead of the router.
What differs between architectures is read from ``info.spec`` (``execute.archs``) and the file's
metadata. One token is computed with matrix-vector products (the decode path's numerics); a chunk
with matrix products, which agree with token-by-token to float32 rounding.

The experts are not computed here. :meth:`MoeModel.chunk_steps` is a generator that yields one
scheduler :class:`~scheduler.core.Step` per MoE block (the chunk's distinct experts with token
counts, from the router's top-k or a trace's ids) and, before resuming, expects the combined expert
output ``(T, hidden)`` of that block through :meth:`MoeModel.deliver`.
A :class:`scheduler.core.Token` whose ``steps`` is this generator is driven by ``scheduler.drive``:
the policy plans each step as it is routed, the executor (``execute.run``) runs the layer as
decided and delivers the output, and the generator continues with the next block. So routing is
computed lazily, and decisions are exactly the scheduler's.

Router: on the host in float64 from float32 logits, as ``execute.archs`` describes (ties: lower id
first). With a route override (trace replay) the trace's ids replace the top-k; the trace's weights
are used when it has them, else the router's own weights of those ids, computed the same way.

RoPE of type ``norm`` (pairs (2i, 2i+1)) is run as ``neox`` (pairs (i, i + d/2)) on q and k rows
permuted the same way inside each head at load time: attention scores are dot products of q and k,
so the shared permutation leaves them unchanged (the reference rotates the pairs directly).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from scheduler import Step

from .archs import rope_angles, yarn_mscale
from .experts import ExecutorError
from .gguf_io import ModelWeights

__all__ = ["MoeModel", "Qwen3Moe", "Route", "TokenInput", "ChunkInput", "RunResult", "merge_step", "trace_tokens", "NumpyExperts", "EngineExperts", "run",
           "check_trace", "fold_trace", "trace_inputs", "array_module", "cuda_graphs_env", "softmax_topk",
           "route_weights", "expert_ffn", "RouterPredictor"]


def cuda_graphs_env() -> bool:
    """The ``MOELAB_CUDA_GRAPHS`` environment variable: ``1`` (the default) lets the fused one-token
    path replay CUDA graphs, ``0`` keeps its plain launches."""
    v = os.environ.get("MOELAB_CUDA_GRAPHS", "1").strip()
    if v not in ("0", "1"):
        raise ExecutorError(f"environment variable MOELAB_CUDA_GRAPHS: {v!r}, expected 0 or 1")
    return v == "1"


def array_module(use_gpu: bool):
    """numpy, or cupy when ``use_gpu`` (imported only then)."""
    if not use_gpu:
        return np
    try:
        import cupy
    except ImportError as exc:
        raise ExecutorError(f"use_gpu needs cupy ({exc}); install moelab[gpu] or run with --policy cpu") from None
    return cupy


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def softmax_topk(probs: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` ids of a probability vector (descending, ties: lower id first) and their weights."""
    ids = np.argsort(-probs, kind="stable")[:k]
    w = probs[ids]
    return ids, (w / w.sum() if norm else w)


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _group_mask(scores: np.ndarray, groups: int, used: int) -> np.ndarray:
    """``scores`` with the experts outside the ``used`` best groups set to -inf; a group's score
    is the sum of its two best expert scores (llama.cpp / DeepSeek V3)."""
    g = scores.reshape(groups, -1)
    best = -np.sort(-g, axis=1)[:, : min(2, g.shape[1])].sum(axis=1)  # (groups,)
    keep = np.argsort(-best, kind="stable")[:used]
    out = np.full_like(g, -np.inf)
    out[keep] = g[keep]
    return out.reshape(-1)


def route_weights(info, logits: np.ndarray, exp_probs_b=None, forced: "Route | None" = None):
    """Expert ids (rank order) and weights of one token at one block from its router logits
    (float64, bias already added), by ``info.gating`` (see ``execute.archs``)."""
    if info.gating == "softmax":
        probs = _softmax(logits)
    elif info.gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:  # softmax_topk: select on the logits, softmax over the selected ones
        probs = logits
    if forced is not None:
        ids = np.asarray(forced.experts, dtype=np.int64)
        if forced.weights is not None:
            return ids, np.asarray(forced.weights, dtype=np.float64)
    else:
        sel = probs if exp_probs_b is None else probs + exp_probs_b
        if info.expert_groups > 1:
            sel = _group_mask(sel, info.expert_groups, info.expert_groups_used)
        ids = np.argsort(-sel, kind="stable")[: info.top_k]
    w = probs[ids]
    if info.gating == "softmax_topk":
        w = _softmax(w)
    if info.norm_topk:
        w = w / max(w.sum(), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids, w


def expert_ffn(xp, activation: str, g, u):
    """The expert nonlinearity on gate and up projections (biases already added)."""
    if activation == "swiglu_oai":
        g = xp.minimum(g, 7.0)
        u = xp.clip(u, -7.0, 7.0)
        return g / (1.0 + xp.exp(-1.702 * g)) * (u + 1.0)
    return g / (1.0 + xp.exp(-g)) * u


@dataclass(frozen=True, slots=True)
class Route:
    """A forced routing for one block: expert ids in rank order, and weights when known."""

    experts: tuple[int, ...]
    weights: tuple[float, ...] | None = None


def _rope_perm(n_heads: int, hd: int, lo: int, rd: int) -> np.ndarray:
    """Row order that turns pairs (2i, 2i+1) of dims lo..lo+rd of each head into (i, i + rd/2)."""
    head = np.arange(hd)
    head[lo:lo + rd] = lo + np.concatenate([np.arange(0, rd, 2), np.arange(1, rd, 2)])
    return (np.arange(n_heads)[:, None] * hd + head[None, :]).reshape(-1)


class MoeModel:
    """Dense path and KV cache of a MoE model on ``xp``; experts come back through ``deliver``.

    State: the KV cache of the current sequence (``reset`` starts a new one) and ``pos``, the
    number of tokens in it. After a token's generator is exhausted, ``logits`` holds its
    ``(vocab,)`` output on ``xp``.

    ``cuda_graphs``: whether the fused one-token path replays each block as a CUDA graph (None:
    :func:`cuda_graphs_env`); results are bit-identical either way. A failed capture prints one
    warning line and leaves the plain launches (:attr:`graphed` says which ran).
    """

    def __init__(self, weights: ModelWeights, use_gpu: bool = False, max_tokens: int = 256,
                 cuda_graphs: bool | None = None):
        info = weights.info
        self.cuda_graphs = bool(use_gpu) and (cuda_graphs_env() if cuda_graphs is None else bool(cuda_graphs))
        self.spec = spec = info.spec
        self.xp = xp = array_module(use_gpu)
        self.info = info
        self.weights = weights
        self.mla = spec.attn == "mla"
        self.rd = info.rope_dims or info.head_dim
        if not self.mla and self.rd != info.head_dim:
            raise ExecutorError(f"{info.path}: rope.dimension_count {self.rd} != head_dim {info.head_dim} "
                                "(partial rotary embeddings are not supported)")
        self.token_embd = weights.token_embd  # stays on the host: one row per token is copied
        self._dev = lambda a: None if a is None else xp.asarray(a, dtype=xp.float32)  # noqa: E731
        self.gd = None
        if use_gpu:
            from .gpu_dense import GpuDense

            self.gd = GpuDense(info.hidden, info.num_heads, max(info.num_kv_heads, 1), info.head_dim,
                               max(info.num_experts), min(info.top_k, 32))
        self.layers = [self._dense_layer(i, l) for i, l in enumerate(weights.layers)]
        self.output_norm = self._dev(weights.output_norm)
        self.output = self._matrix([(None, "output", weights.output, None)])
        factor = info.rope_factor if info.rope_scaling == "yarn" else 1.0
        self.kq_scale = info.attn_scale or 1.0 / np.sqrt(info.head_dim)
        if self.mla:  # llama.cpp: rope magnitude 1, kq scaled by mscale^2 (DeepSeek's YaRN)
            self.rope_mag = 1.0
            self.kq_scale = yarn_mscale(factor, info.yarn_log_mul or 1.0) ** 2 / np.sqrt(info.head_dim)
        else:
            self.rope_mag = yarn_mscale(factor)
        self._alloc(max(int(max_tokens), 1))
        self.fast = self._fast_ok()
        self.pos = 0
        self.logits = self.chunk_logits = None
        self._out = None
        self.route_log: list | None = None  # set to a list to collect (pos, [(layer, ids, weights)]) per token
        self.router_predictor: RouterPredictor | None = None  # set to one to measure it (off: no work)

    # weights -----------------------------------------------------------------------------------
    def _matrix(self, parts):
        """A dense matrix for :meth:`_proj` from ``parts`` ``(layer, key, float32 values, row order or
        None)`` stacked by rows: on a GPU in its stored type (``execute.gpu_dense``) where the
        kernels take it, else float32 on ``xp``; None when ``values`` is None."""
        if parts[0][2] is None:
            return None
        if self.gd is not None:
            from .gguf_io import stored_matrix
            from .gpu_dense import stack_matrices

            m = stack_matrices([(stored_matrix(self.weights, l, k), v, p) for l, k, v, p in parts])
            if m is not None:
                return m
        vals = [v if p is None else v[p] for _, _, v, p in parts]
        return self._dev(vals[0] if len(vals) == 1 else np.concatenate(vals))

    def _fast_ok(self) -> bool:
        """Whether one token runs on the fused kernels (``execute.gpu_dense``): a GPU, GQA with
        head_dim even and <= 256, every block MoE with softmax or softmax_topk routing (no groups,
        no selection bias, top-k <= 32), and every projection and the head in a stored type."""
        info = self.info
        if (self.gd is None or self.mla or info.top_k > 32 or info.gating not in ("softmax", "softmax_topk")
                or info.expert_groups > 1 or info.head_dim % 2 or info.head_dim > 256
                or info.num_heads % max(info.num_kv_heads, 1)):
            return False
        if any(w["router"] is None or w["exp_probs_b"] is not None for w in self.layers):
            return False
        mats = [self.output] + [w[k] for w in self.layers for k in ("wqkv", "wo", "router")]
        return not any(hasattr(m, "__cuda_array_interface__") for m in mats)

    def _ffn_weights(self, l: int, name: str, f: dict | None) -> dict | None:
        if f is None:
            return None
        out = {k: self._matrix([(l, f"{name}.{k}", f[k], None)]) for k in ("gate", "up", "down")}
        out["gate_inp"] = self._dev(f.get("gate_inp"))
        return out

    def _dense_layer(self, l: int, lw) -> dict:
        """Device weights of one block. GQA: q, k, v stacked into one matrix (biases likewise);
        per-head q/k norms tiled into one ``(heads + kv_heads, head_dim)`` weight."""
        info, dev, norm_rope = self.info, self._dev, self.spec.rope == "norm"
        w = {k: dev(getattr(lw, k)) for k in ("attn_norm", "ffn_norm", "sinks")}
        w["wo"] = self._matrix([(l, "wo", lw.wo, None)])
        w["router"] = self._matrix([(l, "router", lw.router, None)])
        w["bo"] = dev((lw.attn_bias or {}).get("o"))
        w["router_bias"] = None if lw.router_bias is None else np.asarray(lw.router_bias, np.float64)
        w["router_bias_dev"] = dev(lw.router_bias)
        w["exp_probs_b"] = None if lw.exp_probs_b is None else np.asarray(lw.exp_probs_b, np.float64)
        w["shared"] = self._ffn_weights(l, "shared", lw.shared)
        w["dense_ffn"] = self._ffn_weights(l, "dense_ffn", lw.dense_ffn)
        if self.mla:
            w["mla"] = self._mla_weights(lw.mla, norm_rope)
            return w
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        pq = _rope_perm(nh, hd, 0, hd) if norm_rope else np.arange(nh * hd)
        pk = _rope_perm(nkv, hd, 0, hd) if norm_rope else np.arange(nkv * hd)
        w["wqkv"] = self._matrix([(l, "wq", lw.wq, pq), (l, "wk", lw.wk, pk), (l, "wv", lw.wv, None)])  # (q + 2 kv, hidden)
        b = lw.attn_bias or {}
        if any(k in b for k in ("q", "k", "v")):
            z = lambda k, n: np.asarray(b[k]) if k in b else np.zeros(n, np.float32)  # noqa: E731
            w["bqkv"] = dev(np.concatenate([z("q", nh * hd)[pq], z("k", nkv * hd)[pk], z("v", nkv * hd)]))
        else:
            w["bqkv"] = None
        w["q_norm_full"] = w["k_norm_full"] = w["qk_norm"] = None
        if self.spec.qk_norm == "full":
            w["q_norm_full"], w["k_norm_full"] = dev(lw.q_norm[pq]), dev(lw.k_norm[pk])
        elif self.spec.qk_norm == "head":
            ph = _rope_perm(1, hd, 0, hd) if norm_rope else np.arange(hd)
            w["qk_norm"] = dev(np.concatenate([np.tile(lw.q_norm[ph], (nh, 1)), np.tile(lw.k_norm[ph], (nkv, 1))]))
        if self.gd is not None and self.spec.qk_norm != "none":  # the fused kernel's (heads + kv) * head_dim weight
            w["qk_weight"] = (w["qk_norm"].reshape(-1) if w["qk_norm"] is not None
                              else self.xp.concatenate([w["q_norm_full"], w["k_norm_full"]]))
        return w

    def _mla_weights(self, m: dict, norm_rope: bool) -> dict:
        info, dev = self.info, self._dev
        nh, hk, rd, kvr = info.num_heads, info.head_dim, self.rd, info.kv_lora_rank
        pq = _rope_perm(nh, hk, hk - rd, rd) if norm_rope else np.arange(nh * hk)
        pkv = _rope_perm(1, kvr + rd, kvr, rd) if norm_rope else np.arange(kvr + rd)
        out = {"kv_a": dev(m["kv_a"][pkv]), "kv_a_norm": dev(m["kv_a_norm"]), "kv_b": dev(m["kv_b"])}
        if "q" in m:
            out["q"] = dev(m["q"][pq])
        else:
            out.update(q_a=dev(m["q_a"]), q_a_norm=dev(m["q_a_norm"]), q_b=dev(m["q_b"][pq]))
        return out

    # state -------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> None:
        """KV cache for ``n`` positions per block, ``(kv_heads, n, head_dim)`` (MLA: per head, keys
        ``(heads, n, nope + rope)``, values ``(heads, n, v_head_dim)``), and RoPE tables."""
        xp, info = self.xp, self.info
        if self.mla:
            kshape, vshape = (info.num_heads, n, info.head_dim), (info.num_heads, n, info.v_head_dim)
        else:
            kshape = vshape = (info.num_kv_heads, n, info.head_dim)
        self.k_cache = [xp.zeros(kshape, xp.float32) for _ in range(info.num_layers)]
        self.v_cache = [xp.zeros(vshape, xp.float32) for _ in range(info.num_layers)]
        ang = rope_angles(np.arange(n), self.rd, info.rope_theta, info.rope_scaling, info.rope_factor,
                          info.rope_orig_ctx)  # (n, rd/2)
        m = self.rope_mag
        self.rope_cos = xp.asarray(m * np.concatenate([np.cos(ang), np.cos(ang)], axis=1), dtype=xp.float32)  # (n, rd)
        self.rope_sin = xp.asarray(m * np.concatenate([-np.sin(ang), np.sin(ang)], axis=1), dtype=xp.float32)
        self._plans = None  # the fused path's prepared launches name the caches and tables

    def _grow(self) -> None:
        old_k, old_v, n = self.k_cache, self.v_cache, self.k_cache[0].shape[1]
        self._alloc(2 * n)
        for l in range(self.info.num_layers):
            self.k_cache[l][:, :n] = old_k[l]
            self.v_cache[l][:, :n] = old_v[l]

    def reset(self) -> None:
        """Start a new sequence (the KV cache is reused, its contents ignored)."""
        self.pos = 0
        self.logits = self.chunk_logits = None

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` positions of the sequence (rejected drafts); their KV entries are
        overwritten by the next tokens run."""
        if not 0 <= n <= self.pos:
            raise ExecutorError(f"rollback of {n} positions, the sequence has {self.pos}")
        self.pos -= n

    def deliver(self, y) -> None:
        """The combined expert output ``(T, hidden)`` of the block the generator last yielded."""
        self._out = y

    # pieces ------------------------------------------------------------------------------------
    def _proj(self, x, m):
        """``x (T, in)`` times matrix ``m`` (``_matrix``) transposed -> ``(T, out)``."""
        if self.gd is not None and not hasattr(m, "__cuda_array_interface__"):
            return self.gd.matmul(x, m)
        return self._mv(x, m)

    @staticmethod
    def _mv(x, w):
        """``x (T, in)`` times ``w (out, in)`` transposed -> ``(T, out)``; one token as a matrix-vector
        product (the decode path's numerics)."""
        return (w @ x[0])[None] if x.shape[0] == 1 else x @ w.T

    def _rms(self, x, w):
        xp = self.xp
        return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + self.info.rms_eps)) * w

    def _rope(self, x, pos: int):
        """NeoX RoPE of ``x (T, heads, d)`` at positions ``pos .. pos + T - 1``: dims i and i + d/2
        form a pair."""
        t, h = x.shape[0], x.shape[-1] // 2
        cos, sin = self.rope_cos[pos:pos + t, None, :], self.rope_sin[pos:pos + t, None, :]  # (T, 1, d)
        swapped = self.xp.concatenate([x[..., h:], x[..., :h]], axis=-1)  # (x2, x1)
        return x * cos + swapped * sin  # (x1 c - x2 s, x2 c + x1 s)

    def _window(self, l: int, t: int) -> tuple[int, object]:
        """First key position of block ``l`` for a chunk of ``t`` tokens at ``pos``, and the
        ``(t, keys)`` mask of the keys each query may see (causal, sliding window); None for one
        token, which sees every key from the first."""
        info, pos = self.info, self.pos
        swa = info.is_swa(l)
        lo = max(0, pos + 1 - info.sliding_window) if swa else 0
        if t == 1:
            return lo, None
        qpos = pos + np.arange(t)[:, None]
        kpos = np.arange(lo, pos + t)[None, :]
        mask = kpos <= qpos
        if swa:
            mask &= kpos > qpos - info.sliding_window
        return lo, self.xp.asarray(mask)

    def _softmax_attend(self, l: int, q, keys, vals, mask):
        """q (kv, T, group, d) against keys (kv, t, d), ``mask`` (T, t) or None: softmax (with
        sinks) -> (kv, T, group, dv)."""
        xp, w = self.xp, self.layers[l]
        nkv, t, g, d = q.shape
        s = (q.reshape(nkv, t * g, d) @ keys.transpose(0, 2, 1)) * np.float32(self.kq_scale)  # (kv, T group, t)
        if mask is not None:
            s = xp.where(xp.repeat(mask, g, axis=0)[None], s, np.float32(-np.inf))
        m = s.max(axis=-1, keepdims=True)
        if w["sinks"] is not None:
            sink = xp.broadcast_to(w["sinks"].reshape(nkv, 1, g), (nkv, t, g)).reshape(nkv, t * g, 1)
            m = xp.maximum(m, sink)
            e = xp.exp(s - m)
            o = (e @ vals) / (e.sum(axis=-1, keepdims=True) + xp.exp(sink - m))
        else:
            e = xp.exp(s - m)
            o = (e @ vals) / e.sum(axis=-1, keepdims=True)
        return o.reshape(nkv, t, g, vals.shape[-1])

    def _attention(self, l: int, x):
        """GQA over the KV cache for ``x (T, hidden)`` at positions ``pos ..``; -> (T, hidden)."""
        info, w, pos, xp = self.info, self.layers[l], self.pos, self.xp
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        t = x.shape[0]
        qkv = self._proj(x, w["wqkv"])  # (T, q + 2 kv)
        if w["bqkv"] is not None:
            qkv = qkv + w["bqkv"]
        if w["q_norm_full"] is not None:
            qk = xp.concatenate([self._rms(qkv[:, : nh * hd], w["q_norm_full"]),
                                 self._rms(qkv[:, nh * hd:(nh + nkv) * hd], w["k_norm_full"])], axis=-1)
            qk = qk.reshape(t, nh + nkv, hd)
        else:
            qk = qkv[:, : (nh + nkv) * hd].reshape(t, nh + nkv, hd)
        if w["qk_norm"] is not None:
            qk = self._rms(qk, w["qk_norm"])
        qk = self._rope(qk, pos)  # (T, heads + kv, hd)
        self.k_cache[l][:, pos:pos + t] = qk[:, nh:].transpose(1, 0, 2)
        self.v_cache[l][:, pos:pos + t] = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd).transpose(1, 0, 2)
        lo, mask = self._window(l, t)
        q = qk[:, :nh].reshape(t, nkv, nh // nkv, hd).transpose(1, 0, 2, 3)  # (kv, T, group, hd)
        o = self._softmax_attend(l, q, self.k_cache[l][:, lo: pos + t], self.v_cache[l][:, lo: pos + t], mask)
        y = self._proj(o.transpose(1, 0, 2, 3).reshape(t, nh * hd), w["wo"])
        return y if w["bo"] is None else y + w["bo"]

    def _attention_mla(self, l: int, x):
        """deepseek2 attention, keys and values decompressed per head (no absorption); x (T, hidden)."""
        xp, info, m, pos = self.xp, self.info, self.layers[l]["mla"], self.pos
        nh, hk, rd, kvr, vd = info.num_heads, info.head_dim, self.rd, info.kv_lora_rank, info.v_head_dim
        nope, t = hk - rd, x.shape[0]
        q = self._mv(x, m["q"]) if "q" in m else self._mv(self._rms(self._mv(x, m["q_a"]), m["q_a_norm"]), m["q_b"])
        q = q.reshape(t, nh, hk)
        kva = self._mv(x, m["kv_a"])  # (T, kv_lora + rd)
        kv = self._mv(self._rms(kva[:, :kvr], m["kv_a_norm"]), m["kv_b"]).reshape(t, nh, nope + vd)
        k_pe = self._rope(kva[:, kvr:].reshape(t, 1, rd), pos)  # (T, 1, rd)
        q = xp.concatenate([q[..., :nope], self._rope(q[..., nope:], pos)], axis=-1)  # (T, nh, hk)
        keys = xp.concatenate([kv[..., :nope], xp.broadcast_to(k_pe, (t, nh, rd))], axis=-1)  # (T, nh, hk)
        self.k_cache[l][:, pos:pos + t] = keys.transpose(1, 0, 2)
        self.v_cache[l][:, pos:pos + t] = kv[..., nope:].transpose(1, 0, 2)
        lo, mask = self._window(l, t)
        o = self._softmax_attend(l, q.transpose(1, 0, 2)[:, :, None, :], self.k_cache[l][:, lo: pos + t],
                                 self.v_cache[l][:, lo: pos + t], mask)  # (nh, T, 1, vd)
        return self._proj(o[:, :, 0].transpose(1, 0, 2).reshape(t, nh * vd), self.layers[l]["wo"])

    def _route(self, l: int, hn, forced) -> tuple[np.ndarray, np.ndarray]:
        """Ids ``(T, k)`` int64 and weights ``(T, k)`` float64 of each token's experts (rank order).
        ``forced[t]`` (a Route or None) replaces token t's routing; a forced route with fewer than
        k experts is padded with its first expert at weight 0 (no contribution)."""
        w = self.layers[l]
        logits = _host(self._proj(hn, w["router"])).astype(np.float64)  # (T, experts): the host needs the ids
        if w["router_bias"] is not None:
            logits = logits + w["router_bias"]
        rows = [route_weights(self.info, logits[i], w["exp_probs_b"], None if forced is None else forced[i])
                for i in range(len(logits))]
        k = max(len(ids) for ids, _ in rows)
        ids = np.empty((len(rows), k), np.int64)
        wts = np.zeros((len(rows), k), np.float64)
        for i, (r_ids, r_w) in enumerate(rows):
            ids[i, : len(r_ids)], wts[i, : len(r_ids)] = r_ids, r_w
            ids[i, len(r_ids):] = r_ids[0]
        self._route_len = [len(r_ids) for r_ids, _ in rows]
        return ids, wts

    def _ffn(self, f: dict, hn):
        g = self._proj(hn, f["gate"])
        return self._proj(g / (1.0 + self.xp.exp(-g)) * self._proj(hn, f["up"]), f["down"])

    def _shared(self, l: int, hn):
        sh = self.layers[l]["shared"]
        if sh is None:
            return 0.0
        y = self._ffn(sh, hn)
        if sh.get("gate_inp") is not None:
            y = y / (1.0 + self.xp.exp(-(hn @ sh["gate_inp"].reshape(-1, 1))))  # (T, 1)
        return y

    # the tokens --------------------------------------------------------------------------------
    def token_steps(self, token_id: int, routes: Sequence[Route | None] | None = None) -> Iterator[Step]:
        """One token: :meth:`chunk_steps` of ``[token_id]``; ``routes[l]`` forces block l."""
        return self.chunk_steps((token_id,), None if routes is None else (routes,))

    def chunk_steps(self, token_ids: Sequence[int], routes: Sequence | None = None, all_logits: bool = False,
                    rollback: int = 0) -> Iterator[Step]:
        """Run ``T = len(token_ids)`` tokens at positions ``pos .. pos + T - 1`` as one batch (after
        forgetting the last ``rollback`` positions); yield each MoE block's Step (see the module
        docstring). Meanwhile ``last_input`` ``(T, hidden)``, ``last_ids`` ``(T, k)`` and
        ``last_weights`` ``(T, k)`` float32 hold the block's normed input and each token's routing.

        Attention is causal inside the chunk. The Step has the chunk's distinct experts in order
        of first appearance (token by token, rank order within a token), ``counts`` = tokens per
        expert and summed weights (one token: ``counts`` None, its own weights). ``routes[t][l]``
        forces token t's routing at block l (None: the router's own). After the last block,
        ``logits`` is the last token's ``(vocab,)`` output and ``chunk_logits`` the ``(T, vocab)``
        outputs when ``all_logits`` (else ``(1, vocab)``, the last)."""
        xp, info = self.xp, self.info
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ExecutorError("a chunk needs at least one token")
        bad = [t for t in ids if not 0 <= t < info.vocab]
        if bad:
            raise ExecutorError(f"token id {bad[0]} out of range 0..{info.vocab - 1}")
        if rollback:
            self.rollback(rollback)
        t = len(ids)
        while self.pos + t > self.k_cache[0].shape[1]:
            self._grow()
        if self.fast and t == 1:
            yield from self._token_fast(ids[0], None if routes is None else routes[0])
            return
        rs = np.float32(info.residual_scale)
        x = xp.asarray(self.token_embd[ids], dtype=xp.float32) * np.float32(info.embedding_scale)  # (T, hidden)
        rows = [[] for _ in ids] if self.route_log is not None else None
        for l in range(info.num_layers):
            w = self.layers[l]
            h = self._rms(x, w["attn_norm"])
            x = x + rs * (self._attention_mla(l, h) if self.mla else self._attention(l, h))
            hn = self._rms(x, w["ffn_norm"])
            if w["router"] is None:
                x = x + rs * self._ffn(w["dense_ffn"], hn)
                continue
            forced = None if routes is None else [None if r is None else r[l] for r in routes]
            tids, twts = self._route(l, hn, forced)
            self.last_input, self.last_ids, self.last_weights = hn, tids, twts.astype(np.float32)
            if self.router_predictor is not None:
                self._predict_router(l, x, tids)
            self._out = None
            step = merge_step(l, tids, twts, self._route_len)
            if rows is not None:
                for i, n in enumerate(self._route_len):
                    rows[i].append((l, tids[i, :n].tolist(), twts[i, :n].tolist()))
            yield step
            if self._out is None:
                raise ExecutorError(f"block {l}: no expert output was delivered for the step")
            x = x + rs * (xp.asarray(self._out) + self._shared(l, hn))
        xs = x if all_logits else x[-1:]
        self.chunk_logits = self._proj(self._rms(xs, self.output_norm), self.output) / np.float32(info.logit_scale)
        self.logits = self.chunk_logits[-1]  # (vocab,)
        if rows is not None:
            self.route_log.extend((self.pos + i, r) for i, r in enumerate(rows))
        self.pos += t

    def _predict_router(self, l: int, x, ids: np.ndarray) -> None:
        """The :class:`RouterPredictor` measurement at MoE block ``l``: its routing ``ids`` ``(T, k)``
        against the prediction made at block l - 1, then block l + 1's prediction (when it is a MoE
        block) from ``x`` ``(T, hidden)``, block l's residual stream after attention (before its MoE
        norm): block l + 1's ffn norm, router and router bias, as its own routing computes them."""
        rp = self.router_predictor
        rp.observe(l, ids, self._route_len)
        if l + 1 < self.info.num_layers and self.layers[l + 1]["router"] is not None:
            w = self.layers[l + 1]
            logits = _host(self._proj(self._rms(x, w["ffn_norm"]), w["router"])).astype(np.float64)  # (T, experts)
            if w["router_bias"] is not None:
                logits = logits + w["router_bias"]
            rp.predict(l + 1, logits, w["exp_probs_b"])

    @property
    def graphed(self) -> bool:
        """Whether one-token decode now replays CUDA graphs (prepared for the current cache size)."""
        return self._plans is not None and all(b.graph is not None for b in self._plans[0])

    def _decode_plans(self) -> tuple[list, object, list]:
        """The prepared launches of every block and of the head for one token (``gpu_dense``): block
        0 reads the embedding; block l > 0 adds the expert output of block l - 1 to the residual
        of block l - 1 into one of two alternating buffers. With ``cuda_graphs`` each block is
        captured as a graph (again after the cache grows); a failed capture warns once and turns
        graphs off for this model."""
        info, gd, spec = self.info, self.gd, self.spec
        rs, eps = float(info.residual_scale), float(info.rms_eps)
        gating = 0 if info.gating == "softmax" else 1
        mode = {"none": 0, "head": 1, "full": 2}[spec.qk_norm]
        blocks, x = [], gd.emb
        for l, w in enumerate(self.layers):
            x_out = None if l == 0 else gd.x[l % 2]
            blocks.append(gd.decode_block(
                x, x_out, gd.hn[l % 2], w["wqkv"], w["attn_norm"], w["bqkv"], w.get("qk_weight"), mode, eps,
                self.rope_cos, self.rope_sin, self.k_cache[l], self.v_cache[l], self.kq_scale, w["sinks"], w["wo"],
                w["bo"], rs, w["router"], w["ffn_norm"], w["router_bias_dev"], gating, info.norm_topk,
                float(info.expert_weights_scale or 1.0), info.sliding_window if info.is_swa(l) else 0))
            x = blocks[-1].cur
        head = gd.decode_head(x, self.output, self.output_norm, eps, rs, float(info.logit_scale))
        if self.cuda_graphs:
            try:
                gd.capture(blocks)
            except Exception as exc:  # noqa: BLE001 - any capture failure leaves the plain launches
                self.cuda_graphs = False
                msg = " ".join(f"{type(exc).__name__}: {exc}".split())
                print(f"moelab: warning: CUDA graph capture failed ({msg}); the fused decode path runs without "
                      "graphs", file=sys.stderr)
        return blocks, head, [h[None] for h in gd.hn]

    def _token_fast(self, token_id: int, routes) -> Iterator[Step]:
        """``chunk_steps`` of one token on the fused kernels (``execute.gpu_dense``): per block
        five launches (RMSNorm + QKV, q/k norm + RoPE + KV append, attention and its merge, output
        projection + residual) and the router's GEMV + top-k, whose ids and weights are the block's
        one host wait; or the block's CUDA graph of all of them (:attr:`graphed`). The expert output
        is added to the residual by the next block's first launch (the head's, after the last
        block). A forced route reads the router's logits after that wait."""
        xp, info, gd, pos = self.xp, self.info, self.gd, self.pos
        if self._plans is None:
            self._plans = self._decode_plans()
        blocks, head, hn_rows = self._plans
        s = gd.stream()
        gd.emb.set(np.ascontiguousarray(self.token_embd[token_id] * np.float32(info.embedding_scale), np.float32))
        add = None
        rows = [] if self.route_log is not None else None
        for l, b in enumerate(blocks):
            w = self.layers[l]
            lo = max(0, pos + 1 - info.sliding_window) if info.is_swa(l) else 0
            tids, twts = b.run(s, 0 if add is None else add.data.ptr, pos, lo, pos + 1 - lo)
            hn = hn_rows[l % 2]  # (1, hidden)
            forced = None if routes is None else routes[l]
            if forced is None:
                n = tids.shape[1]
            else:  # the trace's ids; its weights, or the router's own weights of those ids
                r_ids, r_w = route_weights(info, _host(gd.logits).astype(np.float64), None, forced)
                n = len(r_ids)
                tids, twts = np.asarray(r_ids, np.int64)[None], np.asarray(r_w, np.float32)[None]
            self._route_len = [n]
            self.last_input, self.last_ids, self.last_weights = hn, tids, twts
            if self.router_predictor is not None:
                self._predict_router(l, b.cur[None], tids)
            self._out = None
            ids_l, w_l = tids[0].tolist(), twts[0].astype(np.float64).tolist()
            if rows is not None:
                rows.append((l, ids_l, w_l))
            yield Step(l, tuple(ids_l), None, tuple(w_l))  # merge_step of one token
            add = self._out
            if add is None:
                raise ExecutorError(f"block {l}: no expert output was delivered for the step")
            if not (isinstance(add, xp.ndarray) and add.dtype == xp.float32 and add.flags.c_contiguous):
                add = xp.ascontiguousarray(xp.asarray(add, dtype=xp.float32))
            if w["shared"] is not None:
                add = add + self._shared(l, hn)
        self.chunk_logits = xp.empty((1, info.vocab), xp.float32)
        head.vals[6], head.vals[15] = add.data.ptr, self.chunk_logits.data.ptr
        head(s)
        self.logits = self.chunk_logits[-1]
        if rows is not None:
            self.route_log.append((pos, rows))
        self.pos += 1


def merge_step(layer: int, ids: np.ndarray, weights: np.ndarray | None, lengths: Sequence[int] | None = None) -> Step:
    """The Step of a batch at one block from each token's ids and weights ``(T, k)`` (row t's first
    ``lengths[t]`` entries): distinct experts in order of first appearance, ``counts`` = tokens per
    expert, weights summed in token order. One token: ``counts`` None and its own weights."""
    lengths = [ids.shape[1]] * len(ids) if lengths is None else lengths
    w = [None] * len(ids) if weights is None else np.asarray(weights).tolist()
    return _merge(layer, [(r[:n], None if v is None else v[:n]) for r, v, n in zip(np.asarray(ids).tolist(), w, lengths)])


def _merge(layer: int, parts: Sequence[tuple[Sequence[int], Sequence[float] | None]]) -> Step:
    """``merge_step`` on per-token (experts, weights or None) in rank order."""
    if len(parts) == 1:
        e, w = parts[0]
        return Step(layer, tuple(int(x) for x in e), None, None if w is None else tuple(float(v) for v in w))
    acc: dict[int, list] = {}
    known = all(w is not None for _, w in parts)
    for experts, ws in parts:
        for i, e in enumerate(experts):
            a = acc.get(e)
            v = ws[i] if known else 0.0
            if a is None:
                acc[e] = [1, v]
            else:
                a[0] += 1
                a[1] += v
    return Step(layer, tuple(int(e) for e in acc), tuple(a[0] for a in acc.values()),
                tuple(float(a[1]) for a in acc.values()) if known else None)


Qwen3Moe = MoeModel  # the first architecture's name, kept for existing callers


# the next block's router as a predictor ----------------------------------------------------------
class RouterPredictor:
    """How well the next block's router, applied to the current block's hidden state, predicts the
    next block's experts: a measurement, set on :attr:`MoeModel.router_predictor` (None: off).

    At MoE block l followed by MoE block l + 1, each token's prediction is block l + 1's routing
    rule (:func:`route_weights`: gating, selection bias, groups; ties: lower id) on block l + 1's
    router logits (bias added) of block l's residual stream after attention, normed by block
    l + 1's ffn norm weight: what block l + 1 computes, on the state block l's experts have not yet
    added to. When block l + 1 routes, its experts are looked up in the predicted top-k and top-2k
    (at most the block's experts). Counts per phase (``phase``, set by :meth:`phased` for each
    batch ``run`` drives) and predicted block; a forced route (trace replay) is the actual one."""

    def __init__(self, info):
        import dataclasses

        moe = [n for n in info.num_experts if n]
        self.k = info.top_k
        self.num_experts = min(moe) if moe else 0
        self._wide = dataclasses.replace(info, top_k=min(2 * self.k, max(self.num_experts, 1)))
        self.phase = "decode"
        self.pending: dict[int, np.ndarray] = {}  # block -> (T, 2k) predicted ids in rank order
        self.counts: dict[tuple[str, int], list[int]] = {}  # (phase, block) -> [positions, routed, hits@k, hits@2k]

    def phased(self, phase: str, steps):
        """``steps`` (a batch's generator), counted under ``phase`` from its first step on."""
        self.phase = phase
        self.pending.clear()
        yield from steps

    def predict(self, layer: int, logits: np.ndarray, exp_probs_b) -> None:
        """Predict block ``layer``'s experts from router logits ``(T, experts)`` float64."""
        self.pending[layer] = np.stack([route_weights(self._wide, row, exp_probs_b)[0] for row in logits])

    def observe(self, layer: int, ids: np.ndarray, lengths: Sequence[int]) -> None:
        """Block ``layer``'s routing (row t's first ``lengths[t]`` ids) against its prediction, if any."""
        pred = self.pending.pop(layer, None)
        if pred is None:
            return
        c = self.counts.setdefault((self.phase, layer), [0, 0, 0, 0])
        for row, n, p in zip(np.asarray(ids).tolist(), lengths, pred.tolist()):
            got = set(row[:n])
            c[0] += 1
            c[1] += len(got)
            c[2] += len(got.intersection(p[: self.k]))
            c[3] += len(got.intersection(p))

    def summary(self) -> dict:
        """Recall at k and at 2k (share of the routed experts found in the predicted top-k, top-2k;
        ``top_2k`` is 2k capped at the experts) per phase, overall and per predicted block, with the
        recall of a uniform guess (``chance_*``)."""
        E, wide = self.num_experts, self._wide.top_k
        out = {"k": self.k, "top_2k": wide, "chance_k": self.k / E if E else None,
               "chance_2k": wide / E if E else None}

        def figures(c) -> dict:
            return {"positions": c[0], "routed": c[1], "recall_k": c[2] / c[1] if c[1] else None,
                    "recall_2k": c[3] / c[1] if c[1] else None}

        for phase in ("prefill", "decode"):
            layers = sorted(l for p, l in self.counts if p == phase)
            rows = [self.counts[phase, l] for l in layers]
            total = [sum(c[i] for c in rows) for i in range(4)]
            total[0] = max((c[0] for c in rows), default=0)  # positions: each is counted at every block
            out[phase] = {**figures(total), "per_layer": [{"layer": l, **figures(c)} for l, c in zip(layers, rows)]}
        return out


# expert backends without a GPU -------------------------------------------------------------------
def _cpu_only(item) -> None:
    d = item.decision
    if d.hits or d.uploads or d.streams or d.promotions:
        raise ExecutorError(f"layer {d.layer}: the policy put experts on the GPU (hits {len(d.hits)}, uploads "
                            f"{len(d.uploads)}, streams {len(d.streams)}); without a GPU only policy 'cpu' runs")


class NumpyExperts:
    """Reference expert backend: dequantizes each expert (``gguf_io.dequantize``) and runs it in
    float32 numpy, with the architecture's activation and expert biases. CPU-only: a decision that
    puts experts on the GPU is an error."""

    def __init__(self, weights: ModelWeights):
        self.experts = weights.experts
        self.bias = [l.expert_bias or {} for l in weights.layers]
        self.activation = weights.info.spec.activation

    def _expert(self, t, e: int) -> np.ndarray:
        from .gguf_io import dequantize

        return dequantize(t.data[e], t.qtype).reshape(t.rows, t.cols)

    def _pair(self, layer, b: dict, e: int, x: np.ndarray) -> np.ndarray:
        """Expert ``e`` on ``x`` (hidden,) or (n, hidden), with its biases when the model has them."""
        g, u = x @ self._expert(layer.gate, e).T, x @ self._expert(layer.up, e).T
        if b:
            g, u = g + b["gate"][e], u + b["up"][e]
        d = expert_ffn(np, self.activation, g, u) @ self._expert(layer.down, e).T
        return d + b["down"][e] if b else d

    def run_layer(self, item, x, ids: np.ndarray, weights: np.ndarray):
        """``y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` (summed in j order) for the
        step's tokens: x ``(T, hidden)``, ids and weights ``(T, k)``; -> ``(T, hidden)``."""
        _cpu_only(item)
        return self.compute(item.step, x, ids, weights)

    def compute(self, step: Step, x, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """``run_layer``'s result without looking at the decision."""
        l = step.layer
        layer, b = self.experts[l], self.bias[l]
        xh = _host(x).astype(np.float32)
        ids = np.asarray(ids)
        missing = set(np.unique(ids).tolist()) - set(step.experts)
        if missing:
            raise ExecutorError(f"layer {l}: routed experts {sorted(missing)} are not in the step")
        w = np.asarray(weights, np.float32)
        if len(ids) == 1:  # decode: one vector per expert
            y = np.zeros(layer.hidden, np.float32)
            for e, v in zip(ids[0].tolist(), w[0]):
                y += v * self._pair(layer, b, e, xh[0])
            return y[None]
        pairs = np.zeros((*ids.shape, layer.hidden), np.float32)  # (T, k, hidden)
        for e in step.experts:
            rows, cols = np.nonzero(ids == e)
            pairs[rows, cols] = self._pair(layer, b, e, xh[rows])
        y = np.zeros((len(ids), layer.hidden), np.float32)
        for j in range(ids.shape[1]):
            y += w[:, j:j + 1] * pairs[:, j]
        return y

    def start_background(self, moves) -> None:
        if moves:
            raise ExecutorError("background copies need a GPU; without a GPU only policy 'cpu' runs")

    def await_background(self, moves) -> None:
        pass

    def close(self) -> None:
        pass


class EngineExperts:
    """The expert engine (``execute.engine.ExpertEngine``: GPU arena and kernels, Numba CPU pool) as
    a ``run`` backend; a step of T tokens is run as its (expert, token) pairs."""

    def __init__(self, weights: ModelWeights, capacity, threads: int, use_gpu: bool, timeout_s: float = 60.0,
                 pinned: bool = True):
        info = weights.info
        partial = [l.layer for l in weights.experts if l is not None and info.expert_bias and not l.has_bias]
        if partial:
            raise ExecutorError(f"{info.path}: blocks {partial} lack some of the gate/up/down expert biases; the "
                                "expert kernels (CPU and GPU) need all three (the numpy backend likewise)")
        if use_gpu:
            array_module(True)  # a clear error when cupy is missing
        from threadpoolctl import threadpool_limits

        from .engine import ExpertEngine

        self.engine = ExpertEngine(weights.experts, capacity, threads, use_gpu, timeout_s, pinned=pinned)
        self._first = next((l for l in weights.experts if l is not None), None)
        # numpy's BLAS threads spin-wait after each dense product and starve the Numba pool's
        # thread team (a 2-core layer call went from 0.5 ms to 19 ms); one-token products gain
        # nothing from BLAS threads, so they are limited to one while this backend lives (chunks
        # of prefill lose some dense speed on the host by this; on a GPU the dense path is cupy).
        self._blas = threadpool_limits(limits=1, user_api="blas")

    def prepare(self, policy) -> None:
        """Compile the CPU kernels (first use) and upload the experts the policy placed at
        construction (profile pre-population, or all of them for ``gpu``)."""
        if self._first is not None:
            self.engine.pool.warmup(self._first)
        self.engine.load_residents(dict(policy.cache.slot))

    def begin_layer(self, layer: int, x, ids: np.ndarray) -> None:
        """Start the block's resident experts before the policy plans its step (the engine's early
        start: one token, GPU only; the decisions are unchanged)."""
        self.engine.begin_layer(layer, x, ids)

    def run_layer(self, item, x, ids: np.ndarray, weights: np.ndarray):
        """The step's (expert, token) pairs on the engine: x ``(T, hidden)``, ids and weights
        ``(T, k)``; -> ``(T, hidden)`` on x's side."""
        y = self.engine.run_layer(item, x, ids, weights)
        if self.engine.gpu is not None:
            # the next block's router reads back to the host and would wait for this anyway;
            # waiting here charges the layer's GPU expert work to "experts", not to "dense"
            self.engine.gpu.compute.synchronize()
        return y

    def start_background(self, moves) -> None:
        self.engine.start_background(moves)

    def await_background(self, moves) -> None:
        self.engine.await_background(moves)

    def close(self) -> None:
        self.engine.close()
        self._blas.restore_original_limits()


# the driver loop ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenInput:
    """One token to run: its trace identity, the input token id, and optional forced routes."""

    index: int
    seq: int
    pos: int
    phase: str
    token_id: int
    routes: tuple | None = None  # per block: Route or None


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """T tokens run as one batch (one scheduler Token of ``num_tokens`` T) at positions ``pos ..
    pos + T - 1``: a prefill chunk or a speculative verification batch. A ``pos`` before the end
    of what the sequence has run rolls the KV cache back to it first (rejected drafts)."""

    index: int
    seq: int
    pos: int
    phase: str
    token_ids: tuple[int, ...]
    routes: tuple | None = None  # per token: per block Route or None (or None: the router's)
    all_logits: bool = False  # keep every token's logits (verification), else the last one's

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("ChunkInput.token_ids: expected at least one token")
        if self.routes is not None and len(self.routes) != len(self.token_ids):
            raise ValueError(f"ChunkInput.routes: {len(self.routes)} entries, expected one per token "
                             f"({len(self.token_ids)})")


@dataclass
class RunResult:
    """What a run measured. Times are host wall-clock seconds, summed over tokens. ``tokens``
    counts positions run (a batch of T counts T), ``steps`` the batches (scheduler Tokens)."""

    audit: object
    tokens: int
    wall_s: float
    dense_s: np.ndarray  # (layers,) attention + router, per block
    experts_s: np.ndarray  # (layers,) the backend's run_layer, per block
    other_s: float  # head, background starts and waits, bookkeeping
    logits: list  # host (vocab,) arrays when kept: one per token (per kept row of a batch)
    steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        per = max(self.tokens, 1)
        return {"tokens": self.tokens, "steps": self.steps, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "dense_ms_per_token": 1e3 * float(self.dense_s.sum()) / per,
                "experts_ms_per_token": 1e3 * float(self.experts_s.sum()) / per,
                "other_ms_per_token": 1e3 * self.other_s / per,
                "per_layer_ms_per_token": [{"layer": l, "dense": 1e3 * float(d) / per, "experts": 1e3 * float(e) / per}
                                           for l, (d, e) in enumerate(zip(self.dense_s, self.experts_s))]}


def _tokens(model: MoeModel, inputs) -> Iterator:
    """scheduler Tokens whose steps run the model lazily; a new sequence (or position 0) resets the
    KV cache, a position before the end of what the sequence has run rolls it back."""
    from scheduler import Token

    seq, end = None, 0
    for t in inputs:
        if isinstance(t, ChunkInput):
            ids, routes, all_logits = t.token_ids, t.routes, t.all_logits
        else:
            ids, routes, all_logits = (t.token_id,), None if t.routes is None else (t.routes,), False
        back = 0
        if t.seq != seq or t.pos == 0:
            model.reset()
            seq, end = t.seq, t.pos
        elif t.pos < end:
            back, end = end - t.pos, t.pos
        end += len(ids)
        steps = model.chunk_steps(ids, routes, all_logits, back)
        if model.router_predictor is not None:
            steps = model.router_predictor.phased(t.phase, steps)
        yield Token(t.index, t.seq, t.pos, t.phase, steps, len(ids))


def run(model: MoeModel, backend, policy, inputs, lag_tokens: int = 1, audit=None,
        keep_logits: bool = False, progress=None) -> RunResult:
    """Drive ``policy`` over ``inputs`` (TokenInputs and ChunkInputs) with real compute: the model's
    dense path and ``backend`` for the experts (``run_layer(item, x (T, hidden), ids (T, k),
    weights (T, k)) -> y (T, hidden)``, ``start_background``, ``await_background``, optionally
    ``prepare(policy)`` before the first item; ``begin_layer(layer, x, ids)`` as each block's routing
    is known, before its step is planned). Every driver item is also given to ``audit`` (an
    ``Audit``) if any; ``progress(tokens)`` is called after each batch with the positions run."""
    import dataclasses
    import time

    from scheduler import drive
    from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground

    begin = getattr(backend, "begin_layer", None)

    def started(steps):
        for step in steps:
            begin(step.layer, model.last_input, model.last_ids)
            yield step

    n_layers = model.info.num_layers
    dense, experts = np.zeros(n_layers), np.zeros(n_layers)
    logits, tokens, steps = [], 0, 0
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(policy)
    t0 = mark = time.perf_counter()
    other = 0.0
    tokens_in = _tokens(model, inputs)
    if begin is not None:
        tokens_in = (dataclasses.replace(t, steps=started(t.steps)) for t in tokens_in)
    for item in drive(policy, tokens_in, lag_tokens):
        now = time.perf_counter()
        kind = type(item)
        if kind is RunLayer:
            l = item.step.layer
            dense[l] += now - mark
            y = backend.run_layer(item, model.last_input, model.last_ids, model.last_weights)
            model.deliver(y)
            mark = time.perf_counter()
            experts[l] += mark - now
        else:
            other += now - mark
            if kind is StartBackground:
                backend.start_background(item.moves)
            elif kind is AwaitBackground:
                backend.await_background(item.moves)
            elif kind is EndToken:
                tokens += item.token.num_tokens
                steps += 1
                if keep_logits:
                    logits.extend(_host(model.chunk_logits).copy())
                if progress is not None:
                    progress(tokens)
            mark = time.perf_counter()
            other += mark - now
        if audit is not None:
            audit.observe(item)
    return RunResult(audit, tokens, time.perf_counter() - t0, dense, experts, other, logits, steps)


# traces --------------------------------------------------------------------------------------------
def check_trace(trace, info) -> None:
    """Raise ExecutorError unless ``trace`` routes this model's geometry exactly."""
    if tuple(trace.num_experts) != tuple(info.num_experts) or trace.top_k != info.top_k:
        raise ExecutorError(
            f"trace geometry ({trace.num_layers} layers, experts {_short(trace.num_experts)}, top-{trace.top_k}) "
            f"differs from the model's {info.path} ({info.num_layers} layers, experts {_short(info.num_experts)}, "
            f"top-{info.top_k}); pass --map to fold the trace's layer and expert ids onto the model")


def _short(ns) -> str:
    ns = list(ns)
    return f"{ns[0]} x {len(ns)}" if len(set(ns)) == 1 else str(ns)


def fold_trace(trace, info):
    """A trace of the model's geometry made from another one (``--map``).

    Model block ``m`` takes the trace's layer ``m % L_trace``; each expert id ``e`` becomes
    ``e % E_model``; duplicates that folding creates are dropped (first in rank order kept), and
    the first ``top_k`` (the model's) remaining ids are kept. Weights, when the trace has them,
    follow their ids and are renormalised to sum 1 over the kept ids when the model renormalises
    its top-k. Sequence, position and phase are unchanged."""
    from traces import Trace

    lt = trace.num_layers
    src = [m % lt for m in range(info.num_layers)]
    ids = np.asarray(trace.expert_ids)[:, src, :].astype(np.int64)  # (T, L, k_t)
    e_model = np.asarray(info.num_experts, dtype=np.int64)[None, :, None]
    ids = np.where((ids >= 0) & (e_model > 0), ids % np.maximum(e_model, 1), -1)
    for j in range(1, ids.shape[2]):
        dup = (ids[:, :, :j] == ids[:, :, j:j + 1]).any(axis=2)
        ids[:, :, j][dup] = -1
    order = np.argsort(ids < 0, axis=2, kind="stable")  # valid ids first, rank order kept
    k = min(info.top_k, ids.shape[2])
    ids = np.take_along_axis(ids, order, axis=2)[:, :, :k]
    weights = None
    if trace.weights is not None:
        w = np.take_along_axis(np.asarray(trace.weights, dtype=np.float64)[:, src, :], order, axis=2)[:, :, :k]
        w = np.where(ids >= 0, w, np.nan)
        if info.norm_topk:
            w = w / np.nansum(w, axis=2, keepdims=True)
        weights = w.astype(np.float32)
    meta = dict(trace.meta, folded_from=trace.model)
    return Trace(f"{trace.model} folded onto {Path(info.path).name}", info.num_experts, k, ids, trace.seq,
                 trace.pos, trace.phase, weights, meta)


def trace_batches(trace) -> np.ndarray | None:
    """Batch number of each row of a trace recorded with multi-token steps (``meta["batches"]``:
    the row count of each batch, in order), or None when the trace has no batches (one row each)."""
    b = trace.meta.get("batches")
    if b is None:
        return None
    if (not isinstance(b, list) or not all(isinstance(n, int) and n >= 1 for n in b) or sum(b) != len(trace)):
        raise ExecutorError(f"trace {trace.model!r}: meta field 'batches' must be a list of row counts >= 1 "
                            f"summing to the trace's {len(trace)} rows")
    return np.repeat(np.arange(len(b)), b)


def _row_groups(trace, phase, start, limit) -> Iterator[list]:
    """The selected rows' scheduler Tokens, grouped into the recorded batches (cut where the
    selection or the sequence is)."""
    rows = trace.rows(phase)[start:]
    if limit is not None:
        rows = rows[:limit]
    batch = trace_batches(trace)
    group, last = [], None
    for r, tok in zip(rows.tolist(), trace.tokens(phase, start, limit)):
        key = (tok.seq, r if batch is None else int(batch[r]))
        if group and key != last:
            yield group
            group = []
        group.append(tok)
        last = key
    if group:
        yield group


def trace_tokens(trace, phase: str | None = None, start: int = 0, limit: int | None = None) -> Iterator:
    """scheduler Tokens of ``trace``'s rows with the recorded batches merged (``merge_step`` per
    block): what the run that recorded it planned, for ``scheduler.replay``. A trace without
    batches gives its rows as they are."""
    from scheduler import Token

    for i, group in enumerate(_row_groups(trace, phase, start, limit)):
        first = group[0]
        if len(group) == 1:
            yield Token(i, first.seq, first.pos, first.phase, first.steps)
            continue
        per_layer: dict[int, list] = {}
        for tok in group:
            for st in tok.steps:
                per_layer.setdefault(st.layer, []).append((st.experts, st.weights))
        yield Token(i, first.seq, first.pos, first.phase,
                    tuple(_merge(l, per_layer[l]) for l in sorted(per_layer)), len(group))


def trace_inputs(trace, info, phase: str | None = None, start: int = 0, limit: int | None = None,
                 seed: int = 0) -> Iterator[TokenInput | ChunkInput]:
    """Inputs replaying ``trace`` rows: routes forced to the trace's steps (a block the row does not
    route uses the model's router), input token ids drawn uniformly from the vocabulary by
    ``np.random.default_rng(seed)`` (a trace holds routing, not text). Rows of one recorded batch
    (``trace_batches``) run as one ChunkInput, with the recorded positions (so rejected drafts
    roll the KV cache back as they did)."""
    rng = np.random.default_rng(seed)
    for i, group in enumerate(_row_groups(trace, phase, start, limit)):
        all_routes, ids = [], []
        for tok in group:
            routes = [None] * info.num_layers
            for s in tok.steps:
                routes[s.layer] = Route(s.experts, s.weights)
            all_routes.append(tuple(routes))
            ids.append(int(rng.integers(info.vocab)))
        first = group[0]
        if len(group) == 1:
            yield TokenInput(i, first.seq, first.pos, first.phase, ids[0], all_routes[0])
        else:
            yield ChunkInput(i, first.seq, first.pos, first.phase, tuple(ids), tuple(all_routes))
