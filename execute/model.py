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
first); a GPU chunk's top-k and weights in float64 on the device (``execute.prefill_dense``, which
also runs the chunk's norms, F16 projections and attention in few launches). With a route override (trace replay) the trace's ids replace the top-k; the trace's weights
are used when it has them, else the router's own weights of those ids, computed the same way.

RoPE of type ``norm`` (pairs (2i, 2i+1)) is run as ``neox`` (pairs (i, i + d/2)) on q and k rows
permuted the same way inside each head at load time: attention scores are dot products of q and k,
so the shared permutation leaves them unchanged (the reference rotates the pairs directly).
"""
from __future__ import annotations

import sys
from typing import Iterator, Sequence

import numpy as np

from scheduler import Step

from .archs import rope_angles, yarn_mscale
from .backends import EngineExperts, NumpyExperts, expert_ffn
from .batch_route import merge_rows, route_rows
from .driver import ChunkInput, RunResult, TokenInput, run
from .experts import ExecutorError
from .gguf_model import ModelWeights
from .load_plan import fast_load_env
from .routing import Route, RouterPredictor, merge_step, route_weights, softmax_topk
from .trace_inputs import check_trace, fold_trace, trace_batches, trace_inputs, trace_tokens
from .xp import array_module, cuda_graphs_env, host as _host

__all__ = ["MoeModel", "Qwen3Moe", "Route", "TokenInput", "ChunkInput", "RunResult", "merge_step", "trace_tokens",
           "NumpyExperts", "EngineExperts", "run", "check_trace", "fold_trace", "trace_batches", "trace_inputs",
           "array_module", "cuda_graphs_env", "softmax_topk", "route_weights", "expert_ffn", "RouterPredictor"]


def _residual(x, rs: np.float32, y):
    """``x + rs * y``; ``x + y`` when ``rs`` is 1 (the same values, one launch fewer on the GPU). The
    array comes first in the product: its own operator, not numpy's dispatch to ``__array_ufunc__``."""
    return x + y if rs == 1 else x + y * rs


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
        self.pd = None  # the chunk's dense launches (execute.prefill_dense), MOELAB_PREFILL_DENSE=1
        if use_gpu:
            from .prefill_dense import ChunkDense, dense_env

            if dense_env():
                try:
                    self.pd = ChunkDense()
                except Exception as exc:  # noqa: BLE001 - a module that does not build: one warning, CuPy path
                    msg = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                    print(f"moelab: warning: the chunk dense kernels did not build ({msg}); prefill chunks run on "
                          "CuPy expressions", file=sys.stderr)
        self._staged = None  # the dense matrices' staging ring while they go up (MOELAB_FAST_LOAD)
        if use_gpu and fast_load_env():
            from .gpu_upload import Staged

            self._staged = Staged(xp.cuda.get_current_stream().ptr)
        try:
            self.layers = [self._dense_layer(i, l) for i, l in enumerate(weights.layers)]
            self.output_norm = self._dev(weights.output_norm)
            self.output = self._matrix([(None, "output", weights.output, None)])
        finally:
            if self._staged is not None:
                self._staged.close()
                self._staged = None
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
        self.token_graph = None  # a TokenGraph (execute.token_graph) when decode tokens may run as one graph
        self.step_done = False  # the step just yielded was computed by the token graph (run settles it)
        self.device_chunk = None  # a DeviceChunk (execute.prefill_device) when chunks may run without host waits
        self.router_predictor: RouterPredictor | None = None  # set to one to measure it (off: no work)

    # weights -----------------------------------------------------------------------------------
    def _matrix(self, parts):
        """A dense matrix for :meth:`_proj` from ``parts`` ``(layer, key, float32 values, row order or
        None)`` stacked by rows: on a GPU in its stored type (``execute.gpu_dense``) where the
        kernels take it, else float32 on ``xp``; None when ``values`` is None."""
        if parts[0][2] is None:
            return None
        if self.gd is not None:
            from .gguf_model import stored_matrix
            from .gpu_dense import stack_matrices

            m = stack_matrices([(stored_matrix(self.weights, l, k), v, p) for l, k, v, p in parts], self._staged)
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
            y = self.pd.matmul(x, m, self.gd) if self.pd is not None and x.shape[0] > 1 else None
            return self.gd.matmul(x, m) if y is None else y
        return self._mv(x, m)

    @staticmethod
    def _mv(x, w):
        """``x (T, in)`` times ``w (out, in)`` transposed -> ``(T, out)``; one token as a matrix-vector
        product (the decode path's numerics)."""
        return (w @ x[0])[None] if x.shape[0] == 1 else x @ w.T

    def _rms(self, x, w):
        xp = self.xp
        if self.pd is not None and x.ndim > 1 and x.shape[0] > 1:
            y = self.pd.rms(x, w, self.info.rms_eps)
            if y is not None:
                return y
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
        if self.pd is not None and x.shape[0] > 1:
            y = self.pd.attention(self, l, x)
            if y is not None:
                return y
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
        free = forced is None or all(f is None for f in forced)
        if self.pd is not None and len(hn) > 1 and free and self.pd.routes(self.info, w["exp_probs_b"]):
            batch = self.pd.route(self._proj(hn, w["router"]), w["router_bias_dev"], self.info)
            if batch is not None:  # None: a non-finite logit (the host's rule below)
                self._route_len = [batch[0].shape[1]] * len(hn)
                return batch
        logits = _host(self._proj(hn, w["router"])).astype(np.float64)  # (T, experts): the host needs the ids
        if w["router_bias"] is not None:
            logits = logits + w["router_bias"]
        if len(logits) > 1 and (forced is None or all(f is None for f in forced)):
            batch = route_rows(self.info, logits, w["exp_probs_b"])  # the same ids and weights, no loop
            if batch is not None:
                self._route_len = [batch[0].shape[1]] * len(logits)
                return batch
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
        dev = self.device_chunk  # every block queued at once, the steps settled after (False: the path is off)
        if dev and t > 1 and dev.takes(t, routes) and (yield from dev.steps(x, all_logits, rows)):
            if rows is not None:
                self.route_log.extend((self.pos + i, r) for i, r in enumerate(rows))
            self.pos += t
            return
        for l in range(info.num_layers):
            w = self.layers[l]
            h = self._rms(x, w["attn_norm"])
            x = _residual(x, rs, self._attention_mla(l, h) if self.mla else self._attention(l, h))
            hn = self._rms(x, w["ffn_norm"])
            if w["router"] is None:
                x = _residual(x, rs, self._ffn(w["dense_ffn"], hn))
                continue
            forced = None if routes is None else [None if r is None else r[l] for r in routes]
            tids, twts = self._route(l, hn, forced)
            self.last_input, self.last_ids, self.last_weights = hn, tids, twts.astype(np.float32)
            if self.router_predictor is not None:
                self._predict_router(l, x, tids)
            self._out = None
            step = (merge_rows(l, tids, twts) if t > 1 and min(self._route_len) == tids.shape[1]
                    else merge_step(l, tids, twts, self._route_len))
            if rows is not None:
                for i, n in enumerate(self._route_len):
                    rows[i].append((l, tids[i, :n].tolist(), twts[i, :n].tolist()))
            yield step
            if self._out is None:
                raise ExecutorError(f"block {l}: no expert output was delivered for the step")
            y = xp.asarray(self._out)
            x = _residual(x, rs, y if w["shared"] is None else y + self._shared(l, hn))
        self._head(x, all_logits)
        if rows is not None:
            self.route_log.extend((self.pos + i, r) for i, r in enumerate(rows))
        self.pos += t

    def _head(self, x, all_logits: bool) -> None:
        """``chunk_logits`` (every row of ``x (T, hidden)`` when ``all_logits``, else the last) and
        ``logits`` (the last row's ``(vocab,)``) after the output norm."""
        xs = x if all_logits else x[-1:]
        self.chunk_logits = self._proj(self._rms(xs, self.output_norm), self.output) / np.float32(self.info.logit_scale)
        self.logits = self.chunk_logits[-1]  # (vocab,)

    def warm_up(self, t: int) -> None:
        """Pay a process's first-use costs of the GPU paths before a prompt is timed: the chunk dense
        path of the first block and the head on ``t`` (> 1) stand-in tokens at position 0 (the
        library kernels load, the cuBLAS handle and its per-shape choices, the memory pool grows),
        and the one-token decode plans (their CUDA graphs captured), as a run's first chunk and first
        decode token would. The sequence is untouched: only a new one (``pos`` 0) may be warmed, the
        KV entries written are overwritten by the prompt's first chunk, and ``pos``, ``logits`` and
        the routing stay as they were. No-op without a GPU, for ``t`` < 2, or mid-sequence."""
        if self.gd is None or self.pos != 0:
            return
        xp, t = self.xp, min(int(t), self.k_cache[0].shape[1])
        if t > 1:
            info, w = self.info, self.layers[0]
            x = xp.asarray(self.token_embd[np.arange(t) % info.vocab], dtype=xp.float32)
            h = self._rms(x, w["attn_norm"])
            x = x + (self._attention_mla(0, h) if self.mla else self._attention(0, h))
            hn = self._rms(x, w["ffn_norm"])
            if w["router"] is None:
                x = x + self._ffn(w["dense_ffn"], hn)
            else:
                saved = getattr(self, "_route_len", None)
                self._route(0, hn, None)
                self._route_len = saved
                x = x + self._shared(0, hn)
            self._proj(self._rms(x[-1:], self.output_norm), self.output)
        if self.fast and self._plans is None:
            self._plans = self._decode_plans()
        xp.cuda.get_current_stream().synchronize()

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
        tg = self.token_graph
        ahead = tg is not None and tg.launched(pos, token_id)  # its graph runs already (token_graph: pipelining)
        if not ahead:
            gd.emb.set(np.ascontiguousarray(self.token_embd[token_id] * np.float32(info.embedding_scale), np.float32))
        add, start = None, 0
        rows = [] if self.route_log is not None else None
        if ahead or (tg is not None and routes is None and self.router_predictor is None and tg.want()):
            # the graph's blocks: their steps are decided and settled, not run
            start = yield from tg.steps(self, pos, rows, ahead)
            if start == len(blocks):  # the graph completed the token (logits, position, route log)
                return
            if start:  # block by block from the first block with a miss
                blocks[start - 1].cur[...] = tg.cur[start - 1]
                add = tg.out[start - 1]
        for l, b in enumerate(blocks):
            if l < start:
                continue
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


Qwen3Moe = MoeModel  # the first architecture's name, kept for existing callers
